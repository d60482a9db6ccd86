"""Short CPU runs of the process-reward methods on FrozenLake 4x4, beside the runs without one.

Each run starts from the same tiny random-weight model (same seed) and trains for the same number
of iterations through a real envserve server: GRPO (the bundled frozenlake_grpo.yaml), REINFORCE++
with the env's reward only, AgentPRM, InversePRM and ProgRM (frozenlake_<method>.yaml, on
REINFORCE++: their effect is the difference to the REINFORCE++ run), IPR and RRO (DPO on pairs
from forked rollouts instead of a policy gradient: compare with GRPO), and ARPO (GRPO's update on
trajectories branched over Fork where the policy's entropy rises, 8 per map as GRPO's group: compare
with GRPO).

    .venv/bin/python bench/process_methods.py --iterations 30 --output-dir runs/process-methods --json

Per run: metrics.jsonl and curves.png in its folder; the summary gives the policy's success rate
per iteration (train.success_rate, the sampled policy on the iteration's tasks), its mean over the
first and the last five iterations, the sampled evaluation on the training maps at the end, and
seconds per iteration (process step included).
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

RUNS = {
    "grpo": ("frozenlake_grpo.yaml", {}),
    "reinforce_pp": ("frozenlake_grpo.yaml", {"algo": {"estimator": "reinforce_pp"}}),
    "agentprm": ("frozenlake_agentprm.yaml", {}),
    "inverse_prm": ("frozenlake_inverse_prm.yaml", {}),
    "progrm": ("frozenlake_progrm.yaml", {}),
    "ipr": ("frozenlake_ipr.yaml", {}),
    "rro": ("frozenlake_rro.yaml", {}),
    "arpo": ("frozenlake_arpo.yaml", {}),
}


def run_one(name: str, iterations: int, out: Path, address: str) -> dict:
    from envserve_trainer.api import Connection, Trainer, load_config
    config, overrides = RUNS[name]
    cfg = load_config(config).with_overrides(**overrides, run={"iterations": iterations, "eval_every": iterations,
                                                            "checkpoint_every": 0, "progress": False})
    t0 = time.monotonic()
    trainer = Trainer(cfg, out / name, Connection(env_address=address))
    try:
        records = asyncio.run(trainer.run())
    finally:
        trainer.close()
    success = [r["train"]["success_rate"] for r in records]
    last = records[-1]
    return {"iterations": len(records), "wall_s": round(time.monotonic() - t0, 1),
            "s_per_iteration": round(sum(r["timing"]["iteration_s"] for r in records) / len(records), 2),
            "success_by_iteration": [round(s, 4) for s in success],
            "success_first5": round(sum(success[:5]) / min(5, len(success)), 4),
            "success_last5": round(sum(success[-5:]) / min(5, len(success)), 4),
            "eval_success_end": last.get("eval", {}).get("train_tasks", {}).get("overall", {}).get("success_rate"),
            "process_last": last.get("process", {})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--output-dir", default="runs/process-methods")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()
    from serverproc import ServerProcess
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {}
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as server:
        for name in args.runs.split(","):
            summary[name] = run_one(name, args.iterations, out, server.address)
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
            print(name, {k: v for k, v in summary[name].items() if k != "success_by_iteration"}, flush=True)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
