"""Property-based fuzzing of every gRPC method of a replica with tokens and of the judge: requests
that parse, with field values drawn to be hostile (other tokens' sessions, extreme numbers, NaN and
Infinity in configs, deep Structs, long texts, wrong or missing tokens). Every answer is a status
the caller can act on, never UNKNOWN or INTERNAL; another token's session is never read, stepped
or closed; the replica lives on and its memory stays near where it began.

(tests/fault/test_malformed_requests.py sends bytes that do not parse.)"""
from __future__ import annotations

import grpc
import psutil
import pytest
from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envserve.client import EnvClient
from envserve.v1 import envserve_pb2 as pb
from serverproc import JudgeProcess, ServerProcess

ALICE, BOB, JUDGE = "fuzz-alice", "fuzz-bob", "fuzz-judge"
VICTIM = "fuzz-victim"   # a token the fuzz never presents: its session must come out untouched
REFUSED = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
EXAMPLES = 60   # per method: about a minute for the file on 2 cores


@pytest.fixture(scope="module")
def fleet():
    with ServerProcess(["frozenlake", "sokoban"], workers=1, metrics=False,
                       env_vars={"ENVSERVE_TOKENS": f"{ALICE} name=alice grants=judge,{BOB} name=bob,{VICTIM} grants=judge",
                                 "ENVSERVE_STATE_TOKENS": f"{JUDGE} name=judge"}) as server, \
            JudgeProcess(server.address, env_vars={"ENVSERVE_STATE_TOKEN": JUDGE}) as judge, \
            EnvClient(server.address, token=ALICE) as alice, EnvClient(server.address, token=BOB) as bob, \
            EnvClient(server.address, token=VICTIM) as victim:
        mine = alice.open("frozenlake", 2)
        alice.reset(mine, seeds=[1, 2])
        theirs = bob.open("sokoban", 1)
        bob.reset(theirs, seeds=[3])
        kept = victim.open("sokoban", 1)[0]
        first = victim.reset_one(kept, 4)
        rss = _rss(server)
        yield server, judge, alice, bob, mine, [*theirs, kept], (victim, kept, first, rss)


def _rss(server) -> int:
    p = psutil.Process(server.proc.pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def _strings(fleet_ids: list[str]) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(fleet_ids), st.sampled_from(["frozenlake", "sokoban", "", "nope", "no_think",
                                                                  "grounding", "train", "test", "x/y", "/"]),
                     st.text(max_size=40), st.text(min_size=2000, max_size=3000, alphabet="ab<>/"))


def _json_values(depth: int = 6) -> st.SearchStrategy:
    leaves = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
                       st.integers(-2**70, 2**70).map(float), st.text(max_size=20))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=12), inner, max_size=3)),
                        max_leaves=12)


def _struct(ids) -> st.SearchStrategy:
    keys = st.one_of(st.sampled_from(["dim_room", "num_boxes", "image_size", "max_turns", "render_image",
                                      "size", "p", "history_turns", "max_action_chars", "svg_dir", "seats"]),
                     st.text(max_size=12))

    def make(d):
        s = struct_pb2.Struct()
        for k, v in d.items():
            _set(s, k, v)
        return s
    deep = st.integers(30, 200).map(lambda n: {"deep": _nested(n)})
    return st.one_of(st.dictionaries(keys, _json_values(), max_size=4), deep).map(make)


def _nested(n: int):
    v = 1.0
    for _ in range(n):
        v = {"a": v}
    return v


def _set(struct: struct_pb2.Struct, key: str, value) -> None:
    """Struct.update refuses nothing, but builds NaN and Infinity too: what a client can send."""
    struct.update({key: value})


def _message(descriptor, ids, depth: int = 0) -> st.SearchStrategy:
    """A strategy for any message of `descriptor`, each field drawn or left unset."""
    if descriptor.full_name == "google.protobuf.Struct":
        return _struct(ids)
    fields = {}
    oneofs = {f.containing_oneof.name for f in descriptor.fields if f.containing_oneof is not None}
    for f in descriptor.fields:
        if f.containing_oneof is not None and f.containing_oneof.name in oneofs:
            continue  # drawn below, one member at most
        fields[f.name] = _field(f, ids, depth)
    one_of = {name: st.one_of(st.none(), *[st.tuples(st.just(f.name), _value(f, ids, depth))
                                           for f in descriptor.oneofs_by_name[name].fields]) for name in oneofs}

    def build(drawn):
        values, chosen = drawn
        msg = descriptor._concrete_class()
        for name, v in values.items():
            if v is None:
                continue
            f = descriptor.fields_by_name[name]
            if f.is_repeated:
                target = getattr(msg, name)
                if f.message_type is not None and f.message_type.GetOptions().map_entry:
                    for k, val in v:
                        if f.message_type.fields_by_name["value"].message_type is None:
                            target[k] = val
                        else:
                            target[k].CopyFrom(val)
                elif f.message_type is not None:
                    for item in v:
                        target.add().CopyFrom(item)
                else:
                    target.extend(v)
            elif f.message_type is not None:
                getattr(msg, name).CopyFrom(v)
            else:
                setattr(msg, name, v)
        for pick in chosen.values():
            if pick is not None:
                name, v = pick
                f = descriptor.fields_by_name[name]
                if f.message_type is not None:
                    getattr(msg, name).CopyFrom(v)
                else:
                    setattr(msg, name, v)
        return msg
    return st.tuples(st.fixed_dictionaries({k: st.one_of(st.none(), v) for k, v in fields.items()}),
                     st.fixed_dictionaries(one_of)).map(build)


