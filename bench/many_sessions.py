"""Many sessions: a fleet of envserve replicas on one machine holding and stepping N concurrent
sessions of one grid game, beside OpenEnv 0.10's WebSocket server on the same game at the same
concurrency.

- The game: FrozenLake (envserve's `frozenlake`, 4x4 text, `max_turns` raised), every session moving
  Left and Up from its start corner, into the wall: the same work every step and no episode ends (as
  bench/openenv_endpoint.py's frozenlake side). OpenEnv serves the same class
  (envserve.envs.frozenlake.FrozenLakeEnv) wrapped as an openenv Environment, through its own
  create_app under uvicorn as its env template runs it (vs_openenv.serve_openenv_app), with
  max_concurrent_envs = N.
- envserve: --replicas `envserve serve frozenlake` processes (--workers each, --max-sessions raised
  to hold their share), named by one comma-joined address list. One client process
  (AsyncRoutedClient) opens the N sessions in one call, resets them, and steps them over one Interact
  stream per replica (its RoutedStream), one step in flight per session: each answer sends that
  session's next step at once.
- OpenEnv: one WebSocket per session with OpenEnv EnvClient's connection settings
  (vs_openenv.openenv_connect), each sending a step and awaiting its answer. Connecting is bounded
  (--connect-seconds), so is every step (--step-timeout) and the whole level (a watchdog kills the
  clients): what connected is reported. A client process holds at most --sockets-per-client sockets
  (under the file-descriptor limit), and spreads its local addresses over 127.0.0.0/8 so that one
  address's ephemeral ports do not run out first.
- Per level and side (fresh servers every level; envserve first): sessions held; steps/s and p50/p99
  of a step (sent to answered) over --seconds, once every session has been answered and --warmup
  has passed; failed steps over the whole run (an error status, a broken stream or socket, no
  answer within --step-timeout); resident memory per session: the RSS of the servers' processes
  (replica fronts, forkservers and workers; OpenEnv's one process) holding the reset sessions, minus
  the same servers' before any was opened (after a few sessions warmed every worker), over the
  sessions held. Ratios envserve/OpenEnv where both stepped.

    .venv/bin/python bench/many_sessions.py [--levels 1024,4096,16384,65536] [--replicas 2] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import functools
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
sys.path.insert(0, str(BENCH))

from openenv_endpoint import CONFIG, ENV_ID  # noqa: E402  (frozenlake, max_turns raised)
from vs_openenv import (OpenEnvServer, answer, error_kind, openenv_connect, percentile,  # noqa: E402
                        serve_openenv_app)

MOVES = ("Left", "Up")  # from the start corner: into the wall, the same work every step
LEVELS = "1024,4096,16384,65536"


# -- OpenEnv's server on the same game (a child process) --------------------------------------------
def serve_openenv(max_envs: int) -> None:
    from openenv.core.env_server import Action, Environment, Observation, State

    from envserve.envs.frozenlake import FrozenLakeEnv

    class MoveAction(Action):
        direction: str

    class LakeObservation(Observation):
        board: str = ""

    class FrozenLakeEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.game = FrozenLakeEnv(FrozenLakeEnv.spec.config_defaults)
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kw):
            self.game.reset(seed or 0)
            self._state = State(episode_id=episode_id, step_count=0)
            return LakeObservation(board=self.game.render_text(), reward=0.0, done=False)

        def step(self, action, timeout_s=None, **kw):
            outcome = self.game.step(action.direction)
            self._state.step_count += 1
            return LakeObservation(board=self.game.render_text(), reward=outcome.reward, done=outcome.done)

        @property
        def state(self):
            return self._state

    serve_openenv_app(FrozenLakeEnvironment, MoveAction, LakeObservation, ENV_ID, max_envs)


# -- the drivers (each a child process; JSON lines on stdout) --------------------------------------
def say(kind: str, **fields) -> None:
    print(json.dumps({kind: fields}), flush=True)


def rss(pids: list[int]) -> int:
    from step_throughput import tree_rss
    return sum(tree_rss(p) for p in pids)


class Window:
    """When the measured window opens (every session answered once, and the warm-up passed) and
    closes (--seconds later); the steps answered inside it."""

    def __init__(self, sessions: int, seconds: float, warmup: float, latest_start: float):
        self.sessions, self.seconds = sessions, seconds
        self.t0 = time.perf_counter()
        self.warm_until = self.t0 + warmup
        self.latest_start = self.t0 + latest_start  # a session never answered does not hold it up for ever
        self.answered: set[int] = set()
        self.start = self.end = None
        self.lat: list[float] = []

    def answer(self, k: int, sent: float, now: float) -> None:
        self.answered.add(k)
        if self.start is not None and self.end is None:
            self.lat.append(now - sent)
        self.tick(now)

    def tick(self, now: float) -> None:
        if self.start is None and now >= self.warm_until and (
                len(self.answered) >= self.sessions or now >= self.latest_start):
            self.start = now
        elif self.start is not None and self.end is None and now - self.start >= self.seconds:
            self.end = now

    def result(self) -> dict:
        lat = sorted(self.lat)
        seconds = (self.end or time.perf_counter()) - self.start if self.start else 0.0
        return {"steps": len(lat), "seconds": seconds, "answered_once": len(self.answered),
                "p50_ms": 1e3 * percentile(lat, 0.5) if lat else None,
                "p99_ms": 1e3 * percentile(lat, 0.99) if lat else None}


async def drive_envserve(args) -> None:
    from envserve.client import AsyncRoutedClient
    from envserve.client.errors import EnvServeError

    n, pids = args.n, [int(p) for p in args.pids.split(",")]
    failed: collections.Counter = collections.Counter()
    async with AsyncRoutedClient(args.target) as c:
        t = time.perf_counter()
        try:
            ids = await c.open(ENV_ID, n, CONFIG, "no_think")
            opened = time.perf_counter() - t
            resets = await c.reset(ids, seeds=list(range(n)))
        except EnvServeError as e:
            say("result", held=0, failed={error_kind("open", e): n})
            return
        failed.update(error_kind("reset", r.status.message) for r in resets if r.status.code)
        held = rss(pids)
        say("progress", held=len(ids), open_s=opened, reset_s=time.perf_counter() - t - opened)
        window = Window(n, args.seconds, args.warmup, args.warmup + args.step_timeout)
        turn = [0] * n
        sent: dict[int, tuple[int, float]] = {}  # our tag -> (session, when sent)
        async with c.stream() as s:
            for k in range(n):
                sent[await s.send_step(ids[k], answer(MOVES[0]))] = (k, time.perf_counter())
            while s.in_flight:
                try:
                    got = await asyncio.wait_for(s.recv(), args.step_timeout)
                except asyncio.TimeoutError:
                    failed[f"no answer within {args.step_timeout:g} s"] += s.in_flight
                    break
                now = time.perf_counter()
                for tag, result in got:
                    k, at = sent.pop(tag)
                    if result.status.code:
                        failed[error_kind("step", result.status.message)] += 1
                    else:
                        window.answer(k, at, now)
                    if window.end is None:  # the next step of this session, at once
                        turn[k] += 1
                        sent[await s.send_step(ids[k], answer(MOVES[turn[k] % 2]))] = (k, time.perf_counter())
                window.tick(now)
        stepped = rss(pids)
        closed = await c.close_sessions(ids)
    say("result", held=len(ids), rss_held=held, rss_stepped=stepped, failed=dict(failed),
        close_failed=sum(1 for st in closed if st.code), **window.result())


async def drive_openenv(args) -> None:
    import psutil
    n, first = args.n, args.first
    errors: collections.Counter = collections.Counter()
    failed: collections.Counter = collections.Counter()

    async def open_one(k: int):
        # Local addresses over 127.0.0.0/8: one address has about 28,000 ephemeral ports to one server port.
        local = (f"127.{1 + (k >> 16) % 250}.{(k >> 8) & 255}.{1 + (k & 255) % 250}", 0)
        try:
            ws = await openenv_connect(args.target, local_addr=local)
        except Exception as e:  # noqa: BLE001 - counted by kind
            errors[error_kind("connect", e)] += 1
            return None
        try:
            await ws.send(json.dumps({"type": "reset", "data": {"seed": k}}))
            reply = json.loads(await asyncio.wait_for(ws.recv(), args.step_timeout))
        except Exception as e:  # noqa: BLE001
            closed = type(e).__name__.startswith("ConnectionClosed")
            errors["reset: connection closed" if closed else error_kind("reset", e)] += 1
            await ws.close()
            return None
        if reply.get("type") != "observation":
            errors[error_kind("reset refused", str(reply.get("data", {}).get("code", reply)))] += 1
            await ws.close()
            return None
        return ws

    t = time.perf_counter()
    tasks = [asyncio.create_task(open_one(first + i)) for i in range(n)]
    done, pending = await asyncio.wait(tasks, timeout=args.connect_seconds)
    for task in pending:
        task.cancel()
    if pending:
        errors[f"not connected within {args.connect_seconds:g} s"] += len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    sockets = [task.result() for task in done if task.result() is not None]
    say("progress", connected=len(sockets), connect_s=time.perf_counter() - t, errors=dict(errors))

    window = Window(len(sockets), args.seconds, args.warmup, args.warmup + args.step_timeout)
    stop = asyncio.Event()

    async def one(k: int, ws) -> None:
        i = 0
        while not stop.is_set():
            at = time.perf_counter()
            try:
                await ws.send(json.dumps({"type": "step", "data": {"direction": MOVES[i % 2]}}))
                reply = json.loads(await asyncio.wait_for(ws.recv(), args.step_timeout))
            except Exception as e:  # noqa: BLE001 - a failing socket stops; the others go on
                failed[error_kind("step", e if str(e) else type(e).__name__)] += 1
                return
            if reply.get("type") != "observation":
                failed[error_kind("step refused", str(reply.get("data", {}).get("code", reply)))] += 1
                return
            window.answer(k, at, time.perf_counter())
            i += 1

    loops = [asyncio.create_task(one(k, ws)) for k, ws in enumerate(sockets)]
    while window.end is None and any(not task.done() for task in loops):
        await asyncio.sleep(0.05)
        window.tick(time.perf_counter())
    held = psutil.Process(int(args.pids)).memory_info().rss  # the server's, holding the sockets' sessions
    stop.set()
    _, stuck = await asyncio.wait(loops, timeout=args.step_timeout + 5) if loops else (set(), set())
    for task in stuck:
        task.cancel()
    if stuck:
        failed[f"no answer within {args.step_timeout:g} s"] += len(stuck)

    async def close(ws):
        try:
            await ws.send(json.dumps({"type": "close"}))
        finally:
            await ws.close()
    if sockets:
        await asyncio.wait([asyncio.create_task(close(ws)) for ws in sockets], timeout=30)
    say("result", attempted=n, held=len(sockets), rss_held=held, errors=dict(errors), failed=dict(failed),
        lat_ms=[round(1e3 * x, 3) for x in window.lat], **window.result())


# -- the parent: servers, drivers, report -----------------------------------------------------------
def run_driver(cmd: list[str], limit: float) -> dict:
    """Runs a driver until it ends or `limit` seconds pass (then it is killed); returns its result,
    or what it said it had done (`progress`) and why it gave none."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        watchdog = threading.Timer(limit, proc.kill)
        watchdog.start()
        progress: dict = {}
        result = None
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    msg = json.loads(line)
                    progress.update(msg.get("progress", {}))
                    result = msg.get("result", result)
            proc.wait()
        finally:
            killed = not watchdog.is_alive() and proc.returncode != 0
            watchdog.cancel()
            if proc.poll() is None:  # this run is being stopped: its driver goes too
                proc.kill()
                proc.wait()
        if result is not None:
            return {**progress, **result}
        err.seek(0)
        why = f"killed after {limit:g} s" if killed else (err.read()[-1500:] or f"exit {proc.returncode}")
        return {**progress, "no_result": why}


