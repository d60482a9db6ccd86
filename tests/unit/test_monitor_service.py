"""MonitorService.ListSessions on a real replica process: what each live session shows."""
import io
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from envserve.client import EnvClient, check
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc
from serverproc import ServerProcess

MOVE = "<think>go</think><answer>{}</answer>"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["sokoban", "frozenlake"], workers=2) as s:
        yield s


@pytest.fixture
def env(server):
    with EnvClient(server.address) as c:
        yield c


@pytest.fixture
def monitor(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.MonitorServiceStub(ch)


def by_id(resp):
    return {s.session_id: s for s in resp.sessions}


def test_latest_turn_of_each_session(env, monitor):
    ids = env.open("sokoban", 2, {"render_image": True, "image_size": 96})
    fresh = env.open("frozenlake", 1)
    env.reset(ids, seeds=[5, 6])
    r1 = check(env.step([(ids[0], MOVE.format("Left"))])[0])
    r2 = check(env.step([(ids[0], MOVE.format("Up, Right"))])[0])

    resp = monitor.ListSessions(pb.ListSessionsRequest(include_images=True))
    assert resp.replica_id and all(s.startswith(resp.replica_id + "/") for s in ids)
    seen = by_id(resp)
    assert set(ids + fresh) <= set(seen)
    s = seen[ids[0]]
    assert (s.env_id, s.episode, s.turn, s.started) == ("sokoban", 0, 2, True)
    assert s.reward == pytest.approx(r2.reward)
    assert s.episode_return == pytest.approx(r1.reward + r2.reward)
    assert s.last_action == MOVE.format("Up, Right")
    assert s.observation_text == r2.observation.text
    assert s.action_format == "free_think" and not s.done and not s.truncated
    png = Image.open(io.BytesIO(s.image.png))
    assert png.size == (96, 96) == (s.image.width, s.image.height)
    assert s.image.png == r2.observation.images[0].png  # the latest image, not the reset one
    # Reset but never stepped; and opened but never reset.
    assert seen[ids[1]].turn == 0 and seen[ids[1]].last_action == "" and seen[ids[1]].image.png
    assert not seen[fresh[0]].started and seen[fresh[0]].observation_text == ""
    assert not seen[fresh[0]].HasField("image")
    env.close_sessions(ids + fresh)


def test_filter_limit_order_and_close(env, monitor):
    ids = env.open("frozenlake", 3)
    env.reset(ids, seeds=[0, 1, 2])
    env.step([(ids[1], MOVE.format("Right"))])  # now the most recently updated
    resp = monitor.ListSessions(pb.ListSessionsRequest(env_id="frozenlake", limit=1))
    assert resp.total >= 3 and len(resp.sessions) == 1
    assert resp.sessions[0].session_id == ids[1]
    everything = monitor.ListSessions(pb.ListSessionsRequest(env_id="frozenlake"))
    assert all(s.env_id == "frozenlake" for s in everything.sessions)
    updated = [s.updated_unix for s in everything.sessions]
    assert updated == sorted(updated, reverse=True)
    # Without include_images no image travels, even for sessions that render one.
    img = env.open("sokoban", 1, {"render_image": True})
    env.reset(img, seeds=[1])
    plain = by_id(monitor.ListSessions(pb.ListSessionsRequest(limit=1000)))
    assert not plain[img[0]].HasField("image")
    env.close_sessions(ids + img)
    after = by_id(monitor.ListSessions(pb.ListSessionsRequest(limit=1000)))
    assert not set(ids + img) & set(after)
    with pytest.raises(grpc.RpcError) as e:
        monitor.ListSessions(pb.ListSessionsRequest(limit=-1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_truncation_and_forks(env, monitor):
    sid = env.open("sokoban", 1, {"max_turns": 1, "render_image": True})[0]
    env.reset([sid], seeds=[3])
    r = check(env.step([(sid, MOVE.format("Down"))])[0])
    forks = env.fork(sid, 1)
    seen = by_id(monitor.ListSessions(pb.ListSessionsRequest(include_images=True, limit=1000)))
    assert seen[sid].truncated and not seen[sid].done
    # A fork shows its source's latest turn and image before it steps.
    f = seen[forks[0]]
    assert (f.turn, f.truncated, f.last_action) == (1, True, MOVE.format("Down"))
    assert f.reward == pytest.approx(r.reward) and f.image.png == r.observation.images[0].png
    env.close_sessions([sid, *forks])


def test_listed_in_health_and_reflection(server):
    with grpc.insecure_channel(server.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="envserve.v1.MonitorService")).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert "envserve.v1.MonitorService" in {s.name for s in reply.list_services_response.service}


def test_watching_does_not_keep_sessions_alive():
    # A page polling the monitor must not hold abandoned sessions open: the lease still runs out.
    with ServerProcess(["frozenlake"], workers=1, extra=["--lease-seconds", "1"]) as s, \
            EnvClient(s.address) as env, grpc.insecure_channel(s.address) as ch:
        monitor = pb_grpc.MonitorServiceStub(ch)
        sid = env.open("frozenlake", 1)[0]
        env.reset([sid], seeds=[0])
        listed = True
        for _ in range(600):
            listed = sid in by_id(monitor.ListSessions(pb.ListSessionsRequest()))
            if not listed:
                break
            time.sleep(0.1)
        assert not listed
