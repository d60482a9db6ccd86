"""The path trainers that drive one rollout at a time use (TRL, SkyRL, OpenRLHF, OpenEnv clients):
every session has its own caller that sends one step and waits for it. Against the batch path
(all sessions' steps in one Step call), same sessions, same server, same run.

- batch: one `Step` call with every session's action, repeated (EnvPool's send-all).
- stream_per_session: one Interact stream; each session's task awaits `stream.step(sid, action)`
  (sends of one event-loop turn travel as one message).
- unary_per_session: each session's task awaits its own unary `Step` call.

FrozenLake 4x4 with no_think answers that walk into the wall from the start corner (Left, Up), so
no episode ever ends and every step is the env's whole step (parse, move, text, ground truth);
`envserve serve frozenlake` with 2 workers, client in this process.
Reported: steps/s and the per-step p50/p99 each caller waits, at 1 and 64 sessions, and
ratio_stream_b64 = stream_per_session / batch at 64 sessions (meant to be at least 0.8).

    python bench/per_session.py --json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import AsyncEnvClient, check  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

CONFIG = {"max_turns": 1_000_000}
MOVES = ["Left", "Up"]   # from the start corner: into the wall, forever


def action(i: int) -> str:
    return f"<answer>{MOVES[i % 2]}</answer>"


def summary(lat: list[float], steps: int, seconds: float) -> dict:
    lat.sort()
    return {"steps_per_s": steps / seconds, "p50_ms": 1e3 * lat[len(lat) // 2],
            "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


async def batch(ac: AsyncEnvClient, ids: list[str], seconds: float) -> dict:
    lat, steps, i, t0 = [], 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        for r in await ac.step([(sid, action(i + k)) for k, sid in enumerate(ids)]):
            check(r)
        lat.append(time.perf_counter() - t)
        steps += len(ids)
        i += 1
    return summary(lat, steps, time.perf_counter() - t0)


async def per_session(ids: list[str], seconds: float, step) -> dict:
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    counts = [0] * len(ids)

    async def run(k: int, sid: str) -> None:
        i = k
        while time.perf_counter() < stop:
            t = time.perf_counter()
            check(await step(sid, action(i)))
            lat.append(time.perf_counter() - t)
            counts[k] += 1
            i += 1

    t0 = time.perf_counter()
    await asyncio.gather(*[run(k, sid) for k, sid in enumerate(ids)])
    return summary(lat, sum(counts), time.perf_counter() - t0)


async def measure(address: str, n: int, seconds: float) -> dict:
    async with AsyncEnvClient(address) as ac:
        ids = await ac.open("frozenlake", n, CONFIG, "no_think")
        await ac.reset(ids, seeds=list(range(n)))
        out = {"batch": await batch(ac, ids, seconds)}
        async with ac.stream() as s:
            out["stream_per_session"] = await per_session(ids, seconds, s.step)

        async def unary(sid: str, a: str):
            return (await ac.step([(sid, a)]))[0]
        out["unary_per_session"] = await per_session(ids, seconds, unary)
        await ac.close_sessions(ids)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with ServerProcess(["frozenlake"], workers=args.workers, metrics=False) as server:
        results = {str(n): asyncio.run(measure(server.address, n, args.seconds)) for n in (1, 64)}
    b64 = results["64"]
    results["ratio_stream_b64"] = b64["stream_per_session"]["steps_per_s"] / b64["batch"]["steps_per_s"]
    results["ratio_unary_b64"] = b64["unary_per_session"]["steps_per_s"] / b64["batch"]["steps_per_s"]
    print("| sessions | path | steps/s | p50 ms | p99 ms |\n|---|---|---|---|---|")
    for n in ("1", "64"):
        for path, r in results[n].items():
            print(f"| {n} | {path} | {r['steps_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")
    print(f"64 sessions, one caller each: stream {results['ratio_stream_b64']:.2f}x, unary "
          f"{results['ratio_unary_b64']:.2f}x of the batch rate (target for the stream: 0.8x)")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
