"""Environments as MCP tools, over the streamable-HTTP transport: the `mcp` SDK's own client and
LangChain's MCP adapters (langchain-mcp-adapters, what LangGraph agents load tools with) list the
tools and play Sokoban (text and images) and FrozenLake to success with their experts' moves,
through `envserve mcp` in front of a replica and through a replica's own `--mcp-port`. A bad
action is the env's invalid action; ground truth is a tool only where the operator turns it on;
an MCP session is its opener token's alone."""
from __future__ import annotations

import asyncio
import base64
import json
import re

import pytest

pytest.importorskip("mcp")

from mcp import ClientSession  # noqa: E402
from mcp.client.streamable_http import streamablehttp_client  # noqa: E402

from envserve.client import EnvClient  # noqa: E402
from envserve.client.experts import play_expert  # noqa: E402
from serverproc import ServerProcess, start_cli, wait_until  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
_MCP_LINE = re.compile(r"envserve mcp on (https?://\S+)")
JSON_RPC = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}}


class McpProcess:
    """`envserve mcp` over fixed replicas, on a free loopback port."""

    def __init__(self, replicas, extra=()):
        args = ["mcp", "--port", "0", *[a for r in replicas for a in ("--replica", r)], *extra]
        self.proc, m, self.output = start_cli(args, _MCP_LINE, what="mcp endpoint")
        self.url = m.group(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def replica_mcp_url(server: ServerProcess) -> str:
    wait_until(lambda: any("envserve mcp on " in x for x in server.output), "the replica's MCP endpoint line")
    line = next(x for x in server.output if "envserve mcp on " in x)
    return line.split("envserve mcp on ")[1].split()[0]


@pytest.fixture(scope="module")
def replica():
    with ServerProcess(["sokoban", "frozenlake"], workers=2, metrics=False, extra=["--mcp-port", "0"]) as s:
        yield s


@pytest.fixture(scope="module")
def facade(replica):
    with McpProcess([replica.address]) as m:
        yield m


@pytest.fixture(scope="module")
def truth_facade(replica):
    with McpProcess([replica.address], extra=["--ground-truth"]) as m:
        yield m


def expert_answers(replica, env_id: str, seed: int) -> list[str]:
    """The expert's turns for a seed, played on a session of its own (the same seed starts the same)."""
    with EnvClient(replica.address) as c:
        [game] = play_expert(c, env_id, [seed], "no_think")
    assert game.success
    return [", ".join(t.move.actions) for t in game.turns]


def run(coro):
    return asyncio.run(coro)


def live_ids(address: str) -> set[str]:
    import grpc

    from envserve.v1 import envserve_pb2 as pb
    from envserve.v1 import envserve_pb2_grpc as pb_grpc
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(limit=10000))
    return {x.session_id for x in reply.sessions}


