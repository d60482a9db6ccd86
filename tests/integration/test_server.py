"""The server runtime through a real gRPC server process on loopback."""
import asyncio
import json
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from envserve.client import AsyncEnvClient, EnvClient, check, item_error
from envserve.client.errors import EnvNotFoundError, EnvServeError, ReplicaFullError, SessionNotFoundError
from serverproc import ServerProcess

SOKOBAN_MOVE = "<think>push</think><answer>{}</answer>"


def test_list_envs_and_spec(client):
    ids = {s.env_id for s in client.list_envs()}
    assert {"sokoban", "frozenlake", "minesweeper"} <= ids
    spec = client.get_spec("sokoban")
    assert spec.max_actions_per_turn == 3
    assert json.loads(spec.config_schema_json)["properties"]["dim_room"]["default"] == 6
    with pytest.raises(EnvNotFoundError):     # its own class: no env of that id, not a session
        client.get_spec("no-such-env")
    with pytest.raises(EnvNotFoundError):
        client.open("no-such-env", 1)


def test_batch_spreads_over_workers_and_keeps_order(client):
    ids = client.open("sokoban", 16)
    results = client.reset(ids, seeds=list(range(16)))
    assert [r.session_id for r in results] == ids
    steps = client.step([(sid, SOKOBAN_MOVE.format("Up")) for sid in ids])
    assert [r.session_id for r in steps] == ids
    assert all(r.status.code == 0 and r.turn == 1 for r in steps)
    # The same seed opened again gives the same observation, whichever worker holds it.
    again = client.open("sokoban", 16)
    assert [r.observation.text for r in client.reset(again, seeds=list(range(16)))] == \
           [r.observation.text for r in results]
    client.close_sessions(ids + again)


def test_one_bad_item_fails_alone(client):
    ids = client.open("sokoban", 3)
    client.reset(ids, seeds=[1, 2, 3])
    items = [(ids[0], SOKOBAN_MOVE.format("Left")), ("nope/123", "Up"), (ids[1], "garbage"),
             (ids[2], SOKOBAN_MOVE.format("Down"))]
    res = client.step(items)
    assert res[0].status.code == 0 and res[0].action_valid
    assert isinstance(item_error(res[1]), SessionNotFoundError)
    assert res[2].status.code == 0 and not res[2].action_valid and "Invalid format" in res[2].feedback
    assert res[2].reward_components["format"] == pytest.approx(-0.1)
    assert res[3].status.code == 0
    client.close_sessions(ids)


def test_open_returns_the_sessions_system_prompt(client):
    reply = client.open_sessions("sokoban", 2, {"action_separator": "|", "max_actions_per_turn": 2},
                                 "grounding_worldmodeling")
    assert reply.lease_seconds > 0 and len(reply.session_ids) == 2
    assert reply.system_prompt.startswith(client.get_spec("sokoban").system_prompt)
    assert "<observation>" in reply.system_prompt and "<prediction>" in reply.system_prompt
    assert "action1| action2" in reply.system_prompt and "up to 2 actions" in reply.system_prompt
    client.close_sessions(reply.session_ids)


def test_multiple_actions_per_turn_are_capped(client):
    sid = client.open("sokoban", 1, {"max_actions_per_turn": 2}, "free_think")[0]
    client.reset_one(sid, seed=4)
    r = client.step_one(sid, SOKOBAN_MOVE.format("Up, Down, Up, Down"))
    assert list(r.parsed_actions) == ["Up", "Down"] and r.actions_executed <= 2
    assert "Only the first 2" in r.feedback
    client.close_sessions([sid])


def test_reasoning_fields_travel(client):
    sid = client.open("frozenlake", 1, None, "grounding_worldmodeling")[0]
    client.reset_one(sid, seed=0)
    text = ("<think><observation>the goal is below</observation><reasoning>go down</reasoning>"
            "<prediction>player moves down</prediction></think><answer>Down</answer>")
    r = client.step_one(sid, text)
    assert r.reasoning["observation"] == "the goal is below"
    assert r.reasoning["prediction"] == "player moves down"
    sid2 = client.open("sokoban", 1, None, "meta_reasoning")[0]
    client.reset_one(sid2, seed=0)
    r = client.step_one(sid2, "<planning>push the box right</planning><action>Right</action>")
    assert r.reasoning["meta_tag"] == "planning" and r.parsed_actions == ["Right"]
    client.close_sessions([sid, sid2])


