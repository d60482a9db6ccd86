"""The wire contract as a client generated in another language meets it: the raw generated stubs,
no envserve client. Values shaped by the env travel as JSON text beside their Struct (integers stay
integers), ReadState without a turn reads the latest one, CloseSessions closes under a name no
runtime's channel uses, and every result carries its status."""
import json

import grpc
import pytest

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def stubs(grid_server):
    with grpc.insecure_channel(grid_server.address) as channel:
        yield pb_grpc.EnvServiceStub(channel), pb_grpc.StateServiceStub(channel), channel


def _open(env, config_json="", **kw):
    return env.Open(pb.OpenRequest(env_id="sokoban", count=1, config_json=config_json, **kw), timeout=30)


def test_config_json_opens_with_integers_and_refuses_an_unknown_key(stubs):
    env, _, _ = stubs
    with pytest.raises(grpc.RpcError) as e:
        _open(env, json.dumps({"bogus": 1}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bogus" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _open(env, "[6, 6]")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON object" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        env.Open(pb.OpenRequest(env_id="sokoban", count=1, config_json="{}", config={"max_turns": 5}), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in e.value.details()
    sid = _open(env, json.dumps({"dim_room": 7, "num_boxes": 1, "max_turns": 9})).session_ids[0]
    r = env.Reset(pb.ResetRequest(items=[pb.ResetItem(session_id=sid, seed=3)]), timeout=30).results[0]
    assert r.status.code == 0
    env.CloseSessions(pb.CloseRequest(session_ids=[sid]), timeout=30)


def test_state_info_and_task_parameters_keep_integers(stubs):
    env, state, _ = stubs
    sid = _open(env).session_ids[0]
    r = env.Reset(pb.ResetRequest(items=[pb.ResetItem(session_id=sid, seed=5)]), timeout=30).results[0]
    info = json.loads(r.info_json)
    assert info["seed"] == 5 and isinstance(info["seed"], int)
    truth = state.ReadState(pb.ReadStateRequest(session_id=sid), timeout=30)
    parsed = json.loads(truth.state_json)
    player = parsed["player"]
    assert all(isinstance(x, int) for x in player) and len(player) == 2
    # the Struct beside it says the same in doubles
    assert [v.number_value for v in truth.state.fields["player"].list_value.values] == [float(x) for x in player]
    page = env.ListTasks(pb.ListTasksRequest(env_id="sokoban", page_size=2), timeout=30)
    params = json.loads(page.tasks[0].parameters_json)
    assert params and any(isinstance(v, int) and not isinstance(v, bool) for v in params.values()), params
    env.CloseSessions(pb.CloseRequest(session_ids=[sid]), timeout=30)


def test_read_state_without_a_turn_is_the_latest_and_get_state_keeps_its_meaning(stubs):
    env, state, _ = stubs
    sid = _open(env).session_ids[0]
    env.Reset(pb.ResetRequest(items=[pb.ResetItem(session_id=sid, seed=1)]), timeout=30)
    for action in ("Up", "Left"):
        r = env.Step(pb.StepRequest(items=[pb.StepItem(session_id=sid, action=f"<answer>{action}</answer>")]),
                     timeout=30).results[0]
    assert r.status.code == 0 and r.turn == 2
    latest = state.ReadState(pb.ReadStateRequest(session_id=sid), timeout=30)
    assert latest.turn == 2 and latest.anchor == r.anchor
    assert state.ReadState(pb.ReadStateRequest(session_id=sid, turn=0), timeout=30).turn == 0
    assert state.ReadState(pb.ReadStateRequest(session_id=sid, turn=-2), timeout=30).turn == 1
    # The deprecated rpc answers as it always did: no turn on the wire is turn 0.
    assert state.GetState(pb.GetStateRequest(session_id=sid), timeout=30).turn == 0
    assert state.GetState(pb.GetStateRequest(session_id=sid, turn=-1), timeout=30).turn == 2
    env.CloseSessions(pb.CloseRequest(session_ids=[sid]), timeout=30)


def test_every_result_carries_a_status_and_both_close_names_close(stubs):
    env, _, channel = stubs
    ids = list(env.Open(pb.OpenRequest(env_id="frozenlake", count=2), timeout=30).session_ids)
    for r in env.Reset(pb.ResetRequest(items=[pb.ResetItem(session_id=s, seed=0) for s in ids]), timeout=30).results:
        assert r.HasField("status") and r.status.code == 0
    results = env.Step(pb.StepRequest(items=[pb.StepItem(session_id=ids[0], action="<answer>Jump</answer>"),
                                             pb.StepItem(session_id="no-such-session", action="Up")]),
                       timeout=30).results
    assert results[0].HasField("status") and results[0].status.code == 0 and not results[0].action_valid
    assert results[0].feedback
    assert results[1].status.code == grpc.StatusCode.NOT_FOUND.value[0]
    stream = env.Interact(iter([pb.InteractRequest(items=[
        pb.InteractItem(tag=7, step=pb.StepItem(session_id=ids[1], action="<answer>Down</answer>"))])]), timeout=30)
    got = [res for reply in stream for res in reply.results]
    assert got[0].tag == 7 and got[0].result.HasField("status") and got[0].result.status.code == 0
    closed = env.CloseSessions(pb.CloseRequest(session_ids=[ids[0], "no-such-session"]), timeout=30).statuses
    assert [s.code for s in closed] == [0, grpc.StatusCode.NOT_FOUND.value[0]]
    # The name release 0.1.0 gave CloseSessions is still answered, for clients generated from it.
    close = channel.unary_unary("/envserve.v1.EnvService/Close", request_serializer=pb.CloseRequest.SerializeToString,
                                response_deserializer=pb.CloseResponse.FromString)
    assert [s.code for s in close(pb.CloseRequest(session_ids=[ids[1]]), timeout=30).statuses] == [0]
    after = env.Step(pb.StepRequest(items=[pb.StepItem(session_id=ids[1], action="Up")]), timeout=30).results[0]
    assert after.status.code == grpc.StatusCode.NOT_FOUND.value[0]


def test_restore_takes_a_history_with_config_json(stubs):
    env, _, _ = stubs
    history = pb.SessionHistory(env_id="sokoban", config_json=json.dumps({"dim_room": 7, "num_boxes": 1}),
                                seed=4)
    restored = env.Restore(pb.RestoreRequest(sessions=[history]), timeout=30).sessions[0]
    assert restored.status.code == 0 and restored.session_id
    sid = _open(env, json.dumps({"dim_room": 7, "num_boxes": 1})).session_ids[0]
    fresh = env.Reset(pb.ResetRequest(items=[pb.ResetItem(session_id=sid, seed=4)]), timeout=30).results[0]
    assert restored.anchor == fresh.anchor
    # The episode length a config_json sets bounds the history as the Struct's does.
    long = pb.SessionHistory(env_id="sokoban", config_json='{"max_turns": 2}', seed=4,
                             turns=[pb.ReplayTurn(action="<answer>Up</answer>")] * 3)
    refused = env.Restore(pb.RestoreRequest(sessions=[long]), timeout=30).sessions[0]
    assert refused.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "at most 2" in refused.status.message
    bad = pb.SessionHistory(env_id="sokoban", config_json='{"bogus": 1}', seed=4)
    failed = env.Restore(pb.RestoreRequest(sessions=[bad]), timeout=30).sessions[0]
    assert not failed.session_id and failed.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "bogus" in failed.status.message
    env.CloseSessions(pb.CloseRequest(session_ids=[sid, restored.session_id]), timeout=30)
