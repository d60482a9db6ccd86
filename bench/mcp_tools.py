"""envserve's MCP door (a replica's own, `envserve serve --mcp-port`) measured two ways:

(a) one caller, one session, the same env: p50 of an MCP `step` tool call (the `mcp` SDK's
    ClientSession over streamable HTTP) against p50 of a gRPC Step (envserve's EnvClient.step_one)
    on a session of the same replica. Env: frozenlake, moving into the wall (an episode never ends).
(b) --sessions MCP sessions stepping at once: steps/s over all of them, against OpenEnv 0.10's own
    MCP path (POST /mcp JSON-RPC tools/call on a session made with openenv/session/create, served
    by openenv's create_fastapi_app over an MCPEnvironment whose FastMCP tool runs the step) on the
    same game: a counter that counts steps and echoes the action (bench/openenv_endpoint.py's,
    on both sides). Both sides are driven by the same kind of client: httpx posting JSON-RPC, one
    request in flight per session (envserve's with the MCP session header, its replies read off
    the SSE stream the transport answers with).

Reported as ratios, with the absolute figures, as JSON:

    python bench/mcp_tools.py --sessions 64 --seconds 5 --json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

from openenv_endpoint import ChildServer, counter_distribution  # noqa: E402

LEFT = "Left"   # frozenlake from its start corner: into the wall, so the episode never ends
ACCEPT = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
          "mcp-protocol-version": "2025-06-18"}


# -- OpenEnv's MCP path, in a child process ------------------------------------------------------------
def serve_openenv_mcp(port: int) -> None:
    from fastmcp import FastMCP
    from openenv.core.env_server import create_fastapi_app
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
    from openenv.core.env_server.types import Observation, State

    class CounterMcpEnv(MCPEnvironment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            server = FastMCP("counter")
            self.count = 0

            @server.tool
            def act(action: str) -> dict:
                """Count a step and echo the action."""
                self.count += 1
                return {"text": action, "count": self.count, "reward": 1.0, "done": False}

            super().__init__(server)
            self._state = State(step_count=0)

        def reset(self, seed=None, episode_id=None, **kw):
            self.count = 0
            return Observation(reward=0.0)

        def _step_impl(self, action, timeout_s=None, **kw):
            return Observation(reward=0.0)

        @property
        def state(self):
            return self._state

    import uvicorn

    from envserve.web.server import bind
    app = create_fastapi_app(CounterMcpEnv, CallToolAction, CallToolObservation, max_concurrent_envs=4096)
    sock = bind("127.0.0.1", port)
    print(f"openenv server on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on"))
    asyncio.run(server.serve(sockets=[sock]))


class OpenEnvProcess(ChildServer):
    def __init__(self):
        super().__init__([sys.executable, "-u", __file__, "--serve-openenv"])


# -- clients ---------------------------------------------------------------------------------------------
def sse_json(text: str) -> dict:
    """The JSON-RPC reply in a streamable-HTTP answer (an SSE stream, or plain JSON)."""
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip():
            return json.loads(line[5:])
    return json.loads(text)


class EnvserveMcpSession:
    def __init__(self, http, url: str):
        self.http, self.url, self.headers, self.n = http, url, dict(ACCEPT), 0

    async def rpc(self, method: str, params: dict, notify: bool = False) -> dict:
        self.n += 1
        body = {"jsonrpc": "2.0", "method": method, "params": params, **({} if notify else {"id": self.n})}
        r = await self.http.post(self.url, json=body, headers=self.headers)
        r.raise_for_status()
        if "mcp-session-id" in r.headers:
            self.headers["mcp-session-id"] = r.headers["mcp-session-id"]
        return {} if notify else sse_json(r.text)

    async def open(self) -> None:
        await self.rpc("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                      "clientInfo": {"name": "bench", "version": "0"}})
        await self.rpc("notifications/initialized", {}, notify=True)
        got = await self.rpc("tools/call", {"name": "reset", "arguments": {}})
        assert not got["result"].get("isError"), got

    async def step(self, action: str) -> None:
        got = await self.rpc("tools/call", {"name": "step", "arguments": {"action": action}})
        assert not got["result"]["isError"], got


class OpenEnvMcpSession:
    def __init__(self, http, url: str):
        self.http, self.url, self.sid, self.n = http, url + "/mcp", "", 0

    async def rpc(self, method: str, params: dict) -> dict:
        self.n += 1
        r = await self.http.post(self.url, json={"jsonrpc": "2.0", "id": self.n, "method": method, "params": params})
        r.raise_for_status()
        return r.json()

    async def open(self) -> None:
        self.sid = (await self.rpc("openenv/session/create", {}))["result"]["session_id"]

    async def step(self, action: str) -> None:
        got = await self.rpc("tools/call", {"name": "act", "arguments": {"action": action}, "session_id": self.sid})
        assert "result" in got, got


async def throughput(make, sessions: int, seconds: float, action: str, warmup: float = 0.5) -> float:
    import httpx
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        clients = [make(http) for _ in range(sessions)]
        await asyncio.gather(*[c.open() for c in clients])
        phase = {"record": False, "stop": False}
        counts = [0] * sessions

        async def loop(k: int) -> None:
            while not phase["stop"]:
                await clients[k].step(action)
                if phase["record"]:
                    counts[k] += 1
        tasks = [asyncio.create_task(loop(k)) for k in range(sessions)]
        await asyncio.sleep(warmup)
        phase["record"] = True
        t0 = time.perf_counter()
        await asyncio.sleep(seconds)
        phase["stop"] = True
        elapsed = time.perf_counter() - t0
        total = sum(counts)
        await asyncio.gather(*tasks)
    return total / elapsed


async def mcp_p50(url: str, steps: int) -> float:
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client
    async with streamablehttp_client(url) as (read, write, _):
        async with ClientSession(read, write) as s:
            await s.initialize()
            await s.call_tool("reset", {"seed": 0, "config": {"max_turns": 1_000_000}})
            await s.call_tool("step", {"action": LEFT})   # the tool list fetched, connections warm
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                r = await s.call_tool("step", {"action": LEFT})
                times.append(time.perf_counter() - t)
                assert not r.isError, r
    return statistics.median(times)


def grpc_p50(address: str, steps: int) -> float:
    from envserve.client import EnvClient
    with EnvClient(address) as c:
        [sid] = c.open("frozenlake", 1, {"max_turns": 1_000_000}, "no_think")
        c.reset_one(sid, 0)
        c.step_one(sid, f"<answer>{LEFT}</answer>")
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            c.step_one(sid, f"<answer>{LEFT}</answer>")
            times.append(time.perf_counter() - t)
        c.close_sessions([sid])
    return statistics.median(times)


def mcp_url(server) -> str:
    from serverproc import wait_until
    wait_until(lambda: any("envserve mcp on " in x for x in server.output), "the MCP endpoint line")
    return next(x for x in server.output if "envserve mcp on " in x).split("envserve mcp on ")[1].split()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--steps", type=int, default=300, help="steps timed for the p50s of (a)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve-openenv", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_openenv:
        serve_openenv_mcp(0)
        return 0
    from serverproc import ServerProcess
    out: dict = {"command": "python bench/mcp_tools.py " + " ".join(sys.argv[1:]), "sessions": args.sessions,
                 "seconds": args.seconds, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as folder:
        pythonpath = os.pathsep.join([counter_distribution(Path(folder)), os.environ.get("PYTHONPATH", "")])
        with ServerProcess(["frozenlake", "counter"], workers=args.workers, metrics=False,
                           extra=["--mcp-port", "0"], env_vars={"PYTHONPATH": pythonpath}) as replica:
            url = mcp_url(replica)
            # (a) alternate the two so load on the machine hits them alike
            mcp_times, grpc_times = [], []
            for _ in range(3):
                mcp_times.append(asyncio.run(mcp_p50(url + "/frozenlake", args.steps // 3)))
                grpc_times.append(grpc_p50(replica.address, args.steps // 3))
            out["a_mcp_step_p50_ms"] = round(1e3 * statistics.median(mcp_times), 3)
            out["a_grpc_step_p50_ms"] = round(1e3 * statistics.median(grpc_times), 3)
            out["a_mcp_over_grpc"] = round(out["a_mcp_step_p50_ms"] / out["a_grpc_step_p50_ms"], 2)
            # (b)
            envserve_rate = asyncio.run(throughput(lambda h: EnvserveMcpSession(h, url + "/counter"),
                                                   args.sessions, args.seconds, "hello"))
        openenv = OpenEnvProcess()
        try:
            openenv_rate = asyncio.run(throughput(lambda h: OpenEnvMcpSession(h, openenv.url),
                                                  args.sessions, args.seconds, "hello"))
        finally:
            openenv.kill()
    out["b_envserve_mcp_steps_per_s"] = round(envserve_rate, 1)
    out["b_openenv_mcp_steps_per_s"] = round(openenv_rate, 1)
    out["b_envserve_over_openenv"] = round(envserve_rate / openenv_rate, 2)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:32} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
