"""Uniform against learnability task sampling, RL from the same policy at the same iterations: where
do the env steps and generated tokens go, how many groups carry no signal, and what held-out
success comes of it.

For each sampler (rollout.task_sampler: uniform, learnability) and each RL seed, the bundled
learn_<env>.yaml config (FrozenLake by default; --env-config changes the env, e.g. '{"size": 8}' or
a binary reward, and --set any other section) trains --iterations from one starting policy through
a real replica started here, then plays the held-out seeds greedily (--eval-tasks of them). The
starting policy: --model-path (a policy/ folder), or with --sft-demos N the config's pretrained
model fine-tuned here on N expert episodes of that env (kept in OUTPUT_DIR/sft and reused by a
later run with the same settings), or the config's model as it is; its own held-out success is
measured first. Per run it reports: env steps and generated tokens spent, the share of
signal-free groups per iteration (trials of a task that all scored the same), held-out greedy
success, and held-out success per 1,000 env steps and per 1,000 generated tokens of training.
The last line with --json is the summary.

    .venv/bin/python bench/task_sampling.py --env-config '{"size": 4, "penalty_for_step": 0, "reward_goal": 1}' \
        --sft-demos 300 --set '{"env": {"num_tasks": 16}}' --iterations 8 --eval-tasks 64 \
        --output-dir runs/task-sampling --json
    .venv/bin/python bench/task_sampling.py --quick --json    # a tiny random-weight model: the pipeline only
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SAMPLERS = ("uniform", "learnability")


def run(cfg, out: Path, conn) -> dict:
    from envserve_trainer.api import HFPolicy, Trainer, evaluate_policy
    trainer = Trainer(cfg, out, conn)
    try:
        records = asyncio.run(trainer.run())
        policy = HFPolicy(trainer.learner.model, trainer.tokenizer)
        held = asyncio.run(evaluate_policy(cfg, policy, trainer.tokenizer, conn, temperature=0.0, samples=1,
                                           task_sets=["held_out"]))["held_out"]["overall"]
    finally:
        trainer.close()
    steps = sum(r["train"]["turns"] for r in records)
    tokens = sum(r["train"]["generated_tokens"] for r in records)
    success = held["success_rate"] or 0.0
    return {"env_steps": steps, "generated_tokens": tokens,
            "signal_free_groups": [r["train"]["signal_free_groups"] for r in records],
            "train_success": [r["train"]["success_rate"] for r in records],
            "held_out_success": success, "held_out_tasks": held["trials"],
            "held_out_success_per_1k_steps": 1000 * success / max(steps, 1),
            "held_out_success_per_1k_tokens": 1000 * success / max(tokens, 1)}


def held_out_success(cfg, conn) -> float:
    """Greedy success of cfg's model on the held-out seeds: where RL starts from."""
    from envserve_trainer.api import HFPolicy, evaluate_policy, load_pretrained
    model, tok = load_pretrained(cfg.model.path, dtype=cfg.model.dtype, gguf_file=cfg.model.gguf_file)
    held = asyncio.run(evaluate_policy(cfg, HFPolicy(model, tok), tok, conn, temperature=0.0, samples=1,
                                       task_sets=["held_out"]))["held_out"]["overall"]
    return held["success_rate"] or 0.0


