"""Sessions outlive their replica: a routed client rebuilds a lost session on a live replica by
replaying its history (Restore) and answers as if nothing had happened. Real replicas, a real
redis-server, real kill -9."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import grpc
import pytest

from envserve.client import AsyncRoutedClient, EnvClient, RoutedClient, messages as pb
from envserve.client.experts import plain_answer
from envserve.directory import open_directory, replica_of
from serverproc import Cluster, ServerProcess

GRID = ["sokoban", "frozenlake", "minesweeper"]
MOVES = {"sokoban": ["Up", "Right", "Down", "Left"], "frozenlake": ["Right", "Down", "Left", "Up"],
         "minesweeper": ["(0, 0)", "(2, 3)", "(5, 5)", "(1, 4)", "(4, 1)", "(3, 3)"]}
LOST = grpc.StatusCode.DATA_LOSS.value[0]
ENDED = grpc.StatusCode.FAILED_PRECONDITION.value[0]


@pytest.fixture
def grid_cluster(redis_server):
    c = Cluster(redis_server.url, GRID, ["rec-a", "rec-b", "rec-c"])
    yield c
    c.close()


def _answer(env_id: str, seed: int, turn: int) -> str:
    moves = MOVES[env_id]
    return plain_answer("free_think", [moves[(seed + turn) % len(moves)]])


def _view(r: pb.StepResult) -> tuple:
    """What a trainer sees of a result (the session id aside)."""
    return (r.status.code, r.observation.text, round(r.reward, 9), r.done, r.truncated, r.success, r.anchor,
            r.turn, r.episode, r.trial, r.action_valid, r.transition)


def _play(client: RoutedClient, plan, turns: int, fault=None) -> dict:
    """plan: [(env_id, seed)]. Opens one session each, resets and steps them together for `turns`;
    fault(turn, sids) runs before that turn's step. Returns {index: [view per call]}."""
    sids = [client.open(env_id, 1)[0] for env_id, _ in plan]
    out = {i: [] for i in range(len(plan))}
    for i, r in enumerate(client.reset(sids, [seed for _, seed in plan])):
        assert r.session_id == sids[i]
        out[i].append(_view(r))
    for t in range(turns):
        if fault:
            fault(t, sids)
        results = client.step([(sid, _answer(env_id, seed, t)) for sid, (env_id, seed) in zip(sids, plan)])
        for i, r in enumerate(results):
            assert r.session_id == sids[i]  # the caller's id, wherever the session lives now
            out[i].append(_view(r))
    client.close_sessions(sids)
    return out


def _kill_host_of(cluster: Cluster, sid: str, at_turn: int, state: dict):
    def fault(turn, sids):
        if turn == at_turn and not state.get("done"):
            rid = replica_of(sid)
            cluster.replicas[rid].kill()
            state["done"], state["killed"] = True, rid
    return fault


def test_grid_sessions_survive_kill_of_their_replica(grid_cluster):
    plan = [(GRID[i % 3], 100 + i) for i in range(18)]
    with RoutedClient(grid_cluster.url) as ref_client:
        reference = _play(ref_client, plan, turns=8)
    state: dict = {}
    with RoutedClient(grid_cluster.url) as client:
        first = client.open("sokoban", 1)[0]  # the first session's replica is killed at turn 4
        client.close_sessions([first])
        faulted = _play(client, plan, turns=8, fault=_kill_host_of(grid_cluster, first, 4, state))
        assert client.sessions.recovered >= 1
    assert state.get("killed")
    assert faulted == reference  # observations, rewards, anchors, counters: all as without the fault
    assert all(view[0] == 0 for views in faulted.values() for view in views[:1])


def test_recovery_off_loses_the_sessions_as_before(grid_cluster):
    with RoutedClient(grid_cluster.url, recovery=False) as client:
        sids = client.open("sokoban", 6)
        assert all(r.status.code == 0 for r in client.reset(sids, list(range(6))))
        victim = replica_of(sids[0])
        grid_cluster.replicas[victim].kill()
        results = client.step([(s, _answer("sokoban", 0, 0)) for s in sids])
        on_victim = [r for s, r in zip(sids, results) if replica_of(s) == victim]
        assert on_victim and all(r.status.code != 0 for r in on_victim)
        assert client.sessions.recovered == 0


