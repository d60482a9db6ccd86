"""Opening more sessions than a replica takes in one call: the clients split the Open (and the
batches after it) by the limits the replica says, and a split that fails part way leaves no
session open. Real replica processes on loopback."""
from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from envserve.client import AsyncEnvClient, AsyncRoutedClient, EnvClient, RoutedClient
from envserve.client.errors import EnvServeError, ReplicaFullError
from envserve.directory import open_directory, replica_of
from envserve.v1 import envserve_pb2 as pb
from serverproc import ServerProcess, start_together, wait_until

ENV = "frozenlake"
MOVE = "<think>go</think><answer>Right</answer>"
MANY = 16_384


def live(address: str) -> int:
    with EnvClient(address) as c:
        return c.env.ListEnvs(pb.ListEnvsRequest()).live_sessions


def replica_id(address: str) -> str:
    with EnvClient(address) as c:
        return c.env.ListEnvs(pb.ListEnvsRequest()).replica_id


@pytest.fixture(scope="module")
def default_replica():
    """A replica with the default limits per call (4,096), room for the many sessions."""
    with ServerProcess([ENV], workers=2, metrics=False, extra=["--max-sessions", str(MANY + 1000)]) as s:
        yield s


@pytest.fixture(scope="module")
def small_replica():
    """A replica taking 1,000 sessions per Open and 700 items per batch, 3,000 sessions in all."""
    with ServerProcess([ENV], workers=1, metrics=False, extra=[
            "--max-open-per-call", "1000", "--max-batch-items", "700", "--max-sessions", "3000"]) as s:
        yield s


def check_many(ids: list[str], address: str) -> None:
    assert len(ids) == MANY and len(set(ids)) == MANY
    assert {replica_of(s) for s in ids} == {replica_id(address)}
    assert live(address) == MANY


def test_sync_client_opens_16384_on_a_default_replica(default_replica):
    with EnvClient(default_replica.address) as c:
        reply = c.open_sessions(ENV, MANY)
        ids = list(reply.session_ids)
        check_many(ids, default_replica.address)
        assert reply.max_open_per_call == 4096 and reply.max_batch_items == 4096 and reply.system_prompt
        # The batches after it are split as well: every session resets, a few step.
        resets = c.reset(ids, seeds=list(range(MANY)))
        assert [r.session_id for r in resets] == ids and all(r.status.code == 0 for r in resets)
        steps = c.step([(sid, MOVE) for sid in ids[::4000]])
        assert all(r.status.code == 0 and r.turn == 1 for r in steps), [r.status for r in steps]
        assert [st.code for st in c.close_sessions(ids)] == [0] * MANY
    assert live(default_replica.address) == 0


def test_async_client_opens_16384_on_a_default_replica(default_replica):
    async def run():
        async with AsyncEnvClient(default_replica.address) as c:
            ids = await c.open(ENV, MANY)
            check_many(ids, default_replica.address)
            some = ids[::3000]
            await c.reset(some, seeds=list(range(len(some))))
            steps = await c.step([(sid, MOVE) for sid in some])
            assert all(r.status.code == 0 and r.turn == 1 for r in steps), [r.status for r in steps]
            statuses = await c.close_sessions(ids)
            assert [st.code for st in statuses] == [0] * MANY
    asyncio.run(run())
    assert live(default_replica.address) == 0


def test_a_replica_says_its_limits_and_refuses_more_in_one_call(small_replica):
    with EnvClient(small_replica.address) as c:
        listed = c.env.ListEnvs(pb.ListEnvsRequest())
        assert (listed.max_open_per_call, listed.max_batch_items) == (1000, 700)
        with pytest.raises(grpc.RpcError) as e:
            c.env.Open(pb.OpenRequest(env_id=ENV, count=1001))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1..1000" in e.value.details() and "--max-open-per-call" in e.value.details()


def test_clients_open_past_a_smaller_cap(small_replica):
    with EnvClient(small_replica.address) as c:
        ids = c.open(ENV, 2500)
        assert len(set(ids)) == 2500 and live(small_replica.address) == 2500
        assert (c.limits.max_open_per_call, c.limits.max_batch_items) == (1000, 700)
        resets = c.reset(ids, seeds=list(range(2500)))
        assert [r.session_id for r in resets] == ids and all(r.status.code == 0 for r in resets)
        assert [st.code for st in c.close_sessions(ids)] == [0] * 2500
    # The client's own bound, below the replica's.
    with EnvClient(small_replica.address, max_open_per_call=300) as c:
        ids = c.open(ENV, 1000)
        assert len(set(ids)) == 1000
        c.close_sessions(ids)

    async def run():
        async with AsyncEnvClient(small_replica.address) as c:
            ids = await c.open(ENV, 2500)
            assert len(set(ids)) == 2500 and live(small_replica.address) == 2500
            assert [st.code for st in await c.close_sessions(ids)] == [0] * 2500
    asyncio.run(run())
    assert live(small_replica.address) == 0


def test_a_split_open_that_fails_part_way_closes_what_it_opened(small_replica):
    """3,000 sessions fit; 200 are open; 2,900 more open 1,000 and 1,000, then the third Open finds
    the replica full: the call raises RESOURCE_EXHAUSTED and the 2,000 are closed again."""
    with EnvClient(small_replica.address) as keep:
        kept = keep.open(ENV, 200)
        with EnvClient(small_replica.address) as c, pytest.raises(ReplicaFullError) as e:
            c.open(ENV, 2900)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert live(small_replica.address) == 200

        async def run():
            async with AsyncEnvClient(small_replica.address) as c:
                with pytest.raises(ReplicaFullError):
                    await c.open(ENV, 2900)
        asyncio.run(run())
        assert live(small_replica.address) == 200
        # The kept sessions are untouched.
        assert all(r.status.code == 0 for r in keep.reset(kept))
        keep.close_sessions(kept)
    assert live(small_replica.address) == 0


