"""The adapters across replicas: TRL's environment_factory, SkyRL's and GEM's register given a
directory URL or several addresses spread sessions over every replica; their steps ride one
Interact stream per replica (or unary Steps, the same results); a forked data-loader worker steps
its own; a replica killed -9 mid-rollout loses no rollout; OpenEnv's client through the facade
reaches every replica. Three real replicas, a real redis-server, each framework's own package
making the environments."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from adapter_support import live_session_ids
from envserve.client import AsyncRoutedClient
from envserve.directory import open_directory, replica_of
from envserve.integrations import close_channels
from envserve.integrations.trl import environment_factory
from serverproc import Cluster, redis_or_skip

IDS = ["rep-a", "rep-b", "rep-c"]
ROUTER_REFRESH = 1.0  # seconds a router keeps a listing (RoutedClient's refresh_seconds)
MOVES = ["Right", "Down", "Left", "Up", "Down", "Right"]
FORKPROC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "forkproc.py")


@pytest.fixture(scope="module")
def cluster():
    with redis_or_skip() as redis:
        c = Cluster(redis.url, ["frozenlake", "sokoban"], IDS)
        try:
            yield c
        finally:
            c.close()
            close_channels()


@pytest.fixture(scope="module")
def lone():
    """One frozenlake replica with one worker, for the lane tests: each opens its own sessions and
    reads only its client's lanes, and a worker it stops (SIGSTOP) it lets run again."""
    from serverproc import ServerProcess
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as server:
        yield server


def addresses(cluster) -> list[str]:
    return [cluster.replicas[rid].address for rid in IDS]


def held(cluster, env_id: str = "") -> dict[str, int]:
    """Sessions of env_id (of every env: "") each replica holds, as the replicas themselves report them."""
    return {rid: len(live_session_ids(cluster.replicas[rid].address, env_id)) for rid in IDS}


def settled(cluster) -> None:
    """Waits until every replica has heartbeated since now and routers' cached listings have
    expired: the listing a router plans with then holds what earlier tests closed. (Sessions
    another client closed since a replica's last heartbeat are counted until its next one; within
    that period no router can know of them.)"""
    since = time.time()
    directory = open_directory(cluster.url)
    deadline = since + 60
    while time.time() < deadline:
        listed = {r.replica_id: r.counted_unix for r in directory.replicas()}
        if set(listed) == set(IDS) and min(listed.values()) > since:
            break
        time.sleep(cluster.heartbeat / 4)
    time.sleep(ROUTER_REFRESH)


def assert_spread(counts: dict[str, int], total: int, before: dict[str, int], load: dict[str, int]) -> None:
    """total new sessions of one env (counts against before), on every replica, and the replicas'
    loads level (least loaded first). The cluster is the module's: sessions an earlier test left to
    the lease (a close past its deadline under a busy machine) are in `load`, every env's sessions
    each replica holds, which is what the router levels."""
    assert sum(counts.values()) - sum(before.values()) == total, (before, counts)
    assert min(counts.values()) >= 1, f"a replica holds no session: {counts}"
    assert max(load.values()) - min(load.values()) <= 2, (before, counts, load)


def play(cls, seed: int, moves=MOVES) -> list[str]:
    env = cls()
    texts = [env.reset(seed=seed)]
    texts += [env.move(m) for m in moves]
    texts.append(env.get_reward())
    return texts


