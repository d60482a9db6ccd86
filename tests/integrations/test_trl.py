"""envserve.integrations.trl: TRL's environment_factory over real sessions, and GRPOTrainer training
through it on FrozenLake (a real server on loopback, a tiny random-weight model on the CPU)."""
from __future__ import annotations

import functools
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
        # Recovery off: the only replica is gone (across replicas: tests/integrations/test_replicas.py).
        cls = environment_factory(server.address, "frozenlake", timeout=10, recovery=False)
        env = cls()
        env.reset(seed=0)
        server.kill()
        out = env.move("Down")
        assert out.startswith("Error: the environment failed (DATA_LOSS") and "is gone" in out
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
        # would be) is rebuilt by the next reset: the same id for TRL, another on the replica.
        c.close_sessions([kept.session_id])
    old = kept.session_id
    assert "P" in kept.reset(seed=0) and kept.session_id == old and kept._session.real_id != old
    live = kept._session.real_id
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

    from envserve_trainer.models.small import build_tokenizer, corpus_from_envs
    with EnvClient(address) as c:
        tok = build_tokenizer(corpus_from_envs(c, ["frozenlake"], seeds=range(2), steps=3))
    calls = ["<tool_call>\n" + json.dumps({"name": "move", "arguments": {"direction": d}}) + "\n</tool_call>"
             for d in directions]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ["<tool_call>", "</tool_call>", *calls]])
    tok.chat_template = qwen2_5_chat_template
    allowed = {tok.convert_tokens_to_ids(t) for t in calls} | {tok.eos_token_id}
    return tok, [i for i in range(len(tok)) if i not in allowed]


