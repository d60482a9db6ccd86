"""Faults with real processes: a worker killed mid-batch, SIGTERM mid-batch, idle leases, hostile input."""
import asyncio
import functools
import os
import random
import re
import signal
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from envserve.client import AsyncRoutedClient, EnvClient, RoutedClient, item_error
from envserve.client.errors import EnvServeError, SessionLostError, SessionNotFoundError, UnavailableError
from serverproc import ServerProcess, calls_while_it_stops, start_together

# Unparsable, so it never ends an episode, yet each step renders and records the turn.
MOVE = "<think>wait</think>"
# Big images make each step slow enough that a kill or a signal lands inside a batch.
SLOW = {"render_image": True, "image_size": 1024, "max_turns": 100_000}
DATA_LOSS = grpc.StatusCode.DATA_LOSS.value[0]


def start_slow_batch(c: EnvClient, n: int):
    """Open n slow sessions and start stepping them in one batch on a thread; returns
    (session ids, the thread, a dict that gets the batch's results)."""
    ids = c.open("sokoban", n, SLOW)
    c.reset(ids, seeds=list(range(n)))
    outcome = {}

    def run_batch():
        outcome["results"] = c.step([(sid, MOVE) for sid in ids])

    t = threading.Thread(target=run_batch)
    t.start()
    time.sleep(0.3)
    return ids, t, outcome


def test_worker_killed_during_batch_loses_only_its_sessions():
    with ServerProcess(["sokoban"], workers=2) as server:
        c = EnvClient(server.address)
        victim = server.worker_pids()[0]
        ids, t, outcome = start_slow_batch(c, 64)
        os.kill(victim, signal.SIGKILL)
        t.join(60)
        results = outcome["results"]
        lost = [r for r in results if r.status.code == DATA_LOSS]
        ok = [r for r in results if r.status.code == 0]
        assert len(lost) + len(ok) == 64
        assert 0 < len(lost) < 64 and ok
        assert all("session lost" in r.status.message for r in lost)
        lost_ids = {r.session_id for r in lost}
        # Afterwards the lost sessions say so; the others keep stepping.
        again = c.step([(sid, MOVE) for sid in ids])
        for r in again:
            if r.session_id in lost_ids:
                assert isinstance(item_error(r), SessionLostError)
            else:
                assert r.status.code == 0
        # A replacement worker comes up, and new sessions open once it has (how soon depends on the
        # machine's load: a hang is pytest-timeout's to catch).
        while True:
            try:
                new = c.open("sokoban", 4)
                break
            except EnvServeError:
                time.sleep(0.05)
        assert all(r.status.code == 0 for r in c.reset(new, seeds=[1, 2, 3, 4]))
        while len(server.worker_pids()) < 2:
            time.sleep(0.05)
        assert len(server.worker_pids()) == 2 and victim not in server.worker_pids()
        assert "envserve_worker_restarts_total 1.0" in server.metrics_text()
        c.close()


def wait_draining(address: str) -> None:
    """Until the replica has taken a SIGTERM in: its health service says NOT_SERVING once it refuses
    new sessions (or it has already stopped). A fixed sleep lost that race on a busy machine."""
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status == \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    return
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    return  # stopped already
            time.sleep(0.05)


def test_sigterm_drains_in_flight_batch_then_exits():
    server = ServerProcess(["sokoban"], workers=2, extra=["--drain-timeout", "30"])
    try:
        c = EnvClient(server.address)
        ids, t, outcome = start_slow_batch(c, 32)
        server.proc.send_signal(signal.SIGTERM)
        wait_draining(server.address)
        with pytest.raises((UnavailableError, EnvServeError)) as e:
            EnvClient(server.address, timeout=5).open("sokoban", 1)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        t.join(60)
        assert all(r.status.code == 0 for r in outcome["results"])
        assert server.proc.wait(30) == 0
        assert not psutil.pid_exists(server.proc.pid)
    finally:
        server.kill()


def test_an_open_that_reaches_a_stopping_replica_is_unavailable_never_cancelled():
    """A blocking call has no handle its caller could cancel, so a CANCELLED from a replica that stops
    under it would send the caller to the wrong handling: UNAVAILABLE says go elsewhere."""
    server = ServerProcess(["sokoban"], workers=1)
    try:
        with EnvClient(server.address, timeout=5) as client:
            outcomes = calls_while_it_stops(server.proc, lambda: client.open("sokoban", 1) and "OK")
    finally:
        server.kill()
    assert outcomes["OK"] > 0 and outcomes["UNAVAILABLE"] > 0
    assert set(outcomes) == {"OK", "UNAVAILABLE"}, outcomes


STALE = 600  # the client does not look at the listing again: its Opens go on reaching the stopping replica


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_routed_open_that_reaches_a_stopping_replica_opens_on_another(kind):
    """Replicas listed by address (nothing tells the client one is stopping): every Open succeeds,
    those that land on the stopping replica move on to the other."""
    stopping, other = start_together(*[functools.partial(ServerProcess, ["sokoban"], workers=1)] * 2)
    addresses = [stopping.address, other.address]
    try:
        if kind == "sync":
            client = RoutedClient(addresses, timeout=10, refresh_seconds=STALE)
            open_one = lambda: client.open("sokoban", 1) and "OK"  # noqa: E731
        else:
            client = AsyncRoutedClient(addresses, timeout=10, refresh_seconds=STALE)
            runner = asyncio.Runner()

            async def open_many():
                for got in await asyncio.gather(*[client.open("sokoban", 1) for _ in range(32)],
                                                return_exceptions=True):
                    if isinstance(got, BaseException):
                        raise got

            def open_one():
                runner.run(open_many())
                return "OK"
        try:
            outcomes = calls_while_it_stops(stopping.proc, open_one, threads=8 if kind == "sync" else 1)
        finally:
            if kind == "sync":
                client.close()
            else:
                runner.run(client.close())
                runner.close()
        assert outcomes["OK"] > 0
        assert set(outcomes) == {"OK"}, outcomes
    finally:
        stopping.kill()
        other.kill()