def test_bad_requests_get_status_codes(client):
    with pytest.raises(EnvServeError) as e:
        client.open("sokoban", 1, {"dim_room": "big"})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dim_room" in e.value.message
    with pytest.raises(EnvServeError) as e:
        client.open("frozenlake", 1, {"size": 1})  # the right type, a value the env refuses
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "size" in e.value.message
    with pytest.raises(EnvServeError) as e:
        client.open("sokoban", 1, None, "no_such_format")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(EnvServeError) as e:
        client.open("nowhere", 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    sid = client.open("sokoban", 1)[0]
    res = client.step([(sid, "<answer>Up</answer>")])[0]
    assert res.status.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "reset" in res.status.message
    res = client.reset([sid], split="no-such-split")[0]
    assert res.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with pytest.raises(EnvServeError) as e:
        client.get_state(sid, 0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    client.close_sessions([sid])


def test_splits_draw_from_their_seed_ranges(client):
    sid = client.open("sokoban", 1)[0]
    seeds = {client.reset([sid], split="test")[0].info["seed"] for _ in range(5)}
    assert all(s >= 10_000_000 for s in seeds) and len(seeds) > 1
    r = client.reset([sid], task_id="42")[0]
    assert r.info["seed"] == 42
    client.close_sessions([sid])


def test_ground_truth_history_is_bounded(client):
    sid = client.open("sokoban", 1, {"history_turns": 3, "max_turns": 50})[0]
    client.reset_one(sid, seed=1)
    for _ in range(5):
        # An unparsable answer still uses a turn, and cannot end the episode.
        assert not client.step_one(sid, "no answer here").action_valid
    assert client.get_state(sid, 5).turn == 5
    assert client.get_state(sid, 3).turn == 3
    with pytest.raises(SessionNotFoundError):
        client.get_state(sid, 1)
    truth = client.get_state(sid, -1)
    assert any("player" in rel for rel in truth.relations)
    client.close_sessions([sid])


async def _recv_all(s, n):
    got = {}
    while len(got) < n:
        for tag, result in await s.recv():
            assert tag not in got
            got[tag] = result
    return got


def test_interact_streams_every_result(grid_server):
    async def main():
        async with AsyncEnvClient(grid_server.address) as ac:
            ids = await ac.open("sokoban", 32)
            async with ac.stream() as s:
                tags = {s.send_reset(sid, seed=i): sid for i, sid in enumerate(ids)}
                got = await _recv_all(s, len(ids))
                assert set(got) == set(tags)
                assert all(got[t].session_id == tags[t] and got[t].status.code == 0 for t in tags)
                # Steps pipelined in one send, plus an unknown session failing alone.
                step_tags = dict(zip(s.send_steps([(sid, SOKOBAN_MOVE.format("Left")) for sid in ids]), ids))
                bad = s.send_step("nope/1", "Up")
                seen = await _recv_all(s, len(ids) + 1)
                assert seen[bad].status.code == grpc.StatusCode.NOT_FOUND.value[0]
                assert all(seen[t].turn == 1 and seen[t].session_id == step_tags[t] for t in step_tags)
                assert s.in_flight == 0
            results = [r async for r in ac.step_as_completed([(sid, SOKOBAN_MOVE.format("Up")) for sid in ids])]
            assert sorted(r.session_id for r in results) == sorted(ids)
            await ac.close_sessions(ids)

    asyncio.run(main())


def test_interact_returns_fast_results_before_slow_ones(tmp_path):
    """A step sent later on another worker comes back before a slow one sent first."""
    async def main(address):
        async with AsyncEnvClient(address) as ac:
            slow = await ac.open("sokoban", 1, {"render_image": True, "image_size": 2048})  # worker 0
            fast = await ac.open("sokoban", 1)  # the least loaded worker: worker 1
            await ac.reset(slow + fast, seeds=[0, 1])
            async with ac.stream() as s:
                slow_tag = s.send_step(slow[0], SOKOBAN_MOVE.format("Up"))
                fast_tag = s.send_step(fast[0], SOKOBAN_MOVE.format("Up"))
                order = []
                while len(order) < 2:
                    order += [tag for tag, _ in await s.recv()]
            assert order == [fast_tag, slow_tag]

    # 2048 px images make the slow step slow: above the built-in bound (1024), so this replica's
    # operator allows them.
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"*": {"image_size": {"maximum": 2048}}}))
    with ServerProcess(["sokoban"], workers=2, metrics=False, extra=["--config-limits", str(limits)]) as server:
        asyncio.run(main(server.address))