def frozenlake_run(address: str, out_dir, **config):
    """The tool-calling tokenizer, four FrozenLake rows (seeds 0-3) and a CPU GRPOConfig with `config`."""
    from datasets import Dataset
    from trl import GRPOConfig
    tok, suppress = tool_calling_tokenizer(address, ["Left", "Down", "Right", "Up"])
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Reach the goal.\n"}]] * 4,
                              "seed": [0, 1, 2, 3]})
    args = GRPOConfig(output_dir=str(out_dir), per_device_train_batch_size=4, logging_steps=1,
                      generation_kwargs={"suppress_tokens": suppress}, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", seed=0, disable_tqdm=True, **config)
    return tok, rows, args


def test_grpo_trainer_learns_from_envserve_rewards(grid_server, tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from envserve_trainer.models.small import build_small_model

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    FrozenLake = environment_factory(grid_server.address, "frozenlake")
    episodes: list[float] = []

    class Recorded(FrozenLake):
        """Records what get_reward hands to TRL, to compare with what TRL logs."""

        def get_reward(self) -> float:
            episodes.append(super().get_reward())
            return episodes[-1]

    tok, rows, args = frozenlake_run(grid_server.address, tmp_path, max_steps=2, num_generations=4,
                                     max_completion_length=48, max_tool_calling_iterations=4)
    model = build_small_model(tok, "tiny", seed=0)
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


def patches(pixel_values, grids) -> list[bytes]:
    """Qwen2-VL's flattened patches split into one byte string per image (grid: its t, h, w)."""
    sizes = [t * h * w for t, h, w in grids]
    return [chunk.numpy().tobytes() for chunk in pixel_values.float().split(sizes)]


def test_grpo_trainer_trains_a_qwen2_vl_on_envserve_pictures(grid_server, tmp_path, monkeypatch):
    """GRPOTrainer with a tiny random-weight Qwen2-VL (tests/vlm_support.py) and its processor on
    FrozenLake rendering pictures: reset's and every move's picture come as image blocks, TRL's tool
    loop renders them into the completion through the processor and the training step's forward
    takes them; the env's returns are TRL's rewards."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_vl_chat_template
    from vlm_support import build_tiny_qwen2_vl

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    FrozenLake = environment_factory(grid_server.address, "frozenlake", config={"render_image": True, "image_size": 64})
    episodes: list[float] = []
    seen: list[list] = []

    class Recorded(FrozenLake):
        """Records what get_reward hands to TRL and the pictures each rollout was given."""

        def reset(self, **row):
            self.pictures = []
            return self._keep(super().reset(**row))

        @functools.wraps(FrozenLake.move)   # the tool's schema: the adapter's signature and docstring
        def move(self, direction: str):
            return self._keep(FrozenLake.move(self, direction))

        def _keep(self, blocks):
            self.pictures += [b["image"] for b in blocks if isinstance(b, dict) and b.get("type") == "image"]
            return blocks

        def get_reward(self) -> float:
            episodes.append(super().get_reward())
            seen.append(self.pictures)
            return episodes[-1]

    # Qwen2-VL's own chat template has no tool calls; Qwen3-VL's renders images the same way and is
    # one TRL parses tool calls for.
    tok, _ = tool_calling_tokenizer(grid_server.address, ["Left", "Down", "Right", "Up"])
    model, processor = build_tiny_qwen2_vl(tok, seed=0, chat_template=qwen3_vl_chat_template)
    calls = [t for t in tok.get_vocab() if t.startswith("<tool_call>\n{")]
    allowed = {tok.convert_tokens_to_ids(t) for t in calls} | {tok.eos_token_id}
    suppress = [i for i in range(len(tok)) if i not in allowed]
    # What the vision tower encodes: each call's images (their grids) and whether it is a training pass.
    encoded = []
    model.model.visual.register_forward_hook(
        lambda module, args, kwargs, out: encoded.append((kwargs["grid_thw"].tolist(), torch.is_grad_enabled(),
                                                           args[0].detach().clone())),
        with_kwargs=True)
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Reach the goal.\n"}]] * 4,
                              "seed": [0, 1, 2, 3]})
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=512, max_tool_calling_iterations=3, logging_steps=1,
                      generation_kwargs={"suppress_tokens": suppress}, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=rows, processing_class=processor,
                          environment_factory=Recorded)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        trainer.train()
    finally:
        FrozenLake.close()

    step, = [h for h in trainer.state.log_history if "rewards/Recorded/mean" in h]
    assert len(episodes) == 4
    assert step["rewards/Recorded/mean"] == pytest.approx(sum(episodes) / 4, abs=1e-6)
    assert step["tools/call_frequency"] > 0 and step["tools/failure_frequency"] == 0
    # The training pass encoded every picture the env gave (reset's and each move's, in the
    # completions through the tool turns), and its gradient reached the vision tower.
    assert all(len(p) >= 1 for p in seen) and sum(len(p) for p in seen) > len(seen)
    trained = [(grids, pixels) for grids, grad, pixels in encoded if grad]
    assert len(trained) == 1 and len(trained[0][0]) == sum(len(p) for p in seen)
    # Pixel for pixel the env's pictures, as the processor prepares them (TRL orders them its own way).
    grids, pixels = trained[0]
    prepared = processor.image_processor(images=[im for p in seen for im in p], return_tensors="pt")
    given = patches(prepared["pixel_values"], prepared["image_grid_thw"].tolist())
    assert sorted(patches(pixels, grids)) == sorted(given)
    assert any(not grad for _, grad, _ in encoded)                # generation saw pictures too
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if "visual" in n)


# -- the judge reward ------------------------------------------------------------------------------
JUDGED_FORMAT = "grounding_worldmodeling"


@pytest.fixture(scope="module")
def judge(grid_server):
    from serverproc import JudgeProcess
    with JudgeProcess(grid_server.address) as j:
        yield j


def judge_betas(address: str) -> tuple[float, float]:
    from envserve.client import JudgeClient
    with JudgeClient(address) as jc:
        config = jc.info().config
    return float(config["beta_grounding"]), float(config["beta_world_modeling"])


def expert_turns(address: str, seed: int) -> list[tuple[str, str, str]]:
    """(direction, true observation text, true prediction text) of each turn of the FrozenLake
    expert's episode from `seed`, as the experts write them from the true state."""
    from envserve.client.experts import play_expert
    with EnvClient(address) as c:
        (episode,) = play_expert(c, "frozenlake", [seed], JUDGED_FORMAT, config={"max_actions_per_turn": 1})
    assert episode.success and len(episode.turns) > 2
    return [(t.move.actions[0], t.result.reasoning["observation"], t.result.reasoning["prediction"])
            for t in episode.turns]


def test_tools_take_observation_and_prediction_only_with_a_judge(factory, judge):
    plain = schema(factory("frozenlake", action_format=JUDGED_FORMAT)(), "move")["parameters"]
    assert list(plain["properties"]) == ["direction"]
    judged = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address)()
    move = schema(judged, "move")["parameters"]
    assert list(move["properties"]) == ["direction", "observation", "prediction"]
    assert move["required"] == ["direction"]
    assert move["properties"]["observation"]["type"] == "string"
    assert "relative to you" in move["properties"]["observation"]["description"]
    assert "after this action" in move["properties"]["prediction"]["description"]
    # A format with only one of the fields gets only that parameter; every tool kind gets them.
    grounding = factory("minesweeper", action_format="grounding", judge_address=judge.address)()
    assert list(schema(grounding, "reveal")["parameters"]["properties"]) == ["row", "col", "observation"]
    act = factory("frozenlake", action_format="worldmodeling", judge_address=judge.address, tools="act")()
    assert list(schema(act, "act")["parameters"]["properties"]) == ["action", "prediction"]


def test_a_judge_needs_a_format_with_observation_or_prediction(factory, judge):
    for action_format in ("no_think", "free_think", "meta_reasoning"):
        with pytest.raises(ValueError, match="neither"):
            factory("frozenlake", action_format=action_format, judge_address=judge.address)


def test_true_observations_and_predictions_earn_the_judge_reward(grid_server, factory, judge):
    from envserve.client import JudgeClient, JudgeTask
    from envserve.client.judge import reasoning_reward
    seed, weight = 2, 0.5
    turns = expert_turns(grid_server.address, seed)
    beta_g, beta_w = judge_betas(judge.address)

    plain = factory("frozenlake", action_format=JUDGED_FORMAT)()
    plain.reset(seed=seed)
    for direction, _, _ in turns:
        plain.move(direction)
    assert plain.last_result.success
    env_return = plain.get_reward()

    cls = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address, judge_weight=weight)
    right = cls()
    right.reset(seed=seed)
    for direction, observation, prediction in turns:
        right.move(direction, observation=observation, prediction=prediction)
    assert right.last_result.success
    reward = right.get_reward()
    assert right.judge_errors == []
    assert [s["turn"] for s in right.judge_scores] == list(range(len(turns)))
    # The same texts judged directly, and the reward formula of the client applied to the results.
    with JudgeClient(judge.address) as jc:
        tasks = [JudgeTask(f"{t}/{field}", right.session_id, t, field, text, episode=right.last_result.episode,
                           trial=right.last_result.trial)
                 for t, (_, observation, prediction) in enumerate(turns)
                 for field, text in (("grounding", observation), ("world_modeling", prediction))]
        scores = {r.key: r.score for r in jc.judge(tasks)}
    direct = [reasoning_reward(scores[f"{t}/grounding"], scores[f"{t}/world_modeling"], beta_g, beta_w).total
              for t in range(len(turns))]
    assert all(s == pytest.approx(1.0) for s in scores.values())   # the experts' texts are true
    assert reward == pytest.approx(env_return + weight * sum(direct) / len(direct))
    assert reward > env_return

    # The same moves with wrong texts (each turn's truth shifted to another turn), or none at all.
    wrong = cls()
    wrong.reset(seed=seed)
    for i, (direction, _, _) in enumerate(turns):
        _, observation, prediction = turns[(i + 1) % len(turns)]
        wrong.move(direction, observation=observation, prediction=prediction)
    none = cls()
    none.reset(seed=seed)
    for direction, _, _ in turns:
        none.move(direction)
    assert none.get_reward() == pytest.approx(env_return)
    assert all(s["grounding"] is None and s["reward"] == 0 for s in none.judge_scores)
    wrong_reward = wrong.get_reward()
    assert wrong.judge_errors == []
    assert env_return <= wrong_reward < reward
    mean = sum(reasoning_reward(s["grounding"], s["world_modeling"], beta_g, beta_w).total
               for s in wrong.judge_scores) / len(turns)
    assert wrong_reward == pytest.approx(env_return + weight * mean)
    # A new episode starts with no judge scores.
    right.reset(seed=seed)
    assert right.judge_scores == [] and right.get_reward() == 0.0


