"""Does judging slow rollouts down? Rollout steps/s with the judge on against the same loop with it off.

A rollout loop steps `--sessions` Sokoban sessions (grounding + world-modelling answers) in batches
through a real server. With the judge on, after every batch it hands each session's <observation>
(grounding, turn t) and <prediction> (world modelling, turn t+1) to `envserve judge` with
AsyncJudgeClient.submit and goes on at once; results arrive in the background. Off and on rounds
alternate (`--rounds` of each, `--seconds` long) so drift hits both alike; the off rounds among
themselves give the noise.

    ratio_steps_with_judge  = mean steps/s with the judge on / mean steps/s with it off
    noise_off_rounds        = (max - min) / mean of the off rounds' steps/s
    judged_per_s            = judge results received per second of the on rounds
    judge_latency_p50_ms/p95  submit -> result, per item
    judge_results_ok        = share of results with status OK (all others are counted too); a judge
                              that falls further behind than the kept turns (history_turns) reads
                              turns that are gone, and those items fail NOT_FOUND

The policy: `--policy-ms` per batch models the model writing the next answers (on a GPU, so this
machine's CPUs idle meanwhile); 100 ms for 64 answers is far faster than any LLM. `--policy-ms 0` is
the worst case, a loop that only steps: then the judge's GetState reads (about one per step, served by
the same env replicas) and the results it streams back take CPU the loop would have used.

Run: `.venv/bin/python bench/judge_overhead.py [--seconds 5 --rounds 3 --sessions 64 --policy-ms 0,100,250,500]
[--json]`; with --json the last line is one JSON object: the headline figures are those of the largest
policy time, and `by_policy_ms` has every one.

CPUs: in production the judge is its own pod. Here, by default, the judge process is pinned to the
last CPU and the rollout (this loop, the env server and its workers) to the others, in the off rounds
as in the on rounds, so the ratio measures whether judging holds stepping up, not two programs sharing
cores. `--share-cpus` leaves every process on every CPU: on a 2-core machine that ratio is mostly CPU
contention (the rollout here is CPU-bound with no policy in the loop).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import AsyncEnvClient, AsyncJudgeClient, JudgeTask  # noqa: E402
from serverproc import JudgeProcess, ServerProcess  # noqa: E402

ACTIONS = ("Up", "Down", "Left", "Right")
DESCRIPTIONS = ("The box is above me and the target is to my left.", "The box is to my right, in my row.",
                "The target is below me and the box is above me.", "The box is on my left side.")


def answer(rng: random.Random) -> str:
    return (f"<think><observation>{rng.choice(DESCRIPTIONS)}</observation><reasoning>push</reasoning>"
            f"<prediction>{rng.choice(DESCRIPTIONS)}</prediction></think><answer>{rng.choice(ACTIONS)}</answer>")


async def rollout(env: AsyncEnvClient, sids: list[str], seconds: float, judge: AsyncJudgeClient | None,
                  sent_at: dict[str, float], rng: random.Random, policy_s: float = 0.0) -> int:
    steps, batch = 0, 0
    turn = {s: 0 for s in sids}
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if policy_s:
            await asyncio.sleep(policy_s)  # the policy writing the batch's answers (a GPU; this CPU idles)
        results = await env.step({s: answer(rng) for s in sids})
        steps += len(results)
        batch += 1
        tasks, done = [], []
        for r in results:
            sid = r.session_id
            if judge is not None and r.action_valid:
                for field, tag in (("grounding", "observation"), ("world_modeling", "prediction")):
                    key = f"{sid}/{r.trial}/{r.episode}/{turn[sid]}/{field}"
                    tasks.append(JudgeTask(key, sid, turn[sid], field, r.reasoning[tag], episode=r.episode,
                                           trial=r.trial))
            turn[sid] = r.turn
            if r.done or r.truncated:
                done.append(sid)
        if tasks:
            now = time.perf_counter()
            sent_at.update((t.key, now) for t in tasks)
            judge.submit(tasks)  # returns at once: the loop never awaits the judge
        if done:
            await env.reset(done, seeds=[rng.randrange(1 << 30) for _ in done])
            turn.update((s, 0) for s in done)
    return steps


def pin(pid: int, cpus: list[int]) -> None:
    """Pins a process and everything it has started (the server's workers) to `cpus`."""
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        p.cpu_affinity(cpus)


async def main_async(args) -> dict:
    with ServerProcess(["sokoban"], workers=args.workers, metrics=False) as server, \
            JudgeProcess(server.address) as judge_proc:
        cpus = sorted(os.sched_getaffinity(0))
        placement = "shared"
        if not args.share_cpus and len(cpus) >= 2:
            rollout_cpus, judge_cpus = cpus[:-1], cpus[-1:]
            pin(os.getpid(), rollout_cpus)
            pin(server.proc.pid, rollout_cpus)
            pin(judge_proc.proc.pid, judge_cpus)
            placement = f"rollout on CPUs {rollout_cpus}, judge on {judge_cpus}"
        env = AsyncEnvClient(server.address)
        sids = await env.open("sokoban", args.sessions, action_format="grounding_worldmodeling")
        await env.reset(sids, seeds=list(range(args.sessions)))
        judge = AsyncJudgeClient(judge_proc.address)
        sent_at: dict[str, float] = {}
        arrived: list[tuple[float, float, bool]] = []  # (latency s, arrival time, ok)

        async def consume():
            while True:
                r = await judge.results.get()
                now = time.perf_counter()
                arrived.append((now - sent_at.pop(r.key, now), now, r.status.code == 0))

        consumer = asyncio.get_running_loop().create_task(consume())
        await rollout(env, sids, 1.0, None, sent_at, random.Random(1))  # warm-up
        sweep = {}
        for policy_ms in args.policy_ms:
            policy_s = policy_ms / 1000
            off, on, on_seconds, first = [], [], 0.0, len(arrived)
            # untimed: the same episodes once, so the rooms new seeds need are generated (and cached)
            # before any timed round
            await env.reset(sids, seeds=list(range(args.sessions)))
            await rollout(env, sids, args.seconds, None, sent_at, random.Random(0), policy_s)
            for _ in range(args.rounds):
                # Every round replays the same episodes (same seeds, same answers), so off and on
                # rounds do the same env work, resets of finished episodes included.
                await env.reset(sids, seeds=list(range(args.sessions)))
                t0 = time.perf_counter()
                off.append(await rollout(env, sids, args.seconds, None, sent_at, random.Random(0), policy_s)
                           / (time.perf_counter() - t0))
                await env.reset(sids, seeds=list(range(args.sessions)))
                t0 = time.perf_counter()
                n = await rollout(env, sids, args.seconds, judge, sent_at, random.Random(0), policy_s)
                elapsed = time.perf_counter() - t0
                on.append(n / elapsed)
                on_seconds += elapsed
                await judge.drain()  # the next off round starts with the judge idle
                await asyncio.sleep(0.05)
            sweep[policy_ms] = summary(off, on, on_seconds, arrived[first:])
        consumer.cancel()
        await judge.close()
        await env.close()
    main_policy = max(args.policy_ms)
    out = {"bench": "judge_overhead", "sessions": args.sessions, "rounds": args.rounds, "seconds": args.seconds,
           "cpus": os.cpu_count(), "placement": placement, "policy_ms": main_policy, **sweep[main_policy],
           "by_policy_ms": {str(k): v for k, v in sweep.items()}}
    return out


def summary(off: list[float], on: list[float], on_seconds: float, arrived: list) -> dict:
    lat = sorted(a[0] for a in arrived)

    def pct(q):
        return round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

    mean_off, mean_on = statistics.mean(off), statistics.mean(on)
    return {
        "steps_per_s_judge_off": round(mean_off, 1), "steps_per_s_judge_on": round(mean_on, 1),
        "ratio_steps_with_judge": round(mean_on / mean_off, 3),
        "noise_off_rounds": round((max(off) - min(off)) / mean_off, 3),
        "rounds_off": [round(x, 1) for x in off], "rounds_on": [round(x, 1) for x in on],
        "judged": len(arrived), "judged_per_s": round(len(arrived) / on_seconds, 1),
        "judge_results_ok": round(sum(a[2] for a in arrived) / len(arrived), 3) if arrived else None,
        "judge_latency_p50_ms": pct(0.5), "judge_latency_p95_ms": pct(0.95),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policy-ms", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 100.0, 250.0, 500.0],
                   help="comma-separated: time the policy takes per batch of answers (0: a loop that only "
                        "steps); the headline figures are for the largest")
    p.add_argument("--share-cpus", action="store_true", help="no pinning: judge and rollout share every CPU")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            if k != "by_policy_ms":
                print(f"{k:28} {v}")
        for policy_ms, row in out["by_policy_ms"].items():
            print(f"policy {policy_ms:>6} ms: ratio {row['ratio_steps_with_judge']:.3f} "
                  f"(off {row['steps_per_s_judge_off']}, on {row['steps_per_s_judge_on']} steps/s, "
                  f"noise {row['noise_off_rounds']}), judged {row['judged_per_s']}/s, "
                  f"latency p50 {row['judge_latency_p50_ms']} ms p95 {row['judge_latency_p95_ms']} ms")


if __name__ == "__main__":
    main()