# -- spreading -------------------------------------------------------------------------------------
def test_trl_rollouts_spread_over_every_replica_of_the_directory(cluster):
    settled(cluster)
    before = held(cluster, "frozenlake")
    cls = environment_factory(cluster.url, "frozenlake", include_rules=False)
    envs = [cls() for _ in range(12)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    assert_spread(held(cluster, "frozenlake"), 12, before, held(cluster))
    by_client = collections.Counter(replica_of(e._session.real_id) for e in envs)
    assert set(by_client) == set(IDS)
    cls.close()
    assert sum(held(cluster, "frozenlake").values()) == sum(before.values())


def test_skyrl_and_gem_envs_spread_over_fixed_addresses(cluster):
    skyrl_gym = pytest.importorskip("skyrl_gym")
    gem = pytest.importorskip("gem")
    from envserve.integrations import gem as gem_adapter
    from envserve.integrations import skyrl as skyrl_adapter

    settled(cluster)
    before = held(cluster, "frozenlake")
    (sky,) = skyrl_adapter.register(addresses(cluster), ["frozenlake"], prefix="spread-")
    envs = [skyrl_gym.make(sky, env_config={}, extras={"seed": i}) for i in range(9)]
    for env in envs:
        env.init([])
    assert_spread(held(cluster, "frozenlake"), 9, before, held(cluster))
    for env in envs:
        env.close()

    settled(cluster)
    before = held(cluster, "sokoban")
    (name,) = gem_adapter.register(",".join(addresses(cluster)), ["sokoban"], prefix="spread:")
    envs = [gem.make(name) for _ in range(9)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    assert_spread(held(cluster, "sokoban"), 9, before, held(cluster))
    for env in envs:
        env.close()
    assert sum(held(cluster, "sokoban").values()) == sum(before.values())


# -- the stream and the unary path -----------------------------------------------------------------
def test_stream_and_unary_paths_give_the_same_rollouts_from_many_threads(cluster):
    streamed = environment_factory(cluster.url, "frozenlake", include_rules=False)
    unary = environment_factory(cluster.url, "frozenlake", include_rules=False, stream=False)
    out: dict[tuple[str, int], list[str]] = {}

    def run(kind, cls, seed):
        out[(kind, seed)] = play(cls, seed)
    threads = [threading.Thread(target=run, args=(kind, cls, seed))
               for seed in range(16) for kind, cls in (("stream", streamed), ("unary", unary))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == 32
    for seed in range(16):
        assert out[("stream", seed)] == out[("unary", seed)]
    # The rollouts differ by seed (a test that compared empty texts would pass anyway).
    assert len({tuple(out[("stream", s)][:1]) for s in range(16)}) > 1
    streamed.close()
    unary.close()


def test_a_call_cancelled_mid_way_leaves_the_stream_usable(cluster):
    async def main():
        async with AsyncRoutedClient(cluster.url, stream_steps=True) as client:
            sids = await client.open("frozenlake", 3, {"max_turns": 1000})
            await client.reset(sids, [1, 2, 3])
            turns = {sid: 0 for sid in sids}
            for k in range(40):
                victim, other = sids[k % 3], sids[(k + 1) % 3]
                task = asyncio.ensure_future(client.step([(victim, "<answer>Left</answer>")]))
                for _ in range(k % 4):                       # cancelled at another point each round
                    await asyncio.sleep(0)
                task.cancel()
                # The cancelled item may or may not have been stepped; the next one is answered,
                # in order, and so is another session's on the same stream.
                r = (await client.step([(victim, "<answer>Left</answer>")]))[0]
                assert r.status.code == 0 and r.turn in (turns[victim] + 1, turns[victim] + 2), (k, r)
                turns[victim] = r.turn
                r = (await client.step([(other, "<answer>Left</answer>")]))[0]
                assert r.status.code == 0 and r.turn == turns[other] + 1
                turns[other] = r.turn
            assert 1 <= len(client._streams) <= 3  # one stream per replica, reused after every cancel
            await client.close_sessions(sids)
    asyncio.run(main())


def test_an_env_collected_on_the_loop_thread_is_closed_without_stalling_the_loop(cluster):
    """A collection may run on the client's event loop thread, inside a callback, and finalize an
    env there. Its close must not wait for the loop (which would stall every call of the process
    for the close's timeout, once per env collected): it runs as a task of the loop. A blocking
    call made on that thread is refused, not left waiting for itself."""
    import gc

    from envserve.client import EnvServeError, StreamingClient, streaming
    cls = environment_factory(cluster.url, "frozenlake", include_rules=False)
    kept = cls()
    kept.reset(seed=2)
    gc.disable()  # the cycle below is collected on the loop's thread, not by chance on this one
    try:
        env = cls()
        env.reset(seed=1)
        sid = env._session.real_id
        address = cluster.replicas[replica_of(sid)].address
        env.cycle = env
        del env

        async def collect():
            gc.collect()
        asyncio.run_coroutine_threadsafe(collect(), streaming.process_loop()).result(120)
    finally:
        gc.enable()
    deadline = time.monotonic() + 60
    while sid in live_session_ids(address, "frozenlake") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sid not in live_session_ids(address, "frozenlake")
    assert not kept.move("Down").startswith("Error")

    with StreamingClient(cluster.url) as c:
        assert c.list_envs()

        async def blocking_call():
            with pytest.raises(EnvServeError) as e:
                c.list_envs()
            return e.value
        err = asyncio.run_coroutine_threadsafe(blocking_call(), streaming.process_loop()).result(60)
        assert err.code.name == "FAILED_PRECONDITION" and "event loop thread" in err.message
    cls.close()


# -- fork ------------------------------------------------------------------------------------------
def fork_scenario(cluster, scenario: str, lane_kind: str = "") -> dict:
    """Runs one of forkproc's scenarios in a fresh interpreter against the cluster (with the sync
    lanes of lane_kind, where given)."""
    env = {**os.environ, "ENVSERVE_SYNC_LANE": lane_kind} if lane_kind else None
    proc = subprocess.run([sys.executable, FORKPROC, scenario, cluster.url, *addresses(cluster)],
                          capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_forked_data_loader_worker_steps_its_own_sessions(cluster):
    out = fork_scenario(cluster, "worker")
    assert out["status"] == "ok", out
    assert out["mine"] == out["expected"]
    assert "Reward" in out["inherited"]
    assert out["after"] == out["expected"]    # the parent's client is untouched by the child's


@pytest.mark.parametrize("lane_kind", ["polled", "blocking"])
def test_before_a_fork_no_thread_is_left_inside_grpc(cluster, lane_kind):
    """What the fork hook leaves the child: no event loop thread and no gRPC poller thread (a fork
    taken while one runs inside gRPC's core aborted the child on a starved machine), no lane's call
    open; a session whose env the hook's collection finalized is closed once the fork is done."""
    out = fork_scenario(cluster, "hook", lane_kind)
    assert out["pollers_before"] >= 1, "the scenario needs a live aio channel before the hook runs"
    assert out["lanes_before"] >= 1, "the scenario needs an open lane"
    # a blocking-stream lane runs gRPC threads; a polled one none (its caller polls)
    assert (out["lane_threads_before"] >= 1) == (lane_kind == "blocking"), out
    assert out["pollers_at_fork"] == 0 and out["loop_threads_at_fork"] == 0, json.dumps(out)
    assert out["lanes_at_fork"] == 0 and out["lane_threads_at_fork"] == 0, json.dumps(out)
    assert out["leftover_closed"] and out["same_after"], json.dumps(out)


def test_a_child_forked_beside_another_asyncio_channel_fails_its_calls_at_once(cluster):
    """An asyncio gRPC channel of the process's own is open across the fork: the child inherits a
    poller no thread runs, so its calls fail with FAILED_PRECONDITION and say why, instead of
    waiting forever; the parent goes on."""
    out = fork_scenario(cluster, "foreign")
    assert out["status"] == "FAILED_PRECONDITION", out
    assert "forked while gRPC's asyncio poller ran" in out["message"]
    assert out["after"] == out["expected"]
    # The parent's warning names the cause once: the client's own loop stopped in time.
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "other than envserve's clients'" in out["warnings"][0]


# -- a replica killed -9 ---------------------------------------------------------------------------
def test_a_killed_replicas_rollouts_are_rebuilt_and_the_others_go_on(redis_server):
    c = Cluster(redis_server.url, ["sokoban"], ["kill-a", "kill-b", "kill-c"])
    try:
        cls = environment_factory(c.url, "sokoban", include_rules=False)
        ended = environment_factory(c.url, "sokoban", include_rules=False, recovery=False)
        expected = {seed: play(cls, seed) for seed in range(9)}    # the same rollouts, no fault
        envs = {seed: cls() for seed in range(9)}
        plain = {seed: ended() for seed in range(9)}
        texts = {seed: [env.reset(seed=seed)] for seed, env in envs.items()}
        for seed, env in plain.items():
            env.reset(seed=seed)
        for seed, env in envs.items():
            texts[seed] += [env.move(m) for m in MOVES[:3]]
        # Sokoban's episodes outlast these moves, so every rollout is still going at the kill.
        assert not any(env._done for env in envs.values())
        victim = replica_of(envs[0]._session.real_id)
        on_victim = [s for s, e in envs.items() if replica_of(e._session.real_id) == victim]
        plain_on_victim = {s for s, e in plain.items() if replica_of(e._session.real_id) == victim}
        assert plain_on_victim
        c.replicas[victim].kill()
        for seed, env in envs.items():
            texts[seed] += [env.move(m) for m in MOVES[3:]]
            texts[seed].append(env.get_reward())
        assert texts == expected                       # every rollout, rebuilt or not, as without the fault
        assert on_victim and all(replica_of(envs[s]._session.real_id) != victim for s in on_victim)
        # Without recovery, the victim's rollouts end with text; the others go on.
        for seed, env in plain.items():
            out = env.move("Down")
            if seed in plain_on_victim:
                # UNAVAILABLE while the directory still lists the victim, DATA_LOSS once it does not
                assert out.startswith(("Error: the environment failed (DATA_LOSS",
                                       "Error: the environment failed (UNAVAILABLE")), out
            else:
                assert not out.startswith("Error"), out
        cls.close()
        ended.close()
    finally:
        c.close()


def test_openenvs_client_through_the_facade_spreads_sockets_over_every_replica(cluster):
    pytest.importorskip("openenv")
    from openenv import GenericEnvClient

    from webproc import WebProcess

    async def main(url: str) -> tuple[dict, list]:
        clients = [GenericEnvClient(base_url=f"{url}/openenv/frozenlake") for _ in range(9)]
        for c in clients:
            await c.__aenter__()
        try:
            for seed, c in enumerate(clients):
                await c.reset(seed=seed)
            counts = held(cluster, "frozenlake"), held(cluster)
            rewards = [(await c.step({"message": "<answer>Left</answer>"})).reward for c in clients]
            return counts, rewards
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)

    settled(cluster)
    before = held(cluster, "frozenlake")
    with WebProcess.facade(directory=cluster.url) as web:
        counts, rewards = asyncio.run(main(web.url))
    assert_spread(counts[0], 9, before, counts[1])
    assert len(rewards) == 9


@pytest.mark.parametrize("lane_kind", ["polled", "blocking"])
def test_a_step_past_its_deadline_fails_alone_and_the_stream_goes_on(lone, monkeypatch, lane_kind):
    """A worker stopped (SIGSTOP) mid-episode: the sync step waits its deadline, fails
    DEADLINE_EXCEEDED, and once the worker runs again the next steps are answered: on a new lane
    where the thread stepped alone (the timed-out lane is closed), on the
    same shared stream where the lane was taken."""
    import os
    import signal

    from envserve.client import EnvServeError, RecoverySettings, StreamingClient, sync_lane
    monkeypatch.setattr(sync_lane, "KIND", lane_kind)

    def stalled(c, sid, worker):
        os.kill(worker, signal.SIGSTOP)
        try:
            with pytest.raises(EnvServeError) as e:
                c.step([(sid, "<answer>Left</answer>")])
            assert e.value.code.name == "DEADLINE_EXCEEDED"
        finally:
            os.kill(worker, signal.SIGCONT)

    with StreamingClient(lone.address, timeout=1.0, recovery=RecoverySettings(timeout_seconds=1.0)) as c:
        sid = c.open("frozenlake", 1, {"max_turns": 1000})[0]
        assert c.reset([sid], [0])[0].status.code == 0
        assert c.step([(sid, "<answer>Left</answer>")])[0].turn == 1
        (worker,) = lone.worker_pids()
        lanes = dict(c._lanes)
        assert len(lanes) == 1, "a lone thread steps on its replica's lane"
        stalled(c, sid, worker)
        # The late step was skipped when the worker woke, its caller gone (turn 2 next), or
        # stepped if the worker took it before the replica heard of the deadline (turn 3).
        r = c.step([(sid, "<answer>Left</answer>")])[0]
        assert r.status.code == 0 and r.turn in (2, 3), r
        assert len(c._lanes) == 1 and c._lanes != lanes
        (old,) = lanes.values()
        assert old.closed and old.timed_out
        assert getattr(old, "_due", set()) == set(), "the timed-out call's completions are all taken"

        (lane,) = c._lanes.values()
        with lane.busy:  # another thread holds the lane: steps go over the loop's shared stream
            turn = c.step([(sid, "<answer>Left</answer>")])[0].turn
            assert turn == r.turn + 1
            streams = dict(c.routed._streams)
            assert len(streams) == 1
            stalled(c, sid, worker)
            # The shared stream stays open, so the late step is not cancelled: it ran.
            r = c.step([(sid, "<answer>Left</answer>")])[0]
            assert r.status.code == 0 and r.turn == turn + 2, r
            assert c.routed._streams == streams


def one_step_on_a_lane(c) -> tuple:
    """A session opened, reset and stepped once by a thread alone: that step made its replica's
    lane. Returns the session and the lane."""
    sid = c.open("frozenlake", 1, {"max_turns": 1000})[0]
    c.reset([sid], [0])
    assert c.step([(sid, "<answer>Left</answer>")])[0].turn == 1
    (lane,) = c._lanes.values()
    return sid, lane


@pytest.mark.parametrize("lane_kind", ["polled", "blocking"])
def test_a_lane_never_answers_a_step_with_an_earlier_ones_result(lone, monkeypatch, lane_kind):
    """An answer left on a lane (its caller interrupted while waiting, as by Ctrl-C) is not the next
    caller's: each step reads the answer to its own item."""
    from envserve.client import StreamingClient, sync_lane
    from envserve.v1 import envserve_pb2 as pb
    monkeypatch.setattr(sync_lane, "KIND", lane_kind)
    with StreamingClient(lone.address) as c:
        sid, lane = one_step_on_a_lane(c)
        kind = sync_lane.PolledLane if lane_kind == "polled" else sync_lane.BlockingStreamLane
        assert type(lane) is kind, "this grpcio gives the caller-polled lane"
        # A step whose answer no one reads, as an interrupted caller leaves it.
        lane._send(pb.InteractRequest(items=[pb.InteractItem(
            tag=10**9, step=pb.StepItem(session_id=sid, action="<answer>Left</answer>"))]))
        r = c.step([(sid, "<answer>Left</answer>")])[0]
        assert r.status.code == 0 and r.turn == 3, r
        assert c._lanes == {next(iter(c._lanes)): lane}, "the same lane goes on"


def test_a_lane_to_a_replica_gone_for_good_is_closed(redis_server):
    """A replica scaled away leaves its lane unused: once the routed client retires the replica's
    channel, the lane is closed too (else its gRPC thread would wait for good)."""
    from envserve.client import StreamingClient
    c = Cluster(redis_server.url, ["frozenlake"], ["gone-a", "gone-b"])
    try:
        with StreamingClient(c.url, recovery=False) as client:
            client.routed.retire_after_seconds = 1.0
            sids = client.open("frozenlake", 2, {"max_turns": 1000})
            client.reset(sids, [1, 2])
            assert {replica_of(s) for s in sids} == {"gone-a", "gone-b"}
            for sid in sids:
                assert client.step([(sid, "<answer>Left</answer>")])[0].status.code == 0
            lanes = dict(client._lanes)
            assert {k[0] for k in lanes} == {"gone-a", "gone-b"}
            (gone,) = [lane for k, lane in lanes.items() if k[0] == "gone-a"]
            (kept,) = [s for s in sids if replica_of(s) == "gone-b"]
            c.replicas["gone-a"].kill()
            deadline = time.monotonic() + 60
            while not gone.closed and time.monotonic() < deadline:
                client.close_sessions(client.open("frozenlake", 1))  # a listing: retires what is gone
                assert client.step([(kept, "<answer>Left</answer>")])[0].status.code == 0
                time.sleep(0.2)
            assert gone.closed
            assert {k[0] for k in client._lanes} == {"gone-b"}
    finally:
        c.close()


@pytest.mark.parametrize("lane_kind", ["polled", "blocking"])
def test_a_caller_interrupted_on_its_lane_leaves_it_usable(lone, monkeypatch, lane_kind):
    """A signal handler's exception (Ctrl-C's KeyboardInterrupt) ends a step waiting on its lane:
    that lane is closed, the step still runs on the replica, and the next call reads its own answer
    on a new lane."""
    import signal

    from envserve.client import StreamingClient, sync_lane
    monkeypatch.setattr(sync_lane, "KIND", lane_kind)

    class Interrupted(Exception):
        pass

    waiting_on: list = []  # the lane whose caller the alarm interrupts

    def waiting(lane) -> bool:
        """The caller is inside its exchange with its step sent (a machine may be too starved for
        the caller to get there by the first alarm: a later one interrupts it then)."""
        if lane.deadline is None:
            return False
        if isinstance(lane, sync_lane.PolledLane):
            return "recv" in lane._due
        return lane._requests.empty()  # gRPC's consumer thread has taken the step

    def interrupt(signum, frame):
        if waiting_on and waiting(waiting_on[0]):
            raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with StreamingClient(lone.address) as c:
            sid, lane = one_step_on_a_lane(c)
            (worker,) = lone.worker_pids()
            os.kill(worker, signal.SIGSTOP)  # the answer cannot come while the caller waits
            waiting_on.append(lane)
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.5, 0.1)
                with pytest.raises(Interrupted):
                    c.step([(sid, "<answer>Left</answer>")])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                os.kill(worker, signal.SIGCONT)
            r = c.step([(sid, "<answer>Left</answer>")])[0]
            # The interrupted step ran (this one is turn 3) unless the replica heard its caller
            # was gone before the worker, stopped meanwhile, began it: then it was skipped and
            # this one is turn 2.
            assert r.status.code == 0 and r.turn in (2, 3), r
            assert lane.closed and lane not in sync_lane._OPEN
            (new,) = c._lanes.values()
            assert new is not lane and not new.closed
            assert c.step([(sid, "<answer>Left</answer>")])[0].turn == r.turn + 1
            assert list(c._lanes.values()) == [new]
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_grpcio_without_the_polled_call_gets_blocking_stream_lanes(lone, monkeypatch, caplog):
    """Where the installed grpcio lacks the single-threaded call the polled lane is built on, lanes
    are gRPC's blocking streams, with a warning, and steps go on as before."""
    from envserve.client import StreamingClient, sync_lane

    def missing(self, stub, metadata=()):
        raise AttributeError("'_StreamStreamMultiCallable' object has no attribute '_registered_call_handle'")

    monkeypatch.setattr(sync_lane.PolledLane, "__init__", missing)
    with StreamingClient(lone.address) as c:
        sid, lane = one_step_on_a_lane(c)
        assert [c.step([(sid, "<answer>Left</answer>")])[0].turn for _ in range(2)] == [2, 3]
        assert type(lane) is sync_lane.BlockingStreamLane
    assert "blocking-stream lane instead of a polled one" in caplog.text


@pytest.mark.parametrize("lane_kind", ["polled", "blocking"])
def test_a_streaming_client_dropped_without_close_closes_its_lanes(lone, monkeypatch, lane_kind):
    """A client no one closed (an adapter's env collected with its trainer) ends its lanes when it
    is collected: each holds a call inside gRPC (and a blocking stream, gRPC threads) that a later
    fork would otherwise carry."""
    import gc

    from envserve.client import StreamingClient, sync_lane
    monkeypatch.setattr(sync_lane, "KIND", lane_kind)
    c = StreamingClient(lone.address)
    _, lane = one_step_on_a_lane(c)
    threads = list(lane.threads)
    assert not lane.closed and lane in sync_lane._OPEN
    if lane_kind == "blocking":
        assert any(t.is_alive() for t in threads), "a blocking stream runs gRPC threads while it is open"
    else:
        assert threads == [] and lane._due, "a polled lane: its caller polls, its batches are out"
    del c
    gc.collect()
    assert lane.closed and lane not in sync_lane._OPEN
    assert getattr(lane, "_due", set()) == set(), "every completion of the cancelled call is taken"
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def test_steps_handed_over_from_many_threads_each_reach_their_own_caller(lone):
    """Overlapping sync steps are handed to the loop in a queue and answered straight to each
    waiting thread: every thread gets its own session's next turn, the steps share messages of the
    replica's stream, and nothing is left queued."""
    from envserve.client import StreamingClient
    threads, rounds = 16, 30
    with StreamingClient(lone.address) as c:
        sids = c.open("frozenlake", threads, {"max_turns": 1000})
        c.reset(sids, list(range(threads)))
        c.step([(sids[0], "<answer>Left</answer>")])      # the stream is up (a lone step takes a lane)
        c.step([(sids[0], "<answer>Left</answer>"), (sids[1], "<answer>Left</answer>")])
        start = {sid: (2 if k == 0 else 1 if k == 1 else 0) for k, sid in enumerate(sids)}
        handed = []
        drain = c._drain

        def counted_drain():
            handed.append(len(c._queue))
            drain()
        c._drain = counted_drain
        barrier = threading.Barrier(threads)
        got: dict[str, list[tuple[str, int]]] = {}
        (lane,) = c._lanes.values()

        def rollout(sid):
            barrier.wait()
            got[sid] = [(r.session_id, r.turn) for _ in range(rounds)
                        for r in c.step([(sid, "<answer>Left</answer>")])]
        with lane.busy:  # the lane taken: every step goes the loop's way
            ts = [threading.Thread(target=rollout, args=(sid,)) for sid in sids]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
        stream = next(iter(c.routed._streams.values()))
        for sid in sids:
            real = c.sessions.current(sid)
            assert got[sid] == [(real, start[sid] + k + 1) for k in range(rounds)], sid
        assert sum(handed) == threads * rounds, "every step went through the queue"
        assert len(handed) < threads * rounds, "a drain took several steps at once"
        assert stream.messages_sent < threads * rounds
        assert c._queue == [] and not c._drain_due and c._due == {}


def test_a_stuck_worker_holds_no_handed_over_step_of_its_replica_for_long():
    """A step handed over while its replica owes answers waits for one of them to carry it to the
    stream, but not for ever: with one of the replica's two workers stopped (its answers owed
    until it runs again), the other worker's sessions still get every step answered."""
    import signal
    from envserve.client import StreamingClient
    from serverproc import ServerProcess
    move = "<answer>Left</answer>"
    with ServerProcess(["frozenlake"], workers=2, metrics=False) as server:
        with StreamingClient(server.address) as c:
            sids = c.open("frozenlake", 1, {"max_turns": 1000}) + c.open("frozenlake", 1, {"max_turns": 1000})
            c.reset(sids, [0, 1])  # the least-loaded rule puts them on different workers
            c.step([(sids[0], move)])  # the stream is up (a lone step takes a lane)
            c.step([(sids[0], move), (sids[1], move)])
            (lane,) = c._lanes.values()
            got: dict[str, list] = collections.defaultdict(list)

            def step(sid):
                got[sid] += [r.turn for r in c.step([(sid, move)])]
            stopped = server.worker_pids()[0]
            os.kill(stopped, signal.SIGSTOP)
            try:
                with lane.busy:  # every step goes the loop's way
                    first = {sid: threading.Thread(target=step, args=(sid,)) for sid in sids}
                    for t in first.values():
                        t.start()
                    live = None
                    deadline = time.monotonic() + 60
                    while live is None and time.monotonic() < deadline:
                        live = next((sid for sid, t in first.items() if not t.is_alive()), None)
                        time.sleep(0.01)
                    assert live is not None, "neither session's step came back with one worker stopped"
                    (stuck,) = [sid for sid in sids if sid != live]
                    assert first[stuck].is_alive() and c._due, "the stopped worker owes its answer"
                    for _ in range(5):  # each of these waits with the stuck step's answer owed
                        t = threading.Thread(target=step, args=(live,))
                        t.start()
                        t.join(60)
                        assert not t.is_alive(), "a step of the live worker waited for the stopped one"
                    assert first[stuck].is_alive()
            finally:
                os.kill(stopped, signal.SIGCONT)
            first[stuck].join(60)
            before = {sids[0]: 2, sids[1]: 1}  # the steps each session took before
            assert got[live] == [before[live] + k for k in range(1, 7)] and got[stuck] == [before[stuck] + 1]
            assert c._queue == [] and c._due == {}