def test_health_reflection_and_metrics(grid_server, client):
    with grpc.insecure_channel(grid_server.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "envserve.v1.EnvService", "envserve.v1.StateService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                   health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in reply.list_services_response.service}
        assert {"envserve.v1.EnvService", "envserve.v1.StateService", "grpc.health.v1.Health"} <= names
    sid = client.open("minesweeper", 1)[0]
    client.reset_one(sid, seed=0)
    client.step([("missing/1", "x")])
    text = grid_server.metrics_text()
    assert 'envserve_step_seconds_count{env="minesweeper"}' in text
    assert 'envserve_live_sessions{env="minesweeper"}' in text
    assert "envserve_worker_restarts_total" in text
    assert 'envserve_errors_total{code="NOT_FOUND"}' in text
    client.close_sessions([sid])


def test_max_sessions_is_resource_exhausted():
    with ServerProcess(["sokoban"], workers=1, extra=["--max-sessions", "5"], metrics=False) as server:
        with EnvClient(server.address) as c:
            ids = c.open("sokoban", 4)
            with pytest.raises(ReplicaFullError) as e:
                c.open("sokoban", 2)
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(ReplicaFullError):
                c.fork(ids[0], 2)
            c.close_sessions(ids[:2])
            assert len(c.open("sokoban", 3)) == 3


def test_gym_adapter(grid_server):
    import gymnasium as gym
    from envserve.client.gym_adapter import EnvServeGymEnv
    env = EnvServeGymEnv(grid_server.address, "frozenlake", {"render_image": True}, "no_think")
    assert isinstance(env, gym.Env)
    obs, info = env.reset(seed=3)
    assert "P" in obs["text"] and obs["image"].shape == (128, 128, 3) and info["turn"] == 0
    obs, reward, terminated, truncated, info = env.step("<answer>Left</answer>")
    assert isinstance(reward, float) and info["turn"] == 1 and info["action_valid"]
    obs, reward, terminated, truncated, info = env.step("not an answer")
    assert not info["action_valid"] and reward < 0
    env.close()


def test_thousands_of_concurrent_unary_steps_are_queued_not_cancelled(grid_server):
    """Each of 2,048 sessions awaits its own unary Step at once: more calls than grpc core keeps
    waiting by default (it cancelled some beyond 1,000); every one is answered."""
    from envserve.v1 import envserve_pb2 as pb
    from envserve.v1 import envserve_pb2_grpc as pb_grpc

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(grid_server.address) as ch:
            stub = pb_grpc.EnvServiceStub(ch)
            ids = list((await stub.Open(pb.OpenRequest(env_id="frozenlake", count=2048))).session_ids)
            await stub.Reset(pb.ResetRequest(items=[pb.ResetItem(session_id=s, seed=0) for s in ids]))
            errors: list[str] = []

            async def session(sid: str) -> None:
                for _ in range(2):
                    try:
                        reply = await stub.Step(pb.StepRequest(items=[pb.StepItem(session_id=sid,
                                                                                   action="<answer>Left</answer>")]))
                        assert reply.results[0].status.code == 0
                    except grpc.aio.AioRpcError as e:
                        errors.append(e.code().name)

            await asyncio.gather(*[session(s) for s in ids])
            await stub.CloseSessions(pb.CloseRequest(session_ids=ids))
            return errors

    assert asyncio.run(run()) == []
