"""Closing an Interact stream whatever is happening on its call: a recv() cancelled just before the
close (as a routed stream's readers are), items in flight, a lone caller cancelled mid-step, the
server gone first. A close never raises, a caller still waiting gets EOFError (never a
CancelledError nobody asked for), and the client goes on with a new stream. These races turn on
which of the event loop's and gRPC core's threads runs first, so each test repeats its case many
times; `make test-contention` runs them on a starved machine."""
from __future__ import annotations

import asyncio

import pytest

from envserve.client import AsyncEnvClient, AsyncRoutedClient
from envserve.client.errors import EnvServeError
from envserve.v1 import envserve_pb2 as pb
from serverproc import ServerProcess

STAY = "<answer>Left</answer>"  # FrozenLake starts in the top-left corner: Left stays put, the turn counts up
ROUNDS = 40


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as s:
        yield s


async def outcome(task: asyncio.Task):
    """What a caller that nobody cancelled ended with: its result, EOFError or EnvServeError."""
    try:
        return await task
    except asyncio.CancelledError:
        pytest.fail("a caller that was not cancelled got CancelledError")
    except EOFError:
        return EOFError
    except EnvServeError:
        return EnvServeError


async def turn_of(ac: AsyncEnvClient, sid: str) -> int:
    """The session's turn, read by stepping it once on a stream of its own."""
    async with ac.stream() as s:
        r = await s.step(sid, STAY)
    assert r.status.code == 0, r.status
    return r.turn


def test_a_close_right_after_its_reader_is_cancelled_ends_the_call_quietly(server):
    # The reader's cancellation lands while the close's half-close is on its way, and gRPC cancels
    # the call under it (a routed stream closes its replicas' streams this way).
    async def cancel_reader_and_close(s, reader: asyncio.Task) -> None:
        reader.cancel()
        await s.__aexit__(None, None, None)
        with pytest.raises(asyncio.CancelledError):
            await reader

    async def main():
        async with AsyncEnvClient(server.address) as ac:
            ids = await ac.open("frozenlake", 8, {"max_turns": 100000}, "no_think")
            loop = asyncio.get_running_loop()
            for k in range(ROUNDS):
                streams = [await ac.stream().__aenter__() for _ in ids]
                for s, sid in zip(streams, ids):
                    s.send_reset(sid, seed=k)
                for s, sid in zip(streams, ids):
                    ((_, r),) = await s.recv()
                    assert r.session_id == sid and r.status.code == 0 and r.turn == 0
                readers = [loop.create_task(s.recv()) for s in streams]
                await asyncio.sleep(0)  # each reader awaits a read on its call
                await asyncio.gather(*[cancel_reader_and_close(s, t) for s, t in zip(streams, readers)])
            assert [await turn_of(ac, sid) for sid in ids] == [1] * len(ids)
    asyncio.run(main())


def test_routed_streams_open_and_close_cleanly_round_after_round(redis_server):
    # A routed stream's close cancels its reader task on each replica's stream, then closes it.
    async def rollout(c: AsyncRoutedClient, sid: str, k: int) -> None:
        async with c.stream() as rs:
            await rs.send_reset(sid, seed=k)
            ((_, r),) = await rs.recv()
            assert r.session_id == sid and r.status.code == 0

    async def main():
        async with AsyncRoutedClient(redis_server.url) as c:
            ids = await c.open("frozenlake", 8, {"max_turns": 100000}, "no_think")
            for k in range(ROUNDS):
                await asyncio.gather(*[rollout(c, sid, k) for sid in ids])
            assert all(r.status.code == 0 for r in await c.step([(sid, STAY) for sid in ids]))

    with ServerProcess(["frozenlake"], workers=1, metrics=False, extra=["--directory", redis_server.url]):
        asyncio.run(main())


