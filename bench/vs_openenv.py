"""The same trivial game served by OpenEnv 0.10 and by envserve, closed-loop sessions.

- The game: a 6x6 push-box room (walls on the border, one box, one target), written once here
  (PushBox) and wrapped twice: as an openenv Environment served by OpenEnv's own server
  (create_app under uvicorn with its defaults, as OpenEnv's env template runs it), and as an
  envserve Environment served by `envserve serve pushbox` (a throwaway entry-point distribution
  on the server's PYTHONPATH, as bench/openenv_endpoint.py registers its counter). Every session
  plays SCRIPT: 12 real moves that wander and come back, then the 3 that push the box onto the
  target (reward 1, done); the client then resets it. A `done` anywhere else counts as an error,
  so both servers are checked to play the same game.
- OpenEnv runs from its own venv, made by this bench (pip install openenv==0.10.0 websockets,
  kept under ~/.cache/envserve/bench-openenv-venv); without the package index it falls back to
  this venv's openenv and says so. Two OpenEnv servers: `openenv` with max_concurrent_envs raised
  to the largest session count (its docs' knob for more than one session), and `openenv_default`
  with the template's setting (one session), to record what its defaults do with more.
  Its load generator is that venv's python running this file: one WebSocket per session with
  OpenEnv EnvClient's connection settings, sending OpenEnv's messages.
- envserve (2 workers by default): `envserve_stream`: one Interact stream, each session awaits
  its own `stream.step` (one step in flight per session, like a WebSocket); `envserve_unary`:
  each session awaits its own unary Step; `envserve_batch`: one Step call for all sessions per
  round (the trainer's EnvPool-style path).
- Closed loop: a session sends a step, waits for its answer, sends the next. Each measurement is
  its own client process; sides alternate within a round and are repeated over rounds.
  Reported per side and session count: steps/s, p50/p99 of one step as its caller waits for it,
  CPU seconds per 1,000 steps of each process (server or envserve's front and workers, and the
  client), sessions opened and errors by kind. Plus the floors: a null gRPC call's p50, and for one
  session a round trip that steps nothing on each side (`openenv_null`: OpenEnv's state message;
  `envserve_null`: a unary ListEnvs; `envserve_streamnull`: an Interact item that steps nothing) and
  `envserve_bare`, the game stepped by a bare call.write/call.read client: the least a Python gRPC
  client can do per step.

    .venv/bin/python bench/vs_openenv.py [--json] [--seconds 5] [--sessions 1,16,64,1024]

Top-level imports are the standard library only: OpenEnv's venv runs this file too.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_VENV = Path.home() / ".cache" / "envserve" / "bench-openenv-venv"
OPENENV_PIN = "openenv==0.10.0"

# -- the game -------------------------------------------------------------------------------------
SIZE = 6
START_PLAYER, START_BOX, TARGET = (1, 1), (2, 2), (2, 4)
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
# Wander right and back three times, then down and push the box right twice onto the target.
SCRIPT = ["right", "right", "left", "left"] * 3 + ["down", "right", "right"]


class PushBox:
    """One room: '#' wall, 'P' player, 'B' box, 'T' target. A move into a wall, or pushing the box
    into a wall, leaves the room as it was (and is an invalid action)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.player, self.box, self.done = START_PLAYER, START_BOX, False

    @staticmethod
    def wall(cell: tuple[int, int]) -> bool:
        return cell[0] in (0, SIZE - 1) or cell[1] in (0, SIZE - 1)

    def move(self, action: str) -> tuple[float, bool, bool]:
        """(reward, done, valid) of one action."""
        d = MOVES.get(action.strip().lower())
        if d is None or self.done:
            return 0.0, self.done, False
        nxt = (self.player[0] + d[0], self.player[1] + d[1])
        if self.wall(nxt):
            return 0.0, False, False
        if nxt == self.box:
            pushed = (nxt[0] + d[0], nxt[1] + d[1])
            if self.wall(pushed):
                return 0.0, False, False
            self.box = pushed
        self.player = nxt
        self.done = self.box == TARGET
        return (1.0 if self.done else 0.0), self.done, True

    def render(self) -> str:
        rows = []
        for r in range(SIZE):
            row = ""
            for c in range(SIZE):
                cell = (r, c)
                row += ("#" if self.wall(cell) else "P" if cell == self.player else "B" if cell == self.box
                        else "T" if cell == TARGET else ".")
            rows.append(row)
        return "\n".join(rows)


