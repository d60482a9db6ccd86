"""Bytes that are not a method's request message: INVALID_ARGUMENT with a message, never UNKNOWN,
and the server lives on. Random bytes and mutated valid requests go to every method of a replica
(EnvService, StateService, MonitorService, health, reflection) and of the judge, the streams too."""
from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from envserve.client import EnvClient
from envserve.v1 import envserve_pb2 as pb

from serverproc import JudgeProcess, ServerProcess

pytestmark = pytest.mark.slow


CORRUPT = b"\xff\xff\xff\x07not a message"  # a field header promising more bytes than follow
CALLS = 10_000


def _methods(service: str) -> list[tuple[str, bool, bool]]:
    desc = pb.DESCRIPTOR.services_by_name[service]
    return [(f"/{desc.full_name}/{m.name}", m.client_streaming, m.server_streaming) for m in desc.methods]


def _call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool, data: bytes):
    """Sends data as the request of path; returns the status code the call ended with."""
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if client_streaming:
            for _ in channel.stream_stream(path, **raw)(iter([data]), timeout=60):
                pass
        elif server_streaming:
            for _ in channel.unary_stream(path, **raw)(data, timeout=60):
                pass
        else:
            channel.unary_unary(path, **raw)(data, timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(4)
    if kind == 0 and b:            # flip bytes
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 1 and b:          # truncate
        del b[rng.randrange(len(b)):]
    elif kind == 2:                # insert bytes
        at = rng.randrange(len(b) + 1)
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:                          # random bytes
        b = bytearray(rng.randbytes(rng.randint(1, 64)))
    return bytes(b)


@pytest.fixture(scope="module", params=["workers", "inline"])
def stack(request):
    # --inline runs env code in the front itself: the same bytes must get the same answers.
    extra = ["--inline"] if request.param == "inline" else []
    with ServerProcess(["frozenlake", "sokoban"], workers=1, metrics=False, extra=extra) as server, \
            JudgeProcess(server.address) as judge:
        yield server, judge


def _targets(server, judge):
    """(address, path, client_streaming, server_streaming, valid request bytes) for every method."""
    client = EnvClient(server.address)
    sid = client.open("frozenlake", 1)[0]
    client.reset_one(sid, 3)
    valid = {
        "ListEnvs": pb.ListEnvsRequest(), "GetSpec": pb.GetSpecRequest(env_id="frozenlake"),
        "Open": pb.OpenRequest(env_id="frozenlake", count=1),
        "Reset": pb.ResetRequest(items=[pb.ResetItem(session_id=sid, seed=5)]),
        "Step": pb.StepRequest(items=[pb.StepItem(session_id=sid, action="<answer>Left</answer>")]),
        "Interact": pb.InteractRequest(items=[pb.InteractItem(tag=1, step=pb.StepItem(session_id=sid, action="Up"))]),
        "Fork": pb.ForkRequest(session_id=sid, count=1), "CloseSessions": pb.CloseRequest(session_ids=["nobody"]),
        "Restore": pb.RestoreRequest(sessions=[pb.SessionHistory(
            env_id="frozenlake", seed=3, trial=0, episode=0,
            turns=[pb.ReplayTurn(action="<answer>Left</answer>")])]),
        "ListTasks": pb.ListTasksRequest(env_id="frozenlake", split="test", page_size=3, page_token="3"),
        "GetTaskStats": pb.GetTaskStatsRequest(env_id="frozenlake", scope="fuzz"),
        "GetState": pb.GetStateRequest(session_id=sid), "ReadState": pb.ReadStateRequest(session_id=sid),
        "ListSessions": pb.ListSessionsRequest(),
        "Judge": pb.JudgeRequest(), "GetJudgeInfo": pb.GetJudgeInfoRequest(),
    }
    out = []
    for service in ("EnvService", "StateService", "MonitorService"):
        out += [(server.address, *m, valid[m[0].rsplit("/", 1)[1]].SerializeToString()) for m in _methods(service)]
    # Served under the name release 0.1.0 gave CloseSessions, outside today's proto.
    out.append((server.address, "/envserve.v1.EnvService/Close", False, False, valid["CloseSessions"].SerializeToString()))
    out += [(judge.address, *m, valid[m[0].rsplit("/", 1)[1]].SerializeToString()) for m in _methods("JudgeService")]
    health = health_pb2.HealthCheckRequest(service="").SerializeToString()
    refl = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
    for address in (server.address, judge.address):
        out.append((address, "/grpc.health.v1.Health/Check", False, False, health))
        out.append((address, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True, True, refl))
    return client, sid, out


def test_corrupt_bytes_are_invalid_argument_on_every_method(stack):
    server, judge = stack
    _, _, targets = _targets(server, judge)
    assert len(targets) >= 16  # every EnvService/State/Monitor/Judge method, health, reflection, twice
    channels = {a: grpc.insecure_channel(a) for a in (server.address, judge.address)}
    for address, path, cs, ss, _ in targets:
        code, details = _call(channels[address], path, cs, ss, CORRUPT)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (path, code, details)
        assert path in details and "not a valid" in details, details


def test_a_corrupt_message_mid_stream_ends_the_stream_with_invalid_argument(stack):
    server, judge = stack
    client, sid, _ = _targets(server, judge)
    good = pb.InteractRequest(items=[pb.InteractItem(tag=1, step=pb.StepItem(session_id=sid, action="<answer>Up</answer>"))])
    with grpc.insecure_channel(server.address) as ch:
        call = ch.stream_stream("/envserve.v1.EnvService/Interact", request_serializer=lambda b: b,
                                response_deserializer=pb.InteractResponse.FromString)
        answered = []
        with pytest.raises(grpc.RpcError) as err:
            for reply in call(iter([good.SerializeToString(), CORRUPT]), timeout=60):
                answered += [r.tag for r in reply.results]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert answered == [1]   # the item sent before the bad bytes was answered first
    # The session itself is untouched by the stream's end.
    assert client.step_one(sid, "<answer>Left</answer>").turn >= 1


def test_fuzz_never_answers_unknown_and_the_server_lives(stack):
    server, judge = stack
    client, sid, targets = _targets(server, judge)
    rng = random.Random(20261124)
    channels = {a: grpc.insecure_channel(a) for a in (server.address, judge.address)}
    seen: dict[grpc.StatusCode, int] = {}
    refused = 0  # did not parse
    for i in range(CALLS):
        address, path, cs, ss, valid = targets[i % len(targets)]
        data = _mutate(rng, valid)
        code, details = _call(channels[address], path, cs, ss, data)
        seen[code] = seen.get(code, 0) + 1
        refused += "not a valid" in details
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (path, data, details)
    # Both kinds were exercised: refused bytes and requests that parsed and were answered.
    assert refused > CALLS // 10
    assert CALLS - refused > CALLS // 20, seen
    assert seen.get(grpc.StatusCode.OK, 0) > CALLS // 50, seen
    # Alive, and a fresh session plays.
    fresh = client.open("sokoban", 1)[0]
    client.reset_one(fresh, 1)
    assert client.step_one(fresh, "<answer>Up</answer>").turn == 1
    assert server.proc.poll() is None and judge.proc.poll() is None
