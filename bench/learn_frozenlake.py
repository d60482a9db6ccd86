"""The learning run: GRPO from random init on FrozenLake 4x4 through the gRPC API, on a CPU.

Starts a real envserve server (FrozenLake, not slippery, one map per task seed), trains the tiny
random-weight model with the bundled config (trainer/envserve_trainer/configs/frozenlake_grpo.yaml),
and writes metrics.jsonl, curves.png and a summary JSON to --output-dir:

    .venv/bin/python bench/learn_frozenlake.py --output-dir runs/learn-frozenlake [--minutes 30]

The success rate that matters is the greedy evaluation on the training maps every eval_every
iterations (`eval.train_tasks`), and on held-out maps the policy never trained on (`eval.held_out`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", default="runs/learn-frozenlake")
    ap.add_argument("--config", default="frozenlake_grpo.yaml")
    ap.add_argument("--minutes", type=float, default=30.0, help="stop after the iteration that passes this")
    ap.add_argument("--iterations", type=int, default=None)
    args = ap.parse_args()
    from serverproc import stop_on_sigterm
    stop_on_sigterm()  # a SIGTERM stops the servers this run started, too

    from serverproc import ServerProcess
    from envserve_trainer.api import Connection, Trainer, load_config

    cfg = load_config(args.config)
    out = Path(args.output_dir)
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as server:
        trainer = Trainer(cfg, out, Connection(env_address=server.address))
        t0 = time.monotonic()
        try:
            records = asyncio.run(trainer.run(args.iterations, max_seconds=args.minutes * 60))
        finally:
            trainer.close()
    evals = [(r["iteration"], r["eval"]["train_tasks"]["overall"]["success_rate"]) for r in records if "eval" in r]
    summary = {"iterations": records[-1]["iteration"] if records else 0, "wall_s": time.monotonic() - t0,
               "eval_success_by_iteration": evals,
               "train_success_first": records[0]["train"]["success_rate"] if records else None,
               "train_success_last": records[-1]["train"]["success_rate"] if records else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
