"""One caller per session on one Interact stream (`await stream.step(...)`), as TRL, SkyRL and
OpenEnv clients drive environments: each caller gets its own session's results, sends made in the
same event-loop turn travel as one message, one bad item fails only its caller, and a broken
stream fails every waiting caller instead of leaving it waiting."""
from __future__ import annotations

import asyncio

import pytest

from envserve.client import AsyncEnvClient
from envserve.client.errors import EnvServeError
from serverproc import ServerProcess

ACTIONS = ["<answer>Up</answer>", "<answer>Left</answer>", "<answer>Down</answer>", "<answer>Right</answer>"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=2, metrics=False) as s:
        yield s


def test_each_caller_gets_its_own_sessions_results(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            ids = await ac.open("frozenlake", 16, {"max_turns": 1000}, "no_think")
            async with ac.stream() as s:
                async def rollout(k: int, sid: str) -> list[tuple[str, int]]:
                    r = await s.reset(sid, seed=k)
                    seen = [(r.session_id, r.turn)]
                    for i in range(12):
                        r = await s.step(sid, ACTIONS[(k + i) % 4])
                        seen.append((r.session_id, r.turn))
                        if r.done:
                            r = await s.reset(sid, seed=k)
                            seen.append((r.session_id, r.turn))
                    return seen
                runs = await asyncio.gather(*[rollout(k, sid) for k, sid in enumerate(ids)])
                assert s.in_flight == 0
                with pytest.raises(RuntimeError):
                    await s.recv()
            for sid, seen in zip(ids, runs):
                assert all(r_sid == sid for r_sid, _ in seen)
                # turns count up from each reset, one per step
                assert seen[0][1] == 0 and all(b in (a + 1, 0) for (_, a), (_, b) in zip(seen, seen[1:]))
    asyncio.run(main())


def test_sends_of_one_loop_turn_travel_as_one_message(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            ids = await ac.open("frozenlake", 64, {"max_turns": 1000}, "no_think")
            async with ac.stream() as s:
                await asyncio.gather(*[s.reset(sid, seed=i) for i, sid in enumerate(ids)])
                before = s.messages_sent
                results = await asyncio.gather(*[s.step(sid, ACTIONS[0]) for sid in ids])
                assert [r.session_id for r in results] == ids
                assert s.messages_sent - before == 1   # 64 callers, one InteractRequest
    asyncio.run(main())


def test_a_bad_item_fails_only_its_caller(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            ids = await ac.open("frozenlake", 2, {}, "no_think")
            async with ac.stream() as s:
                await asyncio.gather(*[s.reset(sid, seed=1) for sid in ids])
                good, bad = await asyncio.gather(s.step(ids[0], ACTIONS[1]), s.step("no-such-session", ACTIONS[1]))
                assert good.status.code == 0 and good.turn == 1
                assert bad.status.code != 0 and bad.status.message
    asyncio.run(main())


def test_a_broken_stream_fails_the_waiting_callers():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as doomed:
        async def main():
            async with AsyncEnvClient(doomed.address) as ac:
                sid = (await ac.open("frozenlake", 1, {"max_turns": 100000}, "no_think"))[0]
                async with ac.stream() as s:
                    await s.reset(sid, seed=0)
                    doomed.proc.kill()
                    doomed.proc.wait()
                    with pytest.raises((EnvServeError, EOFError)):
                        for _ in range(1000):
                            await asyncio.wait_for(s.step(sid, ACTIONS[1]), timeout=30)
        asyncio.run(main())


def test_a_lone_caller_cancelled_mid_step_leaves_the_stream_usable(server):
    # A lone caller writes and reads on the call itself, and gRPC cancels the call with a task
    # cancelled there: the stream must open a new call for the next step, not fail it.
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            sid = (await ac.open("frozenlake", 1, {"max_turns": 1000}, "no_think"))[0]
            async with ac.stream() as s:
                await s.reset(sid, seed=3)
                for _ in range(3):
                    task = asyncio.get_running_loop().create_task(s.step(sid, ACTIONS[0]))
                    await asyncio.sleep(0)  # the step is on the wire
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                    r = await s.step(sid, ACTIONS[1])
                    assert r.session_id == sid and r.status.code == 0 and r.turn >= 1
                r = await s.reset(sid, seed=3)
                assert r.status.code == 0 and r.turn == 0
    asyncio.run(main())


def test_cancelling_a_lone_caller_loses_nothing_of_a_caller_that_joined(server):
    async def main():
        async with AsyncEnvClient(server.address) as ac:
            ids = await ac.open("frozenlake", 2, {"max_turns": 1000}, "no_think")
            async with ac.stream() as s:
                for sid in ids:
                    await s.reset(sid, seed=5)
                loop = asyncio.get_running_loop()
                first = loop.create_task(s.step(ids[0], ACTIONS[0]))   # alone on the call
                second = loop.create_task(s.step(ids[1], ACTIONS[0]))  # joins: waits for the first
                await asyncio.sleep(0)
                first.cancel()
                r = await asyncio.wait_for(second, timeout=30)
                assert r.session_id == ids[1] and r.status.code == 0 and r.turn == 1
                with pytest.raises(asyncio.CancelledError):
                    await first
                # Both sessions go on, now sharing the stream.
                results = await asyncio.gather(*[s.step(sid, ACTIONS[1]) for sid in ids])
                assert [r.session_id for r in results] == ids
                assert all(r.status.code == 0 for r in results)
    asyncio.run(main())
