"""Advantage estimators against numbers worked by hand from each paper's equations.

Notation: sample std s = sqrt(sum (x - mean)^2 / (n - 1)) unless a test says population.
eps = 1e-6 shifts results by ~1e-6 relative, hence rel=1e-5 in the comparisons.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from envserve_trainer.methods.gae import bilevel_gae, masked_gae, turn_spans
from envserve_trainer.methods.common import discounted_returns, group_normalize
from envserve_trainer.methods.gigpo import gigpo_advantages
from envserve_trainer.methods.grpo import grpo_advantages
from envserve_trainer.methods.grpo_mr import grpo_mr_advantages
from envserve_trainer.methods.lamer import lamer_advantages, lamer_returns
from envserve_trainer.config.algo import AdvantageConfig

R3 = 1 / math.sqrt(3)
R2 = 1 / math.sqrt(2)


def approx(values, rel=1e-5, abs=1e-9):
    return pytest.approx(values, rel=rel, abs=abs)


# -- GRPO -----------------------------------------------------------------------------------------

def test_grpo_three_trajectories_sample_std():
    # R = [1, 0, 0]: mean 1/3, deviations (2/3, -1/3, -1/3), sum of squares 6/9,
    # sample var 6/9 / 2 = 1/3, s = 1/sqrt(3) -> A = (2/sqrt(3), -1/sqrt(3), -1/sqrt(3)).
    assert grpo_advantages([1.0, 0.0, 0.0]) == approx([2 * R3, -R3, -R3])


def test_grpo_population_std_convention():
    # Same group, population var 6/9 / 3 = 2/9, sigma = sqrt(2)/3 -> A = (sqrt(2), -1/sqrt(2), -1/sqrt(2)).
    cfg = AdvantageConfig(std_ddof=0)
    assert grpo_advantages([1.0, 0.0, 0.0], cfg=cfg) == approx([math.sqrt(2), -R2, -R2])


def test_dr_grpo_does_not_divide_by_std():
    # Dr.GRPO: A = R - mean = (2/3, -1/3, -1/3).
    cfg = AdvantageConfig(scale_by_std=False)
    assert grpo_advantages([1.0, 0.0, 0.0], cfg=cfg) == approx([2 / 3, -1 / 3, -1 / 3])


def test_grpo_normalises_each_group_on_its_own():
    # Group a = [1, 0]: mean 0.5, s = sqrt(0.5) -> +-1/sqrt(2). Group b = [3, 1]: mean 2, s = sqrt(2)
    # -> +-1/sqrt(2) too; pooled, [1, 0, 3, 1] would give different values (mean 1.25).
    out = grpo_advantages([1.0, 0.0, 3.0, 1.0], group_ids=["a", "a", "b", "b"])
    assert out == approx([R2, -R2, R2, -R2])


def test_grpo_identical_rewards_give_zeros_not_nan():
    for rewards in ([0.5, 0.5, 0.5], [0.0, 0.0], [10.0] * 8):
        out = grpo_advantages(rewards)
        assert np.all(np.isfinite(out)) and np.all(out == 0.0)


def test_grpo_singleton_group_gets_zero():
    # b has one member: no baseline, so 0 (not its raw reward as verl's mean-0/std-1 rule would give).
    out = grpo_advantages([1.0, 0.0, 5.0], group_ids=["a", "a", "b"])
    assert out == approx([R2, -R2, 0.0])


def test_grpo_rejects_empty_and_nan_input():
    with pytest.raises(ValueError, match="no values"):
        grpo_advantages([])
    with pytest.raises(ValueError, match="NaN"):
        grpo_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="entries"):
        group_normalize([1.0, 2.0], group_ids=["a"])


# -- GiGPO ------------------------------------------------------------------------------------------

# Three trajectories of one group; all start in anchor s0, T1 and T2 also share s1.
GIGPO_REWARDS = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0]]
GIGPO_ANCHORS = [["s0", "s1", "s2"], ["s0", "s1", "s3"], ["s0", "s4"]]


def test_gigpo_episode_plus_anchor_group_step_advantage():
    # Episode returns (1, 0, 0) -> A_E = (2/sqrt3, -1/sqrt3, -1/sqrt3) as in GRPO.
    # Step returns with gamma 0.95: T1 = (0.9025, 0.95, 1), T2 = T3 = 0.
    # s0 = {0.9025, 0, 0}: a scaled [1, 0, 0] -> (2/sqrt3, -1/sqrt3, -1/sqrt3).
    # s1 = {0.95, 0} -> +-1/sqrt2.  s2, s3, s4 are singletons -> 0.
    # A = A_E + 1.0 * A_S.
    res = gigpo_advantages(GIGPO_REWARDS, GIGPO_ANCHORS)
    assert res.outcome == approx([2 * R3, -R3, -R3])
    assert res.step[0] == approx([2 * R3, R2, 0.0])
    assert res.step[1] == approx([-R3, -R2, 0.0])
    assert res.step[2] == approx([-R3, 0.0])
    assert res.advantages[0] == approx([4 * R3, 2 * R3 + R2, 2 * R3])
    assert res.advantages[1] == approx([-2 * R3, -R3 - R2, -R3])
    assert res.advantages[2] == approx([-2 * R3, -R3])


def test_gigpo_mean_only_shows_the_discount_and_omega():
    # Without std scaling the discount is visible: s0 = {0.95^2 = 0.9025, 0, 0}, mean 0.300833
    # -> (0.601667, -0.300833, -0.300833); s1 = {0.95, 0}, mean 0.475 -> +-0.475.
    # A_E = (2/3, -1/3, -1/3); omega 0.5 halves the step term.
    cfg = AdvantageConfig(scale_by_std=False, gigpo_omega=0.5)
    res = gigpo_advantages(GIGPO_REWARDS, GIGPO_ANCHORS, cfg=cfg)
    assert res.step[0] == approx([0.9025 * 2 / 3, 0.475, 0.0])
    assert res.advantages[0] == approx([2 / 3 + 0.5 * 0.9025 * 2 / 3, 2 / 3 + 0.5 * 0.475, 2 / 3])
    assert res.advantages[1] == approx([-1 / 3 - 0.5 * 0.9025 / 3, -1 / 3 - 0.5 * 0.475, -1 / 3])


def test_gigpo_two_trajectories_sharing_step_zero():
    # T1 = (0, 1), T2 = (0, 0) from the same s0, then different states.
    # A_E: returns (1, 0) -> +-1/sqrt2. s0: {0.95, 0} -> +-1/sqrt2; step 1 anchors differ -> 0.
    res = gigpo_advantages([[0.0, 1.0], [0.0, 0.0]], [["s0", "a"], ["s0", "b"]])
    assert res.advantages[0] == approx([2 * R2, R2])
    assert res.advantages[1] == approx([-2 * R2, -R2])


def test_gigpo_singleton_and_keyless_anchors_get_no_step_advantage():
    # Every anchor is different (or empty): the step term is 0 everywhere, A = A_E.
    res = gigpo_advantages([[1.0], [0.0], [0.0]], [["x"], [""], [""]])
    assert all(np.all(s == 0.0) for s in res.step)
    assert [a[0] for a in res.advantages] == approx([2 * R3, -R3, -R3])


def test_gigpo_revisited_state_adds_one_member_per_visit():
    # T1 visits s0 twice: returns (0 + 0.95*1, 1); T2 = (0). Mean-only:
    # s0 = {0.95, 1, 0}, mean 0.65 -> (0.30, 0.35, -0.65).
    cfg = AdvantageConfig(scale_by_std=False)
    res = gigpo_advantages([[0.0, 1.0], [0.0]], [["s0", "s0"], ["s0"]], cfg=cfg)
    assert res.step[0] == approx([0.30, 0.35])
    assert res.step[1] == approx([-0.65])


def test_gigpo_groups_do_not_share_anchors():
    # Same anchor string in two different groups: each step group is then a singleton.
    res = gigpo_advantages([[1.0], [0.0]], [["s0"], ["s0"]], group_ids=["g1", "g2"])
    assert all(np.all(s == 0.0) for s in res.step) and all(np.all(a == 0.0) for a in res.advantages)


def test_gigpo_rejects_empty_and_mismatched_trajectories():
    with pytest.raises(ValueError, match=r"step_rewards\[1\] has no steps"):
        gigpo_advantages([[1.0], []], [["a"], []])
    with pytest.raises(ValueError, match="no trajectories"):
        gigpo_advantages([], [])
    with pytest.raises(ValueError, match="trajectory 0"):
        gigpo_advantages([[1.0, 0.0]], [["a"]])


def test_discounted_returns():
    # (0, 0, 1) with gamma 0.5: (0.25, 0.5, 1).
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == approx([0.25, 0.5, 1.0])


# -- GRPO-MR (RLVMR) ------------------------------------------------------------------------------

def test_grpo_mr_outcome_plus_alpha_times_tag_group_advantage():
    # Outcome returns (10, 0, 0) -> (2/sqrt3, -1/sqrt3, -1/sqrt3).
    # planning = {T1[0]: 1, T2[0]: 0, T3[1]: 0} -> (2/sqrt3, -1/sqrt3, -1/sqrt3).
    # explore  = {T1[1]: 1, T1[2]: 0, T2[1]: 1}: mean 2/3, deviations (1/3, -2/3, 1/3), sample var 1/3,
    #            s = 1/sqrt3 -> (1/sqrt3, -2/sqrt3, 1/sqrt3).
    # reflection = {T3[0]} singleton -> 0.  A = A_out + 0.5 * A_meta.
    res = grpo_mr_advantages(
        outcome_returns=[10.0, 0.0, 0.0],
        meta_rewards=[[1.0, 1.0, 0.0], [0.0, 1.0], [1.0, 0.0]],
        tags=[["planning", "explore", "explore"], ["planning", "explore"], ["reflection", "planning"]])
    assert res.step[0] == approx([2 * R3, R3, -2 * R3])
    assert res.step[1] == approx([-R3, R3])
    assert res.step[2] == approx([0.0, -R3])
    assert res.advantages[0] == approx([3 * R3, 2.5 * R3, 1 * R3])
    assert res.advantages[1] == approx([-1.5 * R3, -0.5 * R3])
    assert res.advantages[2] == approx([-R3, -1.5 * R3])


def test_grpo_mr_untagged_steps_and_groups():
    # "none" steps get no meta advantage; the two groups' planning steps are not pooled.
    # g1: outcome (1, 0) -> +-1/sqrt2, planning {1, 0} -> +-1/sqrt2. g2: same shape.
    cfg = AdvantageConfig(rlvmr_alpha=1.0)
    res = grpo_mr_advantages([1.0, 0.0, 5.0, 3.0], [[1.0, 0.0], [0.0], [2.0], [0.0]],
                             [["planning", "none"], ["planning"], ["planning"], [None]],
                             group_ids=["g1", "g1", "g2", "g2"], cfg=cfg)
    assert res.advantages[0] == approx([2 * R2, R2])
    assert res.advantages[1] == approx([-2 * R2])
    # g2: planning has one member (T4's step is untagged) -> 0; outcome (5, 3) -> +-1/sqrt2.
    assert res.advantages[2] == approx([R2])
    assert res.advantages[3] == approx([-R2])


def test_grpo_mr_untagged_steps_never_form_a_group():
    # Untagged steps with different meta values: grouped like a tag, the two "none" ones (0.7, 0.0)
    # would get +-1/sqrt2; untagged, no step gets a meta advantage, so A = A_out = +-1/sqrt2.
    res = grpo_mr_advantages([1.0, 0.0], [[0.7, 0.1], [0.0]], [["none", None], ["none"]])
    assert all(np.all(s == 0.0) for s in res.step)
    assert [a[0] for a in res.advantages] == approx([R2, -R2])


def test_grpo_mr_rejects_empty_trajectory():
    with pytest.raises(ValueError, match="no steps"):
        grpo_mr_advantages([1.0, 0.0], [[1.0], []], [["planning"], []])


# -- LaMer ------------------------------------------------------------------------------------------

def test_lamer_cross_episode_returns_three_episodes():
    # gamma_step 0.5, gamma_traj 0.6. In-episode returns g:
    #   ep0 (0, 0.2): g = (0.1, 0.2);  ep1 (0.4, 0): g = (0.4, 0);  ep2 (0, 1): g = (0.5, 1).
    # G^(2) = g^(2) = (0.5, 1.0)
    # G^(1) = g^(1) + 0.6 * 0.5 = (0.7, 0.3)
    # G^(0) = g^(0) + 0.6 * 0.4 + 0.36 * 0.5 = g^(0) + 0.42 = (0.52, 0.62)
    out = lamer_returns([[0.0, 0.2], [0.4, 0.0], [0.0, 1.0]], gamma_step=0.5, gamma_traj=0.6)
    assert out[0] == approx([0.52, 0.62])
    assert out[1] == approx([0.7, 0.3])
    assert out[2] == approx([0.5, 1.0])


def test_lamer_group_normalised_over_trials_per_episode_index():
    # Single-step episodes, so gamma_step does not matter; gamma_traj 0.6.
    # A: [[1]] -> G^(0) = 1.   B: [[0], [1]] -> G^(1) = 1, G^(0) = 0 + 0.6 * 1 = 0.6.   C: [[0], [0]] -> 0, 0.
    # Index 0: {1, 0.6, 0}: mean 8/15, deviations (7, 1, -8)/15, sum sq 114/225, sample var 57/225,
    #          s = sqrt(57)/15 -> (7, 1, -8)/sqrt(57).
    # Index 1: {B: 1, C: 0} -> +-1/sqrt2 (A stopped after succeeding, so it is not a member).
    out = lamer_advantages([[[1.0]], [[0.0], [1.0]], [[0.0], [0.0]]])
    s57 = math.sqrt(57)
    assert out[0][0] == approx([7 / s57])
    assert out[1][0] == approx([1 / s57]) and out[1][1] == approx([R2])
    assert out[2][0] == approx([-8 / s57]) and out[2][1] == approx([-R2])


def test_lamer_defaults_and_empty_episode_rejected():
    # Default gamma_traj is the paper's 0.6: two one-step episodes (0), (1) -> G^(0) = 0.6.
    assert lamer_returns([[0.0], [1.0]])[0] == approx([0.6])
    with pytest.raises(ValueError, match="no steps"):
        lamer_returns([[1.0], []])
    with pytest.raises(ValueError, match="no episodes"):
        lamer_advantages([[[1.0]], []])


# -- token-level GAE -------------------------------------------------------------------------------

def test_masked_gae_skips_an_observation_token():
    # Tokens a0, obs, a1, a2; rewards (0, -, 0, 1), values (0.5, -, 0.6, 0.8), gamma 1, lam 0.95.
    # As the 3-token sequence: t2: delta = 1 - 0.8 = 0.2, A = 0.2
    #                          t1: delta = 0.8 - 0.6 = 0.2, A = 0.2 + 0.95 * 0.2 = 0.39
    #                          t0: delta = 0.6 - 0.5 = 0.1, A = 0.1 + 0.95 * 0.39 = 0.4705
    adv, ret = masked_gae([0.0, 0.0, 0.0, 1.0], [0.5, 7.0, 0.6, 0.8], [1, 0, 1, 1])
    assert adv == approx([0.4705, 0.0, 0.39, 0.2])
    assert ret == approx([0.9705, 0.0, 0.99, 1.0])
    plain, _ = masked_gae([0.0, 0.0, 1.0], [0.5, 0.6, 0.8], [1, 1, 1])
    assert adv[[0, 2, 3]] == approx(plain)


def test_masked_gae_discount_batch_and_bootstrap():
    # Row 0: r (0, 1), V (0.5, 0.5), gamma 0.9, lam 0.8:
    #   t1: delta = 1 - 0.5 = 0.5, A = 0.5;  t0: delta = 0.9 * 0.5 - 0.5 = -0.05, A = -0.05 + 0.72 * 0.5 = 0.31
    # Row 1: mask (0, 1), r (0, 0), V (-, 0.2), bootstrap 1.0: delta = 0.9 * 1.0 - 0.2 = 0.7.
    adv, ret = masked_gae([[0.0, 1.0], [0.0, 0.0]], [[0.5, 0.5], [3.0, 0.2]], [[1, 1], [0, 1]],
                          gamma=0.9, lam=0.8, last_value=[0.0, 1.0])
    assert adv[0] == approx([0.31, 0.5])
    assert adv[1] == approx([0.0, 0.7])
    assert ret[1] == approx([0.0, 0.9])


def test_masked_gae_config_defaults_are_used():
    # gamma 1.0, lam 0.95 from the config: r (0, 1), V (0, 0): A1 = 1, A0 = 0 + 0.95 * 1.
    adv, _ = masked_gae([0.0, 1.0], [0.0, 0.0], [1, 1])
    assert adv == approx([0.95, 1.0])


def test_masked_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="masked"):
        masked_gae([0.0, 1.0], [0.0, 0.0], [1, 0])
    with pytest.raises(ValueError, match="no action tokens"):
        masked_gae([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1, 0], [0, 0]])
    with pytest.raises(ValueError, match="one shape"):
        masked_gae([0.0], [0.0, 0.0], [1, 1])


# -- VAGEN bi-level GAE ------------------------------------------------------------------------------

def test_bilevel_gae_two_turns_of_two_tokens():
    # Tokens: turn 1 = (0, 1), observation 2, turn 2 = (3, 4). V = (0.2, 0.5, -, 0.4, 0.6);
    # turn rewards (0, 1). gamma_turn 0.9, lambda_turn 0.8, gamma_token 1, lambda_token 0.5.
    # Turn level (values at the last tokens 1 and 4):
    #   turn 2: delta = 1 + 0 - 0.6 = 0.4, A = 0.4
    #   turn 1: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.9 * 0.8 * 0.4 = 0.328
    # Token level: A[4] = 0.4; A[3] = (0.6 - 0.4) + 0.5 * 0.4 = 0.4
    #              A[1] = 0.328; A[0] = (0.5 - 0.2) + 0.5 * 0.328 = 0.464
    cfg = AdvantageConfig(gamma_turn=0.9, lambda_turn=0.8, gamma_token=1.0, lambda_token=0.5)
    adv, ret = bilevel_gae([0.0, 1.0], [0.2, 0.5, 9.0, 0.4, 0.6], [1, 1, 0, 1, 1], cfg=cfg)
    assert adv == approx([0.464, 0.328, 0.0, 0.4, 0.4])
    assert ret == approx([0.664, 0.828, 0.0, 0.8, 1.0])


def test_bilevel_gae_equals_token_gae_when_undiscounted():
    # With every gamma and lambda 1, both telescope to A_j = (sum of later rewards) - V_j, which is
    # masked token GAE with each turn's reward on its last token.
    cfg = AdvantageConfig(gamma_turn=1.0, lambda_turn=1.0, gamma_token=1.0, lambda_token=1.0)
    values = [0.3, 0.1, 5.0, 0.7, 0.2, 0.9]
    mask = [1, 1, 0, 1, 1, 1]
    adv, _ = bilevel_gae([0.5, 2.0], values, mask, cfg=cfg)
    token, _ = masked_gae([0.0, 0.5, 0.0, 0.0, 0.0, 2.0], values, mask, gamma=1.0, lam=1.0)
    assert adv == approx(token)
    # ... and by hand for the first token: 0.5 + 2.0 - 0.3.
    assert adv[0] == pytest.approx(2.2)


def test_bilevel_gae_defaults_and_turn_ids():
    # Defaults: turn (0.95, 0.95), token (1, 1). Two adjacent turns told apart only by turn_ids:
    # tokens (0) and (1), V = (0.5, 0.5), rewards (0, 1).
    #   turn 2: A = 1 - 0.5 = 0.5;  turn 1: delta = 0.95 * 0.5 - 0.5 = -0.025, A = -0.025 + 0.9025 * 0.5 = 0.42625
    adv, _ = bilevel_gae([0.0, 1.0], [0.5, 0.5], [1, 1], turn_ids=[0, 1])
    assert adv == approx([0.42625, 0.5])
    assert [list(s) for s in turn_spans([1, 1, 0, 1], turn_ids=None)] == [[0, 1], [3]]


def test_bilevel_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="2 turns"):
        bilevel_gae([1.0], [0.0, 0.0, 0.0], [1, 0, 1])
    with pytest.raises(ValueError, match="no action tokens"):
        bilevel_gae([], [0.0, 0.0], [0, 0])


# -- config ------------------------------------------------------------------------------------------

def test_config_defaults_and_from_mapping():
    cfg = AdvantageConfig()
    assert (cfg.gigpo_omega, cfg.gigpo_gamma, cfg.lamer_gamma_traj, cfg.gae_gamma, cfg.gae_lam) == (
        1.0, 0.95, 0.6, 1.0, 0.95)
    assert AdvantageConfig.from_mapping({"gigpo_gamma": 1}).gigpo_gamma == 1.0
    with pytest.raises(ValueError, match="unknown keys"):
        AdvantageConfig.from_mapping({"gamma": 0.9})
    with pytest.raises(ValueError, match="bool"):
        AdvantageConfig.from_mapping({"scale_by_std": 1})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AdvantageConfig(gae_lam=1.5)


def test_reinforce_pp_normalises_step_returns_over_the_whole_batch():
    from envserve_trainer.methods.reinforce_pp import reinforce_pp_advantages
    # Returns-to-go with gamma 0.5: [1, 0] -> [1, 0]; [0, 0, 4] -> [1, 2, 4]. Pooled: 0, 1, 1, 2, 4,
    # mean 1.6, sample std sqrt(((1.6^2 + 0.6^2 * 2 + 0.4^2 + 2.4^2) / 4) = sqrt(2.3).
    a = reinforce_pp_advantages([[1.0, 0.0], [0.0, 0.0, 4.0]], gamma=0.5, cfg=AdvantageConfig(eps=0.0))
    std = np.sqrt(2.3)
    np.testing.assert_allclose(a[0], [(1 - 1.6) / std, (0 - 1.6) / std])
    np.testing.assert_allclose(a[1], [(1 - 1.6) / std, (2 - 1.6) / std, (4 - 1.6) / std])
    # One batch-wide baseline, not one per trajectory: a trajectory of equal returns is not zeroed.
    b = reinforce_pp_advantages([[1.0], [3.0]], gamma=1.0, cfg=AdvantageConfig(eps=0.0))
    assert b[0][0] < 0 < b[1][0]
