"""The OpenEnv endpoint (/openenv/<env_id>/) driven by the openenv package's own async client
(GenericEnvClient), served two ways, each test running on both: by the facade (`envserve web`) in
front of the real grid server on loopback, and by a replica itself (`envserve serve
--openenv-port`, no facade). The replica's own record (MonitorService, StateService) is the truth."""
from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

pytest.importorskip("openenv")

from google.protobuf import json_format  # noqa: E402
from openenv import GenericEnvClient  # noqa: E402

from envserve.client import EnvClient  # noqa: E402
from envserve.client.experts import plain_answer, plan_frozenlake, plan_sokoban  # noqa: E402
from envserve.v1 import envserve_pb2 as pb  # noqa: E402
from envserve.v1 import envserve_pb2_grpc as pb_grpc  # noqa: E402
from serverproc import ServerProcess, wait_until  # noqa: E402
from webproc import WebProcess  # noqa: E402

IDLE_SECONDS = 3.0


class Endpoint:
    """Where OpenEnv clients go (url + /openenv/<env_id>) and the replica behind it (address)."""

    def __init__(self, url: str, address: str):
        self.url, self.address = url, address


@pytest.fixture(scope="module", params=["facade", "replica"])
def web(request):
    idle = ["--openenv-idle-seconds", str(IDLE_SECONDS)]
    if request.param == "facade":
        grid_server = request.getfixturevalue("grid_server")
        with WebProcess.facade([grid_server.address], extra=idle) as w:
            yield Endpoint(w.url, grid_server.address)
    else:
        with ServerProcess(["sokoban", "frozenlake", "minesweeper"], workers=2, metrics=False,
                           extra=["--openenv-port", "0", *idle]) as server:
            line = next(x for x in server.output if "envserve openenv on " in x)
            url = line.split("envserve openenv on ")[1].split()[0]
            assert url.endswith("/openenv")
            yield Endpoint(url[:-len("/openenv")], server.address)


def live(address: str, env_id: str = "") -> dict[str, pb.SessionSummary]:
    """The replica's own view of its sessions (MonitorService.ListSessions)."""
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return {s.session_id: s for s in reply.sessions}


def truth(address: str, session_id: str) -> dict:
    with EnvClient(address) as c:
        return json_format.MessageToDict(c.get_state(session_id).state)


def client(web, env_id: str) -> GenericEnvClient:
    return GenericEnvClient(base_url=f"{web.url}/openenv/{env_id}")


async def play(env: GenericEnvClient, address: str, planner, seed: int) -> tuple[list, list[str], dict]:
    """Reset with a seed, plan on the ground truth, step the plan until done."""
    first = await env.reset(seed=seed, action_format="no_think")
    state = await env.state()
    plan = planner(truth(address, state["session_id"]))
    assert plan, "the planner found no way to the goal"
    results = [first]
    for move in plan:
        assert not results[-1].done
        results.append(await env.step({"message": plain_answer("no_think", [move])}))
    return results, plan, await env.state()


@pytest.mark.parametrize("env_id,planner,seed", [("sokoban", plan_sokoban, 4), ("frozenlake", plan_frozenlake, 7)])
def test_a_whole_episode_through_openenvs_own_client(web, env_id, planner, seed):
    async def run():
        async with client(web, env_id) as env:
            results, plan, state = await play(env, web.address, planner, seed)
            first, last = results[0], results[-1]
            assert first.done is False and "P" in first.observation["text"]
            assert first.metadata["env_id"] == env_id and first.metadata["system_prompt"]
            assert all(r.metadata["valid_action"] for r in results[1:])
            assert [r.metadata["parsed_actions"] for r in results[1:]] == [[m] for m in plan]
            assert not any(r.done for r in results[:-1])
            assert last.done is True and last.metadata["success"] is True and last.reward > 0
            # The state message agrees with the steps and with the replica's own record.
            assert state["step_count"] == len(plan) and state["turn"] == len(plan) and state["done"] is True
            assert state["episode_return"] == pytest.approx(sum(r.reward for r in results[1:]))
            assert state["action_format"] == "no_think"
            mine = live(web.address, env_id)[state["session_id"]]
            assert (mine.turn, mine.done, mine.success, mine.action_format) == (len(plan), True, True, "no_think")
            assert mine.observation_text == last.observation["text"]
    asyncio.run(run())