def driver_cmd(args, drive: str, target: str, n: int, pids: list[int], first: int = 0) -> list[str]:
    return [sys.executable, "-u", __file__, "--drive", drive, "--target", target, "--n", str(n),
            "--first", str(first), "--pids", ",".join(map(str, pids)), "--seconds", str(args.seconds),
            "--warmup", str(args.warmup), "--step-timeout", str(args.step_timeout),
            "--connect-seconds", str(args.connect_seconds)]


def summarize(r: dict, sessions: int, idle: int) -> dict:
    held = r.get("held", 0)
    out = {"sessions": sessions, "held": held, "steps": r.get("steps", 0), "seconds": r.get("seconds", 0.0),
           "steps_per_s": r["steps"] / r["seconds"] if r.get("seconds") else 0.0,
           "p50_ms": r.get("p50_ms"), "p99_ms": r.get("p99_ms"),
           "failed_steps": sum(r.get("failed", {}).values()), "failures": r.get("failed", {})}
    if held and r.get("rss_held"):
        out["rss_kb_per_session"] = (r["rss_held"] - idle) / held / 1024
    if held and r.get("rss_stepped"):
        out["rss_kb_per_session_stepped"] = (r["rss_stepped"] - idle) / held / 1024
    for key in ("open_s", "reset_s", "connect_s", "errors", "no_result", "close_failed"):
        if r.get(key):
            out[key] = r[key]
    return out


