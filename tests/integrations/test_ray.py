"""envserve on Ray: the `ray://` directory and a fleet of replicas as Ray actors, on a real
multi-node Ray cluster on one machine (ray.cluster_utils.Cluster: a head without CPUs and three
nodes of two CPUs, each with its own raylet and object store). The replicas are real `envserve
serve` processes with their workers; nodes are removed with the cluster's own remove_node, which
kills every process of the node."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from envserve.client import RoutedClient  # noqa: E402
from envserve.client.experts import plain_answer  # noqa: E402
from envserve.directory import ReplicaInfo, open_directory, replica_of  # noqa: E402
from envserve.directory.base import TaskOutcomes  # noqa: E402
from envserve.ray import Fleet, FleetConfig  # noqa: E402

# Starting a Ray worker and a replica process takes seconds on an idle machine and minutes on a busy
# one: the waits for a restarted replica are long, the module runs first (slow).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
RESTART_WAIT = 300
NODES = 3
HEARTBEAT = ["--heartbeat-seconds", "0.5", "--workers", "1"]
MOVES = {"sokoban": ["Up", "Right", "Down", "Left"], "frozenlake": ["Right", "Down", "Left", "Up"]}


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(NODES):
        c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _answer(env_id: str, seed: int, turn: int) -> str:
    moves = MOVES[env_id]
    return plain_answer("free_think", [moves[(seed + turn) % len(moves)]])


def _view(r) -> tuple:
    return (r.status.code, r.observation.text, round(r.reward, 9), r.done, r.truncated, r.success, r.anchor, r.turn)


def _listed(directory, prefix="ray-grid-") -> list:
    return sorted(r.replica_id for r in directory.replicas() if r.replica_id.startswith(prefix) and not r.draining)


def test_ray_directory_keeps_records_like_the_others_and_is_whole_after_its_actor_restarts(cluster):
    d = open_directory("ray://?name=t-records")
    d.heartbeat(ReplicaInfo("a", "a:1", ["sokoban", "frozenlake"], 10, live_sessions=3), 3.0)
    d.heartbeat(ReplicaInfo("b", "b:1", ["minesweeper"], 10), 60)
    assert sorted(r.replica_id for r in d.replicas()) == ["a", "b"]
    assert [r.replica_id for r in d.replicas("frozenlake")] == ["a"]
    assert d.locate("a/0123").live_sessions == 3
    _wait(lambda: [r.replica_id for r in d.replicas()] == ["b"], 120, "a's record to expire")
    d.record_moves({"b/1": "c/9"}, 60)
    assert d.moved_to("b/1") == "c/9" and d.moved_to("b/2") is None
    d.record_outcomes("run", {"t1": TaskOutcomes(episodes=2, successes=1, return_sum=1.5, last_unix=time.time())},
                      3600, 100)
    assert d.task_stats("run")["t1"].successes == 1
    # Another process of the cluster (a Ray task) sees the same records.
    seen = ray.get(ray.remote(num_cpus=0.1)(lambda: [r.replica_id for r in open_directory(
        "ray://?name=t-records").replicas()]).remote())
    assert seen == ["b"]
    # The actor dies: Ray restarts it empty, and the next heartbeat makes it whole.
    ray.kill(ray.get_actor("t-records", namespace="envserve"), no_restart=False)
    _wait(lambda: _try(lambda: d.replicas() == []), RESTART_WAIT, "the restarted directory")
    d.heartbeat(ReplicaInfo("b", "b:1", ["minesweeper"], 10), 60)
    assert [r.replica_id for r in d.replicas()] == ["b"]


def _try(call):
    try:
        return call()
    except Exception:
        return False


def test_a_fleet_over_three_nodes_serves_episodes_through_ray(cluster):
    fleet = Fleet(FleetConfig(families=["grid"], replicas_per_node=1, serve_args=HEARTBEAT,
                              directory_url="ray://?name=t-spread"))
    try:
        infos = fleet.start()
        assert len(infos) == NODES and len({i["node_id"] for i in infos}) == NODES  # one per node
        url = "ray://?name=t-spread"
        _wait(lambda: len(_listed(open_directory(url))) == NODES, 120, "three listed replicas")
        client = RoutedClient(url)
        sids = client.open("sokoban", 6)
        assert len({replica_of(s) for s in sids}) == NODES   # spread by load over the replicas
        results = client.reset(sids, [5] * 6)
        assert len({r.observation.text for r in results}) == 1     # same seed, same board anywhere
        for t in range(4):
            for r in client.step([(s, _answer("sokoban", 5, t)) for s in sids]):
                assert r.status.code == 0 and r.turn == t + 1
        # A Ray task in the cluster finds the fleet through ray:// with no address.
        def from_a_task():
            c = RoutedClient("ray://?name=t-spread")
            sid = c.open("frozenlake", 1)[0]
            return c.reset([sid], [1])[0].status.code
        assert ray.get(ray.remote(num_cpus=0.1)(from_a_task).remote()) == 0
        client.close()
    finally:
        fleet.shutdown()


def _play(client, plan, turns, during=None) -> dict:
    """plan: [(env_id, seed)]; one session each, stepped together for `turns`; during(turn) runs on
    a thread started before that turn's step (a fault while steps are in flight)."""
    sids = [client.open(env_id, 1)[0] for env_id, _ in plan]
    views = {i: [_view(r)] for i, r in enumerate(client.reset(sids, [seed for _, seed in plan]))}
    threads = []
    for t in range(turns):
        if during is not None:
            th = threading.Thread(target=during, args=(t, sids))
            th.start()
            threads.append(th)
        for i, r in enumerate(client.step([(s, _answer(e, seed, t)) for s, (e, seed) in zip(sids, plan)])):
            assert r.session_id == sids[i]
            views[i].append(_view(r))
    for th in threads:
        th.join()
    client.close_sessions(sids)
    return views, sids