def starting_policy(cfg, out: Path, demos: int, conn) -> str:
    """The config's pretrained model fine-tuned on `demos` expert episodes of cfg's split: the policy/
    folder of its checkpoint, reused when OUTPUT_DIR/sft already holds one made with the same config."""
    from envserve.client import EnvClient
    from envserve_trainer.api import SFTTrainer, collect, load_pretrained, policy_folder
    d = cfg.to_dict()
    # What the demonstrations and the fine-tuning depend on (not which tasks RL trains on).
    env = {k: d["env"][k] for k in ("env_id", "env_config", "action_format", "seed_start")}
    key = json.dumps({"env": env, "sft": d["sft"], "model": d["model"], "demos": demos}, sort_keys=True)
    done = out / "sft" / "done.json"
    if done.exists() and json.loads(done.read_text()).get("key") == key:
        return json.loads(done.read_text())["policy"]
    out.mkdir(parents=True, exist_ok=True)
    _, tok = load_pretrained(cfg.model.path, dtype=cfg.model.dtype, gguf_file=cfg.model.gguf_file)
    seeds = range(cfg.env.seed_start, cfg.env.seed_start + demos)
    with EnvClient(conn.env_address) as client:
        got = collect(client, cfg, tok, out / "demos.jsonl", list(seeds))
    print(f"sft: {got['episodes']} expert episodes, expert success {got['success_rate']:.2f}", flush=True)
    sft = SFTTrainer(cfg, out / "sft", [out / "demos.jsonl"], conn)
    records = sft.run()
    policy = policy_folder(sft.save())
    print(f"sft: {sft.step} steps, loss {records[0]['sft']['loss']:.3f} -> {records[-1]['sft']['loss']:.3f}",
          flush=True)
    done.write_text(json.dumps({"key": key, "policy": str(policy)}))
    return str(policy)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env", default="frozenlake", help="a bundled learn_<env>.yaml config")
    p.add_argument("--env-config", default="", help="JSON merged into env.env_config (a harder split)")
    p.add_argument("--set", default="", help='JSON of config sections merged over the config, e.g. '
                   '\'{"env": {"num_tasks": 64}, "rollout": {"max_turns": 6}}\'')
    p.add_argument("--model-path", default="", help="the policy RL starts from (default: the config's model)")
    p.add_argument("--sft-demos", type=int, default=0,
                   help="fine-tune the config's model on this many expert episodes first (0: no SFT)")
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="RL seeds per sampler")
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS, help="which to run")
    p.add_argument("--eval-tasks", type=int, default=64, help="held-out seeds played greedily after RL")
    p.add_argument("--quick", action="store_true", help="tiny random-weight model, 2 iterations, 8 held-out seeds")
    p.add_argument("--output-dir", default="runs/task-sampling")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from envserve_trainer.api import Connection, load_config
    from serverproc import ServerProcess
    cfg = load_config(f"learn_{args.env}.yaml")
    if args.set:
        cfg = cfg.with_overrides(**json.loads(args.set))
    env = {"eval_tasks": 8 if args.quick else args.eval_tasks}
    if args.env_config:
        env["env_config"] = {**cfg.env.env_config, **json.loads(args.env_config)}
    model = {"path": args.model_path} if args.model_path else {}
    if args.quick:
        model = {"random_init": "tiny", "trainable_layers": 0}
        args.iterations = 2
    started = time.monotonic()
    results: dict = {}
    start_success = None
    with ServerProcess([cfg.env.env_id], workers=2, metrics=False) as server:
        conn = Connection(env_address=server.address)
        if args.sft_demos and not args.quick and not args.model_path:
            model = {"path": starting_policy(cfg.with_overrides(env=env), Path(args.output_dir), args.sft_demos, conn)}
        if not args.quick:
            start_success = held_out_success(cfg.with_overrides(env=env, model=model), conn)
            print(f"starting policy: held-out greedy success {start_success:.3f}", flush=True)
        for sampler in args.samplers:
            for seed in args.seeds:
                run_cfg = cfg.with_overrides(env=env, model=model, rollout={"task_sampler": sampler},
                                             run={"seed": seed, "iterations": args.iterations})
                r = run(run_cfg, Path(args.output_dir) / f"{sampler}-seed{seed}", conn)
                results.setdefault(sampler, {})[str(seed)] = r
                print(f"{sampler} seed {seed}: {json.dumps(r)}", flush=True)
    summary = {"minutes": round((time.monotonic() - started) / 60, 1), "iterations": args.iterations,
               "env": args.env, "env_config": env.get("env_config", cfg.env.env_config),
               "start_held_out_success": start_success}
    for sampler, by_seed in results.items():
        runs = list(by_seed.values())
        summary[sampler] = {k: statistics.mean(r[k] for r in runs) for k in (
            "env_steps", "generated_tokens", "held_out_success", "held_out_success_per_1k_steps",
            "held_out_success_per_1k_tokens")}
        summary[sampler]["signal_free_groups"] = statistics.mean(
            v for r in runs for v in r["signal_free_groups"] if v is not None)
        summary[sampler]["held_out_success_by_seed"] = [r["held_out_success"] for r in runs]
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
