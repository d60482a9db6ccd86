"""Outcome statistics: finished episodes of sessions opened with a stats scope, summed per task in
the replicas' directory (the in-process one, or a real redis-server shared by two replicas), read by
GetTaskStats only with the token that recorded them."""
import time

import pytest

from envserve.client import EnvClient, RoutedClient
from envserve.directory.base import TaskOutcomes
from envserve.directory.memory import MemoryDirectory
from envserve.directory.redis_directory import RedisDirectory
from outcomes import LEFT, finish_episodes, stats_when
from serverproc import ServerProcess, start_together


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_directory_sums_outcomes_forgets_stale_tasks_and_keeps_the_most_recent(kind, redis_server):
    d = MemoryDirectory() if kind == "memory" else RedisDirectory.from_url(redis_server.url)
    now = time.time()
    d.record_outcomes("s", {"1": TaskOutcomes(2, 1, 3.0, 10, now, 40), "2": TaskOutcomes(1, 0, -1.0, 5, now)}, 3600, 3)
    d.record_outcomes("s", {"1": TaskOutcomes(1, 1, 2.0, 4, now + 1, 9)}, 3600, 3)
    got = d.task_stats("s")
    assert got["1"] == TaskOutcomes(3, 2, 5.0, 14, pytest.approx(now + 1), 49) and got["2"].episodes == 1
    # Past max_tasks the least recently recorded go; past the TTL, stale ones.
    d.record_outcomes("s", {"3": TaskOutcomes(1, 0, 0.0, 1, now + 2), "4": TaskOutcomes(1, 0, 0.0, 1, now + 3)}, 3600, 3)
    assert set(d.task_stats("s")) == {"1", "3", "4"}
    d.record_outcomes("s", {"5": TaskOutcomes(1, 1, 1.0, 1, now + 4)}, 3600, 10)
    d.record_outcomes("old", {"x": TaskOutcomes(1, 0, 0.0, 1, now - 100)}, 50, 10)
    assert d.task_stats("old") == {} and set(d.task_stats("s")) == {"1", "3", "4", "5"}
    assert d.task_stats("never") == {}
    d.close()


def test_episodes_on_two_replicas_behind_redis_appear_in_one_table(redis_server):
    a, b = start_together(*[lambda rid=rid: ServerProcess(["frozenlake"], workers=1, metrics=False, extra=[
        "--directory", redis_server.url, "--replica-id", rid]) for rid in ("stats-a", "stats-b")])
    with a, b:
        with EnvClient(a.address, stats_scope="run-7") as on_a, EnvClient(b.address, stats_scope="run-7") as on_b:
            finish_episodes(on_a, "frozenlake", [1, 2])
            finish_episodes(on_b, "frozenlake", [2, 3], per_seed=2)
            found = stats_when(on_a, "frozenlake", 6)
            assert {t: s.episodes for t, s in found.items()} == {"1": 1, "2": 3, "3": 2}
            assert all(s.turns_sum == s.episodes for s in found.values())      # one turn each
            assert {t.task_id for t in on_b.task_stats("frozenlake")} == set(found)
            assert on_a.task_stats("frozenlake", "another-run") == []
        with RoutedClient(redis_server.url, stats_scope="run-7") as routed:
            assert {t.task_id: t.episodes for t in routed.task_stats("frozenlake")} == {"1": 1, "2": 3, "3": 2}


def test_generated_tokens_reported_with_each_step_are_summed_per_episode():
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as s, \
            EnvClient(s.address, stats_scope="tokens-run") as c:
        sids = c.open("frozenlake", 2, {"max_turns": 2})
        c.reset(sids, [3, 4])
        c.step([(sids[0], LEFT, 5), (sids[1], LEFT)])          # a step may report none
        c.step([(sids[0], LEFT, 7), (sids[1], LEFT, 11)])
        c.reset([sids[0]], [3])
        c.step([(sids[0], LEFT, 100)])                           # an episode not finished: not counted
        found = stats_when(c, "frozenlake", 2)
        assert {t: (o.episodes, o.tokens_sum) for t, o in found.items()} == {"3": (1, 12), "4": (1, 11)}


def test_a_scope_is_its_tokens_own(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("alice-token name=alice\nbob-token name=bob\n")
    with ServerProcess(["frozenlake"], workers=1, metrics=False, extra=["--token-file", str(tokens)]) as s, \
            EnvClient(s.address, token="alice-token", stats_scope="shared-name") as alice, \
            EnvClient(s.address, token="bob-token", stats_scope="shared-name") as bob:
        finish_episodes(alice, "frozenlake", [5, 6])
        assert set(stats_when(alice, "frozenlake", 2)) == {"5", "6"}
        assert bob.task_stats("frozenlake") == []      # the same name under another token is another scope
        finish_episodes(bob, "frozenlake", [9])
        assert set(stats_when(bob, "frozenlake", 1)) == {"9"}
        assert {t.task_id for t in alice.task_stats("frozenlake")} == {"5", "6"}


def test_sessions_without_a_scope_record_nothing_and_bad_scopes_are_refused(grid_server):
    from envserve.client.errors import EnvServeError
    with EnvClient(grid_server.address) as c:
        finish_episodes(c, "minesweeper", [1])
        with pytest.raises(EnvServeError, match="stats scope"):
            c.task_stats("minesweeper")
        with pytest.raises(EnvServeError, match="at most 128"):
            c.task_stats("minesweeper", "x" * 129)
    with EnvClient(grid_server.address, stats_scope="y" * 129) as c, pytest.raises(EnvServeError, match="at most 128"):
        c.open("minesweeper", 1)


@pytest.mark.parametrize("fault", ["kill", "drain"])
def test_rebuilt_and_moved_sessions_keep_counting_in_their_scope(redis_server, fault):
    """A session rebuilt by its client after its replica was killed, or moved by a draining replica,
    carries its stats scope (SessionHistory.stats_scope): its episode is counted where it ends."""
    import signal

    from envserve.directory import replica_of
    from serverproc import Cluster
    cluster = Cluster(redis_server.url, ["frozenlake"], ["carry-a", "carry-b"])
    try:
        with RoutedClient(cluster.url, stats_scope=f"carry-{fault}") as client:
            sids = client.open("frozenlake", 2, {"max_turns": 3, "size": 8})
            client.reset(sids, [21, 22])
            client.step([(s, LEFT) for s in sids])
            victim = cluster.replicas[replica_of(sids[0])]
            if fault == "kill":
                victim.kill()
            else:
                victim.proc.send_signal(signal.SIGTERM)
                assert victim.proc.wait(60) == 0
            for _ in range(2):
                results = client.step([(s, LEFT) for s in sids])
                assert all(r.status.code == 0 for r in results), [r.status for r in results]
            assert all(r.done or r.truncated for r in results)
            found = stats_when(client, "frozenlake", 2)
        assert {t: (s.episodes, s.turns_sum) for t, s in found.items()} == {"21": (1, 3), "22": (1, 3)}
    finally:
        cluster.close()