async def play_sdk(url: str, answers: list[str], seed: int, config: dict | None = None, token: str | None = None):
    """tools/list, reset, then each answer as a step; returns (tool names, reset result, step results)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with streamablehttp_client(url, headers=headers) as (read, write, _):
        async with ClientSession(read, write) as s:
            await s.initialize()
            names = [t.name for t in (await s.list_tools()).tools]
            args = {"seed": seed, **({"config": config} if config else {})}
            first = await s.call_tool("reset", args)
            steps = [await s.call_tool("step", {"action": a}) for a in answers]
    return names, first, steps


@pytest.mark.parametrize("door", ["facade", "replica"])
@pytest.mark.parametrize("env_id,seed", [("sokoban", 3), ("frozenlake", 5)])
def test_the_sdk_client_plays_to_success_with_rewards_in_structured_content(door, env_id, seed, replica, facade):
    url = (facade.url if door == "facade" else replica_mcp_url(replica)) + f"/{env_id}"
    answers = expert_answers(replica, env_id, seed)
    names, first, steps = run(play_sdk(url, answers, seed))
    assert names == ["step", "reset"]                          # no ground truth without the flag
    assert not first.isError and "<answer>" in first.content[0].text   # the rules come with the first observation
    assert first.structuredContent["turn"] == 0 and not first.structuredContent["done"]
    assert [s.isError for s in steps] == [False] * len(steps)
    done = [s.structuredContent["done"] for s in steps]
    assert done == [False] * (len(steps) - 1) + [True]
    last = steps[-1].structuredContent
    assert last["success"] is True and last["reward"] > 0 and last["turn"] == len(steps)
    assert all(s.structuredContent["action_valid"] for s in steps)
    assert all(s.content[0].type == "text" and s.content[0].text for s in steps)


def test_visual_sokoban_sends_png_image_content(facade):
    async def go():
        async with streamablehttp_client(facade.url + "/sokoban") as (read, write, _):
            async with ClientSession(read, write) as s:
                await s.initialize()
                text_only = await s.call_tool("reset", {"seed": 1})
                # Another config opens a new envserve session with it, as envserve fixes one at Open.
                visual = await s.call_tool("reset", {"seed": 1, "config": {"render_image": True}})
                moved = await s.call_tool("step", {"action": "Up"})
                return text_only, visual, moved
    text_only, visual, moved = run(go())
    assert [c.type for c in text_only.content] == ["text"]
    assert visual.structuredContent["session_id"] != text_only.structuredContent["session_id"]
    for r in (visual, moved):
        assert [c.type for c in r.content] == ["text", "image"]
        assert r.content[1].mimeType == "image/png" and base64.b64decode(r.content[1].data).startswith(PNG)
    assert moved.structuredContent["session_id"] == visual.structuredContent["session_id"]


def test_a_malformed_action_is_an_invalid_action_and_a_wrong_call_a_tool_error(facade):
    async def go():
        async with streamablehttp_client(facade.url + "/frozenlake") as (read, write, _):
            async with ClientSession(read, write) as s:
                await s.initialize()
                bad = await s.call_tool("step", {"action": "fly to the moon"})    # opens and resets first
                wrong_type = await s.call_tool("step", {"action": 7})
                unknown = await s.call_tool("state", {})
                bad_seed = await s.call_tool("reset", {"seed": -1})
                return bad, wrong_type, unknown, bad_seed
    bad, wrong_type, unknown, bad_seed = run(go())
    assert not bad.isError and bad.structuredContent["action_valid"] is False
    assert bad.structuredContent["feedback"] and bad.structuredContent["turn"] == 1
    assert wrong_type.isError and wrong_type.content[0].text.startswith("INVALID_ARGUMENT: step takes")
    assert unknown.isError and "unknown tool 'state'" in unknown.content[0].text
    assert bad_seed.isError and "seed must be" in bad_seed.content[0].text


def test_an_env_no_replica_serves_is_refused_when_the_session_opens(facade):
    import httpx
    got = httpx.post(facade.url + "/nope", json=INITIALIZE, headers=JSON_RPC)
    assert got.status_code == 404
    assert got.json()["error"]["message"].startswith("NOT_FOUND: env 'nope' is not served")


@pytest.fixture(scope="module")
def truth_replica():
    with ServerProcess(["sokoban"], workers=1, metrics=False, extra=["--mcp-port", "0", "--mcp-ground-truth"]) as s:
        yield s


@pytest.mark.parametrize("door", ["facade", "replica"])
def test_ground_truth_is_a_tool_only_with_the_operators_flag(door, request):
    if door == "facade":
        replica, url = request.getfixturevalue("replica"), request.getfixturevalue("truth_facade").url
    else:
        replica = request.getfixturevalue("truth_replica")
        url = replica_mcp_url(replica)

    async def go():
        async with streamablehttp_client(url + "/sokoban") as (read, write, _):
            async with ClientSession(read, write) as s:
                await s.initialize()
                names = [t.name for t in (await s.list_tools()).tools]
                early = await s.call_tool("state", {})
                first = await s.call_tool("reset", {"seed": 3})
                truth = await s.call_tool("state", {})
                with EnvClient(replica.address) as c:   # the same session read over gRPC, while it lives
                    direct = await asyncio.to_thread(c.get_state, first.structuredContent["session_id"])
                return names, early, first, truth, direct
    names, early, first, truth, direct = run(go())
    assert names == ["step", "reset", "state"]
    assert early.isError and early.content[0].text.startswith("FAILED_PRECONDITION")
    assert truth.structuredContent["relations"] == list(direct.relations) and truth.structuredContent["turn"] == 0
    assert truth.structuredContent["state"] == json.loads(direct.state_json)   # integers stay integers
    assert all(isinstance(x, int) for x in truth.structuredContent["state"]["player"])


def test_an_mcp_session_is_its_openers_token_alone(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("alice-key name=alice\nbob-key name=bob\n")
    with ServerProcess(["frozenlake"], workers=1, metrics=False,
                       extra=["--token-file", str(tokens), "--mcp-port", "0"]) as r:
        url = replica_mcp_url(r) + "/frozenlake"

        async def go():
            async with streamablehttp_client(url, headers={"Authorization": "Bearer alice-key"}) as (read, write, sid):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    mine = await s.call_tool("reset", {"seed": 2})
                    alice_sid = sid()
                    # Bob presents Alice's MCP session id with his own token: as if it did not exist.
                    import httpx
                    async with httpx.AsyncClient() as http:
                        hijack = await http.post(url, headers={
                            "Authorization": "Bearer bob-key", "mcp-session-id": alice_sid,
                            "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                            "mcp-protocol-version": "2025-06-18"},
                            json={"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                                  "params": {"name": "step", "arguments": {"action": "Left"}}})
                        anonymous = await http.delete(url, headers={"mcp-session-id": alice_sid})
                        stranger = await http.post(url, headers={"Authorization": "Bearer mallory-key", **JSON_RPC},
                                                   json=INITIALIZE)
                    after = await s.call_tool("step", {"action": "Left"})   # still Alice's, untouched
                    return mine, hijack, anonymous, stranger, after
        mine, hijack, anonymous, stranger, after = run(go())
    assert not mine.isError
    assert hijack.status_code == 404 and anonymous.status_code == 404
    assert stranger.status_code == 401 and "UNAUTHENTICATED" in stranger.text
    assert not after.isError and after.structuredContent["turn"] == 1
    assert after.structuredContent["session_id"] == mine.structuredContent["session_id"]


def test_sessions_past_the_operators_limit_are_refused_and_ended_ones_close():
    with ServerProcess(["frozenlake"], workers=1, metrics=False,
                       extra=["--mcp-port", "0", "--mcp-max-sessions", "1"]) as r:
        url = replica_mcp_url(r) + "/frozenlake"

        async def go():
            async with streamablehttp_client(url) as (read, write, _):
                async with ClientSession(read, write) as s:
                    await s.initialize()
                    first = await s.call_tool("reset", {"seed": 0})
                    import httpx
                    async with httpx.AsyncClient() as http:
                        full = await http.post(url, headers=JSON_RPC, json=INITIALIZE)
            # The client's exit DELETEs the MCP session: its envserve session closes, and there is room.
            again = await play_sdk(url, [], 0)
            return first, full, again
        first, full, again = run(go())
        sid = first.structuredContent["session_id"]
        wait_until(lambda: sid not in live_ids(r.address), "the ended MCP session's envserve session closed")
    assert full.status_code == 503 and "--mcp-max-sessions" in full.text
    assert not again[1].isError


def test_langchain_mcp_adapters_play_sokoban_and_frozenlake(replica, facade):
    pytest.importorskip("langchain_mcp_adapters")
    from langchain_mcp_adapters.client import MultiServerMCPClient
    from langchain_mcp_adapters.tools import load_mcp_tools
    servers = {env: {"url": f"{facade.url}/{env}", "transport": "streamable_http"} for env in ("sokoban", "frozenlake")}
    plans = {env: (seed, expert_answers(replica, env, seed)) for env, seed in (("sokoban", 3), ("frozenlake", 5))}

    async def go():
        client = MultiServerMCPClient(servers)
        out = {}
        for env, (seed, answers) in plans.items():
            # One MCP session for the whole episode: the tools loaded from it share its envserve session.
            async with client.session(env) as session:
                tools = {t.name: t for t in await load_mcp_tools(session)}
                await tools["reset"].ainvoke({"seed": seed})
                last = None
                for i, a in enumerate(answers):
                    last = await tools["step"].ainvoke({"type": "tool_call", "id": f"c{i}", "name": "step",
                                                        "args": {"action": a}})
                out[env] = (sorted(tools), last)
        return out
    out = run(go())
    for env, (names, last) in out.items():
        assert names == ["reset", "step"]
        assert last.artifact["structured_content"]["success"] is True, env
        assert last.artifact["structured_content"]["done"] is True


def test_a_household_text_game_plays_to_the_end_through_the_replicas_endpoint():
    """ALFWorld (generated games): words in, words out, its handcoded expert's commands as the
    agent's, to the task's end."""
    with ServerProcess(["alfworld"], workers=1, metrics=False, extra=["--mcp-port", "0"]) as s:
        answers = expert_answers(s, "alfworld", 2)
        names, first, steps = run(play_sdk(replica_mcp_url(s) + "/alfworld", answers, 2))
    assert names == ["step", "reset"]
    assert "Your task is to" in first.content[0].text
    assert [x.structuredContent["action_valid"] for x in steps] == [True] * len(steps)
    assert steps[-1].structuredContent["done"] and steps[-1].structuredContent["success"]
    assert not any(x.structuredContent["done"] for x in steps[:-1])
