"""A session's whole life, one call at a time, as a rollout that opens a session per episode makes
it: Open, Reset, one Step, Close, repeated. The p50 of each call, against `serve --inline` and a
replica with one worker; the ratio of each call to the Step beside it (the baseline: a Step is the
cheapest call that reaches the env).

FrozenLake 4x4, no_think answers; `envserve serve frozenlake`, client (EnvClient) in this process.

    python bench/session_calls.py --json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import EnvClient  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

CALLS = ("open", "reset", "step", "close")


def lives(address: str, count: int, warmup: int) -> dict:
    client = EnvClient(address)
    times: dict[str, list[float]] = {k: [] for k in CALLS}
    for i in range(warmup + count):
        t0 = time.perf_counter()
        (sid,) = client.open("frozenlake", 1)
        t1 = time.perf_counter()
        client.reset([sid], seeds=[i])
        t2 = time.perf_counter()
        client.step([(sid, "<answer>Left</answer>")])
        t3 = time.perf_counter()
        client.close_sessions([sid])
        t4 = time.perf_counter()
        if i >= warmup:
            for k, dt in zip(CALLS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k].append(1e3 * dt)
    client.close()
    p50 = {k: round(statistics.median(v), 3) for k, v in times.items()}
    return {"p50_ms": p50, "over_step": {k: round(p50[k] / p50["step"], 2) for k in CALLS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict = {"cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    for name, workers, extra in (("inline", 1, ["--inline"]), ("workers", 1, [])):
        with ServerProcess(["frozenlake"], workers=workers, metrics=False, extra=extra) as server:
            out[name] = lives(server.address, args.count, args.warmup)
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
