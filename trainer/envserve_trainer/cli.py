"""`envserve-train`: collect expert demonstrations, fine-tune on them, train with RL and evaluate, all
through envserve's gRPC API.

    envserve-train collect --config FILE (--env-address HOST:PORT | --directory redis://...) --out demos.jsonl
                           [--episodes N] [--seed-start S] [--expert NAME] [--append]
    envserve-train sft   --config FILE --data demos.jsonl [--data ...] [--env-address ... | --directory ...]
                         [--output-dir DIR] [--resume] [--max-steps N]
    envserve-train train --config FILE (--env-address HOST:PORT | --directory redis://...) [--output-dir DIR]
                         [--judge-address HOST:PORT] [--iterations N] [--resume] [--device cpu|cuda]
    envserve-train eval  --config FILE [--checkpoint DIR] (--env-address ... | --directory ...) [--json OUT]
    envserve-train perceive --config FILE (--env-address ... | --directory ...) [--output-dir DIR]

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

from .config.loading import load_config
from .config.train_config import TrainConfig

def _connection(args):
    from .train import Connection
    if bool(args.env_address) == bool(args.directory):
        raise SystemExit("envserve-train: give exactly one of --env-address and --directory")
    return Connection(env_address=args.env_address or "", directory=args.directory or "",
                      judge_address=getattr(args, "judge_address", "") or "",
                      state_readers=tuple(filter(None, [getattr(args, "judge_reader", "")])),
                      token=args.token or os.environ.get("ENVSERVE_TOKEN") or None)


def _service(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env-address", default=os.environ.get("ENVSERVE_ADDRESS", ""),
                   help="one env replica, HOST:PORT (env ENVSERVE_ADDRESS)")
    p.add_argument("--directory", default=os.environ.get("ENVSERVE_DIRECTORY", ""),
                   help="the replicas to spread over: a Redis directory redis://HOST:PORT/DB, or fixed "
                        "addresses HOST:PORT,HOST:PORT (env ENVSERVE_DIRECTORY)")
    p.add_argument("--token", default=None, help="bearer token for the services (env ENVSERVE_TOKEN)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML/JSON settings file, or a bundled config's name")
    _service(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda (torchrun: each rank its local GPU)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default after its help, unless it has none worth showing (None, "", a flag's
    False) or the help already says what it is."""

    def _get_help_string(self, action):
        quiet = action.default is None or action.default == "" or action.default is False
        if quiet or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The `envserve-train` parser with every subcommand's options."""
    parser = argparse.ArgumentParser(prog="envserve-train", description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", formatter_class=HelpFormatter, help="train with RL through the envserve gRPC API")
    _common(tr)
    tr.add_argument("--output-dir", default="runs/train", help="checkpoints, metrics.jsonl, curves.png")
    tr.add_argument("--judge-address", default=os.environ.get("ENVSERVE_JUDGE_ADDRESS", ""),
                    help="the judge service, for algo.use_judge (env ENVSERVE_JUDGE_ADDRESS)")
    tr.add_argument("--judge-reader", default=os.environ.get("ENVSERVE_JUDGE_READER", ""),
                    help="the name of the judge's state token on replicas that have state tokens: the sessions "
                         "this run opens let it read their ground truth (env ENVSERVE_JUDGE_READER)")
    tr.add_argument("--iterations", type=int, default=None, help="overrides run.iterations")
    tr.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    ev = sub.add_parser("eval", formatter_class=HelpFormatter,
                        help="evaluate a checkpoint (or the config's model) and print JSON")
    _common(ev)
    ev.add_argument("--checkpoint", default="", help="a checkpoint-N directory or an HF folder "
                                                     "(default: the config's model.path)")
    ev.add_argument("--json", default="", help="also write the summary to this file")
    sf = sub.add_parser("sft", formatter_class=HelpFormatter,
                        help="supervised fine-tuning on demonstrations (collect's JSONL)")
    _common(sf)
    sf.add_argument("--data", action="append", required=True, help="a demonstrations JSONL file (repeatable)")
    sf.add_argument("--output-dir", default="runs/sft", help="checkpoints and metrics.jsonl")
    sf.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    sf.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    pe = sub.add_parser("perceive", formatter_class=HelpFormatter,
                        help="warm a vision-language model up on the service's ground truth "
                             "(config section perception); SFT starts from the folder it writes")
    _common(pe)
    pe.add_argument("--output-dir", default="runs/perceived", help="the model folder (model.path for sft)")
    co = sub.add_parser("collect", formatter_class=HelpFormatter,
                        help="play an expert through the gRPC API and write demonstrations (JSONL)")
    co.add_argument("--config", required=True, help="the training config (its env, rollout and model sections)")
    _service(co)
    from .collect import add_collect_arguments
    add_collect_arguments(co)
    return parser


def main(argv=None) -> int:
    from .collect import run_collect
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "collect":
        return run_collect(args)
    cfg = load_config(args.config)
    if args.command == "sft":
        return _sft(cfg, args)
    conn = _connection(args)
    if args.command == "perceive":
        return _perceive(cfg, args, conn)
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
        # built with the served model's own tokenizer (model.path: its folder, GGUF file or package).
        from .models.pretrained import load_tokenizer
        from .policies.openai import OpenAIPolicy
        tokenizer = load_tokenizer(cfg.model.path, cfg.model.gguf_file)
        policy = OpenAIPolicy({"base_url": cfg.model.base_url, "model": cfg.model.model_name})
    elif not args.checkpoint and cfg.model.random_init:
        raise SystemExit("envserve-train eval: a random-init model needs --checkpoint")
    summary = asyncio.run(evaluate_checkpoint(cfg, args.checkpoint, conn, args.device, policy, tokenizer))
    text = json.dumps(summary, indent=1, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


def _perceive(cfg: TrainConfig, args, conn) -> int:
    from .rollout.perception import perceive
    from .train import build_vision_policy_model
    from .policies.vision import vision_codec
    if not cfg.model.vision or not cfg.perception.boards:
        raise SystemExit("envserve-train perceive: the config needs model.vision and perception.boards")
    model, processor = build_vision_policy_model(cfg, args.device, conn)
    client = conn.sync_client()
    try:
        result = perceive(model, vision_codec(cfg, processor), cfg, client, logging.getLogger("perception").info)
    except ValueError as e:
        raise SystemExit(f"envserve-train perceive: {e}") from None
    finally:
        client.close()
    out = Path(args.output_dir)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    print(json.dumps({"model": str(out), **result}))
    return 0


def _sft(cfg: TrainConfig, args) -> int:
    from .sft import SFTTrainer
    # The service is optional here: without one, SFT trains without evaluating after each epoch.
    conn = _connection(args) if (args.env_address or args.directory) else None
    missing = [d for d in args.data if not Path(d).exists()]
    if missing:
        raise SystemExit(f"envserve-train sft: no data file {missing[0]!r}")
    try:
        trainer = SFTTrainer(cfg, args.output_dir, args.data, conn, device=args.device, resume=args.resume)
    except ValueError as e:
        raise SystemExit(f"envserve-train sft: {e}") from None
    records = trainer.run(args.max_steps)
    if records:
        last = records[-1]
        print(json.dumps({"step": last["iteration"], "sft": last["sft"],
                          **({"eval": last["eval"]} if "eval" in last else {})}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