def envserve_env_class():
    """PushBox as an envserve Environment (imported only where envserve is installed)."""
    from envserve.core.env import ActionOutcome, EnvSpec, Environment, GroundTruth

    class PushBoxEnv(Environment):
        spec = EnvSpec(env_id="pushbox", description="6x6 push-box room, one box (bench/vs_openenv.py)",
                       system_prompt="Push the box onto the target.", action_space="up, down, left, right",
                       max_turns=100, max_actions_per_turn=1, default_action_format="no_think")

        def reset(self, seed, options=None):
            self.game = PushBox()

        def step(self, action):
            reward, done, valid = self.game.move(action)
            return ActionOutcome(reward=reward, done=done, success=done, valid=valid,
                                 feedback="" if valid else "blocked")

        def render_text(self):
            return self.game.render()

        def ground_truth(self):
            return GroundTruth({"player": list(self.game.player), "box": list(self.game.box)})

    return PushBoxEnv


def pushbox_distribution(folder: Path) -> str:
    """A module and entry point (group envserve.envs) for PushBoxEnv under folder; returns the
    PYTHONPATH that lets `envserve serve pushbox` find it (folder, and this bench's folder)."""
    (folder / "envserve_bench_pushbox.py").write_text(
        "from vs_openenv import envserve_env_class\n\nPushBoxEnv = envserve_env_class()\n")
    info = folder / "envserve_bench_pushbox-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: envserve-bench-pushbox\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[envserve.envs]\npushbox = envserve_bench_pushbox:PushBoxEnv\n")
    return os.pathsep.join([str(folder), str(BENCH)])


# -- OpenEnv's server (runs in OpenEnv's venv) ------------------------------------------------------
def serve_openenv(max_envs: int) -> None:
    from openenv.core.env_server import Action, Environment, Observation, State

    class PushAction(Action):
        direction: str

    class PushObservation(Observation):
        board: str = ""

    class PushBoxEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.game = PushBox()
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kw):
            self.game.reset()
            self._state = State(episode_id=episode_id, step_count=0)
            return PushObservation(board=self.game.render(), reward=0.0, done=False)

        def step(self, action, timeout_s=None, **kw):
            reward, done, _ = self.game.move(action.direction)
            self._state.step_count += 1
            return PushObservation(board=self.game.render(), reward=reward, done=done)

        @property
        def state(self):
            return self._state

    serve_openenv_app(PushBoxEnvironment, PushAction, PushObservation, "pushbox", max_envs)


