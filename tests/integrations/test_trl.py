"""envserve.integrations.trl: TRL's environment_factory over real sessions, and GRPOTrainer training
through it on FrozenLake (a real server on loopback, a tiny random-weight model on the CPU)."""
from __future__ import annotations

import gc
import inspect
import json
import os

import grpc
import pytest

pytest.importorskip("trl")

from transformers.utils.chat_template_utils import get_json_schema  # noqa: E402

from envserve.client import EnvClient, SessionNotFoundError  # noqa: E402
from envserve.integrations.trl import environment_factory  # noqa: E402
from envserve.v1 import envserve_pb2 as pb  # noqa: E402
from envserve.v1 import envserve_pb2_grpc as pb_grpc  # noqa: E402


def tool_names(cls) -> list[str]:
    """The methods TRL turns into tools: public functions of the class but reset and get_reward."""
    return sorted(name for name, _ in inspect.getmembers(cls, inspect.isfunction)
                  if name not in ("reset", "get_reward") and not name.startswith("_"))


def schema(instance, name: str) -> dict:
    return get_json_schema(getattr(instance, name))["function"]


def live_session_ids(address: str, env_id: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        reply = pb_grpc.MonitorServiceStub(ch).ListSessions(pb.ListSessionsRequest(env_id=env_id, limit=10000))
    return {s.session_id for s in reply.sessions}


@pytest.fixture
def factory(grid_server):
    """environment_factory on the shared grid server; every class made is closed afterwards."""
    made = []

    def make(env_id, **kw):
        made.append(environment_factory(grid_server.address, env_id, **kw))
        return made[-1]
    yield make
    for cls in made:
        cls.close()


# -- tools from the spec ---------------------------------------------------------------------------
def test_tools_follow_each_envs_action_space(factory):
    frozenlake, sokoban, mines = factory("frozenlake")(), factory("sokoban")(), factory("minesweeper")()
    assert tool_names(type(frozenlake)) == tool_names(type(sokoban)) == ["move"]
    assert tool_names(type(mines)) == ["reveal"]
    # The choices come from GetSpec's action space, in the env's own order.
    move = schema(frozenlake, "move")
    assert move["parameters"]["properties"]["direction"]["enum"] == ["Left", "Down", "Right", "Up"]
    assert move["parameters"]["required"] == ["direction"]
    assert schema(sokoban, "move")["parameters"]["properties"]["direction"]["enum"] == ["Up", "Down", "Left", "Right"]
    reveal = schema(mines, "reveal")["parameters"]
    assert {k: v["type"] for k, v in reveal["properties"].items()} == {"row": "integer", "col": "integer"}
    # The generic tool: the action text, with the spec's description of the action space.
    act_cls = factory("frozenlake", tools="act")
    act = schema(act_cls(), "act")
    assert tool_names(act_cls) == ["act"] and list(act["parameters"]["properties"]) == ["action"]
    assert "Left, Down, Right, Up" in act["parameters"]["properties"]["action"]["description"]
    assert type(frozenlake).__name__ == "EnvServeFrozenlake"
    with pytest.raises(ValueError, match="unknown action format"):
        factory("frozenlake", action_format="shouting")


def test_reset_with_a_seed_is_deterministic_and_reads_the_row(factory):
    cls = factory("sokoban")
    a, b = cls(), cls()
    first = a.reset(seed=5, prompt=[{"role": "user", "content": "ignored"}])
    assert first == b.reset(seed=5) == a.reset(seed=5)
    assert a.session_id != b.session_id
    assert "You are playing Sokoban" in first       # the rules come first, then the grid
    others = {a.reset(seed=s) for s in range(6, 10)}
    assert len(others | {first}) > 1
    assert a.reset(task_id="5") == first              # a task id is the seed of a generated family
    no_rules = factory("sokoban", include_rules=False)()
    assert no_rules.reset(seed=5) == first.rsplit("\n\n", 1)[1]


def test_invalid_actions_and_finished_episodes_come_back_as_text(factory):
    env = factory("frozenlake", config={"max_turns": 3})()
    env.reset(seed=0)
    out = env.move("Sideways")
    assert "Invalid action" in out and "Reward: -0.1" in out
    assert "one action per call" in env.move("Left, Up")  # refused before any step: no penalty
    assert env.get_reward() == pytest.approx(-0.1)
    assert env.last_result.action_valid is False
    env.move("Left")
    out = env.move("Left")                            # the third turn hits max_turns
    assert "turn limit" in out
    assert "episode is over" in env.move("Down")
    assert env.get_reward() == pytest.approx(-0.3)
    assert env.reset(seed=0) and env.get_reward() == 0.0   # a new episode starts from zero

    mines = factory("minesweeper")()
    mines.reset(seed=1)
    assert "Invalid action" in mines.reveal(9, 9)
    assert "whole numbers" in mines.reveal("two", 3)
    assert "Revealed (2, 3)" in mines.reveal(2, 3)


def test_a_replica_that_dies_mid_episode_ends_the_rollout_with_text():
    from serverproc import ServerProcess
    with ServerProcess(["frozenlake"], workers=1, metrics=False) as server:
        cls = environment_factory(server.address, "frozenlake", timeout=10)
        env = cls()
        env.reset(seed=0)
        server.kill()
        out = env.move("Down")
        assert out.startswith("Error: the environment failed (UNAVAILABLE")
        assert "episode is over" in env.move("Down")
        cls.close()  # best effort, and quick, with the replica gone


def test_images_come_as_content_blocks(factory):
    env = factory("frozenlake", config={"render_image": True, "image_size": 64})()
    blocks = env.reset(seed=1)
    assert [b["type"] for b in blocks] == ["image", "text"]
    assert blocks[0]["image"].size == (64, 64) and "P" in blocks[1]["text"]
    assert [b["type"] for b in env.move("Right")] == ["image", "text"]


def test_sessions_are_closed_by_the_pool_and_by_garbage_collection(grid_server, factory):
    cls = factory("frozenlake")
    kept, dropped = cls(), cls()
    kept.reset(seed=0)
    dropped.reset(seed=0)
    sid = dropped.session_id
    del dropped
    gc.collect()
    with EnvClient(grid_server.address) as c:
        with pytest.raises(SessionNotFoundError):
            c.step_one(sid, "<answer>Left</answer>")
        # A session the server dropped (here: closed behind the pool's back, as an expired lease
        # would be) is opened again by the next reset.
        c.close_sessions([kept.session_id])
    old = kept.session_id
    assert "P" in kept.reset(seed=0) and kept.session_id != old
    live = kept.session_id
    assert live in live_session_ids(grid_server.address, "frozenlake")
    cls.close()
    assert live not in live_session_ids(grid_server.address, "frozenlake")
    # After close, the class still works: the next reset opens a new channel and session.
    assert "P" in kept.reset(seed=0)


# -- GRPOTrainer end to end ------------------------------------------------------------------------
def tool_calling_tokenizer(address: str, directions: list[str]):
    """The trainer's grid tokenizer with the Qwen2.5 chat template that TRL knows how to parse tool
    calls from, and one token per complete `move` call, so that a random model whose sampling is
    restricted to those tokens and end-of-turn makes only well-formed tool calls."""
    from tokenizers import AddedToken
    from trl.chat_template_utils import qwen2_5_chat_template

    from envserve_trainer.model import build_tokenizer, corpus_from_envs
    with EnvClient(address) as c:
        tok = build_tokenizer(corpus_from_envs(c, ["frozenlake"], seeds=range(2), steps=3))
    calls = ["<tool_call>\n" + json.dumps({"name": "move", "arguments": {"direction": d}}) + "\n</tool_call>"
             for d in directions]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<tool_call>", "</tool_call>", *calls]])
    tok.chat_template = qwen2_5_chat_template
    allowed = {tok.convert_tokens_to_ids(t) for t in calls} | {tok.eos_token_id}
    return tok, [i for i in range(len(tok)) if i not in allowed]


def test_grpo_trainer_learns_from_envserve_rewards(grid_server, tmp_path, monkeypatch):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from envserve_trainer.model import build_small_model

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    FrozenLake = environment_factory(grid_server.address, "frozenlake")
    episodes: list[float] = []

    class Recorded(FrozenLake):
        """Records what get_reward hands to TRL, to compare with what TRL logs."""

        def get_reward(self) -> float:
            episodes.append(super().get_reward())
            return episodes[-1]

    tok, suppress = tool_calling_tokenizer(grid_server.address, ["Left", "Down", "Right", "Up"])
    model = build_small_model(tok, "tiny", seed=0)
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Reach the goal.\n"}]] * 4,
                              "seed": [0, 1, 2, 3]})
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=48, max_tool_calling_iterations=4, logging_steps=1,
                      generation_kwargs={"suppress_tokens": suppress}, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tok,
                          environment_factory=Recorded)
    try:
        trainer.train()
        sessions = set(FrozenLake._pool.sessions)
    finally:
        FrozenLake.close()

    steps = [h for h in trainer.state.log_history if "rewards/Recorded/mean" in h]
    assert len(steps) == 2
    # TRL's reward column is the env's episode return: per step, the mean over that step's 4 rollouts.
    assert len(episodes) == 8
    for i, h in enumerate(steps):
        assert h["rewards/Recorded/mean"] == pytest.approx(sum(episodes[4 * i:4 * i + 4]) / 4, abs=1e-6)
        assert h["reward"] == pytest.approx(h["rewards/Recorded/mean"], abs=1e-6)
        assert h["tools/call_frequency"] > 0 and h["tools/failure_frequency"] == 0
    assert any(r != 0 for r in episodes)              # tool calls reached the env and were rewarded
    # One pooled instance per concurrent rollout, each with its own session; all closed afterwards.
    assert len(sessions) == 4
    assert not sessions & live_session_ids(grid_server.address, "frozenlake")
    with EnvClient(grid_server.address) as c:
        for sid in sessions:
            with pytest.raises(SessionNotFoundError):
                c.step_one(sid, "<answer>Left</answer>")