def test_stream_recovers_in_flight_items_after_a_kill(grid_cluster):
    """The trainer's path: AsyncRoutedClient's stream, items in flight when the replica dies."""
    plan = [(GRID[i % 3], 300 + i) for i in range(12)]

    async def run(kill_at: int | None):
        async with AsyncRoutedClient(grid_cluster.url) as client:
            sids = [(await client.open(env_id, 1))[0] for env_id, _ in plan]
            views = {i: [] for i in range(len(plan))}
            async with client.stream() as stream:
                tags = {await stream.send_reset(s, seed=seed): i for i, (s, (_, seed)) in enumerate(zip(sids, plan))}
                for t in range(7):
                    got = {}
                    while len(got) < len(tags):
                        for tag, r in await stream.recv():
                            got[tags[tag]] = r
                    for i, r in sorted(got.items()):
                        assert r.session_id == sids[i]
                        views[i].append(_view(r))
                    tags = {}
                    for i, (s, (env_id, seed)) in enumerate(zip(sids, plan)):
                        tags[await stream.send_step(s, _answer(env_id, seed, t))] = i
                    if t == kill_at:  # the items just sent are in flight on the dying replica
                        grid_cluster.replicas[replica_of(sids[0])].kill()
                got = {}
                while len(got) < len(tags):
                    for tag, r in await stream.recv():
                        got[tags[tag]] = r
                for i, r in sorted(got.items()):
                    views[i].append(_view(r))
            recovered = client.sessions.recovered
            await client.close_sessions(sids)
            return views, recovered

    reference, _ = asyncio.run(run(None))
    faulted, recovered = asyncio.run(run(3))
    assert recovered >= 1
    assert faulted == reference