def _field(f, ids, depth):
    if f.is_repeated:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            return st.lists(st.tuples(_value(key, ids, depth), _value(value, ids, depth)), max_size=3)
        return st.lists(_value(f, ids, depth), max_size=4 if depth < 2 else 1)
    return _value(f, ids, depth)


def _value(f, ids, depth):
    t = f.type
    if t == F.TYPE_MESSAGE:
        return _message(f.message_type, ids, depth + 1) if depth < 3 else st.just(f.message_type._concrete_class())
    if t == F.TYPE_STRING:
        return _strings(ids)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=64 if t == F.TYPE_DOUBLE else 32)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32, F.TYPE_ENUM):
        return st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-3, 10))
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    return st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-3, 10))


def _methods():
    out = []
    for service in ("EnvService", "StateService", "MonitorService", "JudgeService"):
        for m in pb.DESCRIPTOR.services_by_name[service].methods:
            out.append((service, m))
    return out


TOKENS = st.sampled_from([None, ALICE, BOB, JUDGE, "not-a-token", "Bearer"])


@pytest.mark.parametrize("service, method", _methods(), ids=lambda x: getattr(x, "name", x))
def test_no_request_gets_unknown_or_internal(fleet, service, method):
    server, judge, alice, bob, mine, theirs, _ = fleet
    address = judge.address if service == "JudgeService" else server.address
    ids = [*mine, *theirs, f"{mine[0].split('/')[0]}/0000000000000000", "unknown-replica/1"]
    path = f"/envserve.v1.{service}/{method.name}"
    request_class = method.input_type._concrete_class
    response_class = method.output_type._concrete_class
    seen: dict = {}
    with grpc.insecure_channel(address) as channel:
        kw = {"request_serializer": request_class.SerializeToString,
              "response_deserializer": response_class.FromString}
        if method.client_streaming:
            call = channel.stream_stream(path, **kw)
        elif method.server_streaming:
            call = channel.unary_stream(path, **kw)
        else:
            call = channel.unary_unary(path, **kw)

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests=st.lists(_message(method.input_type, ids), min_size=1, max_size=3), token=TOKENS)
        def one(requests, token):
            md = (("authorization", f"Bearer {token}"),) if token else None
            try:
                if method.client_streaming:
                    replies = list(call(iter(requests), timeout=120, metadata=md))
                elif method.server_streaming:
                    replies = list(call(requests[0], timeout=120, metadata=md))
                else:
                    replies = [call(requests[0], timeout=120, metadata=md)]
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code, replies = e.code(), []
                assert code not in REFUSED, (path, requests, e.details())
                assert e.details(), (path, code)      # every refusal says why
            seen[code] = seen.get(code, 0) + 1
            for reply in replies:
                _never_anothers(reply, token, mine, theirs)
        one()
    assert seen, path


def _never_anothers(reply, token, mine, theirs):
    """No reply hands one token another token's session as a success."""
    foreign = theirs if token == ALICE else mine if token == BOB else []
    items = []
    if isinstance(reply, pb.BatchResponse):
        items = list(reply.results)
    elif isinstance(reply, pb.InteractResponse):
        items = [r.result for r in reply.results]
    for r in items:
        if r.session_id in foreign:
            assert r.status.code != 0, r
    if isinstance(reply, pb.CloseResponse):
        return   # statuses only: checked through the sessions still stepping below
    if isinstance(reply, pb.GetStateResponse) and token in (ALICE, BOB):
        raise AssertionError("a session token read ground truth on a replica with state tokens")


@pytest.mark.last_in_module
def test_after_the_fuzz_the_sessions_and_the_replica_are_whole(fleet, report):
    server, judge, alice, bob, mine, theirs, (victim, kept, first, rss) = fleet
    # The victim's session is where its owner left it: nobody else stepped, reset or closed it.
    with EnvClient(server.address, token=JUDGE) as truth:
        state = truth.get_state(kept)
    assert (state.anchor, state.turn, state.episode, state.trial) == (first.anchor, 0, 0, 0)
    assert victim.step_one(kept, "<answer>Left</answer>").turn == 1
    after = _rss(server)
    report(f"gRPC fuzz: replica and workers {rss / 2**20:.0f} -> {after / 2**20:.0f} MiB "
           f"(sessions the fuzz opened included)")
    assert after <= 2.0 * rss
    assert server.proc.poll() is None and judge.proc.poll() is None