@pytest.fixture(scope="module")
def two_small_replicas():
    """Two replicas of 1,000 sessions each, taking 250 (a) and 400 (b) per Open and 300 per batch."""
    def replica(cap):
        return ServerProcess([ENV], workers=1, metrics=False, extra=[
            "--max-open-per-call", str(cap), "--max-batch-items", "300", "--max-sessions", "1000"])
    a, b = start_together(functools.partial(replica, 250), functools.partial(replica, 400))
    try:
        yield a, b
    finally:
        a.kill()
        b.kill()


def test_routed_clients_split_each_replicas_share_by_its_cap(two_small_replicas):
    a, b = two_small_replicas
    addresses = f"{a.address},{b.address}"
    with RoutedClient(addresses) as c:
        ids = c.open(ENV, 1800)
        assert len(set(ids)) == 1800
        assert (live(a.address), live(b.address)) == (900, 900)
        assert {r.replica_id: r.max_open_per_call for r in c.replicas()} == {
            replica_id(a.address): 250, replica_id(b.address): 400}
        resets = c.reset(ids)
        assert all(r.status.code == 0 for r in resets)
        assert [st.code for st in c.close_sessions(ids)] == [0] * 1800
    # The client's own bound below both replicas' caps.
    with RoutedClient(addresses, max_open_per_call=100) as c:
        ids = c.open(ENV, 700)
        assert len(set(ids)) == 700
        c.close_sessions(ids)

    async def run():
        async with AsyncRoutedClient(addresses) as c:
            ids = await c.open(ENV, 1800)
            assert len(set(ids)) == 1800
            # 900 a replica, in batches of the 300 it takes.
            assert all(r.status.code == 0 for r in await c.reset(ids))
            assert all(r.status.code == 0 and r.turn == 1 for r in await c.step([(sid, MOVE) for sid in ids]))
            assert [st.code for st in await c.close_sessions(ids)] == [0] * 1800
    asyncio.run(run())
    assert (live(a.address), live(b.address)) == (0, 0)


def test_a_routed_open_that_finds_replicas_fuller_than_listed_leaves_nothing_open(two_small_replicas):
    """The routed clients plan by a listing taken while both replicas were empty; then 700 sessions
    open on each behind their backs. Their 700 go 350 to each replica (a's in Opens of 250 and
    100): some of these find the replica full, the other replica is full too, so the call fails
    RESOURCE_EXHAUSTED and the sessions its other Opens made are closed."""
    a, b = two_small_replicas
    addresses = f"{a.address},{b.address}"
    with EnvClient(a.address) as fill_a, EnvClient(b.address) as fill_b:
        def filled():
            return fill_a.open(ENV, 700), fill_b.open(ENV, 700)

        def empty(others):
            fill_a.close_sessions(others[0])
            fill_b.close_sessions(others[1])

        with RoutedClient(addresses, refresh_seconds=3600) as c:
            c.replicas(refresh=True)
            others = filled()
            with pytest.raises(EnvServeError) as e:
                c.open(ENV, 700)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            assert (live(a.address), live(b.address)) == (700, 700)
            empty(others)

        async def run():
            async with AsyncRoutedClient(addresses, refresh_seconds=3600) as c:
                await asyncio.to_thread(c.replicas, None, True)
                others = await asyncio.to_thread(filled)
                with pytest.raises(EnvServeError) as e:
                    await c.open(ENV, 700)
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
                return others
        others = asyncio.run(run())
        assert (live(a.address), live(b.address)) == (700, 700)
        empty(others)
    assert (live(a.address), live(b.address)) == (0, 0)


def test_the_heartbeat_carries_the_replicas_limits(redis_server):
    with ServerProcess([ENV], workers=1, metrics=False, extra=[
            "--directory", redis_server.url, "--heartbeat-seconds", "0.5",
            "--max-open-per-call", "123", "--max-batch-items", "456"]) as s:
        d = open_directory(redis_server.url)
        wait_until(lambda: len(d.replicas()) == 1, "the replica's heartbeat")
        (info,) = d.replicas()
        assert (info.max_open_per_call, info.max_batch_items) == (123, 456)
        # A routed client reading that directory opens past it without asking the replica first.
        with RoutedClient(redis_server.url) as c:
            ids = c.open(ENV, 500)
            assert len(set(ids)) == 500 and live(s.address) == 500
            assert [st.code for st in c.close_sessions(ids)] == [0] * 500


def test_a_stream_sends_more_items_than_one_message_takes(small_replica):
    """2,500 steps sent in one go on an Interact stream of a replica taking 700 items per message:
    the stream writes them in several messages, and every one is answered."""
    async def run():
        async with AsyncEnvClient(small_replica.address) as c:
            ids = await c.open(ENV, 2500)
            await c.reset(ids)
            async with c.stream() as s:
                sent = dict(zip(s.send_steps([(sid, MOVE) for sid in ids]), ids))
                got = {}
                while s.in_flight:
                    got.update(await s.recv())
            assert set(got) == set(sent)
            assert all(got[t].session_id == sent[t] and got[t].status.code == 0 for t in sent)
            assert s.messages_sent >= 4
            await c.close_sessions(ids)
    asyncio.run(run())
    assert live(small_replica.address) == 0