def serve_openenv_app(env_class, action_class, observation_class, env_name: str, max_envs: int) -> None:
    """Serves an openenv Environment as OpenEnv's env template does, on a free loopback port it prints."""
    import socket

    import uvicorn
    from openenv.core.env_server import create_app

    # As OpenEnv's env template builds its app; max_envs 0 keeps the template's own setting (1).
    kwargs = {"max_concurrent_envs": max_envs} if max_envs else {}
    app = create_app(env_class, action_class, observation_class, env_name=env_name, **kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"openenv server on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    # The template's uvicorn.run(app, host=, port=): uvicorn's defaults, but for the log level
    # (a line per connection would only fill the log).
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


# -- the closed-loop clients (one process per measurement) ----------------------------------------
class Recorder:
    """What one measurement records, and the window: the parent reads 'measuring' and 'measured'
    on stdout to read the processes' CPU times at the same moments."""

    def __init__(self):
        self.recording = self.stop = False
        self.lat: list[float] = []
        self.steps = 0
        self.errors: collections.Counter = collections.Counter()
        self.elapsed = 0.0
        self.opened = 0

    async def window(self, seconds: float, warmup: float) -> None:
        await asyncio.sleep(warmup)
        self.recording = True
        print("measuring", flush=True)
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        self.recording = False
        self.elapsed = time.perf_counter() - t0
        print("measured", flush=True)
        self.stop = True

    def record(self, dt: float, steps: int = 1) -> None:
        if self.recording:
            self.lat.append(dt)
            self.steps += steps

    def result(self, sessions: int) -> dict:
        lat = sorted(self.lat)
        return {"sessions": sessions, "opened": self.opened, "steps": self.steps, "seconds": self.elapsed,
                "p50_ms": 1e3 * percentile(lat, 0.5) if lat else None,
                "p99_ms": 1e3 * percentile(lat, 0.99) if lat else None, "errors": dict(self.errors)}


def percentile(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def error_kind(where: str, e: BaseException | str) -> str:
    text = e if isinstance(e, str) else f"{type(e).__name__} {e}"
    return f"{where}: {re.sub(r'[0-9a-f-]{32,36}', '<id>', str(text))[:100]}"


async def closed_loop(rec: Recorder, n: int, step, reset, seconds: float, warmup: float) -> None:
    """n callers, each: step (SCRIPT's next move), wait, repeat; reset when the episode ends.
    step(k, move) returns done (None for a call that plays no game); reset(k) resets session k.
    A failing session stops."""

    async def one(k: int) -> None:
        t = 0
        while not rec.stop:
            t0 = time.perf_counter()
            try:
                done = await step(k, SCRIPT[t])
            except Exception as e:  # noqa: BLE001 - counted, the other sessions go on
                rec.errors[error_kind("step", e)] += 1
                return
            rec.record(time.perf_counter() - t0)
            if done is None:  # a null call: no game, no episode
                continue
            if done != (t == len(SCRIPT) - 1):
                rec.errors["episode ended off script"] += 1
            t += 1
            if done or t == len(SCRIPT):
                try:
                    await reset(k)
                except Exception as e:  # noqa: BLE001
                    rec.errors[error_kind("reset", e)] += 1
                    return
                t = 0

    tasks = [asyncio.create_task(one(k)) for k in range(n)]
    await rec.window(seconds, warmup)
    # A session stuck on an answer that never comes is an error, not a hung bench.
    _, stuck = await asyncio.wait(tasks, timeout=30)
    for task in stuck:
        task.cancel()
    if stuck:
        rec.errors["no answer within 30 s"] += len(stuck)


async def openenv_connect(url: str, **kw):
    """A WebSocket to an OpenEnv server with OpenEnv EnvClient's connection settings (env_client.py
    defaults); kw goes to the connection (a local address, say)."""
    from websockets.asyncio.client import connect
    return await connect(url.replace("http://", "ws://") + "/ws", open_timeout=10.0, max_size=100 * 2 ** 20,
                         ping_interval=20.0, ping_timeout=20.0, proxy=None, **kw)


async def drive_openenv(url: str, n: int, seconds: float, warmup: float, null: bool = False) -> dict:
    rec = Recorder()

    async def open_one():
        try:
            ws = await openenv_connect(url)
        except Exception as e:  # noqa: BLE001
            rec.errors[error_kind("connect", e)] += 1
            return None
        try:
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            reply = json.loads(await ws.recv())
        except Exception as e:  # noqa: BLE001
            # With its limit reached the server may close before the refusal is read.
            closed = type(e).__name__.startswith("ConnectionClosed")
            rec.errors["open refused: connection closed" if closed else error_kind("open", e)] += 1
            await ws.close()
            return None
        if reply.get("type") != "observation":
            rec.errors[error_kind("open refused", str(reply.get("data", {}).get("code", reply)))] += 1
            await ws.close()
            return None
        return ws

    sockets = [ws for ws in await asyncio.gather(*[open_one() for _ in range(n)]) if ws is not None]
    rec.opened = len(sockets)

    async def step(k: int, move: str) -> bool:
        ws = sockets[k]
        await ws.send(json.dumps({"type": "step", "data": {"direction": move}}))
        reply = json.loads(await ws.recv())
        if reply.get("type") != "observation":
            raise RuntimeError(reply.get("data", {}).get("code", reply))
        return reply["data"]["done"]

    async def state(k: int, move: str) -> None:
        # OpenEnv's cheapest message: the handler reads env.state on the event loop, no thread.
        ws = sockets[k]
        await ws.send('{"type": "state"}')
        reply = json.loads(await ws.recv())
        if reply.get("type") != "state":
            raise RuntimeError(reply.get("data", {}).get("code", reply))

    async def reset(k: int) -> None:
        ws = sockets[k]
        await ws.send(json.dumps({"type": "reset", "data": {}}))
        reply = json.loads(await ws.recv())
        if reply.get("type") != "observation":
            raise RuntimeError(reply.get("data", {}).get("code", reply))

    await closed_loop(rec, len(sockets), state if null else step, reset, seconds, warmup)

    async def close(ws):
        try:
            await ws.send(json.dumps({"type": "close"}))
        finally:
            await ws.close()
    await asyncio.gather(*[close(ws) for ws in sockets], return_exceptions=True)
    return rec.result(n)


def answer(move: str) -> str:
    return f"<answer>{move}</answer>"  # envserve's no_think action format


async def drive_envserve(path: str, address: str, n: int, seconds: float, warmup: float) -> dict:
    from envserve.client import AsyncEnvClient, check
    from envserve.v1 import envserve_pb2 as pb
    rec = Recorder()
    async with AsyncEnvClient(address) as ac:
        ids: list[str] = []
        try:
            while len(ids) < n:
                ids += await ac.open("pushbox", min(256, n - len(ids)), None, "no_think")
            for r in await ac.reset(ids, seeds=[0] * n):
                check(r)
        except Exception as e:  # noqa: BLE001
            rec.errors[error_kind("open", e)] += 1
            return rec.result(n)
        rec.opened = len(ids)
        if path == "null":
            async def list_envs(k: int, move: str) -> None:
                # A unary call that envserve's front answers itself: gRPC's own round trip.
                await ac._call(ac.env.ListEnvs, pb.ListEnvsRequest())
            await closed_loop(rec, n, list_envs, None, seconds, warmup)
        elif path == "batch":
            await batch_loop(rec, ac, ids, seconds, warmup)
        elif path in ("bare", "streamnull"):
            # The floors of the stream path, one session only: a bare call.write/call.read on one
            # Interact call, with none of InteractStream's tags, futures and reader task (so not
            # safe to cancel mid-call: a measuring stick, not a client). "streamnull" sends an item
            # with neither step nor reset, which the server answers with an item error, stepping nothing.
            call = ac.env.Interact(metadata=ac.metadata)
            tags = iter(range(1, 1 << 62))

            async def exchange(item: pb.InteractItem) -> pb.StepResult:
                await call.write(pb.InteractRequest(items=[item]))
                return (await call.read()).results[0].result

            async def step(k: int, move: str) -> bool | None:
                if path == "streamnull":
                    await exchange(pb.InteractItem(tag=next(tags)))
                    return None
                return check(await exchange(pb.InteractItem(tag=next(tags), step=pb.StepItem(
                    session_id=ids[k], action=answer(move))))).done

            async def reset(k: int) -> None:
                check(await exchange(pb.InteractItem(tag=next(tags), reset=pb.ResetItem(session_id=ids[k], seed=0))))
            await closed_loop(rec, 1, step, reset, seconds, warmup)
            call.cancel()
        elif path == "stream":
            async with ac.stream() as s:
                async def step(k: int, move: str) -> bool:
                    return check(await s.step(ids[k], answer(move))).done

                async def reset(k: int) -> None:
                    check(await s.reset(ids[k], seed=0))
                await closed_loop(rec, n, step, reset, seconds, warmup)
        else:
            async def step(k: int, move: str) -> bool:
                return check((await ac.step([(ids[k], answer(move))]))[0]).done

            async def reset(k: int) -> None:
                check((await ac.reset([ids[k]], seeds=[0]))[0])
            await closed_loop(rec, n, step, reset, seconds, warmup)
        for k in range(0, n, 256):
            await ac.close_sessions(ids[k:k + 256])
    return rec.result(n)


async def batch_loop(rec: Recorder, ac, ids: list[str], seconds: float, warmup: float) -> None:
    """All sessions in one Step call per round; they play in lockstep, so they finish together and
    are reset in one Reset call. Each session's step waits for the whole call."""
    from envserve.client import item_error

    async def run() -> None:
        t, live = 0, list(ids)
        while not rec.stop and live:
            t0 = time.perf_counter()
            results = await ac.step([(sid, answer(SCRIPT[t])) for sid in live])
            dt = time.perf_counter() - t0
            ok = []
            for sid, r in zip(live, results):
                err = item_error(r)
                if err is not None:
                    rec.errors[error_kind("step", err)] += 1
                    continue
                if r.done != (t == len(SCRIPT) - 1):
                    rec.errors["episode ended off script"] += 1
                ok.append(sid)
            rec.record(dt, len(ok))
            live, t = ok, t + 1
            if t == len(SCRIPT):
                await ac.reset(live, seeds=[0] * len(live))
                t = 0

    task = asyncio.create_task(run())
    await rec.window(seconds, warmup)
    await task


def drive(args) -> None:
    if args.drive in ("openenv", "openenv_null"):
        out = asyncio.run(drive_openenv(args.target, args.n, args.seconds, args.warmup, args.drive == "openenv_null"))
    else:
        out = asyncio.run(drive_envserve(args.drive, args.target, args.n, args.seconds, args.warmup))
    print(json.dumps(out), flush=True)


# -- the parent: servers, venv, rounds, report ----------------------------------------------------
def openenv_python(venv: Path) -> tuple[str, str]:
    """The python of OpenEnv's own venv (made once, then reused), or this one's if pip fails."""
    py = venv / "bin" / "python"
    probe = [str(py), "-c", f"import openenv, websockets, uvicorn; assert openenv.__version__ == "
             f"{OPENENV_PIN.split('==')[1]!r}"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(py), f"OpenEnv's own venv {venv}"
    print(f"making OpenEnv's venv: {venv} ({OPENENV_PIN} websockets)", file=sys.stderr, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", OPENENV_PIN, "websockets"], check=True,
                       capture_output=True, timeout=1200)
        subprocess.run(probe, check=True, capture_output=True)
        return str(py), f"OpenEnv's own venv {venv} (made now)"
    except (subprocess.SubprocessError, OSError) as e:
        note = f"could not make OpenEnv's venv ({type(e).__name__}); using this venv's openenv instead"
        print("NOTE: " + note, file=sys.stderr, flush=True)
        return sys.executable, note


class OpenEnvServer:
    """An OpenEnv server in a child process, its log in a file. serve: the script and arguments that
    serve it (default: this file's PushBox, max_envs sessions); it prints "openenv server on URL"."""

    def __init__(self, python: str, max_envs: int, log: Path, serve: "list[str] | None" = None):
        self.log = open(log, "w")
        serve = serve or [__file__, "--serve-openenv", "--max-envs", str(max_envs)]
        self.proc = subprocess.Popen([python, "-u", *serve],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=dict(os.environ, ENABLE_WEB_INTERFACE="false"))
        line = self.proc.stdout.readline()
        m = re.search(r"openenv server on (http://\S+)", line)
        if not m:
            self.kill()
            raise RuntimeError(f"OpenEnv's server did not start: {line!r}\n{log.read_text()[-2000:]}")
        self.url = m.group(1)
        # uvicorn listens only once serve() starts: wait for the socket to answer.
        import urllib.request
        for _ in range(200):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.05)

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()


def measure(cmd: list[str], procs: dict[str, list[int]], timeout: float) -> dict:
    """Runs one client process; CPU of every process between its 'measuring' and 'measured'."""
    from openenv_endpoint import cpu_seconds  # psutil: {role: CPU seconds of its processes}

    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        procs = {**procs, "client": [proc.pid]}
        cpu0 = cpu1 = result = None
        try:
            for line in proc.stdout:
                if line.startswith("measuring"):
                    cpu0 = cpu_seconds(procs)
                elif line.startswith("measured"):
                    cpu1 = cpu_seconds(procs)
                elif line.startswith("{"):
                    result = json.loads(line)
            proc.wait()
        finally:
            watchdog.cancel()
        if result is None:
            err.seek(0)
            return {"failed": (err.read()[-1500:] or f"exit {proc.returncode}")}
        result["cpu_s"] = {k: cpu1[k] - cpu0[k] for k in procs} if cpu0 and cpu1 else {}
        return result


def merge(runs: list[dict]) -> dict:
    """Rounds of one side at one session count: rates over all rounds, median p50/p99."""
    ok = [r for r in runs if "failed" not in r]
    out = {"rounds": len(runs), "failed": [r["failed"] for r in runs if "failed" in r]}
    if not ok:
        return out
    steps, seconds = sum(r["steps"] for r in ok), sum(r["seconds"] for r in ok)
    errors: collections.Counter = collections.Counter()
    for r in ok:
        errors.update(r["errors"])
    timed = [r for r in ok if r["p50_ms"] is not None]
    out.update({
        "steps_per_s": steps / seconds if seconds else 0.0,
        "steps_per_s_rounds": [round(r["steps"] / r["seconds"], 1) for r in ok],
        "p50_ms": statistics.median(r["p50_ms"] for r in timed) if timed else None,
        "p99_ms": statistics.median(r["p99_ms"] for r in timed) if timed else None,
        "opened": min(r["opened"] for r in ok), "errors": dict(errors),
        "cpu_s_per_1k_steps": {k: 1e3 * sum(r["cpu_s"].get(k, 0.0) for r in ok) / steps if steps else None
                               for k in ok[0]["cpu_s"]},
    })
    return out


def null_call_p50_ms(address: str, n: int = 2000) -> float:
    """A ListEnvs round trip: what any unary gRPC call costs here before envserve does anything."""
    from envserve.client import EnvClient
    with EnvClient(address) as c:
        c.list_envs()
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            c.list_envs()
            lat.append(time.perf_counter() - t)
    return 1e3 * statistics.median(lat)


SIDES = ("openenv", "envserve_stream", "envserve_unary", "envserve_batch")
# One round trip that steps nothing: OpenEnv's `state` message on its WebSocket, envserve's ListEnvs.
NULLS = ("openenv_null", "envserve_null")
# One session only, the floors of envserve's stream path: a bare write/read client stepping the game,
# and the same client sending items that step nothing.
STREAM_FLOORS = ("envserve_bare", "envserve_streamnull")


def run(args) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from serverproc import ServerProcess

    sessions = [int(s) for s in args.sessions.split(",")]
    oe_python, venv_note = openenv_python(Path(args.openenv_venv))
    print(f"OpenEnv: {venv_note}", file=sys.stderr, flush=True)
    results: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in sessions} for s in (*SIDES, "openenv_default", *NULLS, *STREAM_FLOORS)}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.pathsep.join(filter(None, [pushbox_distribution(Path(tmp)), os.environ.get("PYTHONPATH", "")]))
        servers: list[OpenEnvServer] = []
        with ServerProcess(["pushbox"], workers=args.workers, metrics=False, extra=["--inline"] if args.inline else [],
                           env_vars={"PYTHONPATH": path}) as es:
            try:
                oe = OpenEnvServer(oe_python, max(sessions), Path(tmp) / "openenv.log")
                servers.append(oe)
                oe_default = OpenEnvServer(oe_python, 0, Path(tmp) / "openenv_default.log")
                servers.append(oe_default)
                es_procs = {"front": [es.proc.pid], "workers": es.worker_pids()}

                def cmd(side: str, n: int, seconds: float) -> tuple[list[str], dict]:
                    base = ["-u", __file__, "--n", str(n), "--seconds", str(seconds), "--warmup", str(args.warmup)]
                    if side.startswith("openenv"):
                        server = oe_default if side == "openenv_default" else oe
                        drive = "openenv_null" if side == "openenv_null" else "openenv"
                        return [oe_python, *base, "--drive", drive, "--target", server.url], \
                            {"server": [server.proc.pid]}
                    return [sys.executable, *base, "--drive", side.split("_")[1], "--target", es.address], es_procs

                for rnd in range(args.rounds):
                    for n in sessions:
                        # Sides take turns going first, so drift on the shared machine hits them alike.
                        order = list(SIDES[rnd % len(SIDES):] + SIDES[:rnd % len(SIDES)])
                        if rnd == 0 and n > 1:
                            order.append("openenv_default")  # its refusals do not change between rounds
                        if n == 1:
                            order += [*NULLS, *STREAM_FLOORS]  # the floors: one round trip, no step
                        for side in order:
                            c, procs = cmd(side, n, args.seconds)
                            r = measure(c, procs, timeout=args.seconds + args.warmup + 300)
                            results[side][n].append(r)
                            brief = r.get("failed", "").strip().splitlines()[-1:] or \
                                [f"{r['steps'] / max(r['seconds'], 1e-9):,.0f} steps/s, p50 {r['p50_ms'] or 0:.2f} ms, "
                                 f"opened {r['opened']}, errors {sum(r['errors'].values())}"]
                            print(f"round {rnd + 1} {side:16s} {n:5d} sessions: {brief[0]}", file=sys.stderr, flush=True)
                floor = null_call_p50_ms(es.address)
            finally:
                for s in servers:
                    s.kill()
    summary = {"seconds": args.seconds, "rounds": args.rounds, "warmup": args.warmup, "envserve_workers": 0 if args.inline else args.workers,
               "openenv": venv_note, "openenv_max_concurrent_envs": max(sessions), "cpu_count": os.cpu_count(),
               "grpc_null_call_p50_ms": floor,
               "results": {side: {str(n): merge(runs) for n, runs in per_n.items() if runs}
                           for side, per_n in results.items()}}
    summary["targets"] = targets(summary["results"], sessions)
    return summary


