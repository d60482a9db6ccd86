"""`serve --inline` against the default worker processes: the same bytes for the same seeds and
actions, on Step and on the Interact stream, from two real servers on loopback."""
import asyncio

import pytest

from envserve.client import AsyncEnvClient, EnvClient
from serverproc import ServerProcess

GAMES = ["sokoban", "frozenlake", "minesweeper"]
MOVES = {"sokoban": ["Left", "Down", "Right", "Up", "fly"], "frozenlake": ["Left", "Down", "Right", "Up", "fly"],
         "minesweeper": ["reveal 1 1", "reveal 2 3", "flag 0 0", "reveal 4 4", "dig"]}


@pytest.fixture(scope="module")
def servers():
    with ServerProcess(GAMES, workers=2, metrics=False) as workers, \
            ServerProcess(GAMES, metrics=False, extra=["--inline"]) as inline:
        assert "0 workers (sessions step in this process)" in "".join(inline.output)
        yield workers.address, inline.address


def _without_ids(results):
    out = []
    for r in results:
        r = type(r).FromString(r.SerializeToString())
        r.ClearField("session_id")
        out.append(r.SerializeToString(deterministic=True))
    return out


def _play_batches(address, env_id):
    with EnvClient(address) as c:
        ids = c.open(env_id, 6, {"max_turns": 8}, "no_think")
        trace = _without_ids(c.reset(ids, seeds=[3, 4, 5, 6, 7, 3]))
        for t in range(8):
            trace += _without_ids(c.step([(sid, f"<answer>{MOVES[env_id][(t + k) % 5]}</answer>")
                                          for k, sid in enumerate(ids)]))
        fork = c.fork(ids[0], 1)[0]
        trace += _without_ids(c.reset([fork], seeds=[9]))
        trace += _without_ids([c.get_state(ids[1], -1)])
        c.close_sessions([*ids, fork])
        return trace


async def _play_stream(address, env_id):
    async with AsyncEnvClient(address) as ac:
        ids = await ac.open(env_id, 6, {"max_turns": 8}, "no_think")
        trace = {}
        async with ac.stream() as s:
            tags = {s.send_reset(sid, seed=seed): k for k, (sid, seed) in enumerate(zip(ids, [3, 4, 5, 6, 7, 3]))}
            for t in range(9):
                got = {}
                while len(got) < len(ids):
                    for tag, r in await s.recv():
                        got[tags.pop(tag)] = r
                for k in sorted(got):
                    trace[(t, k)] = _without_ids([got[k]])[0]
                if t < 8:
                    tags = {tag: k for k, tag in enumerate(s.send_steps(
                        [(sid, f"<answer>{MOVES[env_id][(t + k) % 5]}</answer>") for k, sid in enumerate(ids)]))}
        await ac.close_sessions(ids)
        return trace


@pytest.mark.parametrize("env_id", GAMES)
def test_inline_answers_the_same_bytes_as_workers(servers, env_id):
    by_workers, inline = (_play_batches(a, env_id) for a in servers)
    assert len(by_workers) == 6 + 8 * 6 + 2
    assert inline == by_workers


@pytest.mark.parametrize("env_id", GAMES)
def test_inline_stream_answers_the_same_bytes_as_workers(servers, env_id):
    by_workers, inline = (asyncio.run(_play_stream(a, env_id)) for a in servers)
    assert len(by_workers) == 9 * 6
    assert inline == by_workers
