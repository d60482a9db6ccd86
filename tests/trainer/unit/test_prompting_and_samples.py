"""Token-carrying contexts and the estimator wiring, on hand-made trials (the tokenizer is read from the grid envs)."""
from __future__ import annotations

import numpy as np
import pytest

from envserve_trainer.config.train_config import TrainConfig
from envserve_trainer.rollout.prompting import ChatLayout, ContextBuilder
from envserve_trainer.rollout.engine import remark_of, turn_seed
from envserve_trainer.samples.build import build_samples, turn_reward
from envserve_trainer.rollout.trajectory import Episode, Trial, Turn


@pytest.fixture(scope="module")
def tok(grid_tokenizer):
    return grid_tokenizer


def test_blocks_concatenate_to_the_chat_templates_rendering(tok):
    """system + user + header + answer + user + header, assembled from blocks, equals what the chat
    template renders for the same conversation (when the answer is its natural tokenization)."""
    layout = ChatLayout(tok)
    b = ContextBuilder(layout, "You are playing FrozenLake.", history_turns=2)
    first, user0 = b.prompt_ids("P___\n_O_G", 0)
    answer = tok("<answer>Right</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    b.record("P___\n_O_G", user0, answer, "<answer>Right</answer>")
    second, _ = b.prompt_ids("_P__\n_O_G", 1)
    msgs = [{"role": "system", "content": "You are playing FrozenLake."},
            {"role": "user", "content": "P___\n_O_G"},
            {"role": "assistant", "content": "<answer>Right</answer>"},
            {"role": "user", "content": "_P__\n_O_G"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert second == tok(text, add_special_tokens=False)["input_ids"]
    assert second[:len(first) - len(layout.header_ids)] == first[:-len(layout.header_ids)]


def test_a_length_stopped_answer_is_closed_and_the_prefix_and_suffix_are_put_back(tok):
    layout = ChatLayout(tok)
    right = tok.convert_tokens_to_ids("Right")
    b = ContextBuilder(layout, "S", history_turns=1, response_prefix="<answer>", response_suffix="</answer>")
    _, user0 = b.prompt_ids("obs0", 0)
    b.record("obs0", user0, [right], "<answer>Right</answer>")      # 1 token, no stop token
    ids, _ = b.prompt_ids("obs1", 1)
    text = tok.decode(ids)
    assert "<|im_start|>assistant\n<answer>Right</answer><|im_end|>\n<|im_start|>user\nobs1" in text
    assert text.endswith("<|im_start|>assistant\n<answer>")


def test_window_drops_old_turns_and_rlvmr_is_single_turn_with_plan_and_history(tok):
    layout = ChatLayout(tok)
    b = ContextBuilder(layout, "S", template="rlvmr", history_turns=2, admissible_actions="Left, Right")
    for i in range(4):
        _, u = b.prompt_ids(f"obs{i}", i)
        b.record(f"obs{i}", u, [tok.eos_token_id], f"act{i}", plan="go right" if i == 1 else None)
    text = tok.decode(b.prompt_ids("obs4", 4)[0])
    assert text.count("<|im_start|>assistant") == 1                  # single turn
    assert "Admissible actions: Left, Right" in text and "Your current plan: go right" in text
    assert "act3" in text and "act2" in text and "act1" not in text    # the last 2 steps only
    assert "Current observation (step 4):\nobs4" in text


def test_remark_and_turn_seed():
    assert remark_of("I think <remark>avoid the hole at (1,1)</remark> ok") == "avoid the hole at (1,1)"
    assert remark_of("no tag here") == "no tag here"
    assert turn_seed(1, 2, "a") == turn_seed(1, 2, "a") != turn_seed(1, 2, "b")


def _turn(reward, anchor_before="", anchor="", tag=None, valid=True, success=False, done=False, n_tokens=2):
    reasoning = {"meta_tag": tag} if tag else {}
    return Turn(turn=0, prompt_ids=[1, 2], completion_ids=list(range(3, 3 + n_tokens)), logprobs=[-1.0] * n_tokens,
                text="x", action="x", observation="", reward=reward, action_valid=valid,
                parsed_actions=["x"] if valid or tag else [], reasoning=reasoning, state_anchor=anchor_before,
                anchor=anchor, transition=f"{anchor_before}>{anchor}", success=success, done=done)


def _trial(group, sample, rewards, success=False, **kw):
    turns = [_turn(r, **kw) for r in rewards]
    turns[-1].done = True
    turns[-1].success = success
    return Trial(group, sample, [Episode("frozenlake", "", 0, group, sample, 0, turns=turns)])


def test_grpo_samples_broadcast_the_group_normalised_return_to_every_token():
    # Group g: returns 9.8 (success) and -0.3; mean 4.75, sample std sqrt(2 * 5.05^2) = 7.1418;
    # A = +-5.05 / 7.1418 = +-0.70711 (two members: always +-1/sqrt(2)).
    trials = [_trial("g", 0, [-0.1, -0.1, 10.0], success=True), _trial("g", 1, [-0.1, -0.1, -0.1])]
    samples = build_samples(trials, TrainConfig())
    assert len(samples) == 6 and all(len(s.advantages) == 2 for s in samples)
    np.testing.assert_allclose([s.advantages[0] for s in samples], [0.70711] * 3 + [-0.70711] * 3, atol=1e-5)


def test_failed_trials_are_dropped_and_a_lone_group_gets_zero():
    bad = _trial("g", 1, [1.0])
    bad.info["error"] = "NOT_FOUND: gone"
    samples = build_samples([_trial("g", 0, [5.0]), bad], TrainConfig())
    assert len(samples) == 1 and samples[0].advantages.tolist() == [0.0, 0.0]


def test_gigpo_samples_use_the_state_each_turn_acted_in():
    # Two trajectories from the same start s0: returns 1 and 0 (episode term +-0.70711). At s0 the
    # discounted returns are 1.0 and 0.0 -> step term +-0.70711; at s1 (only trajectory 0) 0.
    # omega 1: trajectory 0 gets [1.41421, 0.70711], trajectory 1 gets [-1.41421].
    t0 = Trial("g", 0, [Episode("e", "", 0, "g", 0, 0, turns=[
        _turn(0.0, "s0", "s1"), _turn(1.0, "s1", "s2", success=True, done=True)])])
    t1 = Trial("g", 1, [Episode("e", "", 0, "g", 1, 0, turns=[_turn(0.0, "s0", "s3", done=True)])])
    cfg = TrainConfig.from_mapping({"algo": {"estimator": "gigpo", "advantage": {"gigpo_gamma": 1.0}}})
    samples = build_samples([t0, t1], cfg)
    np.testing.assert_allclose([s.advantages[0] for s in samples], [1.41421, 0.70711, -1.41421], atol=1e-5)


def test_lamer_credits_a_reflection_with_the_episode_it_led_to():
    def ep(n, rewards, success):
        turns = [_turn(r) for r in rewards]
        turns[-1].done, turns[-1].success = True, success
        e = Episode("e", "", 0, "g", 0, n, turns=turns)
        return e
    a = Trial("g", 0, [ep(0, [0.0], False), ep(1, [10.0], True)])
    a.episodes[0].reflection_ids = ([1, 2], [7, 8, 9], [-0.5] * 3)
    b = Trial("g", 1, [ep(0, [0.0], False), ep(1, [0.0], False)])
    b.episodes[0].reflection_ids = ([1, 2], [7], [-0.5])
    cfg = TrainConfig.from_mapping({"algo": {"estimator": "lamer"}})
    samples = build_samples([a, b], cfg)
    # Episode 1: returns 10 and 0 -> +-0.70711. Episode 0: G_0 = 0 + 0.6 * 10 = 6 vs 0 -> +-0.70711.
    # a: [ep0 turn, reflection, ep1 turn]; the reflection gets episode 1's advantage.
    assert [len(s.completion_ids) for s in samples] == [2, 3, 2, 2, 1, 2]
    np.testing.assert_allclose([s.advantages[0] for s in samples],
                               [0.70711, 0.70711, 0.70711, -0.70711, -0.70711, -0.70711], atol=1e-5)


def test_judge_scores_enter_the_reward_only_when_enabled():
    t = _turn(1.0)
    t.judge_scores = {"grounding": 1.0, "world_modeling": 0.5}
    assert turn_reward(t, TrainConfig()) == 1.0
    on = TrainConfig.from_mapping({"algo": {"use_judge": True}})
    assert turn_reward(t, on) == pytest.approx(1.0 + 0.5 * 1.0 + 0.5 * 0.5)


def test_gae_needs_a_critic():
    cfg = TrainConfig.from_mapping({"algo": {"estimator": "gae"}})
    with pytest.raises(ValueError, match="critic"):
        build_samples([_trial("g", 0, [1.0])], cfg)
    # Values all 0, gamma 1, lambda 0.95: the only reward (1.0) sits on the last token; token
    # advantages backwards: 1.0, 0.95 (two tokens of the one turn).
    raw = TrainConfig.from_mapping({"algo": {"estimator": "gae", "advantage": {"whiten": False}}})
    zeros = lambda p, c: [np.zeros(len(x)) for x in c]   # noqa: E731
    samples = build_samples([_trial("g", 0, [1.0])], raw, value_fn=zeros)
    np.testing.assert_allclose(samples[0].advantages, [0.95, 1.0])
    np.testing.assert_allclose(samples[0].returns, [0.95, 1.0])


@pytest.mark.parametrize("estimator", ["gae", "bilevel_gae"])
def test_gae_advantages_are_whitened_over_the_batch_and_returns_are_not(estimator):
    # Two episodes, one rewarded 1.0 and one 0.0, values all 0: raw advantages are all >= 0, so
    # without whitening the failed episode would not be pushed down at all.
    trials = [_trial("g", 0, [1.0]), _trial("g", 1, [0.0])]
    zeros = lambda p, c: [np.zeros(len(x)) for x in c]   # noqa: E731
    raw = build_samples(trials, TrainConfig.from_mapping(
        {"algo": {"estimator": estimator, "advantage": {"whiten": False}}}), value_fn=zeros)
    white = build_samples(trials, TrainConfig.from_mapping({"algo": {"estimator": estimator}}), value_fn=zeros)
    flat_raw = np.concatenate([s.advantages for s in raw])
    flat = np.concatenate([s.advantages for s in white])
    assert flat_raw.min() >= 0.0
    assert flat.mean() == pytest.approx(0.0, abs=1e-9) and flat.std() == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(flat, (flat_raw - flat_raw.mean()) / flat_raw.std(), atol=1e-5)
    assert white[-1].advantages.max() < 0.0            # the failed episode now loses probability
    for r, w in zip(raw, white):
        np.testing.assert_allclose(w.returns, r.returns)   # the critic's targets stay in reward units


def test_config_refuses_typos_and_bad_values():
    with pytest.raises(ValueError, match="group_sise"):
        TrainConfig.from_mapping({"rollout": {"group_sise": 4}})
    with pytest.raises(ValueError, match="estimator"):
        TrainConfig.from_mapping({"algo": {"estimator": "ppo2"}})
    with pytest.raises(ValueError, match="section"):
        TrainConfig.from_mapping({"rollouts": {}})
    with pytest.raises(ValueError, match="lamer_gamma_traj"):
        TrainConfig.from_mapping({"algo": {"advantage": {"lamer_gamma_traj": 1.5}}})
    cfg = TrainConfig.from_mapping({"rollout": {"allowed_words": ["Left"]}})
    assert TrainConfig.from_mapping(cfg.to_dict()) == cfg
    # The perception warm-up: off unless boards are given; its moves a list; bad numbers refused.
    assert TrainConfig().perception.boards == 0
    cfg = TrainConfig.from_mapping({"perception": {"boards": 10, "actions": ["Up", "Down"]}})
    assert cfg.perception.actions == ("Up", "Down") and TrainConfig.from_mapping(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="perception.boards"):
        TrainConfig.from_mapping({"perception": {"boards": -1}})
    with pytest.raises(ValueError, match="perception.actions"):
        TrainConfig.from_mapping({"perception": {"boards": 3, "actions": []}})
    with pytest.raises(ValueError, match="must be a list"):
        TrainConfig.from_mapping({"perception": {"actions": "Up"}})
