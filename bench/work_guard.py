"""What a replica's item time limit costs a step: the same FrozenLake measurements (a batch Step of
64 sessions, 64 callers each on its own session over one stream, one caller alone) against a
replica with `--item-time-limit 60` (a worker writes each item's number to the shared array and
the front times it from there) and one with `--item-time-limit 0` (no limit), run in turns,
A B A B, so drift on a busy machine falls on both.

Optionally the same against another source tree (`--baseline-src DIR`, e.g. a `git worktree` of
an earlier commit's `services/`), run beside it in the same turns.

Run: `.venv/bin/python bench/work_guard.py [--rounds 3] [--seconds 3] [--baseline-src DIR] [--json]`;
the last line with --json is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import AsyncEnvClient, check  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

CONFIG = {"max_turns": 1_000_000}
ACTIONS = ["Left", "Up"]   # against the walls of the start cell (top left): episodes never end


def action(i: int) -> str:
    return f"<answer>{ACTIONS[i % 2]}</answer>"


async def measure(address: str, seconds: float) -> dict:
    async with AsyncEnvClient(address) as ac:
        ids = await ac.open("frozenlake", 64, CONFIG, "no_think")
        await ac.reset(ids, seeds=list(range(64)))
        out = {}
        # A batch Step of every session, back to back.
        steps, i, stop = 0, 0, time.perf_counter() + seconds
        t0 = time.perf_counter()
        while time.perf_counter() < stop:
            for r in await ac.step([(sid, action(i)) for sid in ids]):
                check(r)
            steps, i = steps + len(ids), i + 1
        out["batch_steps_per_s"] = steps / (time.perf_counter() - t0)
        async with ac.stream() as s:
            # 64 callers, each stepping its own session.
            counts = [0] * len(ids)
            stop = time.perf_counter() + seconds

            async def run(k, sid):
                while time.perf_counter() < stop:
                    check(await s.step(sid, action(counts[k])))
                    counts[k] += 1
            t0 = time.perf_counter()
            await asyncio.gather(*[run(k, sid) for k, sid in enumerate(ids)])
            out["stream64_steps_per_s"] = sum(counts) / (time.perf_counter() - t0)
            # One caller alone: the latency of a step.
            lat, stop, k = [], time.perf_counter() + seconds, 0
            while time.perf_counter() < stop:
                t = time.perf_counter()
                check(await s.step(ids[0], action(k)))
                lat.append(time.perf_counter() - t)
                k += 1
            out["lone_p50_ms"] = 1e3 * statistics.median(lat)
        await ac.close_sessions(ids)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--baseline-src", default="", help="a services/ folder of another tree, measured in the same turns")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    kinds = {"limit_60": (["--item-time-limit", "60"], None), "limit_0": (["--item-time-limit", "0"], None)}
    if args.baseline_src:
        path = os.pathsep.join([os.path.abspath(args.baseline_src), os.environ.get("PYTHONPATH", "")])
        kinds["baseline"] = ([], {"PYTHONPATH": path})
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind, (extra, env_vars) in kinds.items():
            with ServerProcess(["frozenlake"], workers=args.workers, metrics=False, extra=extra,
                               env_vars=env_vars) as server:
                runs[kind].append(asyncio.run(measure(server.address, args.seconds)))
    medians = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in runs.items()}
    ratios = {f"{k}_over_limit_0": {m: medians[k][m] / medians["limit_0"][m] for m in medians[k]}
              for k in medians if k != "limit_0"}
    print("| replica | batch steps/s | 64 callers steps/s | lone p50 ms |\n|---|---|---|---|")
    for k, m in medians.items():
        print(f"| {k} | {m['batch_steps_per_s']:.0f} | {m['stream64_steps_per_s']:.0f} | {m['lone_p50_ms']:.3f} |")
    for k, r in ratios.items():
        print(f"{k}: " + ", ".join(f"{m} {v:.3f}x" for m, v in r.items()))
    if args.json:
        print(json.dumps({"medians": medians, "ratios": ratios, "rounds": args.rounds, "seconds": args.seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
