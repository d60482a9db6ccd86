"""Rollouts over a real envserve server: groups, determinism, LaMer trials, windows, limits, failures."""
from __future__ import annotations

import asyncio

import pytest

from serverproc import ServerProcess

from envserve.client.aio import AsyncEnvClient
from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.models.small import build_small_model
from envserve_trainer.policies.hf import HFPolicy
from envserve_trainer.rollout.prompting import MEMORY_HEADER
from envserve_trainer.rollout.engine import RolloutEngine, Task


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["frozenlake"], workers=2, metrics=False) as s:
        yield s


@pytest.fixture(scope="module")
def tok(grid_tokenizer):
    return grid_tokenizer


def _policy(tok, words=("Left", "Down", "Right", "Up"), seed=0):
    ids = [tok.convert_tokens_to_ids(w) for w in words]
    return HFPolicy(build_small_model(tok, "tiny", seed=seed), tok, allowed_token_ids=ids or None)


ONE_WORD = {"max_new_tokens": 1, "response_prefix": "<answer>", "response_suffix": "</answer>",
            "allowed_words": ["Left", "Down", "Right", "Up"]}


def _collect(server, tok, rollout, tasks, k, policy=None, seed=3, **kw):
    cfg = TrainConfig.from_mapping({"rollout": rollout})

    async def go():
        async with AsyncEnvClient(server.address) as c:
            eng = RolloutEngine(c, policy or _policy(tok), tok, cfg, seed=seed)
            try:
                return await eng.collect(tasks, k, **kw), eng
            finally:
                await eng.close()
    return asyncio.run(go())


def test_groups_of_k_trials_per_task_in_order_and_turns_match_the_env(server, tok):
    trials, _ = _collect(server, tok, {**ONE_WORD, "history_turns": 0}, [Task(0), Task(1)], 3)
    assert [(t.group, t.sample) for t in trials] == [("default/0", 0), ("default/0", 1), ("default/0", 2),
                                                       ("default/1", 0), ("default/1", 1), ("default/1", 2)]
    for t in trials:
        [ep] = t.episodes
        assert ep.done and 1 <= len(ep.turns) <= 10
        for i, turn in enumerate(ep.turns):
            assert turn.turn == i                    # the observation each turn answered
            assert turn.action in {f"<answer>{w}</answer>" for w in ONE_WORD["allowed_words"]}
            assert turn.action_valid and turn.reward_components
            assert len(turn.completion_ids) == len(turn.logprobs) == 1
        # GiGPO's anchors: each turn acted in the state the previous turn left.
        for a, b in zip(ep.turns, ep.turns[1:]):
            assert b.state_anchor == a.anchor
    # One task, one initial state: every trial of a group starts from the same anchor.
    assert len({t.episodes[0].turns[0].state_anchor for t in trials[:3]}) == 1
    assert trials[0].episodes[0].turns[0].state_anchor != trials[3].episodes[0].turns[0].state_anchor


def test_completions_do_not_depend_on_batching(server, tok):
    """Seeds are per (task, sample, episode, turn): a batch of 1 and a batch of 64 sample the same."""
    rollout = {**ONE_WORD, "history_turns": 0}
    a, _ = _collect(server, tok, {**rollout, "max_batch": 64}, [Task(5), Task(6)], 4)
    b, _ = _collect(server, tok, {**rollout, "max_batch": 1}, [Task(5), Task(6)], 4)
    assert [[t.action for t in x.episodes[0].turns] for x in a] == [[t.action for t in x.episodes[0].turns] for x in b]
    c, _ = _collect(server, tok, {**rollout, "max_batch": 64}, [Task(5), Task(6)], 4, seed=4)
    assert [[t.action for t in x.episodes[0].turns] for x in a] != [[t.action for t in x.episodes[0].turns] for x in c]


def test_history_window_and_turn_limit(server, tok):
    trials, eng = _collect(server, tok, {**ONE_WORD, "history_turns": 2, "max_turns": 4}, [Task(2)], 4)
    header = eng.layout.header_ids
    for t in trials:
        ep = t.episodes[0]
        assert len(ep.turns) <= 4
        assert ep.turn_limited == (len(ep.turns) == 4 and not ep.done)
        for i, turn in enumerate(ep.turns):
            # The context holds min(i, 2) earlier answers: one assistant header per kept turn, plus the current one.
            n_headers = sum(1 for j in range(len(turn.prompt_ids) - len(header) + 1)
                            if turn.prompt_ids[j:j + len(header)] == header)
            assert n_headers == min(i, 2) + 1
            if i >= 1:
                # The previous completion is carried as the exact ids it was sampled as.
                prev = ep.turns[i - 1].completion_ids
                assert any(turn.prompt_ids[j:j + len(prev)] == prev for j in range(len(turn.prompt_ids)))


def test_lamer_trials_carry_memory_and_replay_the_same_task(server, tok):
    policy = _policy(tok, words=())   # free text, so reflections have words in them
    rollout = {"max_new_tokens": 6, "episodes_per_trial": 3, "memory": "both", "stop_on_success": False,
               "reflection_max_new_tokens": 10, "max_turns": 2, "history_turns": 1}
    trials, eng = _collect(server, tok, rollout, [Task(7)], 2, policy=policy)
    for t in trials:
        assert [e.episode for e in t.episodes] == [0, 1, 2]
        # same_task resets: every episode starts in the task's initial state.
        assert len({e.turns[0].state_anchor for e in t.episodes}) == 1
        assert len({e.env_trial for e in t.episodes}) == 1      # one trial on the server, too
        for e in t.episodes[:-1]:
            assert e.reflection_ids is not None                 # a reflection after every episode but the last
        assert t.episodes[-1].reflection_ids is None
        # Episode n's context opens with the memory of episodes < n: n trajectory lines and n reflections.
        for n, e in enumerate(t.episodes):
            text = tok.decode(e.turns[0].prompt_ids)
            if n == 0:
                assert MEMORY_HEADER.strip() not in text
            else:
                assert text.count("attempt: actions") == n and text.count("reflection:") == n
                assert f"reflection: {t.episodes[n - 1].reflection}" in text


def test_lamer_reflections_only_and_stop_on_success(server, tok):
    rollout = {**ONE_WORD, "episodes_per_trial": 4, "memory": "trajectories", "history_turns": 0}
    trials, _ = _collect(server, tok, rollout, [Task(0), Task(3)], 4)
    for t in trials:
        for e in t.episodes[:-1]:
            assert not e.success                          # a success ends the trial
            assert e.reflection_ids is None               # trajectories only: no reflection calls
        assert len(t.episodes) == 4 or t.episodes[-1].success


def test_a_failing_session_ends_its_trial_alone(server, tok):
    cfg = TrainConfig.from_mapping({"rollout": {**ONE_WORD, "history_turns": 0}})

    async def go():
        async with AsyncEnvClient(server.address) as c:
            eng = RolloutEngine(c, _policy(tok), tok, cfg, seed=1)
            sids = await eng._ensure_sessions(4)
            await c.close_sessions([sids[1]])             # lost before the rollout starts
            try:
                return await eng.collect([Task(0)], 4)
            finally:
                await eng.close()
    trials = asyncio.run(go())
    assert trials[1].info["error"].startswith("NOT_FOUND: unknown session")
    for i in (0, 2, 3):
        assert "error" not in trials[i].info and trials[i].episodes[0].done
