"""Sokoban step throughput: in-process sessions vs the gRPC server (Step batches, Interact stream),
served by worker processes (the default) and by `serve --inline` (keys prefixed inline_).

Every figure is a ratio against the in-process baseline measured in the same run, so the
numbers travel between machines. Run: `.venv/bin/python bench/step_throughput.py [--json]`.
The last line with --json is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from envserve.client import AsyncEnvClient, EnvClient  # noqa: E402
from envserve.core.session import Session  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

ACTIONS = ["Up", "Left", "Down", "Right"]
CONFIG = {"max_turns": 1_000_000}


def action(i: int) -> str:
    return f"<think>move</think><answer>{ACTIONS[i % 4]}</answer>"


# Finished sessions sit out until a quarter of the batch is done, then are reset together,
# in both loops alike: a trainer resets in bulk, and a reset is not a step.
RESET_FRACTION = 0.25


def in_process(n_sessions: int, seconds: float) -> tuple[float, list[float]]:
    sessions = [Session("sokoban", CONFIG, "free_think") for _ in range(n_sessions)]
    for i, s in enumerate(sessions):
        s.reset(seed=i)
    live = list(range(n_sessions))
    steps, lat, i = 0, [], 0
    t0 = time.perf_counter()
    t_end = t0 + seconds
    while time.perf_counter() < t_end:
        still = []
        for k in live:
            t = time.perf_counter()
            r = sessions[k].step(action(i))
            lat.append(time.perf_counter() - t)
            if not (r.done or r.truncated):
                still.append(k)
        steps += len(live)
        live = still
        if len(live) <= n_sessions * (1 - RESET_FRACTION):
            for k in set(range(n_sessions)) - set(live):
                sessions[k].reset(seed=k)
            live = list(range(n_sessions))
        i += 1
    return steps / (time.perf_counter() - t0), lat


def grpc_batch(client: EnvClient, batch: int, seconds: float) -> float:
    ids = client.open("sokoban", batch, CONFIG, "free_think")
    client.reset(ids, seeds=list(range(batch)))
    live = list(range(batch))
    steps, i = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        results = client.step([(ids[k], action(i)) for k in live])
        steps += len(live)
        live = [k for k, r in zip(live, results) if not (r.done or r.truncated)]
        if len(live) <= batch * (1 - RESET_FRACTION):
            done = sorted(set(range(batch)) - set(live))
            client.reset([ids[k] for k in done], seeds=done)
            live = list(range(batch))
        i += 1
    rate = steps / (time.perf_counter() - t0)
    client.close_sessions(ids)
    return rate


def grpc_latency(client: EnvClient, n: int) -> list[float]:
    sid = client.open("sokoban", 1, CONFIG, "free_think")[0]
    client.reset([sid], seeds=[0])
    lat = []
    for i in range(n):
        t = time.perf_counter()
        r = client.step([(sid, action(i))])[0]
        lat.append(time.perf_counter() - t)
        if r.done:
            client.reset([sid], seeds=[0])
    client.close_sessions([sid])
    return lat


async def interact(address: str, n_sessions: int, seconds: float) -> float:
    """EnvPool-style: every session stays in flight; the sessions of each received batch of
    results are sent their next step together."""
    async with AsyncEnvClient(address) as ac:
        ids = await ac.open("sokoban", n_sessions, CONFIG, "free_think")
        await ac.reset(ids, seeds=list(range(n_sessions)))
        steps = 0
        async with ac.stream() as s:
            tag_sid = dict(zip(s.send_steps([(sid, action(0)) for sid in ids]), ids))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                ready = await s.recv()
                steps += len(ready)
                nxt = []
                for tag, r in ready:
                    sid = tag_sid.pop(tag)
                    if r.done or r.truncated:
                        tag_sid[s.send_reset(sid, seed=ids.index(sid))] = sid
                    else:
                        nxt.append((sid, action(steps + len(nxt))))
                tag_sid.update(zip(s.send_steps(nxt), [sid for sid, _ in nxt]))
            elapsed = time.perf_counter() - t0
            while s.in_flight:
                await s.recv()
        await ac.close_sessions(ids)
        return steps / elapsed


def _canned_step_server(answer: bytes, port_queue) -> None:
    """A bare grpc.aio server whose Step parses the request and answers `answer` as it is."""
    import grpc

    from envserve.v1 import envserve_pb2 as pb

    async def step(request, context):
        return answer

    async def serve():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("envserve.v1.EnvService", {
            "Step": grpc.unary_unary_rpc_method_handler(step, request_deserializer=pb.StepRequest.FromString)})])
        port_queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


def transport_floor(client: EnvClient, batch: int, calls: int = 1500) -> float:
    """Median seconds of a `batch`-item Step through EnvClient to a server that does no work: it
    answers real results captured from the replica. What any design pays before stepping an env."""
    import multiprocessing as mp

    from envserve.v1 import envserve_pb2 as pb
    ids = client.open("sokoban", batch, CONFIG, "free_think")
    client.reset(ids, seeds=list(range(batch)))
    answer = pb.BatchResponse(results=client.step([(sid, action(1)) for sid in ids])).SerializeToString()
    client.close_sessions(ids)
    ctx = mp.get_context("spawn")  # a fresh process: no gRPC state forked from this one
    ports = ctx.Queue()
    proc = ctx.Process(target=_canned_step_server, args=(answer, ports), daemon=True)
    proc.start()
    try:
        with EnvClient(f"127.0.0.1:{ports.get(timeout=60)}") as bare:
            lat = []
            for i in range(calls):
                t = time.perf_counter()
                bare.step([(sid, action(i)) for sid in ids])
                lat.append(time.perf_counter() - t)
    finally:
        proc.kill()
    return statistics.median(lat[calls // 10:])


def tree_rss(pid: int) -> int:
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def grpc_floor(client: EnvClient, n: int) -> list[float]:
    """Round trips of ListEnvs: what any unary call costs here before envserve does anything."""
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        client.list_envs()
        lat.append(time.perf_counter() - t)
    return lat


def idle_memory(client: EnvClient, pid: int, n: int = 1000) -> float:
    """RSS of the server and its workers per idle (opened and reset) session, on a fresh server."""
    warm = client.open("sokoban", 10)
    client.reset(warm, seeds=list(range(10)))
    client.close_sessions(warm)
    time.sleep(0.5)
    before = tree_rss(pid)
    ids = []
    for k in range(0, n, 250):
        chunk = client.open("sokoban", 250)
        client.reset(chunk, seeds=list(range(k, k + 250)))
        ids += chunk
    time.sleep(0.5)
    after = tree_rss(pid)
    client.close_sessions(ids)
    return (after - before) / n / 1024


def cpu_seconds(server: ServerProcess) -> dict[str, float]:
    def used(pids):
        return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)
    return {"client": used([os.getpid()]), "front": used([server.proc.pid]), "workers": used(server.worker_pids())}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def over_grpc(server: ServerProcess, base_rate: float, base_lat: list[float], seconds: float) -> dict:
    out = {}
    with EnvClient(server.address) as client:
        for b in (1, 16, 64, 256):
            cpu_before = cpu_seconds(server)
            t0 = time.perf_counter()
            rate = grpc_batch(client, b, seconds)
            steps = rate * (time.perf_counter() - t0)
            out[f"step_b{b}_steps_per_s"] = round(rate, 1)
            out[f"ratio_step_b{b}"] = round(rate / base_rate, 3)
            if b == 64:  # CPU per step of each side: client, the front, its workers (all share the cores)
                out.update({f"b64_cpu_us_per_step_{side}": round((after - cpu_before[side]) / steps * 1e6, 1)
                            for side, after in cpu_seconds(server).items()})
        rate = asyncio.run(interact(server.address, 64, seconds))
        out["interact_b64_steps_per_s"] = round(rate, 1)
        out["ratio_interact_b64"] = round(rate / base_rate, 3)
        lat = grpc_latency(client, 2000)
        floor = grpc_floor(client, 2000)
    out["inproc_latency_p50_ms"] = round(statistics.median(base_lat) * 1e3, 4)
    out["grpc_latency_p50_ms"] = round(statistics.median(lat) * 1e3, 4)
    out["added_latency_p50_ms"] = round((statistics.median(lat) - statistics.median(base_lat)) * 1e3, 4)
    out["added_latency_p99_ms"] = round((pct(lat, 0.99) - pct(base_lat, 0.99)) * 1e3, 4)
    out["grpc_floor_p50_ms"] = round(statistics.median(floor) * 1e3, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--workers", type=int, default=0, help="server workers (0: one per CPU)")
    ap.add_argument("--modes", default="workers,inline",
                    help="replicas to measure, comma-separated: workers (the default replica), inline")
    args = ap.parse_args()
    modes = {"workers": ("", []), "inline": ("inline_", ["--inline"])}
    unknown = set(args.modes.split(",")) - set(modes)
    if unknown:
        ap.error(f"unknown --modes {sorted(unknown)}; choose from {sorted(modes)}")
    chosen = [modes[m] for m in modes if m in args.modes.split(",")]

    base_rate, base_lat = in_process(64, args.seconds)
    out = {"inproc_steps_per_s": round(base_rate, 1), "cpus": os.cpu_count()}
    workers = args.workers or (os.cpu_count() or 1)
    out["workers"] = workers
    step_s = 1 / base_rate
    # The default replica (worker processes), then `serve --inline` (sessions step in the front).
    for prefix, extra in chosen:
        with ServerProcess(["sokoban"], workers=workers, metrics=False, extra=extra) as server:
            out.update({prefix + k: v for k, v in over_grpc(server, base_rate, base_lat, args.seconds).items()})
            if not prefix:
                with EnvClient(server.address) as client:
                    floor = transport_floor(client, 64)
                # The best b64 ratio a design could reach here: the transport, plus the 64 steps in
                # one process (inline) or split over two perfectly parallel workers.
                out["transport_b64_ms"] = round(floor * 1e3, 3)
                out["ratio_step_b64_reachable_inline"] = round(64 / (floor + 64 * step_s) / base_rate, 3)
                out["ratio_step_b64_reachable_2_workers"] = round(64 / (floor + 32 * step_s) / base_rate, 3)
    for prefix, extra in chosen:
        with ServerProcess(["sokoban"], workers=workers, metrics=False, extra=extra) as server:
            with EnvClient(server.address) as client:
                out[prefix + "kb_per_idle_session"] = round(idle_memory(client, server.proc.pid), 2)
    if not args.json:
        width = max(map(len, out))
        for k, v in out.items():
            print(f"{k:{width}s}  {v}")
    print(json.dumps(out) if args.json else "")


if __name__ == "__main__":
    main()
