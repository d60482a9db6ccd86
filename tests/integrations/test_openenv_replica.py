"""A replica serving OpenEnv's protocol itself (`envserve serve --openenv-port`): many sockets
stepping at once, whose steps go to the workers in shared batches, each get their own session's
result; tokens guard it as they guard the replica's gRPC services; a gRPC client and an OpenEnv
socket meet the same sessions. (test_openenv.py plays whole episodes through it with OpenEnv's
own client.)"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

pytest.importorskip("openenv")

from openenv import GenericEnvClient  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from envserve.v1 import envserve_pb2 as pb  # noqa: E402
from envserve.v1 import envserve_pb2_grpc as pb_grpc  # noqa: E402
from serverproc import ServerProcess  # noqa: E402

MOVES = ["Left", "Down", "Right", "Up"]


def openenv_url(server: ServerProcess) -> str:
    line = next(x for x in server.output if "envserve openenv on " in x)
    return line.split("envserve openenv on ")[1].split()[0]


def live(address: str, metadata=()) -> dict[str, pb.SessionSummary]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(limit=10000), metadata=metadata)
    return {s.session_id: s for s in reply.sessions}


@pytest.fixture(scope="module")
def replica():
    with ServerProcess(["frozenlake", "sokoban"], workers=2, metrics=False, extra=["--openenv-port", "0"]) as s:
        yield s


def test_sixty_four_sockets_stepping_at_once_each_get_their_own_sessions_results(replica):
    base = openenv_url(replica) + "/frozenlake"
    n, steps = 64, 6

    async def one(k: int):
        async with connect(base.replace("http://", "ws://") + "/ws", ping_interval=None) as ws:
            await ws.send(json.dumps({"type": "reset", "data": {"seed": k % 5, "action_format": "no_think"}}))
            first = json.loads(await ws.recv())
            assert first["type"] == "observation", first
            sid = first["data"]["metadata"]["session_id"]
            seen = []
            for i in range(steps):
                # A different action sequence per socket: a result given to the wrong socket shows.
                move = MOVES[(k + i) % 4]
                await ws.send(json.dumps({"type": "step", "data": {"message": f"<answer>{move}</answer>"}}))
                reply = json.loads(await ws.recv())
                assert reply["type"] == "observation", reply
                seen.append((reply["data"]["metadata"]["session_id"], reply["data"]["metadata"]["turn"],
                             reply["data"]["metadata"]["parsed_actions"]))
                if reply["data"]["done"]:
                    break
            await ws.send(json.dumps({"type": "state"}))
            state = json.loads(await ws.recv())["data"]
            on_replica = live(replica.address)[sid]
            return k, sid, seen, state, on_replica

    async def run():
        return await asyncio.gather(*[one(k) for k in range(n)])

    results = asyncio.run(run())
    assert len({sid for _, sid, _, _, _ in results}) == n
    for k, sid, seen, state, on_replica in results:
        assert [s for s, _, _ in seen] == [sid] * len(seen)
        assert [t for _, t, _ in seen] == list(range(1, len(seen) + 1))
        assert [a for _, _, a in seen] == [[MOVES[(k + i) % 4]] for i in range(len(seen))]
        assert state["session_id"] == sid and state["step_count"] == len(seen)
        # The replica's record agrees: that socket's last move, at that turn.
        assert on_replica.turn == len(seen)
        assert on_replica.last_action == f"<answer>{MOVES[(k + len(seen) - 1) % 4]}</answer>"


def test_a_grpc_client_and_a_socket_meet_the_same_sessions(replica):
    # FrozenLake from its start corner: Left and Up walk into the wall, so the episode goes on.
    base = openenv_url(replica) + "/frozenlake"
    sid = httpx.post(f"{base}/reset", json={"seed": 3, "action_format": "no_think"}).json()["metadata"]["session_id"]
    with grpc.insecure_channel(replica.address) as ch:
        stub = pb_grpc.EnvServiceStub(ch)
        r = stub.Step(pb.StepRequest(items=[pb.StepItem(session_id=sid, action="<answer>Left</answer>")])).results[0]
        assert r.status.code == 0 and r.turn == 1

    async def run():
        env = GenericEnvClient(base_url=base)
        env._ws_url += f"?session_id={sid}"
        async with env:
            step = await env.step({"message": "<answer>Up</answer>"})
            return step, await env.state()
    step, state = asyncio.run(run())
    assert step.metadata["session_id"] == sid and step.metadata["turn"] == 2 and step.done is False
    assert state["session_id"] == sid
    assert live(replica.address)[sid].last_action == "<answer>Up</answer>"
    assert httpx.post(f"{base}/close", json={"session_id": sid}).json()["closed"] is True
    assert sid not in live(replica.address)


def test_tokens_guard_the_replicas_openenv_endpoint(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token\nbob-token\n")
    alice, bob = {"Authorization": "Bearer alice-token"}, {"Authorization": "Bearer bob-token"}
    with ServerProcess(["frozenlake"], workers=1, metrics=False,
                       extra=["--token-file", str(tokens), "--openenv-port", "0"]) as s:
        base = openenv_url(s) + "/frozenlake"
        assert httpx.get(f"{base}/health").status_code == 401
        assert httpx.post(f"{base}/reset", json={"seed": 1}).status_code == 401
        assert httpx.get(f"{base}/health", headers=alice).json() == {"status": "healthy"}
        sid = httpx.post(f"{base}/reset", json={"seed": 1}, headers=alice).json()["metadata"]["session_id"]
        r = httpx.post(f"{base}/step", json={"session_id": sid, "action": {"message": "<answer>Down</answer>"}},
                       headers=alice)
        assert r.status_code == 200 and r.json()["metadata"]["turn"] == 1
        # Another token's steps on alice's session are refused by the replica, not run.
        r = httpx.post(f"{base}/step", json={"session_id": sid, "action": {"message": "<answer>Down</answer>"}},
                       headers=bob)
        assert r.status_code == 403 and "another token" in r.json()["message"]
        assert live(s.address, (("authorization", "Bearer alice-token"),))[sid].turn == 1

        async def socket(headers):
            async with connect(base.replace("http://", "ws://") + "/ws", additional_headers=headers,
                               ping_interval=None) as ws:
                if not headers:  # refused as the socket opens its session: the error comes unasked
                    return json.loads(await ws.recv())
                await ws.send(json.dumps({"type": "reset", "data": {"seed": 0}}))
                return json.loads(await ws.recv())
        refused = asyncio.run(socket({}))
        assert refused["type"] == "error" and "bearer token" in refused["data"]["message"]
        assert asyncio.run(socket(bob))["type"] == "observation"
