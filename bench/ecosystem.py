"""Other ecosystems' envs served by envserve, against the same envs stepped in-process.

Gymnasium: CartPole-v1 (text observations) at batch 64, through envserve's batched Step on a
loopback server, against 64 gymnasium envs stepped in a plain loop in this process, in the same
run, so the ratio travels between machines.

OpenEnv: the echo Environment class of tests/openenv_envs at 64 concurrent sessions, served by
envserve (openenv:<module>:<Class>, batched Step on a loopback server) against the same class
served by OpenEnv's own server (create_app under uvicorn on loopback, 64 WebSocket sessions of
OpenEnv's client stepped concurrently), same machine, same run.

Run: `.venv/bin/python bench/ecosystem.py [--json] [--seconds 10] [--parts gymnasium,openenv]`;
with --json the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path.insert(0, TESTS)

from envserve.client import EnvClient  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

GYM_ID = "CartPole-v1"
BATCH = 64
ACTIONS = ("Left", "Right")
# The OpenEnv class both servers serve, and the message each session sends.
OPENENV_MODULE, OPENENV_CLASS = "openenv_envs.echo", "EchoEnvironment"
OPENENV_ID = f"openenv:{OPENENV_MODULE}:{OPENENV_CLASS}"
OPENENV_MESSAGE = "hello"
# How long OpenEnv's server may take to answer /health after starting.
OPENENV_START_SECONDS = 60.0


def gym_in_process(seconds: float) -> float:
    """Env steps per second of BATCH gymnasium envs stepped one after another, reset when over."""
    import gymnasium as gym
    envs = [gym.make(GYM_ID) for _ in range(BATCH)]
    for i, e in enumerate(envs):
        e.reset(seed=i)
    steps, k, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for i, e in enumerate(envs):
            _, _, terminated, truncated, _ = e.step((k + i) % 2)
            if terminated or truncated:
                e.reset(seed=i + k)
        steps += BATCH
        k += 1
    return steps / (time.perf_counter() - t0)


def envserve_batched(client: EnvClient, seconds: float) -> float:
    """Env steps per second of BATCH sessions stepped by one Step call per round; sessions whose
    episode ended are reset in one Reset call before the next round."""
    env_id = f"gymnasium:{GYM_ID}"
    sids = client.open(env_id, BATCH, {"max_turns": 1_000_000}, "no_think")
    client.reset(sids, seeds=list(range(BATCH)))
    steps, k, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        results = client.step([(s, f"<answer>{ACTIONS[(k + i) % 2]}</answer>") for i, s in enumerate(sids)])
        ended = [s for s, r in zip(sids, results) if r.done or r.truncated]
        if ended:
            client.reset(ended, seeds=[k + i for i in range(len(ended))])
        steps += BATCH
        k += 1
    elapsed = time.perf_counter() - t0
    client.close_sessions(sids)
    return steps / elapsed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_tests_on_path() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p))


def openenv_own_server(port: int) -> subprocess.Popen:
    """OpenEnv's create_app for the class, BATCH sessions allowed, under uvicorn on loopback."""
    code = (f"import uvicorn\n"
            f"from openenv.core.env_server import create_app\n"
            f"from {OPENENV_MODULE} import {OPENENV_CLASS} as E, EchoAction, EchoObservation\n"
            f"app = create_app(E, EchoAction, EchoObservation, max_concurrent_envs={BATCH})\n"
            f"uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=_with_tests_on_path(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    import httpx
    deadline = time.monotonic() + OPENENV_START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"OpenEnv's server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"OpenEnv's server did not answer /health within {OPENENV_START_SECONDS}s")


def openenv_clients(url: str, seconds: float) -> float:
    """Env steps per second of BATCH OpenEnv client sessions, each round one step on every session
    at once (asyncio.gather), sessions whose episode ended reset before the next round."""
    from openenv import GenericEnvClient

    async def run() -> float:
        envs = [GenericEnvClient(base_url=url) for _ in range(BATCH)]
        await asyncio.gather(*(e.connect() for e in envs))
        await asyncio.gather(*(e.reset(seed=i) for i, e in enumerate(envs)))
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            results = await asyncio.gather(*(e.step({"message": OPENENV_MESSAGE}) for e in envs))
            ended = [e for e, r in zip(envs, results) if r.done]
            if ended:
                await asyncio.gather(*(e.reset(seed=i) for i, e in enumerate(ended)))
            steps += BATCH
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*(e.close() for e in envs))
        return steps / elapsed

    return asyncio.run(run())


def envserve_openenv(client: EnvClient, seconds: float) -> float:
    """The same loop through envserve: one batched Step per round, one Reset for ended sessions."""
    sids = client.open(OPENENV_ID, BATCH, {}, "no_think")
    client.reset(sids, seeds=list(range(BATCH)))
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        results = client.step([(s, f"<answer>{OPENENV_MESSAGE}</answer>") for s in sids])
        ended = [s for s, r in zip(sids, results) if r.done or r.truncated]
        if ended:
            client.reset(ended, seeds=list(range(len(ended))))
        steps += BATCH
    elapsed = time.perf_counter() - t0
    client.close_sessions(sids)
    return steps / elapsed


def gymnasium_part(args) -> dict:
    local = gym_in_process(args.seconds)
    with ServerProcess([f"gymnasium:{GYM_ID}"], workers=args.workers, metrics=False) as server, \
            EnvClient(server.address) as client:
        served = envserve_batched(client, args.seconds)
    print(f"gymnasium {GYM_ID} batch {BATCH}: in-process loop {local:,.0f} steps/s, envserve batched Step "
          f"{served:,.0f} steps/s ({served / local:.3f}x), {args.workers} workers")
    return {"gymnasium_env": GYM_ID, "in_process_steps_per_s": round(local),
            "envserve_step_steps_per_s": round(served), "envserve_over_in_process": round(served / local, 4)}


def openenv_part(args) -> dict:
    port = _free_port()
    own = openenv_own_server(port)
    try:
        theirs = openenv_clients(f"http://127.0.0.1:{port}", args.seconds)
    finally:
        own.kill()
        own.wait()
    with ServerProcess([OPENENV_ID], workers=args.workers, metrics=False, env_vars={
            "PYTHONPATH": _with_tests_on_path()["PYTHONPATH"]}) as server, EnvClient(server.address) as client:
        ours = envserve_openenv(client, args.seconds)
    print(f"openenv {OPENENV_CLASS} {BATCH} sessions: OpenEnv's server {theirs:,.0f} steps/s, envserve "
          f"{ours:,.0f} steps/s ({ours / theirs:.3f}x), {args.workers} workers")
    return {"openenv_env": OPENENV_ID, "openenv_server_steps_per_s": round(theirs),
            "envserve_openenv_steps_per_s": round(ours), "envserve_over_openenv_server": round(ours / theirs, 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0, help="measuring time of each side")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--parts", default="gymnasium,openenv", help="comma-separated: gymnasium, openenv")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    parts = {"gymnasium": gymnasium_part, "openenv": openenv_part}
    chosen = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in parts]
    if unknown:
        ap.error(f"unknown parts {unknown}; known: {sorted(parts)}")
    out = {"batch": BATCH, "workers": args.workers, "seconds": args.seconds}
    for p in chosen:
        out.update(parts[p](args))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