def test_same_seed_same_first_observation_and_the_turn_data(web):
    async def run():
        async with client(web, "sokoban") as a, client(web, "sokoban") as b:
            ra, rb = await a.reset(seed=11), await b.reset(seed=11)
            sa, sb = await a.state(), await b.state()
            assert sa["session_id"] != sb["session_id"]
            assert ra.observation["text"] == rb.observation["text"]
            assert (ra.reward, ra.done, ra.observation["turn"]) == (0.0, False, 0)
            others = {(await a.reset(seed=s)).observation["text"] for s in (12, 13, 14)}
            assert others - {ra.observation["text"]}
            assert (await a.reset(seed=11)).observation["text"] == ra.observation["text"]
    asyncio.run(run())


def test_a_second_clients_steps_never_touch_the_first_session(web):
    async def run():
        async with client(web, "frozenlake") as a, client(web, "frozenlake") as b:
            await a.reset(seed=2, action_format="no_think")
            await b.reset(seed=2, action_format="no_think")
            ida, idb = (await a.state())["session_id"], (await b.state())["session_id"]
            await a.step({"message": "<answer>Right</answer>"})
            for move in ("Down", "Left", "Up"):
                await b.step({"message": f"<answer>{move}</answer>"})
            sa, sb = await a.state(), await b.state()
            assert (sa["step_count"], sb["step_count"]) == (1, 3)
            on_server = live(web.address, "frozenlake")
            assert (on_server[ida].turn, on_server[idb].turn) == (1, 3)
            assert on_server[ida].last_action == "<answer>Right</answer>"
            assert on_server[idb].last_action == "<answer>Up</answer>"
            # Concurrent steps on both sockets (batched together underneath).
            ra, rb = await asyncio.gather(a.step({"message": "<answer>Down</answer>"}),
                                          b.step({"message": "<answer>Right</answer>"}))
            assert (ra.metadata["session_id"], rb.metadata["session_id"]) == (ida, idb)
            assert (ra.metadata["turn"], rb.metadata["turn"]) == (2, 4)
    asyncio.run(run())


def test_closing_the_socket_closes_the_envserve_session(web):
    async def run():
        env = client(web, "minesweeper")
        await env.connect()
        await env.reset(seed=1)
        sid = (await env.state())["session_id"]
        assert sid in live(web.address, "minesweeper")
        await env.close()
        return sid

    sid = asyncio.run(run())
    wait_until(lambda: sid not in live(web.address, "minesweeper"), "the session closed with its socket")
    # A socket dropped without OpenEnv's close message closes its session too.
    from websockets.sync.client import connect
    import json
    with connect(web.url.replace("http://", "ws://") + "/openenv/sokoban/ws") as ws:
        ws.send(json.dumps({"type": "state"}))
        dropped = json.loads(ws.recv())["data"]["session_id"]
        assert dropped in live(web.address, "sokoban")
    wait_until(lambda: dropped not in live(web.address, "sokoban"), "a dropped socket's session closed")