def test_a_node_removed_under_load_loses_no_episode_and_the_fleet_is_back_to_size(cluster):
    c = cluster
    url = "ray://?name=t-node-loss"
    fleet = Fleet(FleetConfig(families=["grid"], replicas_per_node=1, serve_args=HEARTBEAT, directory_url=url))
    try:
        infos = fleet.start()
        directory = open_directory(url)
        _wait(lambda: len(_listed(directory)) == NODES, 120, "three listed replicas")
        client = RoutedClient(url)
        plan = [("sokoban" if i % 2 else "frozenlake", 10 + i) for i in range(12)]
        reference, _ = _play(client, plan, turns=8)
        # The node of the replica holding sessions goes while steps run; its place is taken by a
        # new node, as a cluster's autoscaler or operator would replace it.
        victim = infos[0]
        node = next(w for w in c.worker_nodes if w.node_id == victim["node_id"])

        def remove(turn, sids):
            if turn == 3:
                c.remove_node(node)

        faulted, sids = _play(client, plan, turns=8, during=remove)
        assert faulted == reference
        assert sum(replica_of(s) == victim["replica_id"] for s in sids) >= 2   # it held episodes
        c.add_node(num_cpus=2)
        # Ray restarted the lost replica's actor elsewhere: three replicas again, one new.
        _wait(lambda: len(_listed(directory)) == NODES and victim["replica_id"] not in _listed(directory),
              RESTART_WAIT, "the fleet back to its size")
        now = fleet.replicas()
        assert len(now) == NODES and victim["node_id"] not in {i["node_id"] for i in now}
        assert again_plays(client)
        client.close()
    finally:
        fleet.shutdown()


def again_plays(client) -> bool:
    sids = client.open("sokoban", 3)
    return all(r.status.code == 0 for r in client.reset(sids, [1, 2, 3])) and not client.close_sessions(sids)[0].code


def test_a_dead_replica_process_is_restarted_with_its_actor(cluster):
    url = "ray://?name=t-crash"
    fleet = Fleet(FleetConfig(families=["frozenlake"], replicas=2, serve_args=HEARTBEAT, directory_url=url))
    try:
        before = {i["replica_id"]: i for i in fleet.start()}
        directory = open_directory(url)
        _wait(lambda: len(_listed(directory, "ray-frozenlake-")) == 2, 120, "two listed replicas")
        first = fleet._families["frozenlake"].actors[0]
        ray.get(first.kill_replica.remote())
        after = _wait(lambda: _try(lambda: {i["replica_id"] for i in fleet.replicas(timeout=5)} - set(before)),
                      RESTART_WAIT, "a new replica from the restarted actor")
        assert len(after) == 1
        _wait(lambda: after <= set(_listed(directory, "ray-frozenlake-")), 120, "the new replica listed")
        assert fleet.size("frozenlake") == 2
    finally:
        fleet.shutdown()