def test_a_judge_that_dies_mid_episode_scores_the_rest_zero(grid_server, factory):
    from serverproc import JudgeProcess
    turns = expert_turns(grid_server.address, 2)
    plain = factory("frozenlake", action_format=JUDGED_FORMAT)()
    plain.reset(seed=2)
    plain.move(turns[0][0])
    first_return = plain.get_reward()
    for direction, _, _ in turns[1:]:
        plain.move(direction)
    with JudgeProcess(grid_server.address) as judge:
        beta_g, beta_w = judge_betas(judge.address)
        env = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address, timeout=10)()
        env.reset(seed=2)
        direction, observation, prediction = turns[0]
        env.move(direction, observation=observation, prediction=prediction)
        # get_reward mid-episode waits for the turns so far: the first is judged while the judge is up.
        assert env.get_reward() == pytest.approx(first_return + beta_g + beta_w)
        judge.kill()
        for direction, observation, prediction in turns[1:]:
            out = env.move(direction, observation=observation, prediction=prediction)
            assert "Error" not in out                 # the rollout goes on without the judge
        assert env.last_result.success
        reward = env.get_reward()
    scores = env.judge_scores
    assert len(scores) == len(turns)
    assert scores[0]["grounding"] == pytest.approx(1.0) and scores[0]["reward"] == pytest.approx(beta_g + beta_w)
    assert all(s["grounding"] is None and s["world_modeling"] is None and s["reward"] == 0 for s in scores[1:])
    assert len(env.judge_errors) == len(turns) - 1 and all("UNAVAILABLE" in e for e in env.judge_errors)
    assert reward == pytest.approx(plain.get_reward() + (beta_g + beta_w) / len(turns))


