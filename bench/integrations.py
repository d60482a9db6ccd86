"""The framework adapters (envserve.integrations) against OpenEnv's own client, on one game written
once: the 6x6 push-box room of bench/vs_openenv.py, served by OpenEnv 0.10's server (uvicorn, as its
env template runs it) and by `envserve serve pushbox`. Every rollout plays vs_openenv's SCRIPT (15
moves, the last push ends the episode) and is reset, outside the timing, when it ends.

- serial: one rollout making one call at a time (TRL's tool loop): the p50/p99 of a call through
  each adapter (TRL's tool, SkyRL's and GEM's `step`; `trl_unary` is TRL with `stream=False`)
  against OpenEnv's `SyncEnvClient.step`, sides alternating in rounds; against envserve with
  `--inline` (no worker hop) and with worker processes (the default replica).
- concurrent: 64 rollouts as 4 processes of 16 threads (how trainers run env workers), each thread
  its own rollout: steps/s of TRL's adapter (stream and unary) against OpenEnv's client the same
  way, each thread with its own SyncEnvClient (one WebSocket, as OpenEnv's clients are used).
- replicas: the same 64 TRL rollouts given a redis:// directory of 3 replicas: how many sessions
  each replica got (most over least), and the steps/s.
- endpoint (`--endpoint`): bench/openenv_endpoint.py's 64-socket comparison of envserve's OpenEnv
  endpoint against OpenEnv's server, run as is and its ratios reported here.

    .venv/bin/python bench/integrations.py --json
    .venv/bin/python bench/integrations.py --json --serial-only --rounds 7   # the serial part alone
    .venv/bin/python bench/integrations.py --json --replicas-only --rounds 5  # the spread alone
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "tests")]

from vs_openenv import SCRIPT, OpenEnvServer, pushbox_distribution  # noqa: E402

ENV_ID = "pushbox"
SERIAL_SIDES = ("openenv_sync", "trl", "trl_unary", "skyrl", "gem")
CONCURRENT_SIDES = ("openenv_sync", "trl", "trl_unary")


def answer(move: str) -> str:
    return f"<answer>{move}</answer>"  # the no_think format the push-box env defaults to


# -- rollouts: reset() outside the timing, step(move) -> whether the episode ended -----------------
class OpenEnvRollout:
    def __init__(self, url: str):
        from openenv.core import GenericEnvClient
        self.client = GenericEnvClient(base_url=url).sync()
        self.client.__enter__()

    def reset(self, seed: int) -> None:
        self.client.reset()

    def step(self, move: str) -> bool:
        return bool(self.client.step({"direction": move}).done)

    def close(self) -> None:
        self.client.__exit__(None, None, None)


class TRLRollout:
    def __init__(self, cls):
        self.env = cls()

    def reset(self, seed):
        self.env.reset(seed=seed)

    def step(self, move):
        self.env.act(move)
        return self.env._done

    def close(self):
        pass


class SkyRLRollout:
    """As SkyRL's generator: a fresh env per trajectory, made and init'ed in reset."""

    def __init__(self, env_class):
        self.env_class, self.env = env_class, None

    def reset(self, seed):
        import skyrl_gym
        self.close()
        self.env = skyrl_gym.make(self.env_class, env_config={}, extras={"seed": seed})
        self.env.init([])

    def step(self, move):
        return self.env.step(answer(move))["done"]

    def close(self):
        if self.env is not None:
            self.env.close()


class GEMRollout:
    def __init__(self, env_id):
        import gem
        self.env = gem.make(env_id)

    def reset(self, seed):
        self.env.reset(seed)

    def step(self, move):
        _, _, terminated, truncated, _ = self.env.step(answer(move))
        return terminated or truncated

    def close(self):
        self.env.close()


def maker(side: str, target: str):
    """A function making one rollout of `side` against target (OpenEnv's URL, or envserve's)."""
    if side == "openenv_sync":
        return lambda: OpenEnvRollout(target)
    if side in ("trl", "trl_unary"):
        from envserve.integrations.trl import environment_factory
        cls = environment_factory(target, ENV_ID, tools="act", include_rules=False, stream=side == "trl")
        return lambda: TRLRollout(cls)
    if side == "skyrl":
        from envserve.integrations.skyrl import register
        (env_class,) = register(target, [ENV_ID], prefix="bench-", include_rules=False)
        return lambda: SkyRLRollout(env_class)
    if side == "gem":
        from envserve.integrations.gem import register
        (env_id,) = register(target, [ENV_ID], prefix=f"bench-{target}:", include_rules=False)
        return lambda: GEMRollout(env_id)
    raise ValueError(side)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- serial ----------------------------------------------------------------------------------------
def serial_round(rollout, calls: int, warmup: int) -> list[float]:
    lat: list[float] = []
    k, seed = 0, 0
    rollout.reset(seed)
    while len(lat) < calls:
        t = time.perf_counter()
        ended = rollout.step(SCRIPT[k % len(SCRIPT)])
        dt = time.perf_counter() - t
        k += 1
        if warmup:
            warmup -= 1
        else:
            lat.append(dt)
        if ended:
            seed, k = seed + 1, 0
            rollout.reset(seed)
    return lat


def serial(targets: dict[str, str], rounds: int, calls: int, sides: list[str]) -> dict:
    rollouts = {s: maker(s, targets["openenv" if s.startswith("openenv") else "envserve"])() for s in sides}
    per_round: dict[str, list[float]] = {s: [] for s in sides}
    pooled: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(rounds):
        for s in sides[r % len(sides):] + sides[:r % len(sides)]:
            lat = serial_round(rollouts[s], calls, warmup=50)
            per_round[s].append(1e3 * statistics.median(lat))
            pooled[s] += lat
    for ro in rollouts.values():
        ro.close()
    return {s: {"p50_ms": round(statistics.median(per_round[s]), 3), "p99_ms": round(1e3 * pct(pooled[s], 0.99), 3),
                "p50_ms_by_round": [round(x, 3) for x in per_round[s]], "calls": len(pooled[s])} for s in sides}


# -- concurrent: one process of `threads` rollouts (run by the parent, 4 at once) ---------------------
def drive(side: str, target: str, threads: int, seconds: float, warmup: float) -> dict:
    make = maker(side, target)
    rollouts = [make() for _ in range(threads)]
    for k, ro in enumerate(rollouts):
        ro.reset(k)
    replicas = collections.Counter()
    if side.startswith("trl"):
        from envserve.directory import replica_of
        replicas.update(replica_of(ro.env._session.real_id) for ro in rollouts)
    counts = [0] * threads
    phase = {"record": False, "stop": False}
    errors = collections.Counter()

    def loop(i: int) -> None:
        ro, k, seed = rollouts[i], 0, i
        while not phase["stop"]:
            try:
                ended = ro.step(SCRIPT[k % len(SCRIPT)])
            except Exception as e:  # noqa: BLE001 (counted, the rollout goes on)
                errors[type(e).__name__] += 1
                ended = True
            k += 1
            if phase["record"]:
                counts[i] += 1
            if ended:
                seed, k = seed + 1000, 0
                ro.reset(seed)

    ts = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    time.sleep(warmup)
    phase["record"] = True
    t0, cpu0 = time.perf_counter(), time.process_time()
    print("recording", flush=True)  # the parent reads the server's CPU between these two lines
    time.sleep(seconds)
    phase["record"] = False
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print("recorded", flush=True)
    phase["stop"] = True
    for t in ts:
        t.join(30)
    for ro in rollouts:
        ro.close()
    return {"steps": sum(counts), "seconds": elapsed, "cpu_seconds": cpu, "replicas": dict(replicas),
            "errors": dict(errors)}


def concurrent(side: str, target: str, processes: int, threads: int, seconds: float,
               server_pids: "list[int]") -> dict:
    import psutil
    cmd = [sys.executable, __file__, "--drive", side, "--target", target, "--threads", str(threads),
           "--seconds", str(seconds)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    servers = [psutil.Process(pid) for pid in server_pids]

    def server_cpu() -> float:  # the servers' processes and their children (workers, forkserver)
        total = 0.0
        for p in [*servers, *(c for s in servers for c in s.children(recursive=True))]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    # The server's CPU while every process records (from the last to start until the first to stop).
    marks = []
    for p in procs:
        marks.append(p.stdout.readline().strip())
    cpu0, t0 = server_cpu(), time.perf_counter()
    marks.append(procs[0].stdout.readline().strip())
    cpu1, t1 = server_cpu(), time.perf_counter()
    if marks != ["recording"] * processes + ["recorded"]:
        raise RuntimeError(f"a rollout process failed ({side}): {marks}")
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 300)
        outs.append(json.loads(out.strip().splitlines()[-1]))
    steps = sum(o["steps"] for o in outs)
    replicas = collections.Counter()
    for o in outs:
        replicas.update(o["replicas"])
    errors = collections.Counter()
    for o in outs:
        errors.update(o["errors"])
    steps_per_s = steps / statistics.mean(o["seconds"] for o in outs)
    # The CPU a step on each side (the rollout processes' own, threads and gRPC's included; the
    # server's, its workers' included): where the two cores are shared, what one side spends the
    # other cannot.
    return {"steps_per_s": round(steps_per_s),
            "client_cpu_ms_per_step": round(1e3 * sum(o["cpu_seconds"] for o in outs) / max(steps, 1), 3),
            "server_cpu_ms_per_step": round(1e3 * (cpu1 - cpu0) / max(t1 - t0, 1e-9) / max(steps_per_s, 1), 3),
            "replicas": dict(replicas), "errors": dict(errors)}


# -- the parent ------------------------------------------------------------------------------------
def replicas(args, env_vars: dict) -> dict:
    """64 TRL rollouts given a redis:// directory of 3 replicas: sessions per replica, steps/s."""
    from serverproc import Cluster, RedisProcess
    with RedisProcess() as redis:
        cluster = Cluster(redis.url, [ENV_ID], ["rep-0", "rep-1", "rep-2"], workers=1, env_vars=env_vars)
        try:
            print("concurrent trl over 3 replicas...", file=sys.stderr, flush=True)
            res = concurrent("trl", redis.url, args.processes, args.threads, args.seconds,
                             [rep.proc.pid for rep in cluster.replicas.values()])
            counts = [res["replicas"].get(rid, 0) for rid in ("rep-0", "rep-1", "rep-2")]
            return {**res, "sessions_by_replica": counts, "most_over_least": round(max(counts) / max(1, min(counts)), 3)}
        finally:
            cluster.close()


