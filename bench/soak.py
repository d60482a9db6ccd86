"""Hours of mixed load on 3 replicas behind a real redis-server, with faults on a schedule, sampling
what leaks show up in. One JSON line.

Load (threads of RoutedClient, one AsyncRoutedClient stream, a judge client): episodes of each env
in --envs, forks stepped beside their parents, sessions left open for the lease to reclaim, streams
whose reads are cancelled mid-call, rule-judge calls. Faults, one every --fault-every seconds in
turn: kill -9 a worker, kill -9 a replica (started again under its id), restart Redis, SIGTERM-drain
a replica (it moves its sessions) and start a new one. Every --sample-every seconds: the RSS and PSS,
threads, open fds, processes and JVMs of every replica's process tree, the judge's and this
process's, and the live sessions the directory reports. After the load: an idle wait of lease plus
reap time, then the sessions must be back to 0 and no process or fd left behind.

    .venv/bin/python bench/soak.py --minutes 120 --fault-targets 1 --json  # the long run (docs)
    .venv/bin/python bench/soak.py --minutes 3 --envs sokoban,frozenlake,minesweeper,webshop --json

Slopes are per hour, least squares over the samples after --warmup (a fraction of the run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import psutil  # noqa: E402
from serverproc import JudgeProcess, RedisProcess, ServerProcess, stop_on_sigterm  # noqa: E402

from envserve.client import AsyncRoutedClient, JudgeClient, JudgeTask, RoutedClient  # noqa: E402
from envserve.directory import open_directory  # noqa: E402

GRID = {"sokoban": ["Up", "Right", "Down", "Left"], "frozenlake": ["Right", "Down", "Left", "Up"],
        "minesweeper": ["(0, 0)", "(2, 3)", "(5, 5)", "(1, 4)", "(4, 1)", "(3, 3)"]}
JUDGED = {"sokoban", "frozenlake"}  # the rule judge's envs
ENDED = 9  # FAILED_PRECONDITION: stepping an episode that is over
FAULTS = ["worker", "replica", "redis", "drain"]
# PSS charges each process a share of the library pages it maps, so it moves as other processes on
# the machine start and stop; USS (the pages only this process holds) is the figure for leaks.
METRICS = ["rss_mb", "pss_mb", "uss_mb", "threads", "fds", "processes", "jvms"]


def tree_stats(pid: int) -> dict:
    """RSS, PSS, USS (MiB), threads, fds, processes and JVMs of a process and everything under it."""
    out = dict.fromkeys(METRICS, 0)
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            mem = p.memory_full_info()
            out["rss_mb"] += mem.rss / 2**20
            out["pss_mb"] += getattr(mem, "pss", mem.rss) / 2**20
            out["uss_mb"] += getattr(mem, "uss", mem.rss) / 2**20
            out["threads"] += p.num_threads()
            out["fds"] += p.num_fds()
            out["processes"] += 1
            out["jvms"] += p.name() == "java"
        except psutil.Error:
            pass
    return out


class Stack:
    def __init__(self, envs: list[str], replicas: int, lease: float, heartbeat: float):
        self.envs, self.lease, self.heartbeat = envs, lease, heartbeat
        self.redis = RedisProcess()
        self.replicas: dict[str, ServerProcess] = {}
        self.lock = threading.Lock()
        for i in range(replicas):
            self.start(f"soak-{i}")
        self.judge = JudgeProcess(directory=self.redis.url)

    def start(self, rid: str) -> None:
        proc = ServerProcess(self.envs, workers=1, metrics=False, extra=[
            "--directory", self.redis.url, "--heartbeat-seconds", str(self.heartbeat), "--replica-id", rid,
            "--lease-seconds", str(self.lease), "--drain-timeout", "30"])
        with self.lock:
            self.replicas[rid] = proc

    def live_sessions(self) -> int:
        try:
            with open_directory(self.redis.url) as d:
                return sum(max(0, r.live_sessions) for r in d.replicas())
        except Exception:
            return -1

    def sample(self) -> dict:
        with self.lock:
            roots = {f"{rid}:{p.proc.pid}": p.proc.pid for rid, p in self.replicas.items()}
        roots[f"judge:{self.judge.proc.pid}"] = self.judge.proc.pid
        total = dict.fromkeys(METRICS, 0)
        trees, private = {}, {}
        for name, pid in roots.items():
            stats = tree_stats(pid)
            trees[name] = round(stats["pss_mb"], 1)
            private[name] = round(stats["uss_mb"], 1)
            for k, v in stats.items():
                total[k] += v
        me = psutil.Process()
        judge = tree_stats(self.judge.proc.pid)
        return {**{k: round(v, 1) for k, v in total.items()}, "live_sessions": self.live_sessions(),
                "judge_fds": judge["fds"], "judge_threads": judge["threads"],
                "client_rss_mb": round(me.memory_info().rss / 2**20, 1), "client_threads": me.num_threads(),
                "client_fds": me.num_fds(), "tree_pss_mb": trees, "tree_uss_mb": private}

    def fault(self, kind: str, rng: random.Random, targets: int) -> None:
        with self.lock:
            rid = rng.choice(sorted(self.replicas)[:targets])
            proc = self.replicas[rid]
        if kind == "worker":
            pids = proc.worker_pids()
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
        elif kind == "replica":
            proc.kill()
            self.start(rid)
        elif kind == "redis":
            self.redis.restart()
        elif kind == "drain":
            proc.proc.send_signal(signal.SIGTERM)
            try:
                proc.proc.wait(60)
            except Exception:
                proc.kill()
            self.start(rid)

    def close(self) -> None:
        for p in self.replicas.values():
            p.kill()
        self.judge.kill()
        self.redis.stop()


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.c = {"episodes": 0, "steps": 0, "forks": 0, "abandoned": 0, "stream_cancels": 0, "judged": 0,
                  "failed_items": 0, "judge_errors": 0}
        self.failures: dict[str, int] = {}  # the first words of each failure -> how often

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.c[key] += n

    def failed(self, what: str, key: str = "failed_items") -> None:
        with self.lock:
            self.c[key] += 1
            kind = what[:120]
            self.failures[kind] = self.failures.get(kind, 0) + 1


def _answer(env_id: str, result, k: int) -> str:
    if env_id in GRID:
        moves = GRID[env_id]
        return f"<answer>{moves[k % len(moves)]}</answer>"
    valid = list(result.info["valid_actions"]) if "valid_actions" in result.info else []
    return f"<answer>{valid[(7 * k + 3) % len(valid)] if valid else 'look'}</answer>"


def _ok(counts: Counts, results, what: str) -> list:
    for r in results:
        if r.status.code not in (0, ENDED):
            counts.failed(f"{what}: {r.status.code} {r.status.message}")
    return results


def episodes(url: str, envs: list[str], stop: threading.Event, counts: Counts, seed: int, judge_address: str):
    rng = random.Random(seed)
    with RoutedClient(url) as client, JudgeClient(judge_address) as judge:
        while not stop.is_set():
            env_id = rng.choice(envs)
            try:
                config = {} if env_id in GRID else {"include_valid_actions": True}
                sid = client.open(env_id, 1, config, "no_think")[0]
                r = _ok(counts, client.reset([sid], [rng.randrange(10**6)]), "reset")[0]
                kept = [sid]
                for k in range(rng.randint(3, 10)):
                    if r.done or r.truncated or r.status.code:
                        break
                    r = _ok(counts, client.step([(sid, _answer(env_id, r, k))]), "step")[0]
                    counts.add("steps")
                    if k == 2 and rng.random() < 0.2:
                        kids = client.fork(sid, 2)
                        counts.add("forks")
                        _ok(counts, client.step([(c, _answer(env_id, r, k + 1 + i)) for i, c in enumerate(kids)]),
                            "fork step")
                        kept += kids
                    if env_id in JUDGED and k == 1 and rng.random() < 0.3:
                        # The judge reads the truth where the session is now; a replica killed since
                        # the step fails the read (a judge error, not a lost episode).
                        real = client.sessions.current(sid)
                        for j in judge.judge([JudgeTask(f"{real}:{k}", real, r.turn, "grounding",
                                                        "the player is left of box0")]):
                            counts.add("judged")
                            if j.status.code:
                                counts.failed(f"judge: {j.status.message}", "judge_errors")
                if rng.random() < 0.1:
                    counts.add("abandoned")  # left for the lease to reclaim
                else:
                    client.close_sessions(kept)
                counts.add("episodes")
            except Exception as e:  # noqa: BLE001 (a soak reports every failure and goes on)
                counts.failed(f"{env_id}: {type(e).__name__}: {e}")
                time.sleep(0.2)


def streams(url: str, stop: threading.Event, counts: Counts, seed: int):
    """Grid sessions stepped over the routed stream; some reads cancelled mid-call, the stream
    closed and opened again."""
    rng = random.Random(seed)

    async def run():
        async with AsyncRoutedClient(url) as client:
            while not stop.is_set():
                try:
                    sids = await client.open("sokoban", 8)
                    await client.reset(sids, [rng.randrange(10**6) for _ in sids])
                    async with client.stream() as s:
                        for k in range(6):
                            for sid in sids:
                                await s.send_step(sid, _answer("sokoban", None, k))
                            if rng.random() < 0.3:
                                task = asyncio.ensure_future(s.recv())
                                await asyncio.sleep(0)
                                task.cancel()
                                counts.add("stream_cancels")
                                break
                            while s.in_flight:
                                _ok(counts, [r for _, r in await s.recv()], "stream step")
                    await client.close_sessions(sids)
                except Exception as e:  # noqa: BLE001
                    counts.failed(f"stream: {type(e).__name__}: {e}")
                    await asyncio.sleep(0.2)
    asyncio.run(run())


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 3:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    den = sum((t - mt) ** 2 for t, _ in samples)
    return 0.0 if den == 0 else sum((t - mt) * (v - mv) for t, v in samples) / den * 3600


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--envs", default="sokoban,frozenlake,minesweeper,webshop,alfworld,scienceworld")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--threads", type=int, default=3, help="episode threads")
    ap.add_argument("--lease", type=float, default=20.0, help="the replicas' session lease (s)")
    ap.add_argument("--fault-every", type=float, default=60.0)
    ap.add_argument("--fault-targets", type=int, default=0,
                    help="hit only the first N replicas (0: all); the others live through the run, so "
                         "their process trees' memory slopes are read without restarts in them")
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run left out of the slopes")
    ap.add_argument("--heartbeat", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    stop_on_sigterm()  # a SIGTERM stops the servers this run started, too
    envs = [e for e in args.envs.split(",") if e]

    stack = Stack(envs, args.replicas, args.lease, args.heartbeat)
    try:
        baseline = stack.sample()
        stop, counts = threading.Event(), Counts()
        threads = [threading.Thread(target=episodes, args=(stack.redis.url, envs, stop, counts, args.seed + i,
                                                           stack.judge.address), daemon=True)
                   for i in range(args.threads)]
        threads.append(threading.Thread(target=streams, args=(stack.redis.url, stop, counts, args.seed + 99),
                                        daemon=True))
        for t in threads:
            t.start()
        rng = random.Random(args.seed)
        samples: list[tuple[float, dict]] = []
        faults: dict[str, int] = dict.fromkeys(FAULTS, 0)
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        next_fault, next_sample = t0 + args.fault_every, t0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - t0, stack.sample()))
                next_sample = now + args.sample_every
            if now >= next_fault:
                kind = FAULTS[sum(faults.values()) % len(FAULTS)]
                stack.fault(kind, rng, args.fault_targets or args.replicas)
                faults[kind] += 1
                next_fault = time.monotonic() + args.fault_every
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(120)
        # Idle: every session left open is reclaimed by its lease (plus the reaper's period).
        time.sleep(args.lease + min(5.0, args.lease / 10) + 3 * args.heartbeat + 2)
        final = stack.sample()
        kept = [(t, s) for t, s in samples if t >= args.warmup * args.minutes * 60]
        slopes = {k: round(slope_per_hour([(t, s[k]) for t, s in kept]), 2)
                  for k in [*METRICS, "client_rss_mb", "client_fds", "client_threads"]}
        mean_pss = sum(s["pss_mb"] for _, s in kept) / max(1, len(kept))
        # Per process tree (a replica under one pid, the judge): the growth of each tree that lived
        # through the whole window after warm-up, in percent of its mean per hour.
        def per_tree(key: str) -> dict:
            out = {}
            for name in kept[0][1][key] if kept else []:
                series = [(t, s[key][name]) for t, s in kept if name in s[key]]
                if len(series) == len(kept):
                    mean = sum(v for _, v in series) / len(series)
                    out[name] = round(100 * slope_per_hour(series) / mean, 2) if mean else 0.0
            return out
        out = {"minutes": args.minutes, "envs": envs, **counts.c, "faults": faults,
               "baseline": baseline, "final": final, "slope_per_hour": slopes,
               "pss_growth_percent_per_hour": round(100 * slopes["pss_mb"] / mean_pss, 2) if mean_pss else 0.0,
               "tree_pss_growth_percent_per_hour": per_tree("tree_pss_mb"),
               "tree_uss_growth_percent_per_hour": per_tree("tree_uss_mb"),
               "samples": len(samples), "failures": counts.failures,
               "left_behind": {"sessions": final["live_sessions"],
                               "processes": final["processes"] - baseline["processes"],
                               "jvms": final["jvms"] - baseline["jvms"],
                               "fds": final["fds"] - baseline["fds"]}}
        print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    finally:
        stack.close()


if __name__ == "__main__":
    main()
