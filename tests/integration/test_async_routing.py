"""AsyncRoutedClient and its stream across replicas, with a real Redis and two real replicas."""
from __future__ import annotations

import asyncio
import functools
import time

import pytest

from envserve.client import AsyncRoutedClient
from envserve.directory import open_directory, replica_of
from serverproc import ServerProcess, start_together

HEARTBEAT = 0.5


@pytest.fixture
def two_replicas(redis_server):
    extra = ["--directory", redis_server.url, "--heartbeat-seconds", str(HEARTBEAT)]
    a, b = start_together(*(functools.partial(ServerProcess, ["sokoban"], workers=1, metrics=False,
                                              extra=[*extra, "--replica-id", rid]) for rid in ("async-a", "async-b")))
    d = open_directory(redis_server.url)
    deadline = time.time() + 30
    while len(d.replicas()) < 2 and time.time() < deadline:
        time.sleep(0.05)
    yield redis_server, a, b
    a.kill()
    b.kill()


def test_stream_spans_replicas_and_survives_one_dying(two_replicas):
    redis_server, a, b = two_replicas

    async def run():
        async with AsyncRoutedClient(redis_server.url) as c:
            ids = await c.open("sokoban", 40)
            assert sorted({replica_of(s) for s in ids}) == ["async-a", "async-b"]
            assert [replica_of(s) for s in ids].count("async-a") == 20
            first = await c.reset(ids, list(range(40)))
            assert [r.session_id for r in first] == ids and all(r.status.code == 0 for r in first)

            async with c.stream() as s:
                sent = {await s.send_step(sid, "<answer>Up</answer>"): sid for sid in ids}
                got = {}
                while s.in_flight:
                    for tag, result in await s.recv():
                        got[tag] = result
                # Every tag comes back once, carrying the session it was sent for.
                assert set(got) == set(sent)
                assert all(got[t].session_id == sent[t] and got[t].turn == 1 for t in sent)

                a.kill()
                await asyncio.sleep(2 * HEARTBEAT + 0.05)
                sent = {await s.send_step(sid, "<answer>Down</answer>"): sid for sid in ids}
                got = {}
                while s.in_flight:
                    for tag, result in await s.recv():
                        got[tag] = result
            # a's sessions were rebuilt on b from their histories: every item answered, under its own id.
            assert set(got) == set(sent)
            for tag, sid in sent.items():
                assert got[tag].status.code == 0 and got[tag].turn == 2, got[tag].status
                assert got[tag].session_id == sid
            assert {replica_of(c.sessions.current(sid)) for sid in ids} == {"async-b"}
            new = await c.open("sokoban", 6)
            assert {replica_of(s) for s in new} == {"async-b"}
            statuses = await c.close_sessions(new)
            assert [st.code for st in statuses] == [0] * 6
    asyncio.run(run())
