"""The images and docker-compose.yml, for real: build the base image and the family images with the
deploy scripts, bring the stack up under a unique project name, play a whole episode in every grid
env through the containers (on each published port, through the Redis directory with the routing
client, and through the HTTP facade), have the judge score a session it finds through the directory,
run the trainer service for one training iteration against the grid replica, then take the stack down and
check with the Docker Engine API (the docker SDK; podman's compatible service here) that none of its
containers, networks or volumes is left.

Readiness is polled here through the gRPC health service on the published ports: compose
healthchecks never fire under podman without systemd. See stack.py for the engine and base choice.
"""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stack import GRID_ENVS, ROOT, leftovers, new_stack

# The timeout only ends a hung run (a stuck mirror, a wedged engine); a fresh machine needs ~3 min.
pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]

READY_WITHIN = 180  # seconds for every service to answer after `compose up`
# Services besides the grid replicas: redis, web, judge.
OTHER_SERVICES = 3


@pytest.fixture(scope="module")
def stack(engine, built):
    _, files, timings = built
    s = new_stack(engine, files)
    s.timings.update(timings)
    try:
        s.up()
        start = time.monotonic()
        wait_ready(s)
        s.timings["ready_s"] = time.monotonic() - start
        yield s
    finally:
        s.down()
        print("container test timings:", json.dumps({k: round(v, 1) for k, v in s.timings.items()}))


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_json(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def wait_ready(stack) -> None:
    """Every replica SERVING on its published port and listed in the directory, the facade and the
    judge up."""
    from envserve.directory import open_directory
    deadline = time.monotonic() + READY_WITHIN
    waiting = ["start"]
    while waiting and time.monotonic() < deadline:
        waiting = [name for name in [*GRID_ENVS, "judge"] if not serving(f"127.0.0.1:{stack.ports[name]}")]
        if not waiting:
            try:
                with open_directory(f"redis://127.0.0.1:{stack.ports['redis']}/0") as d:
                    listed = {e for r in d.replicas() for e in r.envs}
                waiting = [f"directory:{env}" for env in GRID_ENVS if env not in listed]
            except Exception as e:  # noqa: BLE001 - Redis not accepting yet
                waiting = [f"directory ({e})"]
        if not waiting:
            try:
                http_json(f"http://127.0.0.1:{stack.ports['web']}/healthz")
            except OSError:
                waiting = ["web"]
        if waiting:
            time.sleep(0.5)
    if waiting:
        raise AssertionError(f"not ready after {READY_WITHIN} s: {waiting}\n{stack.logs()}")


def play_episode(client, env_id: str, seed: int) -> dict:
    # The demo's scripted agent: it plans from the ground truth (StateService) and answers in text.
    from envserve.demo import play
    return play(client, env_id, seed)


def test_episode_in_each_grid_container_on_its_published_port(stack):
    from envserve.client import EnvClient
    for env_id in GRID_ENVS:
        with EnvClient(f"127.0.0.1:{stack.ports[env_id]}") as client:
            assert [s.env_id for s in client.list_envs()] == [env_id]
            result = play_episode(client, env_id, seed=5)
        assert result["success"], result
        assert result["png_bytes"] > 0, result


def test_routed_client_through_the_redis_directory(stack):
    from envserve.client.routing import RoutedClient
    from envserve.directory import replica_of
    rc = RoutedClient(f"redis://127.0.0.1:{stack.ports['redis']}/0", use_external=True)
    try:
        replicas = {r.envs[0]: r for r in rc.replicas(refresh=True)}
        assert sorted(replicas) == sorted(GRID_ENVS)
        for env_id, r in replicas.items():
            assert r.address == f"{env_id}:50051"                       # in-network: the service name
            assert r.external_address == f"127.0.0.1:{stack.ports[env_id]}"  # from the host
        for env_id in GRID_ENVS:
            sid = rc.open(env_id, 1)[0]
            assert replica_of(sid) == replicas[env_id].replica_id
            rc.close_sessions([sid])
            result = play_episode(rc, env_id, seed=9)
            assert result["success"], result
    finally:
        rc.close()


def test_http_facade_serves_every_replica_in_the_directory(stack):
    base = f"http://127.0.0.1:{stack.ports['web']}"
    listed = http_json(f"{base}/v1/envs")
    assert sorted(e["envId"] for e in listed["envs"]) == sorted(GRID_ENVS)
    assert len(listed["replicas"]) == len(GRID_ENVS)
    opened = http_json(f"{base}/v1/sessions", {"env_id": "frozenlake", "count": 1})
    sid = opened["sessionIds"][0]
    first = http_json(f"{base}/v1/reset", {"items": [{"session_id": sid, "seed": 3}]})["results"][0]
    assert first["status"].get("code", 0) == 0, first
    step = http_json(f"{base}/v1/step", {"items": [{"session_id": sid, "action": "<answer>Down</answer>"}]})
    assert step["results"][0]["status"].get("code", 0) == 0, step
    closed = http_json(f"{base}/v1/close", {"session_ids": [sid]})
    assert all(s.get("code", 0) == 0 for s in closed["statuses"]), closed


def test_judge_scores_a_session_through_the_directory(stack):
    """The judge in the stack finds the session's replica in Redis and reads its ground truth there."""
    from envserve.client import EnvClient, JudgeClient, JudgeTask
    with EnvClient(f"127.0.0.1:{stack.ports['sokoban']}") as client:
        sid = client.open("sokoban", 1)[0]
        try:
            # Seed 3: player (4,1), box (3,1), target (2,1): box and target straight above the player.
            client.reset([sid], seeds=[3])
            with JudgeClient(f"127.0.0.1:{stack.ports['judge']}") as judge:
                (result,) = judge.judge([JudgeTask(
                    "k", sid, 0, "grounding",
                    "The box is above me in the same column, and the target is above me too, in my column.")])
        finally:
            client.close_sessions([sid])
    assert result.status.code == 0, result.status.message
    assert result.score == 1.0 and result.judge == "rule", result


def trainer_service() -> dict:
    with open(ROOT / "docker-compose.yml") as f:
        return yaml.safe_load(f)["services"]["trainer"]


def test_trainer_image_runs_the_cli_as_the_envserve_user(engine, trainer_built):
    helped = engine.run(["run", "--rm", trainer_built, "train", "--help"]).stdout
    for flag in ("--config", "--directory", "--output-dir", "--iterations", "--resume", "--device"):
        assert flag in helped, flag
    # uid 10001 owns the output folder, so a fresh named volume mounted there is writable for it.
    ids = engine.run(["run", "--rm", "--entrypoint", "sh", trainer_built, "-c", "id -u; stat -c %u /ckpt"]).stdout
    assert ids.split() == ["10001", "10001"]


def test_trainer_service_trains_one_iteration_through_the_directory(stack, trainer_built):
    """The compose trainer, its own command plus --iterations 1: it finds the frozenlake replica through
    Redis (the in-network address the replica advertises), trains, and leaves metrics, curves and a
    checkpoint in its named volume, which a second container reads back."""
    service = trainer_service()
    assert service["profiles"] == ["train"]  # `docker compose up` alone does not start a training run
    run = ["--profile", "train", "run", "--rm", "--no-deps", "-T"]
    stack.compose(*run, "trainer", *service["command"], "--iterations", "1", timeout=900)
    read = ("import json, os; print(json.dumps({'files': sorted(os.listdir('/ckpt')), "
            "'metrics': [json.loads(l) for l in open('/ckpt/metrics.jsonl')], "
            "'png': open('/ckpt/curves.png', 'rb').read(8).hex()}))")
    out = stack.compose(*run, "--entrypoint", "python3", "trainer", "-c", read).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert [m["iteration"] for m in found["metrics"]] == [1]
    assert "checkpoint-1" in found["files"]
    assert bytes.fromhex(found["png"]) == b"\x89PNG\r\n\x1a\n"


def test_image_healthchecks_pass(stack):
    """The HEALTHCHECK each image declares (envserve health over gRPC; /healthz; redis-cli ping)."""
    names = stack.containers()
    assert len(names) == len(GRID_ENVS) + OTHER_SERVICES, names
    deadline = time.monotonic() + 60  # docker runs checks on its own interval (10 s)
    unhealthy = names
    while unhealthy and time.monotonic() < deadline:
        unhealthy = [n for n in unhealthy if not stack.healthy(n)]
        if unhealthy:
            time.sleep(1)
    assert not unhealthy


@pytest.mark.last_in_module
def test_down_leaves_no_container_or_network(stack, engine_api):
    label = f"com.docker.compose.project={stack.project}"
    before = leftovers(engine_api, label, f"{stack.project}_")
    # The API must see the running stack, or an empty answer below would prove nothing.
    assert len(before["containers"]) == len(GRID_ENVS) + OTHER_SERVICES, before
    assert before["networks"], before
    stack.down()
    assert leftovers(engine_api, label, f"{stack.project}_") == {"containers": [], "networks": []}
    # The trainer's named volume (checkpoints) goes with `down -v` too.
    volumes = {v.name for v in engine_api.volumes.list()}
    assert f"{stack.project}_trainer-output" not in volumes