def test_a_close_with_items_in_flight_ends_their_callers_with_eof(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            ids = await ac.open("frozenlake", 4, {"max_turns": 100000}, "no_think")
            await ac.reset(ids, [1] * len(ids))
            loop = asyncio.get_running_loop()
            for _ in range(ROUNDS // 4):
                # A lone caller, reading on the call itself.
                s = await ac.stream().__aenter__()
                lone = loop.create_task(s.step(ids[0], STAY))
                await asyncio.sleep(0)  # its item is on the wire
                await s.__aexit__(None, None, None)
                got = await outcome(lone)
                assert got is EOFError or (isinstance(got, pb.StepResult) and got.status.code == 0), got

                # Callers sharing the call through its writer and reader tasks.
                s = await ac.stream().__aenter__()
                shared = [loop.create_task(s.step(sid, STAY)) for sid in ids]
                await asyncio.sleep(0)
                await s.__aexit__(None, None, None)
                for got in [await outcome(t) for t in shared]:
                    assert got is EOFError or (isinstance(got, pb.StepResult) and got.status.code == 0), got

                # EnvPool style: a recv() waiting in another task.
                s = await ac.stream().__aenter__()
                s.send_steps([(sid, STAY) for sid in ids])
                reader = loop.create_task(s.recv())
                await asyncio.sleep(0)
                await s.__aexit__(None, None, None)
                got = await outcome(reader)
                assert got is EOFError or (isinstance(got, list) and all(r.status.code == 0 for _, r in got)), got
                with pytest.raises(EOFError):
                    s.send_step(ids[0], STAY)
            # The sessions go on: a closed stream's items were stepped or dropped, never broken.
            for sid in ids:
                assert await turn_of(ac, sid) >= 1
    asyncio.run(main())


def test_a_close_after_a_cancelled_lone_caller(server):
    # gRPC cancels the call with a lone caller cancelled in its write or read; before its write
    # began, the call is left open. Either way the close must end it quietly, and so must a close
    # right after the next step opened a new call.
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            sid = (await ac.open("frozenlake", 1, {"max_turns": 100000}, "no_think"))[0]
            await ac.reset([sid], [2])
            loop = asyncio.get_running_loop()
            for k in range(ROUNDS):
                s = await ac.stream().__aenter__()
                await s.step(sid, STAY)
                task = loop.create_task(s.step(sid, STAY))
                for _ in range(k % 3):  # 0: cancelled before it began; 1, 2: on the wire
                    await asyncio.sleep(0)
                task.cancel()
                if k % 2:
                    await s.__aexit__(None, None, None)  # the cancellation has not landed yet
                    with pytest.raises(asyncio.CancelledError):
                        await task
                else:
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    if k % 4 == 0:
                        r = await s.step(sid, STAY)  # on a new call
                        assert r.status.code == 0 and r.session_id == sid, r.status
                    await s.__aexit__(None, None, None)
                with pytest.raises(EOFError):
                    await s.step(sid, STAY)
            assert await turn_of(ac, sid) > ROUNDS
    asyncio.run(main())


def test_a_close_right_after_the_server_ended_the_call():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as doomed:
        async def main():
            async with AsyncEnvClient(doomed.address) as ac:
                ids = await ac.open("frozenlake", 3, {"max_turns": 100000}, "no_think")
                await ac.reset(ids, [0] * len(ids))
                loop = asyncio.get_running_loop()
                lone = await ac.stream().__aenter__()      # a lone caller's call, idle
                await lone.step(ids[0], STAY)
                shared = await ac.stream().__aenter__()    # callers that overlapped: its reader task waits
                await asyncio.gather(*[shared.step(sid, STAY) for sid in ids])
                pool = await ac.stream().__aenter__()      # EnvPool style: a recv() waits
                pool.send_step(ids[2], STAY)
                await pool.recv()
                waiting = loop.create_task(pool.recv())
                await asyncio.sleep(0)
                doomed.kill()
                for s in (lone, shared, pool):
                    await s.__aexit__(None, None, None)
                assert await outcome(waiting) in (EOFError, EnvServeError)
        asyncio.run(main())


def test_streams_open_and_close_round_after_round_losing_no_step(server):
    # Every step of these rounds completes before its stream closes, so the session's turn counts
    # exactly the steps sent: nothing is lost or stepped twice across the calls' ends.
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            sid, other = await ac.open("frozenlake", 2, {"max_turns": 100000}, "no_think")
            await ac.reset([sid, other], [4, 4])
            loop = asyncio.get_running_loop()
            steps = 0
            for k in range(5 * ROUNDS):
                async with ac.stream() as s:
                    kind = k % 5
                    if kind == 1:    # a lone caller
                        assert (await s.step(sid, STAY)).status.code == 0
                        steps += 1
                    elif kind == 2:  # EnvPool
                        s.send_step(sid, STAY)
                        ((_, r),) = await s.recv()
                        assert r.status.code == 0
                        steps += 1
                    elif kind == 3:  # two callers sharing the call
                        a, b = await asyncio.gather(s.step(sid, STAY), s.step(other, STAY))
                        assert a.status.code == b.status.code == 0
                        steps += 1
                    elif kind == 4:  # a reader left waiting, cancelled right before the close
                        s.send_step(sid, STAY)
                        await s.recv()
                        steps += 1
                        reader = loop.create_task(s.recv())
                        await asyncio.sleep(0)
                        reader.cancel()
                    # kind 0: opened and closed unused
            assert await turn_of(ac, sid) == steps + 1
    asyncio.run(main())
