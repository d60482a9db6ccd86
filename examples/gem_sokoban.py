"""An envserve environment in GEM: register it, then play with GEM's own API (gem.make, reset,
step) and a vector env of several sessions (gem.make_vec).

    envserve serve sokoban --port 50051 &
    python examples/gem_sokoban.py --address 127.0.0.1:50051 --episodes 2

The policy is a stand-in for the model: `--policy planner` solves the level from the true state
(envserve's StateService), `--policy random` takes GEM's `sample_random_action()`. Each answer is
the model's whole text; the session's action format (`no_think`: `<answer>Up</answer>`) parses it.
"""
from __future__ import annotations

import argparse
import os
import sys

import gem

from envserve.client import EnvClient, state_dict
from envserve.client.experts import plan_sokoban
from envserve.integrations.gem import register


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("ENVSERVE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--vector", type=int, default=4, help="envs in the vector env (0: skip it)")
    p.add_argument("--policy", choices=["planner", "random"], default="planner")
    args = p.parse_args(argv)

    env_id, = register(args.address, ["sokoban"])        # "envserve:sokoban"
    truth = EnvClient(args.address)

    def act(env) -> str:
        if args.policy == "random":
            return env.sample_random_action()
        moves = plan_sokoban(state_dict(truth.get_state(env.session_id)))
        return f"<answer>{moves[0] if moves else 'Up'}</answer>"

    env = gem.make(env_id)
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        obs, info = env.reset(seed=seed)
        total, turns, done = 0.0, 0, False
        while not done:
            obs, reward, terminated, truncated, info = env.step(act(env))
            total, turns, done = total + reward, turns + 1, terminated or truncated
        print(f"episode seed={seed}: turns={turns} return={total:.2f} success={bool(info.get('success'))}",
              flush=True)
    env.close()

    if args.vector:
        # One session per env; GEM resets a finished env itself (autoreset) with the next seed.
        vec = gem.make_vec([env_id] * args.vector, seed=args.first_seed)
        obs, infos = vec.reset()
        rewards = [0.0] * args.vector
        for _ in range(3):
            obs, reward, terminated, truncated, infos = vec.step([act(e) for e in vec.envs])
            rewards = [a + float(b) for a, b in zip(rewards, reward)]
        print(f"vector env: {args.vector} sessions, 3 steps, rewards {[round(r, 2) for r in rewards]}", flush=True)
        for e in vec.envs:   # GEM's vector envs have no close of their own
            e.close()
    truth.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
