"""Writes verl's dataset for an envserve environment: train.parquet and val.parquet, one row per
episode (level).

    python examples/verl/write_dataset.py --address 127.0.0.1:50051 --env-id sokoban \
        --train 512 --val 32 --out-dir ~/data/envserve-sokoban

Columns, as verl's RLHFDataset reads them:
  data_source   "envserve/<env_id>" (verl groups validation metrics by it)
  prompt        a chat: the instruction and the level's first observation, read from the server (the
                agent loop EnvServeAgentLoop builds its own prompt from the session and ignores this
                one; verl's ToolAgentLoop shows the model nothing else before its first tool call)
  ability       "agent"
  reward_model  {"style": "rule", "ground_truth": ""}: the reward is the env's, returned by the agent
                loop (verl's rm_scores), so there is nothing to compare against
  agent_name    which agent loop plays the row: envserve_agent (agent_loops.yaml) or tool_agent
  extra_info    {index, split, env_id, seed, tools_kwargs}: EnvServeAgentLoop reads env_id and seed
                here; EnvServeTool gets the seed through tools_kwargs.<tool>.create_kwargs

Train and validation seeds do not overlap (validation starts at --val-seed).
"""
from __future__ import annotations

import argparse
import os
import sys

import pandas as pd

from envserve.client import EnvClient
from envserve.integrations._common import action_choices, is_cell_space

INSTRUCTION = "Solve the level. Answer in the format the rules ask for."


def tool_name(spec) -> str:
    """The name EnvServeTool gives its tool for this env (its schema comes from the same spec)."""
    return "move" if action_choices(spec) else "reveal" if is_cell_space(spec) else "act"


def rows(client: EnvClient, env_id: str, seeds: range, split: str, agent_name: str, action_format: str) -> list[dict]:
    spec = client.get_spec(env_id)
    tool = tool_name(spec)
    sid = client.open(env_id, 1, None, action_format or spec.default_action_format)[0]
    out = []
    try:
        for index, seed in enumerate(seeds):
            first = client.reset_one(sid, seed).observation.text
            out.append({
                "data_source": f"envserve/{env_id}",
                "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n{first}"}],
                "ability": "agent",
                "reward_model": {"style": "rule", "ground_truth": ""},
                "agent_name": agent_name,
                "extra_info": {"index": index, "split": split, "env_id": env_id, "seed": seed,
                               "tools_kwargs": {tool: {"create_kwargs": {"seed": seed}}}},
            })
    finally:
        client.close_sessions([sid])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("ENVSERVE_ADDRESS", "127.0.0.1:50051"))
    p.add_argument("--env-id", default="sokoban")
    p.add_argument("--train", type=int, default=512, help="training rows (seeds 0..N-1)")
    p.add_argument("--val", type=int, default=32, help="validation rows")
    p.add_argument("--val-seed", type=int, default=1_000_000, help="first validation seed")
    p.add_argument("--agent-name", default="envserve_agent", choices=["envserve_agent", "tool_agent"])
    p.add_argument("--action-format", default="", help="of the observation in the prompt (default: the env's)")
    p.add_argument("--out-dir", default=os.path.expanduser("~/data/envserve-sokoban"))
    args = p.parse_args(argv)
    if args.train < 1 or args.val < 0:
        p.error("--train must be >= 1 and --val >= 0")

    os.makedirs(args.out_dir, exist_ok=True)
    with EnvClient(args.address) as client:
        splits = {"train": range(args.train), "val": range(args.val_seed, args.val_seed + args.val)}
        for split, seeds in splits.items():
            path = os.path.join(args.out_dir, f"{split}.parquet")
            frame = pd.DataFrame(rows(client, args.env_id, seeds, split, args.agent_name, args.action_format))
            frame.to_parquet(path)
            print(f"wrote {path}: {len(frame)} rows", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
