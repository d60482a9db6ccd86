"""What routing through the directory costs: RoutedClient against EnvClient on the same replicas.

Two sokoban replicas register in a real redis-server. The baseline steps each replica's sessions
with its own EnvClient, one replica after the other; the routed client steps one mixed batch that
it splits by replica and sends to both at once. Both run alongside in this process, alternating in
rounds, so the ratio travels between machines. Run: `.venv/bin/python bench/routing_overhead.py [--json]`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import EnvClient, RoutedClient  # noqa: E402
from envserve.directory import replica_of  # noqa: E402
from serverproc import RedisProcess, ServerProcess  # noqa: E402

CONFIG = {"max_turns": 1_000_000}
ACTIONS = ["Up", "Left", "Down", "Right"]


def _steps_per_second(step_batch, ids, seconds) -> float:
    n, i = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step_batch([(s, f"<answer>{ACTIONS[i % 4]}</answer>") for s in ids])
        n += len(ids)
        i += 1
    return n / (time.perf_counter() - t0)


def main() -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with RedisProcess() as redis_server:
        extra = ["--directory", redis_server.url, "--heartbeat-seconds", "1"]
        with ServerProcess(["sokoban"], workers=1, metrics=False, extra=[*extra, "--replica-id", "bench-a"]) as a, \
                ServerProcess(["sokoban"], workers=1, metrics=False, extra=[*extra, "--replica-id", "bench-b"]) as b:
            routed = RoutedClient(redis_server.url)
            while len(routed.replicas("sokoban", refresh=True)) < 2:
                time.sleep(0.1)
            ids = routed.open("sokoban", args.batch, CONFIG)
            routed.reset(ids, list(range(len(ids))))
            direct = {"bench-a": EnvClient(a.address), "bench-b": EnvClient(b.address)}
            by_replica = {rid: [s for s in ids if replica_of(s) == rid] for rid in direct}

            def direct_step(pairs):
                for rid, c in direct.items():
                    c.step([(s, act) for s, act in pairs if replica_of(s) == rid])

            ratios, base, rout = [], [], []
            for _ in range(args.rounds):
                d = _steps_per_second(direct_step, ids, args.seconds)
                r = _steps_per_second(routed.step, ids, args.seconds)
                base.append(d)
                rout.append(r)
                ratios.append(r / d)
            result = {
                "batch": args.batch, "replicas": 2,
                "direct_steps_per_s": round(statistics.median(base), 1),
                "routed_steps_per_s": round(statistics.median(rout), 1),
                "ratio_routed_vs_direct": round(statistics.median(ratios), 3),
                "sessions_per_replica": {k: len(v) for k, v in by_replica.items()},
            }
            routed.close()
            for c in direct.values():
                c.close()
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:28s} {v}")
    return result


if __name__ == "__main__":
    main()
