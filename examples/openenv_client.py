"""OpenEnv's own client playing an envserve environment: a replica serves OpenEnv's protocol itself
with `--openenv-port`, so trainers that drive environments through OpenEnv (TRL's OpenEnv recipes,
SkyRL, NeMo Gym, AgileRL) reach envserve with no code of envserve's on their side.

    envserve serve sokoban --port 50051 --openenv-port 8000 &
    python examples/openenv_client.py --url http://127.0.0.1:8000/openenv/sokoban

(`envserve web` serves the same endpoint in front of any number of replicas: http://HOST:8080/openenv/<env_id>.)
reset takes envserve's options as keyword arguments (seed, action_format, config); step takes
{"message": the model's text}. The policy here answers random moves (a stand-in for the model);
with `--grpc-address` of the same replica it plays the planner's moves on the true state instead.
"""
from __future__ import annotations

import argparse
import random
import sys

from openenv import GenericEnvClient


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/openenv/sokoban")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--grpc-address", default="", help="the replica's gRPC address: play the planner's moves")
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    if args.grpc_address:
        from envserve.client import EnvClient, state_dict
        from envserve.client.experts import plan_sokoban
        truth = EnvClient(args.grpc_address)

    with GenericEnvClient(base_url=args.url).sync() as env:
        r = env.reset(seed=args.seed, action_format="no_think", config={"max_turns": args.max_turns})
        print(r.observation["text"])
        session = env.state()["session_id"]
        # done is the env's own end; an episode cut by the turn limit says truncated in its metadata.
        while not (r.done or r.metadata.get("truncated")):
            if args.grpc_address:
                moves = plan_sokoban(state_dict(truth.get_state(session)))
                move = moves[0] if moves else "Up"
            else:
                move = rng.choice(["Up", "Down", "Left", "Right"])
            r = env.step({"message": f"<answer>{move}</answer>"})
            print(f"turn {r.metadata['turn']}: {move} -> reward {r.reward:.2f}")
        state = env.state()
    print(f"episode over: turns={state['step_count']} return={state['episode_return']:.2f} "
          f"success={r.metadata['success']} truncated={bool(r.metadata.get('truncated'))} "
          f"session={state['session_id']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