def test_a_session_survives_its_replica_restarting_on_the_same_address(redis_server):
    """One replica only: the session waits for it to come back, then is rebuilt there (NOT_FOUND or
    UNAVAILABLE from the restarted replica both mean lost)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(redis_server.url, ["sokoban"], [])
    try:
        cluster.start("solo", port)
        cluster.wait_listed(["solo"])
        with RoutedClient(redis_server.url) as client, RoutedClient(redis_server.url) as ref:
            sid, ref_sid = client.open("sokoban", 1)[0], ref.open("sokoban", 1)[0]
            for c, s in ((client, sid), (ref, ref_sid)):
                assert c.reset([s], [7])[0].status.code == 0
                for t in range(3):
                    assert c.step([(s, _answer("sokoban", 7, t))])[0].status.code == 0
            expected = ref.step([(ref_sid, _answer("sokoban", 7, 3))])[0]
            cluster.replicas["solo"].kill()
            cluster.start("solo", port)
            got = client.step([(sid, _answer("sokoban", 7, 3))])[0]
            assert got.status.code == 0, got.status.message
            assert got.session_id == sid
            assert _view(got) == _view(expected)
            assert client.get_state(sid).anchor == got.anchor
    finally:
        cluster.close()


def test_fixed_addresses_list_what_answers_and_a_replica_back_on_its_address_gets_the_session():
    """No directory: a client given addresses asks each (ListEnvs) for its id, envs and load; one
    that does not answer is left out; a replica restarted on its address (a new id) rebuilds the
    sessions of the one it replaced, stepped from the stream and unary paths alike."""
    from envserve.client import StreamingClient
    from envserve.client.addresses import AddressDirectory
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    first = ServerProcess(["sokoban"], workers=1, metrics=False, extra=["--port", str(port)])
    second = None
    try:
        addresses = [first.address, nobody]
        directory = AddressDirectory(addresses)
        (listed,) = directory.replicas()
        assert (listed.address, listed.envs, listed.live_sessions) == (first.address, ["sokoban"], 0)
        assert listed.capacity > 0 and not listed.draining and nobody in directory.errors
        with RoutedClient(addresses) as client, StreamingClient(addresses) as streamed, \
                RoutedClient([first.address]) as ref:
            sids = [client.open("sokoban", 1)[0], streamed.open("sokoban", 1)[0], ref.open("sokoban", 1)[0]]
            assert directory.replicas()[0].live_sessions == 3
            for c, sid in zip((client, streamed, ref), sids):
                assert c.reset([sid], [7])[0].status.code == 0
                for t in range(3):
                    assert c.step([(sid, _answer("sokoban", 7, t))])[0].status.code == 0
            expected = ref.step([(sids[2], _answer("sokoban", 7, 3))])[0]
            first.kill()
            second = ServerProcess(["sokoban"], workers=1, metrics=False, extra=["--port", str(port)])
            assert directory.replicas()[0].replica_id != listed.replica_id
            for c, sid in zip((client, streamed), sids):
                got = c.step([(sid, _answer("sokoban", 7, 3))])[0]
                assert got.status.code == 0, got.status.message
                assert got.session_id == sid and _view(got) == _view(expected)
                assert c.sessions.current(sid) != sid
        directory.close()
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_recovery_after_a_worker_dies(redis_server):
    cluster = Cluster(redis_server.url, ["sokoban"], ["w-a"], workers=2)
    try:
        with RoutedClient(redis_server.url) as client, RoutedClient(redis_server.url) as ref:
            sids, ref_sids = client.open("sokoban", 6), ref.open("sokoban", 6)
            for c, ss in ((client, sids), (ref, ref_sids)):
                assert all(r.status.code == 0 for r in c.reset(ss, list(range(6))))
                assert all(r.status.code == 0 for r in c.step([(s, _answer("sokoban", i, 0)) for i, s in enumerate(ss)]))
            os.kill(cluster.replicas["w-a"].worker_pids()[0], signal.SIGKILL)
            time.sleep(0.5)  # let the front see the death (its lost sessions answer DATA_LOSS)
            got = client.step([(s, _answer("sokoban", i, 1)) for i, s in enumerate(sids)])
            expected = ref.step([(s, _answer("sokoban", i, 1)) for i, s in enumerate(ref_sids)])
            assert [r.session_id for r in got] == sids
            assert [_view(r) for r in got] == [_view(r) for r in expected]
            assert client.sessions.recovered >= 1
    finally:
        cluster.close()


def test_a_divergent_replay_fails_naming_the_turn(grid_cluster):
    with RoutedClient(grid_cluster.url) as client:
        sid = client.open("sokoban", 1)[0]
        assert client.reset([sid], [11])[0].status.code == 0
        for t in range(4):
            assert client.step([(sid, _answer("sokoban", 11, t))])[0].status.code == 0
        client.sessions.log(sid).anchors[2] = "0123456789abcdef"  # what turn 3 "was"
        grid_cluster.replicas[replica_of(sid)].kill()
        got = client.step([(sid, _answer("sokoban", 11, 4))])[0]
        assert got.status.code == LOST
        assert "diverged at turn 3" in got.status.message
        assert got.session_id == sid


def test_restore_checks_every_anchor_and_rebuilds_the_ground_truth(grid_cluster):
    """The Restore call itself: a history replayed elsewhere ends in the same anchor, its turns
    readable by GetState; a wrong anchor names its turn; an unknown env fails only its item."""
    a, b = grid_cluster.replicas["rec-a"], grid_cluster.replicas["rec-b"]
    with EnvClient(a.address) as ca, EnvClient(b.address) as cb:
        sid = ca.open("frozenlake", 1)[0]
        first = ca.reset([sid], [5])[0]
        steps = [ca.step([(sid, _answer("frozenlake", 5, t))])[0] for t in range(3)]
        history = pb.SessionHistory(env_id="frozenlake", seed=5, trial=first.trial, episode=first.episode,
                                    reset_anchor=first.anchor,
                                    turns=[pb.ReplayTurn(action=_answer("frozenlake", 5, t), anchor=r.anchor)
                                           for t, r in enumerate(steps)])
        bad = pb.SessionHistory()
        bad.CopyFrom(history)
        bad.turns[1].anchor = "ffffffffffffffff"
        reply = cb.restore([history, bad, pb.SessionHistory(env_id="no-such-env", seed=1)])
        ok, diverged, unknown = reply.sessions
        assert ok.status.code == 0 and ok.anchor == steps[-1].anchor
        assert diverged.session_id == "" and diverged.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "diverged at turn 2" in diverged.status.message
        assert unknown.status.code == grpc.StatusCode.NOT_FOUND.value[0]
        for turn in range(4):
            assert cb.get_state(ok.session_id, turn).anchor == ca.get_state(sid, turn).anchor
        nxt = _answer("frozenlake", 5, 3)
        assert _view(cb.step([(ok.session_id, nxt)])[0]) == _view(ca.step([(sid, nxt)])[0])


def test_a_fork_inherits_its_parents_history_and_is_recovered(grid_cluster):
    with RoutedClient(grid_cluster.url) as client, RoutedClient(grid_cluster.url) as ref:
        def prepare(c):
            sid = c.open("sokoban", 1)[0]
            c.reset([sid], [21])
            for t in range(3):
                c.step([(sid, _answer("sokoban", 21, t))])
            return c.fork(sid, 2)
        kids, ref_kids = prepare(client), prepare(ref)
        for c, ks in ((client, kids), (ref, ref_kids)):
            c.step([(ks[0], _answer("sokoban", 21, 3))])
        grid_cluster.replicas[replica_of(kids[0])].kill()
        got = client.step([(k, _answer("sokoban", 21, 4 + i)) for i, k in enumerate(kids)])
        expected = ref.step([(k, _answer("sokoban", 21, 4 + i)) for i, k in enumerate(ref_kids)])
        assert [r.session_id for r in got] == kids
        assert [_view(r) for r in got] == [_view(r) for r in expected]


def test_recovery_goes_on_while_the_directory_is_down(grid_cluster, redis_server):
    """Redis restarts empty: the client serves known sessions from its cache, and a lost one is
    rebuilt on a replica it already knows; replicas re-register on their next heartbeat."""
    with RoutedClient(grid_cluster.url) as client, RoutedClient(grid_cluster.url) as ref:
        sids, ref_sids = client.open("frozenlake", 6), ref.open("frozenlake", 6)
        for c, ss in ((client, sids), (ref, ref_sids)):
            assert all(r.status.code == 0 for r in c.reset(ss, list(range(40, 46))))
        redis_server.stop()
        grid_cluster.replicas[replica_of(sids[0])].kill()
        got = client.step([(s, _answer("frozenlake", 40 + i, 0)) for i, s in enumerate(sids)])
        expected = ref.step([(s, _answer("frozenlake", 40 + i, 0)) for i, s in enumerate(ref_sids)])
        assert [_view(r) for r in got] == [_view(r) for r in expected]
        redis_server.start()
        alive = [rid for rid, p in grid_cluster.replicas.items() if p.proc.poll() is None]
        grid_cluster.wait_listed(alive)


def test_a_drained_replica_loses_no_episode(grid_cluster):
    """SIGTERM (a Kubernetes scale-down): the replica refuses new sessions, finishes in-flight calls
    and stops; its sessions are rebuilt elsewhere on their next call."""
    plan = [(GRID[i % 3], 500 + i) for i in range(12)]
    with RoutedClient(grid_cluster.url) as ref_client:
        reference = _play(ref_client, plan, turns=6)
    state: dict = {}

    def drain(turn, sids):
        if turn == 3 and not state:
            rid = replica_of(sids[0])
            proc = grid_cluster.replicas[rid].proc
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            state["drained"] = rid
    with RoutedClient(grid_cluster.url) as client:
        faulted = _play(client, plan, turns=6, fault=drain)
        assert client.sessions.recovered >= 1
    assert state["drained"] and faulted == reference


TEXT_ENVS = {
    # env -> (config, seed): text families whose sessions are rebuilt by replay through their engines.
    "webshop": ({"include_valid_actions": True}, 3),
    "alfworld": ({"include_valid_actions": True}, 2),
    "scienceworld": ({"include_valid_actions": True}, 1),
}


@pytest.mark.parametrize("env_id", sorted(TEXT_ENVS))
def test_a_text_session_survives_kill_of_its_replica(redis_server, env_id):
    from envserve.core.registry import env_ids
    if env_id not in env_ids():
        pytest.skip(f"{env_id} is not installed")
    config, seed = TEXT_ENVS[env_id]
    cluster = Cluster(redis_server.url, [env_id], ["text-a", "text-b"])
    try:
        with RoutedClient(redis_server.url) as client, RoutedClient(redis_server.url) as ref:
            elsewhere = []  # (client, session) opened on the other replica, kept until both are placed

            def open_on(c, rid):
                # The subject on text-a (killed), the reference on text-b. A misplaced session stays
                # open: closed at once, the loads are even again after the next heartbeat and a slow
                # Open would land on the same replica every time (ties break the same way).
                for _ in range(8):
                    sid = c.open(env_id, 1, config, "no_think")[0]
                    if replica_of(sid) == rid:
                        return sid
                    elsewhere.append((c, sid))
                raise AssertionError(f"no session landed on {rid}")
            sid, ref_sid = open_on(client, "text-a"), open_on(ref, "text-b")
            for c, s in elsewhere:
                c.close_sessions([s])
            views = {}
            for c, s in ((client, sid), (ref, ref_sid)):
                r = c.reset([s], [seed])[0]
                assert r.status.code == 0, r.status.message
                texts = []
                for k in range(4):
                    valid = list(r.info["valid_actions"])
                    texts.append(f"<answer>{valid[(3 * k + 1) % len(valid)]}</answer>")
                    r = c.step([(s, texts[-1])])[0]
                    assert r.status.code == 0, r.status.message
                views[s] = (texts, r)
            texts, before = views[sid]
            cluster.replicas["text-a"].kill()
            valid = list(before.info["valid_actions"])
            nxt = f"<answer>{valid[len(valid) // 2]}</answer>"
            got = client.step([(sid, nxt)])[0]
            expected = ref.step([(ref_sid, nxt)])[0]
            assert got.status.code == 0, got.status.message
            assert replica_of(client.sessions.current(sid)) == "text-b"
            # ScienceWorld lists a room's objects in its JVM's hash order: same lines, maybe reordered.
            assert _view(got)[2:] == _view(expected)[2:]
            assert sorted(got.observation.text.splitlines()) == sorted(expected.observation.text.splitlines())
    finally:
        cluster.close()


def test_a_redis_restart_loses_no_routing(grid_cluster, redis_server):
    """Redis down, then back empty: known sessions keep stepping where they are (no rebuild), and
    the replicas are listed again after their next heartbeat."""
    with RoutedClient(grid_cluster.url, refresh_seconds=0.0) as client:
        sids = client.open("sokoban", 9)
        assert {replica_of(s) for s in sids} == {"rec-a", "rec-b", "rec-c"}
        assert all(r.status.code == 0 for r in client.reset(sids, list(range(9))))
        redis_server.stop()
        down = client.step([(s, _answer("sokoban", 0, 0)) for s in sids])
        assert all(r.status.code in (0, ENDED) for r in down), [r.status for r in down]
        redis_server.start()  # empty until each replica's next heartbeat
        client.replicas(refresh=True)  # as an Open would: the listing the client routes by is (nearly) empty
        for t in range(1, 6):
            results = client.step([(s, _answer("sokoban", 0, t)) for s in sids])
            # (an episode that ended answers FAILED_PRECONDITION; none may be lost or unreachable)
            assert all(r.status.code in (0, ENDED) for r in results), [r.status for r in results]
        assert client.sessions.recovered == 0
        grid_cluster.wait_listed(["rec-a", "rec-b", "rec-c"])
        assert {replica_of(s) for s in client.open("sokoban", 3)} <= {"rec-a", "rec-b", "rec-c"}


def test_a_draining_replica_moves_its_sessions_and_clients_follow(grid_cluster):
    """SIGTERM: the replica rebuilds its live sessions on the others (Restore, from the histories
    its workers keep), records the moves in the directory and stops. Any client can follow the
    record; a routed client does it by itself, without replaying."""
    with RoutedClient(grid_cluster.url) as client, RoutedClient(grid_cluster.url) as ref:
        sids, ref_sids = client.open("frozenlake", 12), ref.open("frozenlake", 12)
        for c, ss in ((client, sids), (ref, ref_sids)):
            assert all(r.status.code == 0 for r in c.reset(ss, list(range(60, 72))))
            for t in range(3):
                c.step([(s, _answer("frozenlake", 60 + i, t)) for i, s in enumerate(ss)])
        victim = replica_of(sids[0])
        on_victim = [s for s in sids if replica_of(s) == victim]
        proc = grid_cluster.replicas[victim].proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        directory = open_directory(grid_cluster.url)
        moved = {s: directory.moved_to(s) for s in on_victim}
        directory.close()
        assert all(moved.values()) and all(replica_of(m) != victim for m in moved.values())
        # A plain client (any language) reads the new id and goes on there.
        new = moved[on_victim[0]]
        home = grid_cluster.replicas[replica_of(new)]
        with EnvClient(home.address) as plain:
            assert plain.get_state(new).anchor == client.get_state(on_victim[0]).anchor
        got = client.step([(s, _answer("frozenlake", 60 + i, 3)) for i, s in enumerate(sids)])
        expected = ref.step([(s, _answer("frozenlake", 60 + i, 3)) for i, s in enumerate(ref_sids)])
        assert [r.session_id for r in got] == sids
        assert [_view(r) for r in got] == [_view(r) for r in expected]
        assert {s: client.sessions.current(s) for s in on_victim} == moved  # followed, not replayed
