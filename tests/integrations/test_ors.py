"""The Open Reward Standard door of the facade, driven by the ORS client package (ors-sdk) from
PyPI: splits and tasks, sessions on a task, the env's reward inline with each tool output, a grid
game and a text game (ALFWorld) played to success with their experts' moves, and the ownership rule."""
import pytest

ors_client = pytest.importorskip("ors.client")

from envserve.client import EnvClient  # noqa: E402
from envserve.client.experts import play_expert  # noqa: E402
from serverproc import ServerProcess  # noqa: E402
from webproc import WebProcess  # noqa: E402


@pytest.fixture(scope="module")
def replica():
    with ServerProcess(["sokoban", "alfworld"], workers=2, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def facade(replica):
    with WebProcess.facade([replica.address]) as w:
        yield w


def expert_turns(replica, env_id: str, task) -> list[str]:
    """The expert's answers for the task, played on a session of their own (same task id, same start)."""
    with EnvClient(replica.address) as c:
        [game] = play_expert(c, env_id, [int(task.task_spec["seed"])], "no_think",
                             split=task.task_spec["split"])
    assert game.success
    return [", ".join(t.move.actions) for t in game.turns]


def test_splits_and_tasks_are_envserves_listing(facade, replica):
    import httpx
    assert httpx.get(f"{facade.url}/list_environments").json() == ["alfworld", "sokoban"]
    with ors_client.ORS(base_url=facade.url) as client:
        env = client.environment("alfworld")
        assert {"train", "valid_seen", "valid_unseen"} <= set(env.list_splits())
        with EnvClient(replica.address) as c:
            listed = c.list_tasks("alfworld", "valid_unseen", 5)
        assert env.num_tasks("valid_unseen") == listed.total
        assert [t.task_spec["task_id"] for t in env.get_task_range("valid_unseen", 0, 5)] == \
               [t.task_id for t in listed.tasks]
        third = env.get_task("valid_unseen", 2)
        assert third.task_spec["task_type"] == listed.tasks[2].task_type and third.environment_name == "alfworld"
        big = client.environment("sokoban")
        assert big.num_tasks("train") == 1_000_000
        with pytest.raises(Exception, match="index-based"):
            big.list_tasks("train")                 # a million tasks are paged, never listed whole
        with pytest.raises(Exception, match="Invalid split"):
            big.num_tasks("nope")


@pytest.mark.parametrize("env_id,split", [("sokoban", "test"), ("alfworld", "valid_seen")])
def test_the_experts_moves_played_through_ors_reach_success_with_rewards_inline(facade, replica, env_id, split):
    with ors_client.ORS(base_url=facade.url) as client:
        env = client.environment(env_id)
        task = env.get_task(split, 3)
        answers = expert_turns(replica, env_id, task)
        with env.session(task=task) as session:
            prompt = session.get_prompt()
            assert "<answer>" in prompt[0].text                 # the rules and the answer format
            [tool] = session.list_tools()
            assert tool.name == "act" and "action" in tool.input_schema["properties"]
            outputs = [session.call_tool("act", {"action": a}) for a in answers]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].metadata["success"] is True and outputs[-1].reward > 0
    assert all(o.reward is not None and o.blocks[0].text for o in outputs)


def test_bad_calls_are_tool_errors_and_sessions_are_their_tokens(tmp_path):
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("alice-key name=alice\nbob-key name=bob\n")
    with ServerProcess(["frozenlake"], workers=1, metrics=False, extra=["--token-file", str(tokens)]) as r, \
            WebProcess.facade([r.address]) as w:
        with ors_client.ORS(base_url=w.url, api_key="alice-key") as alice:
            env = alice.environment("frozenlake")
            with env.session(split="test", index=0) as session:
                with pytest.raises(ors_client.ToolCallError, match="unknown tool"):
                    session.call_tool("jump", {})
                with pytest.raises(ors_client.ToolCallError, match="action"):
                    session.call_tool("act", {"move": 1})
                out = session.call_tool("act", {"action": "Sideways"})
                assert out.metadata["valid_action"] is False and not out.finished
                # Bob, with Alice's session id, is refused before anything happens to it.
                import httpx
                refused = httpx.post(f"{w.url}/frozenlake/call", headers={"X-API-Key": "bob-key",
                                                                         "X-Session-ID": session.sid},
                                     json={"name": "act", "input": {"action": "Left"}})
                assert refused.status_code == 403 and "another token" in refused.json()["detail"]
                assert httpx.post(f"{w.url}/ping", headers={"X-Session-ID": session.sid}).status_code == 401
        with ors_client.ORS(base_url=w.url) as anonymous, pytest.raises(Exception):
            anonymous.environment("frozenlake").num_tasks("test")