def _reaped(server) -> float:
    return float(re.search(r"^envserve_sessions_reaped_total (\S+)$", server.metrics_text(), re.M).group(1))


def _rss_of(pids):
    return sum(psutil.Process(p).memory_info().rss for p in pids)


LEASE_FOR_RECLAIM = 15


def test_idle_sessions_are_reclaimed_and_memory_returns():
    # The lease outlasts the load below even on a starved machine, and the peak is the largest
    # sample of it, so the peak holds every session: with a 2 s lease the reaper took the first
    # batches while later ones were still allocating, and the one sample at the end understated it.
    with ServerProcess(["sokoban"], workers=1, extra=["--lease-seconds", str(LEASE_FOR_RECLAIM)]) as server:
        c = EnvClient(server.address)
        pids = server.worker_pids()
        # Warm up so that one-time allocations (imports, caches) are not counted as sessions.
        warm = c.open("sokoban", 200, {"history_turns": 64})
        c.reset(warm, seeds=list(range(200)))
        c.close_sessions(warm)
        time.sleep(0.5)
        base = _rss_of(pids)
        # On a starved machine the 2 s lease can run out between the warm-up's calls, and the
        # reaper takes some of those sessions before their close: count only what follows.
        reaped_before = _reaped(server)
        ids, peak = [], base
        for _ in range(10):
            batch = c.open("sokoban", 200, {"history_turns": 64})
            c.reset(batch, seeds=list(range(200)))
            for _ in range(8):
                c.step([(sid, MOVE) for sid in batch])
            ids += batch
            peak = max(peak, _rss_of(pids))
        assert peak > base
        deadline = time.monotonic() + LEASE_FOR_RECLAIM + 30
        while "envserve_live_sessions{env=\"sokoban\"} 0.0" not in server.metrics_text():
            assert time.monotonic() < deadline, "sessions were not reaped"
            time.sleep(0.2)
        with pytest.raises(SessionNotFoundError):
            c.step_one(ids[0], MOVE)
        assert _reaped(server) - reaped_before == 2000
        # Most of what the sessions took is given back. The gauge drops when the front forgets the
        # sessions; the worker may still be closing them, so wait for it (bounded) rather than race.
        deadline = time.monotonic() + 20
        while (after := _rss_of(pids)) - base >= 0.5 * (peak - base) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert after - base < 0.5 * (peak - base), (base, peak, after)
        c.close()


def test_a_call_renews_the_lease():
    with ServerProcess(["sokoban"], workers=1, extra=["--lease-seconds", "1.5"], metrics=False) as server:
        c = EnvClient(server.address)
        sid = c.open("sokoban", 1)[0]
        c.reset_one(sid, seed=0)
        for _ in range(6):
            time.sleep(0.5)
            c.get_state(sid, -1)
        assert c.step_one(sid, MOVE).turn == 1
        c.close()


def hostile_strings(n, rng):
    pieces = ["<answer>", "</answer>", "<think>", "</think>", "<observation>", "</prediction>", "<planning>",
              "<action>", "</action>", "<", ">", "/", "Up", "Left", ",", "\x00", "\x1b[2J", "\r\n", "\ud7ff",
              "é", "漢", "🙂", "\t", "((", "))", "<answer><answer>", "</think></think>"]
    for i in range(n):
        kind = i % 5
        if kind == 0:
            yield "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        elif kind == 1:
            yield "".join(chr(rng.randint(0, 0xD7FF)) for _ in range(rng.randint(0, 200)))
        elif kind == 2:
            depth = rng.randint(1, 60)
            yield "<think>" * depth + "<answer>Up" + "</answer>" * rng.randint(0, depth)
        elif kind == 3:
            yield "<answer>" + rng.choice(["Up", "Down", "x"]) * rng.randint(0, 3000)
        else:
            yield rng.choice(["", " ", "\x00" * 100, "<answer></answer>", "<think></think><answer> </answer>"])


def test_ten_thousand_hostile_actions():
    with ServerProcess(["sokoban", "minesweeper"], workers=2) as server:
        c = EnvClient(server.address)
        rng = random.Random(1234)
        sessions = c.open("sokoban", 25, {"max_turns": 1_000_000}, "free_think") + \
            c.open("minesweeper", 25, {"max_turns": 1_000_000}, "no_think")
        c.reset(sessions, seeds=list(range(50)))
        texts = list(hostile_strings(9_998, rng)) + ["x" * 1_048_576, "<answer>" + "Up," * 400_000 + "</answer>"]
        invalid = 0
        # One item per session per batch, so an episode that ends mid-batch cannot fail a later item.
        for start in range(0, len(texts), len(sessions)):
            chunk = texts[start:start + len(sessions)]
            results = c.step([(sessions[i % len(sessions)], t) for i, t in enumerate(chunk)])
            finished = set()
            for r in results:
                assert r.status.code == 0, r.status.message
                if not r.action_valid:
                    invalid += 1
                    assert r.feedback
                if r.done or r.truncated:
                    finished.add(r.session_id)
            # A text that happens to be a winning move ends its episode: start another.
            if finished:
                c.reset(sorted(finished))
        assert invalid >= 9_000
        errors = [line for line in server.metrics_text().splitlines() if line.startswith("envserve_errors_total{")]
        assert errors == []
        assert server.proc.poll() is None
        c.close()
