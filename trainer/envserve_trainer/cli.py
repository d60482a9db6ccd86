"""`envserve-train`: train a policy on envserve environments, or evaluate a checkpoint.

    envserve-train train --config FILE (--env-address HOST:PORT | --directory redis://...) [--output-dir DIR]
                         [--judge-address HOST:PORT] [--iterations N] [--resume] [--device cpu|cuda]
    envserve-train eval  --config FILE --checkpoint DIR (--env-address ... | --directory ...) [--json OUT]

Under torchrun (`torchrun --nproc-per-node N -m envserve_trainer train ...`) each process takes its
share of the task groups and DDP/FSDP averages the gradients.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from .config import TrainConfig

BUNDLED_CONFIGS = Path(__file__).resolve().parent / "configs"


def _config(path: str) -> TrainConfig:
    p = Path(path)
    if not p.exists() and (BUNDLED_CONFIGS / path).exists():
        p = BUNDLED_CONFIGS / path    # a bundled config by name, e.g. frozenlake_grpo.yaml
    if not p.exists():
        raise SystemExit(f"envserve-train: no config file {path!r} (bundled: "
                         f"{', '.join(sorted(x.name for x in BUNDLED_CONFIGS.glob('*.yaml')))})")
    try:
        return TrainConfig.load(p)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"envserve-train: {p}: {e}") from None


def _connection(args):
    from .train import Connection
    if bool(args.env_address) == bool(args.directory):
        raise SystemExit("envserve-train: give exactly one of --env-address and --directory")
    return Connection(env_address=args.env_address or "", directory=args.directory or "",
                      judge_address=getattr(args, "judge_address", "") or "",
                      token=args.token or os.environ.get("ENVSERVE_TOKEN") or None)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML/JSON settings file, or a bundled config's name")
    p.add_argument("--env-address", default=os.environ.get("ENVSERVE_ADDRESS", ""),
                   help="one env replica, HOST:PORT (env ENVSERVE_ADDRESS)")
    p.add_argument("--directory", default=os.environ.get("ENVSERVE_DIRECTORY", ""),
                   help="the Redis directory of replicas, redis://HOST:PORT/DB (env ENVSERVE_DIRECTORY)")
    p.add_argument("--token", default=None, help="bearer token for the services (env ENVSERVE_TOKEN)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (torchrun: each rank its local GPU)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="envserve-train", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train with RL through the envserve gRPC API")
    _common(tr)
    tr.add_argument("--output-dir", default="runs/train", help="checkpoints, metrics.jsonl, curves.png")
    tr.add_argument("--judge-address", default=os.environ.get("ENVSERVE_JUDGE_ADDRESS", ""),
                    help="the judge service, for algo.use_judge (env ENVSERVE_JUDGE_ADDRESS)")
    tr.add_argument("--iterations", type=int, default=None, help="overrides run.iterations")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    ev = sub.add_parser("eval", help="evaluate a checkpoint (or the config's model) and print JSON")
    _common(ev)
    ev.add_argument("--checkpoint", default="", help="a checkpoint-N directory (or a save_pretrained one)")
    ev.add_argument("--json", default="", help="also write the summary to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = _config(args.config)
    conn = _connection(args)
    if args.command == "train":
        from .train import Trainer
        if args.iterations is not None and args.iterations < 1:
            raise SystemExit("envserve-train: --iterations must be >= 1")
        trainer = Trainer(cfg, args.output_dir, conn, device=args.device, resume=args.resume)
        try:
            records = asyncio.run(trainer.run(args.iterations))
        finally:
            trainer.close()
        if records:
            last = records[-1]
            print(json.dumps({"iteration": last["iteration"], "train": last["train"], "update": last["update"],
                              **({"eval": last["eval"]} if "eval" in last else {})}, default=str))
        return 0
    from .train import evaluate_checkpoint
    policy = tokenizer = None
    if cfg.model.backend == "openai":
        # A served model: rollouts send token-id prompts to /completions (vLLM, SGLang accept them),
        # built with the served model's tokenizer (model.path) or the small model's.
        from .model import build_tokenizer
        from .policy.openai import OpenAIPolicy
        if cfg.model.path:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        else:
            tokenizer = build_tokenizer()
        policy = OpenAIPolicy({"base_url": cfg.model.base_url, "model": cfg.model.model_name})
    elif not args.checkpoint:
        raise SystemExit("envserve-train eval: give --checkpoint (or model.backend: openai)")
    summary = asyncio.run(evaluate_checkpoint(cfg, args.checkpoint, conn, args.device, policy, tokenizer))
    text = json.dumps(summary, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