def test_http_sessions_step_and_are_reclaimed_when_idle(web):
    base = f"{web.url}/openenv/frozenlake"
    with httpx.Client(timeout=30) as http:
        r = http.post(f"{base}/reset", json={"seed": 7, "action_format": "no_think"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert set(body) == {"observation", "reward", "done", "metadata"}
        sid = body["metadata"]["session_id"]
        assert sid in live(web.address, "frozenlake")
        r = http.post(f"{base}/step", json={"session_id": sid, "action": {"message": "<answer>Down</answer>"}})
        assert r.status_code == 200 and r.json()["metadata"]["turn"] == 1
        assert http.get(f"{base}/state", params={"session_id": sid}).json()["step_count"] == 1
        # No session named: OpenEnv's HTTP step has no session of its own here.
        r = http.post(f"{base}/step", json={"action": {"message": "<answer>Down</answer>"}})
        assert r.status_code == 400 and "session_id" in r.json()["message"]
        # Calls keep it alive past the idle timeout; silence past it closes it on the replica.
        for _ in range(3):
            time.sleep(IDLE_SECONDS * 0.3)
            assert http.get(f"{base}/state", params={"session_id": sid}).status_code == 200
        assert sid in live(web.address, "frozenlake")
        wait_until(lambda: sid not in live(web.address, "frozenlake"), "the idle session was reclaimed")
        r = http.post(f"{base}/step", json={"session_id": sid, "action": {"message": "<answer>Down</answer>"}})
        assert r.status_code == 404 and "reclaimed" in r.json()["message"]
        # An explicit close works too.
        sid2 = http.post(f"{base}/reset", json={"seed": 1}).json()["metadata"]["session_id"]
        assert http.post(f"{base}/close", json={"session_id": sid2}).json()["closed"] is True
        assert sid2 not in live(web.address, "frozenlake")


def test_a_socket_can_attach_to_an_http_session_and_keeps_it_alive(web):
    base = f"{web.url}/openenv/frozenlake"
    sid = httpx.post(f"{base}/reset", json={"seed": 7}).json()["metadata"]["session_id"]

    async def run():
        env = GenericEnvClient(base_url=base)
        env._ws_url += f"?session_id={sid}"  # OpenEnv's server attaches a socket by this query too
        async with env:
            assert (await env.state())["session_id"] == sid
            await asyncio.sleep(IDLE_SECONDS * 1.5)   # attached: not reclaimed
            r = await env.step({"message": "<think>-</think><answer>Down</answer>"})
            assert r.metadata["session_id"] == sid and r.metadata["valid_action"]
    asyncio.run(run())
    assert sid in live(web.address, "frozenlake")      # the socket did not own it
    wait_until(lambda: sid not in live(web.address, "frozenlake"), "reclaimed once detached and idle")


def test_invalid_actions_are_feedback_and_bad_messages_errors_on_a_live_socket(web):
    async def run():
        async with client(web, "frozenlake") as env:
            await env.reset(seed=0, action_format="no_think")
            bad = await env.step({"message": "<answer>Sideways</answer>"})
            assert bad.metadata["valid_action"] is False and bad.done is False
            assert bad.metadata["feedback"] and bad.reward < 0
            assert bad.metadata["actions_executed"] == 0 and "Sideways" in bad.metadata["feedback"]
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                await env.step({"code": "print(1)"})          # no action text at all
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                await env.reset(seed=-1)
            ok = await env.step({"message": "<answer>Down</answer>"})
            assert ok.metadata["valid_action"] is True and ok.metadata["turn"] == 2
            with pytest.raises(RuntimeError, match="UNKNOWN_TYPE"):
                await env._send_and_receive({"type": "teleport"})
            assert (await env.state())["step_count"] == 2
            # A config change at reset reopens the session with it.
            before = (await env.state())["session_id"]
            r = await env.reset(seed=0, config={"size": 3}, action_format="no_think")
            assert r.metadata["session_id"] != before and (await env.state())["config"] == {"size": 3}
    asyncio.run(run())


def test_unknown_env_ids_are_a_clear_error(web):
    async def run():
        async with client(web, "nethack") as env:
            with pytest.raises(RuntimeError) as e:
                await env.reset(seed=0)
        return str(e.value)
    message = asyncio.run(run())
    assert "'nethack' is not served" in message and "sokoban" in message and "FACTORY_ERROR" in message
    r = httpx.get(f"{web.url}/openenv/nethack/health")
    assert r.status_code == 404 and "not served" in r.json()["message"]
    assert httpx.post(f"{web.url}/openenv/nethack/reset", json={}).status_code == 404


def test_health_schema_and_metadata(web):
    base = f"{web.url}/openenv/sokoban"
    assert httpx.get(f"{base}/health").json() == {"status": "healthy"}
    schema = httpx.get(f"{base}/schema").json()
    assert set(schema) == {"action", "observation", "state"}
    assert schema["action"]["required"] == ["message"]
    assert "no_think" in schema["action"]["properties"]["message"]["description"]
    meta = httpx.get(f"{base}/metadata").json()
    assert meta["name"] == "sokoban" and "Sokoban" in meta["readme_content"]


def test_an_episode_out_of_turns_is_done_for_openenvs_client(web):
    """OpenEnv has one `done`: the turn limit ends the episode there too, with truncated in the
    metadata, so a client looping until done never steps into an ended episode."""
    async def run():
        async with client(web, "sokoban") as env:
            r = await env.reset(seed=4, action_format="no_think", config={"max_turns": 3})
            steps = 0
            while not r.done:
                r = await env.step({"message": plain_answer("no_think", [["Left", "Right"][steps % 2]])})
                steps += 1
            assert steps == 3 and r.metadata["truncated"] is True and r.metadata["success"] is False
            assert (await env.state())["done"] is True
    asyncio.run(run())
