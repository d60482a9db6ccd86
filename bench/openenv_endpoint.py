"""envserve's OpenEnv endpoints (a replica's own, `envserve serve --openenv-port`, and the facade's,
`envserve web`, /openenv/<env>/ws) against OpenEnv 0.10's own server
(openenv.core.env_server.create_fastapi_app under uvicorn) on a trivial env, over the same client.

- OpenEnv side: a counter env written here on openenv's Environment base class (each step counts
  and echoes the action text), in its own uvicorn process, as `openenv serve` runs one. Variants:
  `openenv` implements the plain reset/step methods (OpenEnv runs them in the session's thread),
  `openenv_async` overrides reset_async/step_async (awaited on the event loop, no thread); both
  with envserve's uvicorn settings (no per-message deflate) on uvicorn's own WebSocket protocol.
  `openenv_shipped` runs under uvicorn's defaults, as OpenEnv's env template does;
  `openenv_envserve_ws` / `openenv_async_envserve_ws` on envserve's WebSocket protocol.
- envserve side: the same counter written here as an envserve Environment (no trivial env is
  registered; the replica loads this one through an entry point). `envserve_direct`: the replica
  serves OpenEnv itself (no facade), one worker process; `envserve_direct_inline`: the same with
  --inline (sessions step in the front process). `envserve_counter`: `envserve serve` behind
  `envserve web`; `envserve_frozenlake`: frozenlake, the smallest registered env (4x4, no turn
  limit here, moves into the wall so an episode never ends), behind the facade. All go through
  envserve's whole step: the action format's parser, rewards, the turn's ground truth kept for
  StateService.
- The client is the `websockets` library sending exactly the messages OpenEnv's EnvClient sends
  ({"type": "step", "data": {"message": ...}}), one connection per session; the sides alternate
  in rounds so load on the machine hits them alike. Reported: steps/s over all sessions at
  --sessions concurrent sockets, the CPU time the server's processes spent per step there, by
  process (envserve: facade, replica front, workers; OpenEnv: its one process), and the bench
  client's own, p50/p90 of one step there, and p50 of one socket stepping alone.

    python bench/openenv_endpoint.py --json
    python bench/openenv_endpoint.py --sides envserve_direct,envserve_counter,openenv,openenv_async
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

ENV_ID, CONFIG = "frozenlake", {"max_turns": 1_000_000}
ACTIONS = ["<answer>Left</answer>", "<answer>Up</answer>"]  # from the start corner: into the wall

# The same counter as the OpenEnv side's, as an envserve Environment; the replica finds it through
# an entry point (group envserve.envs) of a throwaway distribution put on its PYTHONPATH.
COUNTER_MODULE = '''
from envserve.core.env import ActionOutcome, EnvSpec, Environment, GroundTruth


class CounterEnv(Environment):
    spec = EnvSpec(env_id="counter", description="counts steps and echoes the action (bench)",
                   system_prompt="Say anything.", action_space="any text", max_turns=1_000_000,
                   max_actions_per_turn=1, default_action_format="no_think")

    def reset(self, seed, options=None):
        self.count, self.last = 0, ""

    def step(self, action):
        self.count += 1
        self.last = action
        return ActionOutcome(reward=1.0)

    def render_text(self):
        return self.last or "start"

    def ground_truth(self):
        return GroundTruth({"count": self.count})
'''


def counter_distribution(folder: Path) -> str:
    """Writes the counter env and its entry point under folder; returns the folder to put on PYTHONPATH."""
    (folder / "envserve_bench_counter.py").write_text(COUNTER_MODULE)
    info = folder / "envserve_bench_counter-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: envserve-bench-counter\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[envserve.envs]\ncounter = envserve_bench_counter:CounterEnv\n")
    return str(folder)


# -- OpenEnv's own server, in a child process ---------------------------------------------------------
def serve_openenv(port: int, use_async: bool, as_shipped: bool = False, envserve_ws: bool = False) -> None:
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

    class CounterAction(Action):
        message: str

    class CounterObservation(Observation):
        text: str = ""
        count: int = 0

    class CounterEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kw):
            self._state = State(episode_id=episode_id, step_count=0)
            return CounterObservation(text="start", count=0, reward=0.0)

        def step(self, action, timeout_s=None, **kw):
            self._state.step_count += 1
            return CounterObservation(text=action.message, count=self._state.step_count, reward=1.0)

        @property
        def state(self):
            return self._state

    class AsyncCounterEnv(CounterEnv):
        async def reset_async(self, seed=None, episode_id=None, **kw):
            return self.reset(seed, episode_id)

        async def step_async(self, action, timeout_s=None, **kw):
            return self.step(action)

    app = create_fastapi_app(AsyncCounterEnv if use_async else CounterEnv, CounterAction, CounterObservation,
                             max_concurrent_envs=4096)
    from envserve.web.server import bind
    sock = bind("127.0.0.1", port)
    print(f"openenv server on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    if as_shipped:
        # As OpenEnv's env template serves an app (`uvicorn.run(app, host=, port=)`): uvicorn's
        # defaults, so per-message deflate on; only the log level is lowered (this pipe is not read).
        import uvicorn
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    else:
        # With the same uvicorn settings as `envserve web` (no per-message deflate, no access log),
        # on uvicorn's own WebSocket protocol; with envserve_ws, on envserve's (which stops reading
        # a socket only once 16 messages wait, envserve.web.server.WebSocketProtocol).
        import uvicorn

        from envserve.web.server import WebSocketProtocol
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                               ws_per_message_deflate=False,
                                               ws=WebSocketProtocol if envserve_ws else "auto"))
    asyncio.run(server.serve(sockets=[sock]))


class ChildServer:
    """An OpenEnv server in a child process (`cmd`), once it printed "openenv server on URL"."""

    def __init__(self, cmd: list[str]):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, ENABLE_WEB_INTERFACE="false"))
        out = []
        for line in self.proc.stdout:
            out.append(line)
            m = re.search(r"openenv server on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return
        raise RuntimeError("openenv server did not start:\n" + "".join(out))

    def kill(self):
        self.proc.kill()
        self.proc.wait()


class OpenEnvProcess(ChildServer):
    def __init__(self, use_async: bool, as_shipped: bool = False, envserve_ws: bool = False):
        super().__init__([sys.executable, "-u", __file__, "--serve-openenv"] + (["--async-env"] if use_async else [])
                         + (["--as-shipped"] if as_shipped else []) + (["--envserve-ws"] if envserve_ws else []))


# -- the client -----------------------------------------------------------------------------------
async def open_socket(url: str, reset: dict):
    from websockets.asyncio.client import connect
    ws = await connect(url.replace("http://", "ws://") + "/ws", max_size=None, ping_interval=None)
    await ws.send(json.dumps({"type": "reset", "data": reset}))
    reply = json.loads(await ws.recv())
    assert reply["type"] == "observation", reply
    return ws


def cpu_seconds(roles: dict[str, list[int]]) -> dict[str, float]:
    import psutil
    out = {}
    for role, pids in roles.items():
        out[role] = 0.0
        for pid in pids:
            t = psutil.Process(pid).cpu_times()
            out[role] += t.user + t.system
    return out


async def run_side(side: tuple[str, dict, list[int]], sessions: int, seconds: float, warmup: float = 0.5) -> dict:
    """`sessions` sockets stepping as fast as their replies come for `seconds` (after a warm-up);
    also the CPU time the server's processes spent per step meanwhile."""
    url, reset, roles = side
    sockets = await asyncio.gather(*[open_socket(url, reset) for _ in range(sessions)])
    latencies: list[list[float]] = [[] for _ in sockets]
    phase = {"record": False, "stop": False}

    async def loop(k: int) -> None:
        ws, lat, i = sockets[k], latencies[k], 0
        while not phase["stop"]:
            t = time.perf_counter()
            await ws.send(json.dumps({"type": "step", "data": {"message": ACTIONS[i % 2]}}))
            reply = json.loads(await ws.recv())
            if phase["record"]:
                lat.append(time.perf_counter() - t)
            if reply["type"] != "observation":
                raise RuntimeError(f"step failed: {reply}")
            i += 1

    tasks = [asyncio.create_task(loop(k)) for k in range(sessions)]
    await asyncio.sleep(warmup)
    phase["record"] = True
    cpu0 = cpu_seconds(roles)
    client0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    phase["record"] = False
    elapsed = time.perf_counter() - t0
    cpu1 = cpu_seconds(roles)
    client = time.process_time() - client0
    cpu = {role: cpu1[role] - cpu0[role] for role in roles}
    phase["stop"] = True
    await asyncio.gather(*tasks)
    for ws in sockets:
        await ws.send(json.dumps({"type": "close"}))
        await ws.close()
    flat = sorted(x for lat in latencies for x in lat)
    return {"steps": len(flat), "seconds": elapsed, "steps_per_s": len(flat) / elapsed, "cpu_s": cpu,
            "client_cpu_s": client,
            "p50_ms": 1e3 * flat[len(flat) // 2], "p90_ms": 1e3 * flat[int(len(flat) * 0.9)]}


def merge(rounds: list[dict]) -> dict:
    steps = sum(r["steps"] for r in rounds)
    roles = rounds[0]["cpu_s"]
    return {"steps": steps, "steps_per_s": steps / sum(r["seconds"] for r in rounds),
            "server_cpu_us_per_step": 1e6 * sum(sum(r["cpu_s"].values()) for r in rounds) / steps,
            "client_cpu_us_per_step": 1e6 * sum(r["client_cpu_s"] for r in rounds) / steps,
            "cpu_us_per_step_by_role": {role: 1e6 * sum(r["cpu_s"][role] for r in rounds) / steps for role in roles},
            "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
            "p90_ms": statistics.median(r["p90_ms"] for r in rounds)}


SIDES = {
    "envserve_counter": "CounterEnv as an envserve env (this bench), through `envserve web`",
    "envserve_frozenlake": "frozenlake 4x4, no_think, moves into the wall, through `envserve web`",
    "envserve_direct": "CounterEnv, OpenEnv served by the replica itself (`envserve serve --openenv-port`), "
                       "one worker process",
    "envserve_direct_inline": "the same with --inline (sessions step in the replica's front process)",
    "openenv": "CounterEnv on openenv's Environment, sync reset/step (this bench)",
    "openenv_async": "the same with reset_async/step_async",
    "openenv_shipped": "the sync one under uvicorn's defaults, as OpenEnv's env template serves it "
                       "(per-message deflate on)",
    "openenv_envserve_ws": "the sync one on envserve's WebSocket protocol (reads paused only once 16 "
                           "messages wait)",
    "openenv_async_envserve_ws": "the async one on envserve's WebSocket protocol",
}
DEFAULT_SIDES = tuple(SIDES)
_OPENENV_LINE = re.compile(r"envserve openenv on (http://\S+)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0, help="per side per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=1, help="envserve replica workers")
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                    help="comma-separated sides to run, of: " + ", ".join(SIDES))
    ap.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    ap.add_argument("--serve-openenv", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--async-env", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--as-shipped", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--envserve-ws", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_openenv:
        serve_openenv(0, args.async_env, args.as_shipped, args.envserve_ws)
        return 0
    wanted = [x.strip() for x in args.sides.split(",") if x.strip()]
    unknown = set(wanted) - set(SIDES)
    if unknown:
        ap.error(f"unknown sides {sorted(unknown)}; known: {list(SIDES)}")

    import contextlib
    import tempfile

    import openenv
    from serverproc import ServerProcess
    from webproc import WebProcess

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = os.pathsep.join(filter(None, [counter_distribution(Path(tmp)), os.environ.get("PYTHONPATH", "")]))
        env_vars = {"PYTHONPATH": path}
        # side name -> (base url, reset data, {role: pids}); CPU is reported per role.
        sides: dict[str, tuple] = {}
        if {"envserve_counter", "envserve_frozenlake"} & set(wanted):
            server = stack.enter_context(ServerProcess(["counter", ENV_ID], workers=args.workers, metrics=False,
                                                       env_vars=env_vars))
            web = stack.enter_context(WebProcess.facade([server.address]))
            roles = {"facade": [web.proc.pid], "front": [server.proc.pid], "workers": server.worker_pids()}
            if "envserve_counter" in wanted:
                sides["envserve_counter"] = (f"{web.url}/openenv/counter", {"seed": 0}, roles)
            if "envserve_frozenlake" in wanted:
                # Sessions that never end: no turn limit (set at reset, which reopens the session).
                sides["envserve_frozenlake"] = (f"{web.url}/openenv/{ENV_ID}",
                                                {"seed": 0, "config": CONFIG, "action_format": "no_think"}, roles)
        for name, inline in (("envserve_direct", False), ("envserve_direct_inline", True)):
            if name not in wanted:
                continue
            extra = ["--openenv-port", "0"] + (["--inline"] if inline else [])
            direct = stack.enter_context(ServerProcess(["counter"], workers=args.workers, metrics=False,
                                                       env_vars=env_vars, extra=extra))
            url = _OPENENV_LINE.search("".join(direct.output)).group(1)
            roles = {"front": [direct.proc.pid], "workers": [] if inline else direct.worker_pids()}
            sides[name] = (f"{url}/counter", {"seed": 0}, roles)
        for name, use_async, as_shipped, envserve_ws in (
                ("openenv", False, False, False), ("openenv_async", True, False, False),
                ("openenv_shipped", False, True, False), ("openenv_envserve_ws", False, False, True),
                ("openenv_async_envserve_ws", True, False, True)):
            if name in wanted:
                p = OpenEnvProcess(use_async, as_shipped, envserve_ws)
                stack.callback(p.kill)
                sides[name] = (p.url, {"seed": 0}, {"server": [p.proc.pid]})
        sides = {name: sides[name] for name in wanted}
        concurrent = {name: [] for name in sides}
        alone = {name: [] for name in sides}

        async def bench():
            for side in sides.values():  # warm up every server once
                await run_side(side, 4, 0.3, warmup=0.1)
            for _ in range(args.rounds):
                for name, side in sides.items():
                    concurrent[name].append(await run_side(side, args.sessions, args.seconds))
                for name, side in sides.items():
                    alone[name].append(await run_side(side, 1, args.seconds / 2))
        asyncio.run(bench())

    results = {name: {**merge(concurrent[name]), "alone_p50_ms": statistics.median(r["p50_ms"] for r in alone[name])}
               for name in sides}
    summary = {"sessions": args.sessions, "rounds": args.rounds, "seconds": args.seconds,
               "replica_workers": args.workers, "openenv_version": openenv.__version__,
               "envs": {name: SIDES[name] for name in sides}, **results}
    mine = [n for n in sides if n.startswith("envserve")]
    theirs = [n for n in sides if n.startswith("openenv")]
    for m in mine:
        for t in theirs:
            summary[f"ratio_{m}_vs_{t}"] = results[m]["steps_per_s"] / results[t]["steps_per_s"]
    print(f"| server | steps/s at {args.sessions} sockets | server CPU us/step (by process) | p50 ms | p90 ms "
          "| one socket p50 ms |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        parts = ", ".join(f"{role} {us:.0f}" for role, us in r["cpu_us_per_step_by_role"].items())
        parts += f"; client {r['client_cpu_us_per_step']:.0f}"
        print(f"| {name} | {r['steps_per_s']:.0f} | {r['server_cpu_us_per_step']:.0f} ({parts}) | {r['p50_ms']:.2f} | "
              f"{r['p90_ms']:.2f} | {r['alone_p50_ms']:.2f} |")
    for m in mine:
        print(f"{m}: " + ", ".join(f"{summary[f'ratio_{m}_vs_{t}']:.2f}x {t}" for t in theirs))
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