def test_a_fleet_grows_from_2_to_4_by_load_and_back_to_2_without_losing_an_episode(cluster):
    url = "ray://?name=t-scale"
    fleet = Fleet(FleetConfig(families=["grid"], replicas=2, min_replicas=2, max_replicas=4, target_load=0.5,
                              scale_down_after_seconds=0, serve_args=[*HEARTBEAT, "--max-sessions", "8"],
                              directory_url=url))
    try:
        fleet.start()
        directory = open_directory(url)
        _wait(lambda: len(_listed(directory)) == 2, 120, "two listed replicas")
        client = RoutedClient(url, refresh_seconds=0.0)
        assert fleet.autoscale_once() == {"grid": 2}       # idle: stays at its minimum
        crowd = client.open("frozenlake", 14)               # 14 of 16 places: asks for 14 / (8 x 0.5) = 4
        _wait(lambda: fleet.load("grid")[0] == 14, 120, "the replicas to count 14 sessions")
        assert fleet.autoscale_once() == {"grid": 4}
        _wait(lambda: len(_listed(directory)) == 4, 120, "four listed replicas")
        # One episode on each replica: one kept from each of the first two, two opened now (they
        # go to the empty new replicas); then the crowd leaves.
        old = {}
        for s in crowd:
            old.setdefault(replica_of(s), s)
        keepers = list(old.values()) + client.open("frozenlake", 2)
        assert len({replica_of(s) for s in keepers}) == 4
        client.close_sessions([s for s in crowd if s not in keepers])
        seeds = [3, 4, 5, 6]
        reference = _reference(client, seeds, turns=6)
        views = {i: [_view(r)] for i, r in enumerate(client.reset(keepers, seeds))}
        for t in range(3):
            for i, r in enumerate(client.step([(s, _answer("frozenlake", seeds[i], t)) for i, s in enumerate(keepers)])):
                views[i].append(_view(r))
        _wait(lambda: fleet.load("grid")[0] == 4, 120, "the replicas to count the 4 kept sessions")
        assert fleet.autoscale_once() == {"grid": 2}       # 4 sessions ask for 1: its minimum, 2
        assert len(_listed(directory)) == 2
        assert any(directory.moved_to(s) for s in keepers)  # the drained replicas' sessions moved
        for t in range(3, 6):
            for i, r in enumerate(client.step([(s, _answer("frozenlake", seeds[i], t)) for i, s in enumerate(keepers)])):
                views[i].append(_view(r))
        assert views == reference
        client.close()
    finally:
        fleet.shutdown()


def _reference(client, seeds, turns) -> dict:
    sids = client.open("frozenlake", len(seeds))
    views = {i: [_view(r)] for i, r in enumerate(client.reset(sids, seeds))}
    for t in range(turns):
        for i, r in enumerate(client.step([(s, _answer("frozenlake", seeds[i], t)) for i, s in enumerate(sids)])):
            views[i].append(_view(r))
    client.close_sessions(sids)
    return views


def test_envserve_ray_up_serves_a_fleet_until_interrupted(cluster):
    c = cluster
    url = "ray://?name=t-cli"
    proc = subprocess.Popen([sys.executable, "-m", "envserve.cli", "ray", "up", "--address", c.address,
                             "--families", "grid", "--replicas-per-node", "1", "--autoscale-seconds", "1",
                             "--directory", url, "--", *HEARTBEAT],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "fleet up" in line:
                break
        assert any("fleet up (grid: 3)" in line for line in lines), "".join(lines)
        assert sum("grid replica ray-grid-" in line for line in lines) == NODES
        client = RoutedClient(url)
        sid = client.open("minesweeper", 1)[0]
        assert client.reset([sid], [2])[0].status.code == 0
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
        directory = open_directory(url)
        _wait(lambda: _listed(directory) == [], 120, "the drained replicas to leave the directory")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_replica_that_cannot_start_fails_the_fleet_start_with_its_reason(cluster):
    fleet = Fleet(FleetConfig(families=["no-such-env"], replicas=1, directory_url="ray://?name=t-bad"))
    try:
        with pytest.raises(ray.exceptions.RayError, match="did not start: exited with 2"):
            fleet.start()
    finally:
        fleet.shutdown()
    with pytest.raises(ValueError, match="target_load"):
        FleetConfig(target_load=0)
