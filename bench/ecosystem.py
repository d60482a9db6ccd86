"""Other ecosystems' envs served by envserve, against the same envs stepped in-process.

Gymnasium: CartPole-v1 (text observations) at batch 64, through envserve's batched Step on a
loopback server, against 64 gymnasium envs stepped in a plain loop in this process, in the same
run, so the ratio travels between machines. Run: `.venv/bin/python bench/ecosystem.py [--json]
[--seconds 10]`; with --json the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import EnvClient  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

GYM_ID = "CartPole-v1"
BATCH = 64
ACTIONS = ("Left", "Right")


def gym_in_process(seconds: float) -> float:
    """Env steps per second of BATCH gymnasium envs stepped one after another, reset when over."""
    import gymnasium as gym
    envs = [gym.make(GYM_ID) for _ in range(BATCH)]
    for i, e in enumerate(envs):
        e.reset(seed=i)
    steps, k, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i, e in enumerate(envs):
            _, _, terminated, truncated, _ = e.step((k + i) % 2)
            if terminated or truncated:
                e.reset(seed=i + k)
        steps += BATCH
        k += 1
    return steps / (time.perf_counter() - t0)


def envserve_batched(client: EnvClient, seconds: float) -> float:
    """Env steps per second of BATCH sessions stepped by one Step call per round; sessions whose
    episode ended are reset in one Reset call before the next round."""
    env_id = f"gymnasium:{GYM_ID}"
    sids = client.open(env_id, BATCH, {"max_turns": 1_000_000}, "no_think")
    client.reset(sids, seeds=list(range(BATCH)))
    steps, k, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        results = client.step([(s, f"<answer>{ACTIONS[(k + i) % 2]}</answer>") for i, s in enumerate(sids)])
        ended = [s for s, r in zip(sids, results) if r.done or r.truncated]
        if ended:
            client.reset(ended, seeds=[k + i for i in range(len(ended))])
        steps += BATCH
        k += 1
    elapsed = time.perf_counter() - t0
    client.close_sessions(sids)
    return steps / elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time of each side")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    local = gym_in_process(args.seconds)
    with ServerProcess([f"gymnasium:{GYM_ID}"], workers=args.workers, metrics=False) as server, \
            EnvClient(server.address) as client:
        served = envserve_batched(client, args.seconds)
    out = {"gymnasium_env": GYM_ID, "batch": BATCH, "workers": args.workers, "seconds": args.seconds,
           "in_process_steps_per_s": round(local), "envserve_step_steps_per_s": round(served),
           "envserve_over_in_process": round(served / local, 4)}
    print(f"gymnasium {GYM_ID} batch {BATCH}: in-process loop {local:,.0f} steps/s, envserve batched Step "
          f"{served:,.0f} steps/s ({served / local:.3f}x), {args.workers} workers")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
