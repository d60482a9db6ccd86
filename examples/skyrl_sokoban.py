"""An envserve environment in SkyRL: register it with skyrl_gym, then roll out episodes the way
SkyRL's generator does (make per trajectory, init with the row's prompt, step the model's text until
done, get_metrics, close).

    envserve serve sokoban --port 50051 &
    python examples/skyrl_sokoban.py --address 127.0.0.1:50051 --episodes 2

In training, SkyRL's dataset rows name the env class (`"env_class": "envserve-sokoban"`) and carry the
seed; the config's `environment.skyrl_gym.envserve-sokoban` is the env_config. The policy below is a
stand-in for the model: `--policy planner` solves the level from the true state (envserve's
StateService), `--policy random` answers random moves. Each answer is the model's whole text; the
session's action format (`no_think`: `<answer>Up</answer>`) parses it.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import skyrl_gym
from omegaconf import DictConfig

from envserve.client import EnvClient, state_dict
from envserve.client.experts import plan_sokoban
from envserve.integrations.skyrl import register

PROMPT = [{"role": "system", "content": "You are a careful Sokoban player."},
          {"role": "user", "content": "Solve the level."}]


def planner_policy(address: str):
    """Answers the planner's next move on the true state (a model would read the chat instead)."""
    client = EnvClient(address)

    def policy(env, chat) -> str:
        moves = plan_sokoban(state_dict(client.get_state(env.session_id)))
        return f"<answer>{moves[0] if moves else 'Up'}</answer>"
    return policy


def random_policy(seed: int):
    rng = random.Random(seed)
    return lambda env, chat: f"<answer>{rng.choice(['Up', 'Down', 'Left', 'Right'])}</answer>"


def rollout(env_class: str, seed: int, max_turns: int, policy) -> dict:
    """One trajectory, as SkyRL's generator runs it."""
    env = skyrl_gym.make(env_class, env_config=DictConfig({}), extras={"seed": seed, "max_turns": max_turns})
    try:
        chat, _ = env.init([dict(m) for m in PROMPT])
        done = False
        while not done:
            text = policy(env, chat)
            out = env.step(text)
            chat += [{"role": "assistant", "content": text}, *out["observations"]]
            done = out["done"]
        return env.get_metrics()
    finally:
        env.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("ENVSERVE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--max-turns", type=int, default=30)
    p.add_argument("--policy", choices=["planner", "random"], default="planner")
    args = p.parse_args(argv)

    env_class, = register(args.address, ["sokoban"])     # "envserve-sokoban"
    policy = planner_policy(args.address) if args.policy == "planner" else random_policy(args.first_seed)
    for seed in range(args.first_seed, args.first_seed + args.episodes):
        m = rollout(env_class, seed, args.max_turns, policy)
        print(f"episode seed={seed}: turns={m['turns']} return={m['return']:.2f} success={m['success']} "
              f"invalid_actions={m['invalid_actions']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