def run_envserve(args, n: int) -> dict:
    from envserve.client import EnvClient
    from serverproc import ServerProcess, start_together
    per_replica = math.ceil(n / args.replicas)
    extra = ["--max-sessions", str(max(10_000, per_replica + per_replica // 10))]
    fleet = start_together(*(functools.partial(ServerProcess, [ENV_ID], workers=args.workers, metrics=False,
                                               extra=extra) for _ in range(args.replicas)))
    try:
        for server in fleet:  # every worker imports and builds the game once before the idle reading
            with EnvClient(server.address) as c:
                ids = c.open(ENV_ID, 4 * args.workers, CONFIG, "no_think")
                c.reset(ids)
                c.step([(sid, answer(MOVES[0])) for sid in ids])
                c.close_sessions(ids)
        pids = [s.proc.pid for s in fleet]
        time.sleep(0.5)
        idle = rss(pids)
        limit = 600 + n / 100  # only a hung run meets it
        r = run_driver(driver_cmd(args, "envserve", ",".join(s.address for s in fleet), n, pids), limit)
    finally:
        for server in fleet:
            server.kill()
    out = summarize(r, n, idle)
    out["fleet"] = f"{args.replicas} replicas x {args.workers} workers, --max-sessions {extra[1]}"
    return out


def run_openenv(args, n: int, tmp: Path) -> dict:
    from step_throughput import tree_rss
    server = OpenEnvServer(sys.executable, n, tmp / f"openenv-{n}.log",
                           serve=[__file__, "--serve-openenv", "--max-envs", str(n)])
    try:
        time.sleep(0.5)
        idle = tree_rss(server.proc.pid)
        per = args.sockets_per_client
        parts = [(first, min(per, n - first)) for first in range(0, n, per)]
        limit = args.connect_seconds + args.warmup + args.seconds + 3 * args.step_timeout + 60
        with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
            runs = list(pool.map(lambda p: run_driver(driver_cmd(args, "openenv", server.url, p[1], [server.proc.pid],
                                                                 p[0]), limit), parts))
        alive = server.proc.poll() is None
    finally:
        server.kill()
    merged: dict = {"held": sum(r.get("held", r.get("connected", 0)) for r in runs),
                    "steps": sum(r.get("steps", 0) for r in runs),
                    "seconds": max((r.get("seconds", 0.0) for r in runs), default=0.0),
                    "rss_held": max((r.get("rss_held", 0) for r in runs), default=0)}
    lat = sorted(x for r in runs for x in r.get("lat_ms", ()))
    merged["p50_ms"] = percentile(lat, 0.5) if lat else None
    merged["p99_ms"] = percentile(lat, 0.99) if lat else None
    for key in ("failed", "errors"):
        total: collections.Counter = collections.Counter()
        for r in runs:
            total.update(r.get(key, {}))
        merged[key] = dict(total)
    if any("no_result" in r for r in runs):
        merged["no_result"] = "; ".join(sorted({r["no_result"].strip().splitlines()[-1] for r in runs
                                                if "no_result" in r}))
    merged["connect_s"] = max((r.get("connect_s", 0.0) for r in runs), default=0.0)
    out = summarize(merged, n, idle)
    # A step rate over several clients' windows: the sum of each one's.
    out["steps_per_s"] = sum(r["steps"] / r["seconds"] for r in runs if r.get("seconds"))
    out["clients"] = len(parts)
    out["server_alive_after"] = alive
    return out


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
        soft = hard
    return soft


def stops(level: dict) -> bool:
    """Whether a side fell short at a level: sessions not held, failed steps, no result."""
    return level["held"] < level["sessions"] or level["failed_steps"] > 0 or "no_result" in level


def fmt(x, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ("| sessions | envserve held | steps/s | p50 / p99 ms | failed steps | KB/session (held / stepped) "
            "| OpenEnv connected | steps/s | p50 / p99 ms | failed steps | KB/session | steps/s envserve/OpenEnv |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        e, o = row.get("envserve"), row.get("openenv")
        cells = [f"{row['sessions']:,}"]
        if e:
            cells += [f"{e['held']:,}", fmt(e.get("steps_per_s")), f"{fmt(e.get('p50_ms'))} / {fmt(e.get('p99_ms'))}",
                      f"{e['failed_steps']:,}",
                      f"{fmt(e.get('rss_kb_per_session'), '.1f')} / {fmt(e.get('rss_kb_per_session_stepped'), '.1f')}"]
        else:
            cells += ["-"] * 5
        if o:
            cells += [f"{o['held']:,}", fmt(o.get("steps_per_s")), f"{fmt(o.get('p50_ms'))} / {fmt(o.get('p99_ms'))}",
                      f"{o.get('failed_steps', 0):,}",
                      fmt(o.get("rss_kb_per_session") if o["held"] == row["sessions"] else None, ".1f"),
                      fmt(row.get("ratio_steps_per_s"), ".1f")]
        else:
            cells += ["-"] * 6
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default=LEVELS, help="session counts, comma-separated")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="workers per replica")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per level and side")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--step-timeout", type=float, default=30.0, help="a step unanswered this long fails")
    ap.add_argument("--connect-seconds", type=float, default=60.0, help="OpenEnv: time allowed to connect")
    ap.add_argument("--sockets-per-client", type=int, default=0,
                    help="OpenEnv: sockets per client process (0: the file-descriptor limit less 1,000)")
    ap.add_argument("--sides", default="envserve,openenv")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    ap.add_argument("--serve-openenv", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-envs", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--drive", choices=("envserve", "openenv"), help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--pids", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_openenv:
        serve_openenv(args.max_envs)
        return 0
    if args.drive:
        asyncio.run(drive_envserve(args) if args.drive == "envserve" else drive_openenv(args))
        return 0

    from serverproc import stop_on_sigterm
    stop_on_sigterm()  # a SIGTERM stops the servers this run started, too
    fds = raise_fd_limit()
    args.sockets_per_client = args.sockets_per_client or max(1000, fds - 1000)
    sides = {s.strip() for s in args.sides.split(",")}
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in levels:
            row: dict = {"sessions": n}
            if "envserve" in sides:
                row["envserve"] = run_envserve(args, n)
                print(f"envserve {n:6d}: {json.dumps(row['envserve'])}", file=sys.stderr, flush=True)
            if "openenv" in sides:
                row["openenv"] = run_openenv(args, n, Path(tmp))
                print(f"openenv  {n:6d}: {json.dumps(row['openenv'])}", file=sys.stderr, flush=True)
            e, o = row.get("envserve"), row.get("openenv")
            # Ratios at the same concurrency only: where both sides held every session and stepped.
            if e and o and e["steps_per_s"] and o["steps_per_s"] and e["held"] == o["held"] == n:
                row["ratio_steps_per_s"] = e["steps_per_s"] / o["steps_per_s"]
                if e.get("rss_kb_per_session") and o.get("rss_kb_per_session"):
                    row["ratio_kb_per_session"] = e["rss_kb_per_session"] / o["rss_kb_per_session"]
            rows.append(row)
    summary = {"levels": rows, "replicas": args.replicas, "workers_per_replica": args.workers,
               "seconds": args.seconds, "warmup": args.warmup, "step_timeout": args.step_timeout,
               "connect_seconds": args.connect_seconds, "fd_limit": fds, "cpu_count": os.cpu_count(),
               "envserve_stops_at": next((r["sessions"] for r in rows if "envserve" in r and stops(r["envserve"])), None),
               "openenv_stops_at": next((r["sessions"] for r in rows if "openenv" in r and stops(r["openenv"])), None)}
    print(table(rows))
    print(f"envserve falls short first at: {summary['envserve_stops_at'] or 'none of these levels'}; "
          f"OpenEnv at: {summary['openenv_stops_at'] or 'none of these levels'} "
          f"(file-descriptor limit {fds:,})")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