def run(args) -> dict:
    from serverproc import ServerProcess

    out: dict = {"cpu_count": os.cpu_count(), "load_average_at_start": os.getloadavg(),
                 "rollouts": args.processes * args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.pathsep.join(filter(None, [pushbox_distribution(Path(tmp)), os.environ.get("PYTHONPATH", "")]))
        env_vars = {"PYTHONPATH": path}
        os.environ["PYTHONPATH"] = path  # the drive processes load the pushbox env too (its spec)
        if args.replicas_only:
            runs = [replicas(args, env_vars) for _ in range(args.rounds)]
            return {**out, "replicas_by_round": runs,
                    "most_over_least_by_round": [r["most_over_least"] for r in runs]}
        oe = OpenEnvServer(sys.executable, args.processes * args.threads, Path(tmp) / "openenv.log")
        try:
            for name, extra, workers in (("inline", ["--inline"], 1), ("workers", [], args.workers)):
                if args.concurrent_only and name == "inline":
                    continue
                with ServerProcess([ENV_ID], workers=workers, metrics=False, extra=extra, env_vars=env_vars) as es:
                    targets = {"openenv": oe.url, "envserve": es.address}
                    if not args.concurrent_only:
                        print(f"serial against envserve {name}...", file=sys.stderr, flush=True)
                        out[f"serial_{name}"] = serial(targets, args.rounds, args.calls, list(SERIAL_SIDES))
                    if not args.serial_only and (name == "workers" or args.concurrent_inline):
                        res = {}
                        for r in range(args.rounds):
                            for side in CONCURRENT_SIDES[r % 3:] + CONCURRENT_SIDES[:r % 3]:
                                target = targets["openenv" if side.startswith("openenv") else "envserve"]
                                print(f"concurrent {side} round {r + 1}...", file=sys.stderr, flush=True)
                                pids = [oe.proc.pid if side.startswith("openenv") else es.proc.pid]
                                res.setdefault(side, []).append(
                                    concurrent(side, target, args.processes, args.threads, args.seconds, pids))
                        out[f"concurrent_{name}"] = {
                            side: {"steps_per_s": statistics.median(x["steps_per_s"] for x in runs),
                                   "by_round": [x["steps_per_s"] for x in runs],
                                   "client_cpu_ms_per_step": statistics.median(x["client_cpu_ms_per_step"] for x in runs),
                                   "server_cpu_ms_per_step": statistics.median(x["server_cpu_ms_per_step"] for x in runs),
                                   "errors": sum((collections.Counter(x["errors"]) for x in runs), collections.Counter())}
                            for side, runs in res.items()}
        finally:
            oe.kill()
        if not args.serial_only and not args.concurrent_only:
            out["replicas"] = replicas(args, env_vars)
    if args.endpoint:
        print("OpenEnv endpoint (bench/openenv_endpoint.py)...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, str(BENCH / "openenv_endpoint.py"), "--json", "--sides",
                               "envserve_direct,envserve_counter,openenv", "--seconds", str(args.seconds)],
                              capture_output=True, text=True, timeout=1800)
        lines = proc.stdout.strip().splitlines()
        out["endpoint"] = json.loads(lines[-1]) if proc.returncode == 0 and lines else {"failed": proc.stderr[-2000:]}

    ratios = {}
    for name in ("inline", "workers"):
        s = out.get(f"serial_{name}")
        if not s:
            continue
        for side in SERIAL_SIDES[1:]:
            ratios[f"serial_{name}_{side}_p50_over_openenv"] = round(s[side]["p50_ms"] / s["openenv_sync"]["p50_ms"], 3)
            # Paired by round (the sides of a round run back to back): steadier where other load comes and goes.
            by_round = [a / b for a, b in zip(s[side]["p50_ms_by_round"], s["openenv_sync"]["p50_ms_by_round"])]
            ratios[f"serial_{name}_{side}_p50_over_openenv_paired"] = round(statistics.median(by_round), 3)
    for name in ("inline", "workers"):
        c = out.get(f"concurrent_{name}")
        if c:
            for side in ("trl", "trl_unary"):
                ratios[f"concurrent_{name}_{side}_over_openenv"] = round(
                    c[side]["steps_per_s"] / c["openenv_sync"]["steps_per_s"], 3)
    out["ratios"] = ratios
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=1000, help="serial calls per side per round")
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0, help="per concurrent measurement")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrent-inline", action="store_true", help="also the concurrent runs against --inline")
    ap.add_argument("--endpoint", action="store_true", help="also bench/openenv_endpoint.py's 64-socket run")
    ap.add_argument("--serial-only", action="store_true", help="only the serial measurements")
    ap.add_argument("--replicas-only", action="store_true", help="only the 3-replica spread, once a round")
    ap.add_argument("--concurrent-only", action="store_true",
                    help="only the 64 concurrent rollouts against worker replicas, each side once a round")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--drive", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        print(json.dumps(drive(args.drive, args.target, args.threads, args.seconds, warmup=1.0)), flush=True)
        return 0
    out = run(args)
    print(json.dumps(out) if args.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