def targets(res: dict, sessions: list[int]) -> dict:
    """The three comparisons the README reports, each envserve path against OpenEnv (its limit raised)."""
    def get(side, n, key):
        return res.get(side, {}).get(str(n), {}).get(key)

    out = {}
    if 64 in sessions and get("openenv", 64, "steps_per_s"):
        for side in SIDES[1:]:
            out[f"ratio_{side}_64"] = (get(side, 64, "steps_per_s") or 0.0) / get("openenv", 64, "steps_per_s")
    if 1 in sessions and get("openenv", 1, "p50_ms"):
        for side in (*SIDES[1:], "envserve_null", *STREAM_FLOORS):
            out[f"p50_{side}_1_below_openenv"] = (get(side, 1, "p50_ms") or 1e9) < get("openenv", 1, "p50_ms")
    big = max(sessions)
    out[f"sessions_{big}"] = {side: {"opened": get(side, big, "opened"),
                                     "errors": sum((get(side, big, "errors") or {}).values())}
                              for side in (*SIDES, "openenv_default") if get(side, big, "opened") is not None}
    return out


def table(summary: dict) -> str:
    lines = ["| side | sessions | steps/s | p50 ms | p99 ms | CPU s / 1k steps: server (front + workers) | "
             "client | opened | errors |", "|---|---|---|---|---|---|---|---|---|"]
    for side, per_n in summary["results"].items():
        for n, r in per_n.items():
            if "steps_per_s" not in r:
                lines.append(f"| {side} | {n} | failed: {r['failed'][:1]} | | | | | | |")
                continue
            cpu = r["cpu_s_per_1k_steps"]
            server = (f"{cpu['server']:.2f}" if "server" in cpu else
                      f"{cpu['front'] + cpu['workers']:.2f} ({cpu['front']:.2f} + {cpu['workers']:.2f})") \
                if r["steps_per_s"] else "-"
            client = f"{cpu['client']:.2f}" if r["steps_per_s"] else "-"
            errs = ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or "0"
            p50 = f"{r['p50_ms']:.2f}" if r["p50_ms"] is not None else "-"
            p99 = f"{r['p99_ms']:.2f}" if r["p99_ms"] is not None else "-"
            lines.append(f"| {side} | {n} | {r['steps_per_s']:,.0f} | {p50} | {p99} | {server} | {client} | "
                         f"{r['opened']} | {errs} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1,16,64,1024", help="comma-separated session counts")
    ap.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    ap.add_argument("--warmup", type=float, default=1.0, help="stepping before each measurement")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="envserve workers")
    ap.add_argument("--inline", action="store_true", help="envserve steps sessions in its front (serve --inline)")
    ap.add_argument("--openenv-venv", default=str(DEFAULT_VENV))
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    # The processes this bench starts of itself.
    ap.add_argument("--serve-openenv", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-envs", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--drive", choices=("openenv", "openenv_null", "stream", "unary", "batch", "null", "bare", "streamnull"), help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_openenv:
        serve_openenv(args.max_envs)
        return 0
    if args.drive:
        drive(args)
        return 0

    summary = run(args)
    print(table(summary))
    t = summary["targets"]
    print(f"\nnull gRPC call p50: {summary['grpc_null_call_p50_ms']:.3f} ms; OpenEnv: {summary['openenv']}")
    for k, v in t.items():
        print(f"{k}: {v if not isinstance(v, float) else round(v, 2)}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
