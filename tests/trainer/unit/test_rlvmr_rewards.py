"""RLVMR's meta-reasoning reward rules, one test per rule, plus the reward aggregation helpers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from envserve_trainer.methods.grpo_mr import grpo_mr_advantages
from envserve_trainer.config.algo import RewardConfig
from envserve_trainer.methods.grpo_mr import MetaStep, rlvmr_rewards
from envserve_trainer.methods.rewards import reasoning_reward, step_reward


def ok(tag, action="a", transition=""):
    """A step that parsed and whose action was legal."""
    return MetaStep(tag=tag, parsed=True, valid=True, action=action, transition=transition)


def illegal(tag, action="a", transition=""):
    """A step that parsed but whose action the env refused."""
    return MetaStep(tag=tag, parsed=True, valid=False, action=action, transition=transition)


UNPARSED = MetaStep(tag=None, parsed=False, valid=False)


# -- planning ---------------------------------------------------------------------------------------

def test_planning_rewarded_on_success_decayed_by_later_plans():
    # Planning at steps 0, 2, 3 of a successful trajectory; k = later planning steps = (2, 1, 0):
    # r_plan * 0.95^k = (0.9025, 0.95, 1.0). Step 1 (monitor) earns r_monitor = 0.
    steps = [ok("planning"), ok("monitor"), ok("planning"), ok("planning")]
    out = rlvmr_rewards(steps, success=True)
    assert out.meta == pytest.approx([0.9025, 0.0, 0.95, 1.0])
    assert out.tags == ["planning", "monitor", "planning", "planning"]


def test_planning_gets_nothing_when_the_trajectory_failed():
    out = rlvmr_rewards([ok("planning"), ok("planning")], success=False)
    assert np.all(out.meta == 0.0) and out.outcome == 0.0


def test_invalid_planning_step_is_neither_rewarded_nor_counted_as_later_plan():
    # Step 1 is an illegal action: no meta reward, tag "none", and it does not decay step 0 (k = 0).
    out = rlvmr_rewards([ok("planning"), illegal("planning")], success=True)
    assert out.meta == pytest.approx([1.0, 0.0])
    assert out.tags == ["planning", "none"]
    assert np.all(out.format == 0.0)


def test_planning_decay_and_magnitude_are_config():
    cfg = RewardConfig(r_plan=2.0, plan_decay=0.5)
    # k = (1, 0) -> (2 * 0.5, 2).
    assert rlvmr_rewards([ok("planning"), ok("planning")], True, cfg).meta == pytest.approx([1.0, 2.0])


# -- explore ----------------------------------------------------------------------------------------

def test_explore_rewarded_only_for_new_transitions():
    # Transitions (t1, t2, t1, ""): new, new, repeated, none executed -> (1, 1, 0, 0).
    steps = [ok("explore", transition="t1"), ok("explore", transition="t2"),
             ok("explore", transition="t1"), ok("explore", transition="")]
    assert rlvmr_rewards(steps, success=False).meta == pytest.approx([1.0, 1.0, 0.0, 0.0])


def test_explore_novelty_counts_transitions_of_every_earlier_step():
    # A monitor step already made transition t1, so the explore step repeating it earns nothing;
    # an illegal step that still executed t2 earns nothing itself but marks t2 as seen.
    steps = [ok("monitor", transition="t1"), ok("explore", transition="t1"),
             illegal("explore", transition="t2"), ok("explore", transition="t2"),
             ok("explore", transition="t3")]
    assert rlvmr_rewards(steps, success=True).meta == pytest.approx([0.0, 0.0, 0.0, 0.0, 1.0])


# -- reflection -----------------------------------------------------------------------------------

def test_reflection_after_invalid_action_with_a_different_action():
    steps = [
        illegal("explore", action="go north"),    # 0: invalid -> no meta reward
        ok("reflection", action="go south"),      # 1: follows an invalid step, new action -> r_reflect
        ok("reflection", action="go east"),       # 2: previous step was valid -> 0
        illegal("monitor", action="open door"),   # 3: invalid
        ok("reflection", action="open door"),     # 4: repeats the invalid action -> 0
        UNPARSED,                                 # 5: did not parse
        ok("reflection", action="look"),          # 6: follows an unparsable (invalid) step -> r_reflect
    ]
    out = rlvmr_rewards(steps, success=False)
    assert out.meta == pytest.approx([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0])


def test_reflection_at_the_first_step_follows_nothing():
    assert rlvmr_rewards([ok("reflection")], success=True).meta == pytest.approx([0.0])


# -- monitor, format, outcome ------------------------------------------------------------------------

def test_monitor_is_zero_by_default_and_configurable():
    assert rlvmr_rewards([ok("monitor")], True).meta == pytest.approx([0.0])
    assert rlvmr_rewards([ok("monitor")], True, RewardConfig(r_monitor=0.3)).meta == pytest.approx([0.3])


def test_format_penalty_and_outcome_return():
    # Success (10) with two unparsed steps (-0.1 each): outcome return 10 - 0.2 = 9.8.
    out = rlvmr_rewards([UNPARSED, ok("planning"), UNPARSED], success=True)
    assert out.format == pytest.approx([-0.1, 0.0, -0.1])
    assert out.meta == pytest.approx([0.0, 1.0, 0.0])
    assert out.tags == ["none", "planning", "none"]
    assert out.outcome == 10.0
    assert out.outcome_return() == pytest.approx(9.8)
    # A failed trajectory: only the penalties.
    assert rlvmr_rewards([UNPARSED], success=False).outcome_return() == pytest.approx(-0.1)


def test_untagged_valid_step_has_no_meta_reward():
    # A format without meta tags (e.g. free_think) parses with tag None: no reward, no penalty.
    out = rlvmr_rewards([ok(None)], success=True)
    assert out.meta == pytest.approx([0.0]) and out.format == pytest.approx([0.0]) and out.tags == ["none"]


def test_rejects_empty_trajectory_and_unknown_tag():
    with pytest.raises(ValueError, match="no steps"):
        rlvmr_rewards([], success=True)
    with pytest.raises(ValueError, match="unknown meta tag"):
        ok("thinking")
    with pytest.raises(ValueError, match="valid without"):
        MetaStep(tag=None, parsed=False, valid=True)


# -- from envserve results ----------------------------------------------------------------------

def test_meta_step_from_a_step_result_proto():
    from envserve.v1 import envserve_pb2 as pb

    r = pb.StepResult(parsed_actions=["go north", "open door"], action_valid=True,
                      reasoning={"meta_tag": "explore", "explore": "try the door"}, transition="abc")
    assert MetaStep.from_result(r) == MetaStep("explore", True, True, "go north, open door", "abc")
    # A failed parse: no parsed actions; the tag that was found does not count.
    bad = pb.StepResult(action_valid=False, reasoning={"meta_tag": "planning"})
    assert MetaStep.from_result(bad) == MetaStep(None, False, False, "", "")
    # Parsed but illegal.
    inv = pb.StepResult(parsed_actions=["fly"], action_valid=False, reasoning={"meta_tag": "reflection"})
    step = MetaStep.from_result(inv)
    assert (step.tag, step.parsed, step.valid) == ("reflection", True, False)


def test_meta_step_from_a_mapping():
    d = {"parsed_actions": ["look"], "action_valid": True, "reasoning": {"meta_tag": "monitor"}, "transition": ""}
    assert MetaStep.from_result(d) == MetaStep("monitor", True, True, "look", "")


# -- end to end: rules into GRPO-MR ------------------------------------------------------------------

def test_rules_feed_grpo_mr():
    # T1 succeeds: plan (1.0), explore new t1 (1.0).  T2 fails: plan (0), unparsed (-0.1 format).
    # Outcome returns (10, -0.1) -> +-1/sqrt2. planning {1, 0} -> +-1/sqrt2; explore {T1} singleton -> 0;
    # T2's unparsed step is untagged -> 0. A = A_out + 0.5 * A_meta.
    t1 = rlvmr_rewards([ok("planning"), ok("explore", transition="t1")], success=True)
    t2 = rlvmr_rewards([ok("planning"), UNPARSED], success=False)
    res = grpo_mr_advantages([t1.outcome_return(), t2.outcome_return()], [t1.meta, t2.meta], [t1.tags, t2.tags])
    r2 = 1 / math.sqrt(2)
    assert res.advantages[0] == pytest.approx([1.5 * r2, r2], rel=1e-5)
    assert res.advantages[1] == pytest.approx([-1.5 * r2, -r2], rel=1e-5)


# -- aggregation -----------------------------------------------------------------------------------

def test_reasoning_reward_weights_the_judge_scores():
    # 0.5 * 0.8 + 0.5 * 0.4 = 0.6; a missing score adds nothing; an unparsed turn earns none.
    assert reasoning_reward(0.8, 0.4) == pytest.approx(0.6)
    assert reasoning_reward(0.8, None) == pytest.approx(0.4)
    assert reasoning_reward(0.8, 0.4, format_valid=False) == 0.0
    assert reasoning_reward(1.0, 1.0, RewardConfig(beta_grounding=0.2, beta_world_modeling=0.3)) == pytest.approx(0.5)


def test_step_reward_adds_trainer_components():
    assert step_reward(1.0, {"reasoning": 0.6, "meta": -0.1}) == pytest.approx(1.5)
    assert step_reward(-0.1) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="not finite"):
        step_reward(0.0, {"reasoning": float("nan")})


def test_reward_config_defaults_and_from_mapping():
    cfg = RewardConfig()
    assert (cfg.r_success, cfg.r_plan, cfg.r_explore, cfg.r_reflect, cfg.r_monitor, cfg.r_format) == (
        10.0, 1.0, 1.0, 1.0, 0.0, -0.1)
    assert RewardConfig.from_mapping({"r_success": 1}).r_success == 1.0
    with pytest.raises(ValueError, match="unknown keys"):
        RewardConfig.from_mapping({"r_plans": 1.0})