def test_close_stops_the_judges_threads_and_a_later_episode_is_judged_again(grid_server, factory, judge):
    import threading
    turns = expert_turns(grid_server.address, 2)
    cls = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address)
    env = cls()
    for _ in range(2):
        env.reset(seed=2)
        for direction, observation, prediction in turns:
            env.move(direction, observation=observation, prediction=prediction)
        env.get_reward()
        assert env.judge_errors == [] and len(env.judge_scores) == len(turns)
        assert all(s["grounding"] == pytest.approx(1.0) for s in env.judge_scores)
        assert any(t.name.startswith("envserve-trl-judge") for t in threading.enumerate())
        cls.close()
        for t in threading.enumerate():
            if t.name.startswith("envserve-trl-judge"):
                t.join()


def test_each_factory_counts_repeated_judge_texts_apart_unless_given_one_scope(grid_server, factory, judge):
    # VAGEN's repetition penalty: a wrong text said again earns -0.1 in place of its F1 of 0. Another
    # factory on the same judge (another run) starts from no counts; judge_scope= shares them.
    turns = expert_turns(grid_server.address, 2)
    stock = "The goal is above me and to my left."        # wrong on every turn of these maps

    def grounding(cls, moves: int) -> list[float]:
        env = cls()
        env.reset(seed=2)
        for direction, _, _ in turns[:moves]:
            env.move(direction, observation=stock)
        env.get_reward()
        assert env.judge_errors == []
        return [s["grounding"] for s in env.judge_scores]

    first = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address)
    # The steps' texts go to the judge from background threads, in any order and possibly together:
    # at most one of them is scored while the text has been counted only once.
    scores = grounding(first, 3)
    assert all(s in (0.0, pytest.approx(-0.1)) for s in scores) and scores.count(0.0) <= 1
    other = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address)
    assert grounding(other, 1) == [0.0]
    shared = factory("frozenlake", action_format=JUDGED_FORMAT, judge_address=judge.address,
                     judge_scope=first._judge.scope)
    assert grounding(shared, 1) == [pytest.approx(-0.1)]


# -- sampling where the run can learn ------------------------------------------------------------
def test_learnability_sampling_puts_grpo_groups_on_the_tasks_the_run_can_learn(grid_server, tmp_path, monkeypatch):
    """Outcomes recorded under the factory's stats scope: task 0 always solved, task 2 never, task 1
    half the time, task 3 unseen. TRL's trainer with the mixin draws groups of num_generations
    identical rows, mostly tasks 1 and 3, and trains on them."""
    from trl import GRPOTrainer

    from envserve.client.experts import play_expert
    from envserve.integrations.trl import LearnabilitySampling
    from envserve_trainer.models.small import build_small_model
    from outcomes import finish_episodes, stats_when

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    scope = f"trl-learnability-{os.getpid()}"
    with EnvClient(grid_server.address, stats_scope=scope) as c:
        play_expert(c, "frozenlake", [0] * 12 + [1] * 3, "no_think")
        finish_episodes(c, "frozenlake", [1] * 3 + [2] * 12)      # one turn of "Left": no success
        found = stats_when(c, "frozenlake", 30)
    assert {t: (s.episodes, s.successes) for t, s in found.items()} == {"0": (12, 12), "1": (6, 3), "2": (12, 0)}

    FrozenLake = environment_factory(grid_server.address, "frozenlake", stats_scope=scope)
    played: list[int] = []

    class Recorded(FrozenLake):
        def reset(self, **row):
            played.append(int(row["seed"]))
            return super().reset(**row)

    class Trainer(LearnabilitySampling, GRPOTrainer):
        pass

    tok, rows, args = frozenlake_run(grid_server.address, tmp_path, max_steps=1, num_generations=2,
                                     max_completion_length=32, max_tool_calling_iterations=2)
    trainer = Trainer(model=build_small_model(tok, "tiny", seed=0), args=args, train_dataset=rows,
                      processing_class=tok, environment_factory=Recorded)
    try:
        sampler = trainer._get_train_sampler()
        order = list(sampler)
        # An epoch: as many draws as rows, two batches of two groups of two identical rows.
        assert len(order) == len(sampler) == 8
        assert all(order[i] == order[i + 1] for i in range(0, 8, 2))
        assert order[0] != order[2] and order[4] != order[6]     # a batch's groups are different tasks
        drawn = [i for _ in range(400) for i in sampler.draw_batch()]
        counts = {seed: drawn.count(seed) for seed in range(4)}
        assert min(counts[1], counts[3]) > 2 * max(counts[0], counts[2]) and min(counts.values()) > 0
        trainer.train()
    finally:
        FrozenLake.close()
    assert len(played) == 4 and played[0] == played[1] and played[2] == played[3]   # groups of 2 identical rows
    assert any("loss" in h for h in trainer.state.log_history)
