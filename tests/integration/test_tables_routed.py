"""Tables of two seats through the directory: an Open of several tables through the router keeps
each table's seats on one replica, spreads the tables over the replicas, and every game plays to
its end with each seat stepped by its own rollout."""
from __future__ import annotations

import asyncio
import functools
import time

import grpc
import pytest

pytest.importorskip("textarena")

from envserve.client import AsyncRoutedClient, RoutedClient  # noqa: E402
from envserve.client.errors import EnvServeError  # noqa: E402
from envserve.directory import open_directory, replica_of  # noqa: E402
from serverproc import ServerProcess, start_together  # noqa: E402

TTT = "textarena:TicTacToe-v0"
# Seat 0 takes the left column while seat 1 plays the middle one.
MOVES = ([0, 3, 6], [4, 5, 8])


@pytest.fixture
def two_replicas(redis_server):
    extra = ["--directory", redis_server.url, "--heartbeat-seconds", "0.5"]
    a, b = start_together(*(functools.partial(ServerProcess, [TTT], workers=2, metrics=False,
                                              extra=[*extra, "--replica-id", rid]) for rid in ("tables-a", "tables-b")))
    d = open_directory(redis_server.url)
    deadline = time.time() + 30
    while len(d.replicas()) < 2 and time.time() < deadline:
        time.sleep(0.05)
    yield redis_server
    a.kill()
    b.kill()


def test_tables_spread_over_replicas_and_each_game_plays_to_its_end(two_replicas):
    async def seat(c, sid, moves):
        out = [(await c.reset([sid], [3]))[0]]
        for m in moves:
            if out[-1].done:
                break
            out.append(await c.step_one(sid, f"<answer>[{m}]</answer>"))
        return out

    async def main():
        async with AsyncRoutedClient(two_replicas.url) as c:
            ids = await c.open(TTT, 8, {"opponent": "session"}, "no_think")
            tables = [ids[k:k + 2] for k in range(0, len(ids), 2)]
            played = await asyncio.gather(*[seat(c, sid, MOVES[k % 2]) for k, sid in enumerate(ids)])
            await c.close_sessions(ids)
            return tables, played

    tables, played = asyncio.run(main())
    assert all(replica_of(a) == replica_of(b) for a, b in tables)       # a table never spans replicas
    assert {replica_of(a) for a, _ in tables} == {"tables-a", "tables-b"}
    for k in range(0, len(played), 2):
        first, second = played[k], played[k + 1]
        assert all(r.status.code == 0 for r in first + second)
        assert first[-1].done and first[-1].reward == 1.0 and first[-1].success
        assert second[-1].done and second[-1].reward == -1.0 and not second[-1].success
        assert first[-1].observation.text == second[-1].observation.text


def test_an_odd_count_of_seats_is_refused_before_any_replica_is_asked(redis_server):
    with RoutedClient(redis_server.url) as c:   # no replica registered: the client answers itself
        with pytest.raises(EnvServeError) as e:
            c.open(TTT, 3, {"opponent": "session"})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "even count" in str(e.value)
