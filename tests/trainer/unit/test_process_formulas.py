"""The process-reward methods' formulas (envserve_trainer.methods.process) against numbers worked by hand.

Every expected value is computed in a comment from the formula in the module's docstring, never by
calling the function under test. sigma(x) = 1 / (1 + e^-x); -log sigma(x) = log(1 + e^-x).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from envserve_trainer.methods.grpo import grpo_advantages
from envserve_trainer.methods.process import agentprm, arpo, dpo, inverse_prm, ipr, progrm, rro
from envserve_trainer.config.process import (AgentPRMConfig, ARPOConfig, DPOConfig, InversePRMConfig, IPRConfig,
                                             ProgRMConfig, RROConfig)
from envserve_trainer.methods.process.dpo import ScoredTokens
from envserve_trainer.update.losses import score_pairs


def softplus(x: float) -> float:
    """-log sigma(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# -- AgentPRM -------------------------------------------------------------------------------------------

def test_q_hat_is_the_mean_discounted_return_over_visits():
    # gamma 0.5. Trajectory A, rewards (0, 0, 1): G_2 = 1, G_1 = 0 + 0.5 * 1 = 0.5, G_0 = 0.5 * 0.5 = 0.25.
    # Trajectory B, rewards (0, 1): G_1 = 1, G_0 = 0.5. (s0, a) is visited in both: (0.25 + 0.5) / 2.
    q = agentprm.q_hat_targets([[0, 0, 1], [0, 1]], [["s0a", "s1b", "s2c"], ["s0a", "s3d"]], gamma=0.5)
    assert q["s0a"] == agentprm.QHat(pytest.approx(0.375), 2)
    assert q["s1b"] == agentprm.QHat(pytest.approx(0.5), 1)
    assert q["s2c"].value == pytest.approx(1.0) and q["s3d"].value == pytest.approx(1.0)


def test_q_hat_counts_revisits_within_a_trajectory_and_skips_unnamed_steps():
    # Rewards (0, 0, 1), gamma 0.5, keys (x, x, None): x's returns 0.25 and 0.5 -> 0.375 over 2 visits;
    # the last step has no key; an empty trajectory adds nothing.
    q = agentprm.q_hat_targets([[0, 0, 1], []], [["x", "x", None], []], gamma=0.5)
    assert q == {"x": agentprm.QHat(pytest.approx(0.375), 2)}
    with pytest.raises(ValueError):
        agentprm.q_hat_targets([[0, 1]], [["x"]])


def test_bce_target_maps_returns_linearly_and_clips():
    # (5 - 0) / (10 - 0) = 0.5; 12 and -1 fall outside [0, 10] and clip to 1 and 0.
    assert agentprm.bce_target(5.0, 0.0, 10.0) == pytest.approx(0.5)
    assert agentprm.bce_target(12.0, 0.0, 10.0) == 1.0
    assert agentprm.bce_target(-1.0, 0.0, 10.0) == 0.0
    # The defaults are a 0/1 outcome's range: 0.25 stays 0.25.
    assert agentprm.bce_target(0.25) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        agentprm.bce_target(0.5, 1.0, 1.0)


def test_prm_bce_loss_values_mask_and_gradient():
    # z = 0, y = 0.5: -(0.5 log 0.5 + 0.5 log 0.5) = ln 2. z = ln 3, y = 1: sigma(ln 3) = 3/4, -log(3/4) = ln(4/3).
    logits = torch.tensor([0.0, math.log(3.0)], requires_grad=True)
    targets = t([0.5, 1.0])
    assert float(agentprm.prm_bce_loss(logits, targets)) == pytest.approx((math.log(2) + math.log(4 / 3)) / 2)
    assert float(agentprm.prm_bce_loss(logits, targets, t([1, 0]))) == pytest.approx(math.log(2))
    assert float(agentprm.prm_bce_loss(logits, targets, t([0, 0]))) == 0.0
    # dL/dz = (sigma(z) - y) / 2 per entry: (0.5 - 0.5) / 2 = 0 and (0.75 - 1) / 2 = -0.125 (descent raises z).
    agentprm.prm_bce_loss(logits, targets).backward()
    assert logits.grad.tolist() == pytest.approx([0.0, -0.125])
    with pytest.raises(ValueError):
        agentprm.prm_bce_loss(torch.zeros(1), t([1.5]))


def test_prm_step_rewards_are_the_heads_probability():
    # sigma(0) = 0.5, sigma(ln 3) = 3/4, sigma(-ln 3) = 1/4.
    r = agentprm.prm_step_rewards(t([0.0, math.log(3), -math.log(3)]))
    assert r.tolist() == pytest.approx([0.5, 0.75, 0.25])


# -- InversePRM -----------------------------------------------------------------------------------------

def test_transition_logits_and_terminal_handling():
    # gamma 0.5: z = 2 - 0.5 * 1 = 1.5; the second transition is terminal, so Q(s', a') counts as 0: z = 1.
    z = inverse_prm.transition_logits(t([2.0, 1.0]), t([1.0, 3.0]), t([0, 1]), gamma=0.5)
    assert z.tolist() == pytest.approx([1.5, 1.0])


def test_inverse_prm_loss_expert_positive_policy_negative():
    # Expert z = 1.5: -log sigma(1.5) = log(1 + e^-1.5). Policy z = 1 (terminal): -log(1 - sigma(1)) = log(1 + e^1).
    loss = inverse_prm.inverse_prm_loss(t([2.0, 1.0]), t([1.0, 3.0]), torch.tensor([1, 0]), t([0, 1]), gamma=0.5)
    assert float(loss) == pytest.approx(softplus(-1.5) + softplus(1.0), rel=1e-6)


def test_inverse_prm_loss_averages_each_class_on_its_own():
    # z = (2, 0, 0) (no next Q), one expert and two policy transitions:
    # log(1 + e^-2) + mean(log 2, log 2) = log(1 + e^-2) + ln 2 (a pooled mean would give (log(1 + e^-2) + 2 ln 2) / 3).
    q = t([2.0, 0.0, 0.0])
    loss = inverse_prm.inverse_prm_loss(q, torch.zeros(3), torch.tensor([1, 0, 0]), gamma=0.99)
    assert float(loss) == pytest.approx(softplus(-2.0) + math.log(2), rel=1e-6)
    # Only experts: the policy term is absent, not NaN.
    only = inverse_prm.inverse_prm_loss(t([2.0]), t([0.0]), torch.tensor([1]))
    assert float(only) == pytest.approx(softplus(-2.0), rel=1e-6)


def test_inverse_prm_gradient_raises_expert_q_and_lowers_policy_q():
    q_sa = torch.tensor([0.0, 0.0], requires_grad=True)
    q_next = torch.tensor([0.0, 0.0], requires_grad=True)
    inverse_prm.inverse_prm_loss(q_sa, q_next, torch.tensor([1, 0]), gamma=0.5).backward()
    # z = 0 for both. Expert: dL/dz = -(1 - sigma(0)) = -0.5; policy: dL/dz = sigma(0) = 0.5.
    # dz/dQ(s,a) = 1, dz/dQ(s',a') = -gamma = -0.5.
    assert q_sa.grad.tolist() == pytest.approx([-0.5, 0.5])
    assert q_next.grad.tolist() == pytest.approx([0.25, -0.25])


# -- ProgRM ---------------------------------------------------------------------------------------------

HEAT_EGG = [
    ["go fridge", "open fridge", "take egg", "go microwave", "heat egg", "go table", "put egg"],
    ["look", "go fridge", "take egg", "go microwave", "heat egg", "put egg"],
    ["go fridge", "take egg", "inventory", "go microwave", "heat egg", "go table", "put egg"],
]


def test_lcs_of_two_sequences_and_its_tie_rule():
    a = ["go", "take", "go", "heat", "go", "put"]
    b = ["look", "go", "take", "go", "cool", "heat", "go", "put"]
    assert progrm.lcs(a, b) == a                      # every step of a appears in b in order
    assert progrm.lcs(a, ["x", "y"]) == [] and progrm.lcs([], b) == []
    # (x, y) against (y, x): two LCSs of length 1; an element of a is skipped first, so b's y is matched.
    assert progrm.lcs(["x", "y"], ["y", "x"]) == ["y"]


def test_recipe_of_a_cluster_is_the_folded_lcs():
    # LCS(s1, s2): s2's look is not in s1, open fridge and go table are not in s2 in order ->
    # (go fridge, take egg, go microwave, heat egg, put egg); all five appear in s3 in order.
    assert progrm.recipe(HEAT_EGG) == ["go fridge", "take egg", "go microwave", "heat egg", "put egg"]
    assert progrm.recipe([]) == []
    assert progrm.recipe([["a", "b"]]) == ["a", "b"]


def test_labels_and_progress_rewards_of_a_seven_step_trajectory():
    key = progrm.recipe(HEAT_EGG)                      # |L| = 5
    actions = ["look", "go fridge", "take egg", "go table", "go microwave", "look", "heat egg"]
    # Key steps met at t = 1, 2, 4, 6 (0-based) -> 1/5, 2/5, 3/5, 4/5; others carry the last label:
    # 0, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8 (the egg is never put: progress stops at 4/5).
    labels = progrm.progress_labels(actions, key)
    assert labels == pytest.approx([0.0, 0.2, 0.4, 0.4, 0.6, 0.6, 0.8])
    # r_t = Prog(s_t) - Prog(s_{t-1}), Prog(s_0) = 0: 0, .2, .2, 0, .2, 0, .2; they sum to the last label.
    rewards = progrm.progress_rewards(labels)
    assert rewards == pytest.approx([0.0, 0.2, 0.2, 0.0, 0.2, 0.0, 0.2])
    assert sum(rewards) == pytest.approx(labels[-1])
    # A member of the cluster covers its recipe: its last label is 1.
    assert progrm.progress_labels(HEAT_EGG[1], key)[-1] == pytest.approx(1.0)


def test_labels_follow_the_lcs_alignment_and_empty_recipes():
    key = ["take", "heat", "put"]
    # (take, put, heat): the LCS has 2 of 3 key steps; take -> 1/3, then put is aligned (b matched early)
    # -> 2/3, and heat, out of order, adds nothing.
    assert progrm.progress_labels(["take", "put", "heat"], key) == pytest.approx([1 / 3, 2 / 3, 2 / 3])
    assert progrm.progress_labels(["look", "look"], []) == [0.0, 0.0]
    assert progrm.progress_labels([], key) == []


def test_cluster_by_key_in_order_of_first_appearance():
    assert progrm.cluster_by_key(["a", "b", "a", "c"]) == [[0, 2], [1], [3]]
    assert progrm.cluster_by_key([]) == []


def test_cluster_by_jaccard_threshold_is_inclusive():
    seqs = [["take", "heat", "put"], ["take", "heat", "put", "look"], ["take", "cool", "put"], ["go", "open"]]
    # J(1, 0) = 3/4. J(2, 0) = |{take, put}| / |{take, heat, put, cool}| = 2/4; J(2, 1) = 2/5. J(3, .) = 0.
    assert progrm.cluster_by_jaccard(seqs, threshold=0.6) == [[0, 1], [2], [3]]
    assert progrm.cluster_by_jaccard(seqs, threshold=0.5) == [[0, 1, 2], [3]]     # 2/4 >= 0.5 joins
    assert progrm.cluster_by_jaccard([], 0.5) == []


def test_cluster_recipes_skip_small_and_empty_clusters():
    seqs = HEAT_EGG + [["go garden"], ["x", "y"], ["y", "z"], ["p"], ["q"]]
    clusters = [[0, 1, 2], [3], [4, 5], [6, 7]]
    # [3] is below min size 2; LCS(x y, y z) = (y); LCS(p, q) is empty, so no recipe.
    assert progrm.cluster_recipes(seqs, clusters, min_cluster_size=2) == [progrm.recipe(HEAT_EGG), ["y"]]
    assert progrm.cluster_recipes(seqs, [], 2) == []


def test_best_recipe_by_covered_fraction():
    recipes = [["take", "cool", "put"], ["take", "heat", "put"]]
    assert progrm.best_recipe(["go", "take", "heat", "go", "put"], recipes) == 1      # 3/3 against 2/3
    assert progrm.best_recipe(["a"], [["a", "b"], ["a", "c"]]) == 0                     # 1/2 each: the first
    assert progrm.best_recipe(["z"], recipes) is None                                  # nothing in common
    assert progrm.best_recipe(["take"], []) is None and progrm.best_recipe(["take"], [[]]) is None


def test_progress_bce_is_smallest_at_the_labels():
    # Logits ln(1/4) and ln(2/3) give sigma = 0.2 and 0.4, the labels: dL/dz = (sigma - y) / 2 = 0, and the
    # loss is the labels' mean entropy: (H(0.2) + H(0.4)) / 2, H(p) = -(p ln p + (1 - p) ln(1 - p)).
    logits = torch.tensor([math.log(0.25), math.log(2 / 3)], requires_grad=True)
    labels = t([0.2, 0.4])
    loss = progrm.progress_bce_loss(logits, labels)
    h = lambda p: -(p * math.log(p) + (1 - p) * math.log(1 - p))  # noqa: E731
    assert float(loss) == pytest.approx((h(0.2) + h(0.4)) / 2, rel=1e-6)
    loss.backward()
    assert logits.grad.abs().max() < 1e-6


# -- the DPO family -------------------------------------------------------------------------------------

def test_dpo_loss_value_and_gradient_direction():
    pc = torch.tensor([-1.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    rc, rr = t([-1.5]), t([-1.5])
    # margin m = (-1 + 1.5) - (-2 + 1.5) = 1; beta m = 0.1; -log sigma(0.1) = log(1 + e^-0.1).
    assert float(dpo.dpo_margins(pc, pr, rc, rr, beta=0.1)) == pytest.approx(0.1)
    loss = dpo.dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert float(loss) == pytest.approx(softplus(-0.1), rel=1e-6)
    loss.backward()
    # dL/dpi_w = -beta sigma(-beta m) = -0.1 / (1 + e^0.1) = -0.047502; dL/dpi_l = +0.047502.
    g = 0.1 / (1 + math.exp(0.1))
    assert pc.grad.item() == pytest.approx(-g, rel=1e-5) and pr.grad.item() == pytest.approx(g, rel=1e-5)


def test_dpo_loss_of_no_pairs_is_zero_and_backpropagates():
    empty = torch.zeros(0, requires_grad=True)
    loss = dpo.dpo_loss(empty, empty, torch.zeros(0), torch.zeros(0))
    assert float(loss) == 0.0
    loss.backward()                                  # no NaN, no error


def test_sequence_logprob_and_sft_respect_the_mask():
    logp = t([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    mask = t([[1, 1, 0], [0, 0, 0]])
    # Row 0: -1 - 2 = -3 (the -3 is masked out); row 1: nothing counts.
    assert dpo.sequence_logprob(logp, mask).tolist() == pytest.approx([-3.0, 0.0])
    # Token-mean NLL: (1 + 2) / 2 masked tokens = 1.5; no token at all gives 0.
    assert float(dpo.sft_loss(logp, mask)) == pytest.approx(1.5)
    assert float(dpo.sft_loss(logp, torch.zeros_like(mask))) == 0.0


def _outcome_sides():
    # Chosen: policy (-1, -2) -> -3; reference (-1.5, -2) -> -3.5. Rejected: policy (-2, -1, [-9 masked]) -> -3,
    # reference (-1, -1.5, [-1 masked]) -> -2.5. m = (-3 + 3.5) - (-3 + 2.5) = 1.
    chosen = ScoredTokens(t([[-1.0, -2.0, 0.0]]), t([[-1.5, -2.0, 0.0]]), t([[1, 1, 0]]))
    rejected = ScoredTokens(t([[-2.0, -1.0, -9.0]]), t([[-1.0, -1.5, -1.0]]), t([[1, 1, 0]]))
    return chosen, rejected


def test_outcome_dpo_loss_masks_tokens():
    chosen, rejected = _outcome_sides()
    # beta 0.1: log(1 + e^-0.1). Counting the masked -9 and -1 would give m = 1 - (-9 + 1) = 9 instead.
    assert float(dpo.outcome_dpo_loss(chosen, rejected, beta=0.1)) == pytest.approx(softplus(-0.1), rel=1e-6)


def test_step_dpo_loss_scores_from_the_step_on():
    # Identical prefix tokens (2 of them) cancel: m = (-0.5 + 1) - (-2 + 1) = 1.5 either way -> log(1 + e^-0.15).
    chosen = ScoredTokens(t([[-1.0, -1.0, -0.5]]), t([[-1.2, -1.1, -1.0]]), t([[1, 1, 1]]))
    rejected = ScoredTokens(t([[-1.0, -1.0, -2.0]]), t([[-1.2, -1.1, -1.0]]), t([[1, 1, 1]]))
    expected = softplus(-0.15)
    assert float(dpo.step_dpo_loss(chosen, rejected, [2], [2], beta=0.1)) == pytest.approx(expected, rel=1e-6)
    assert float(dpo.outcome_dpo_loss(chosen, rejected, beta=0.1)) == pytest.approx(expected, rel=1e-6)
    # A rejected row whose prefix differs: from step 2 on still m = 1.5; over whole rows the chosen's
    # -2 - (-2.3) = 0.3 plus 0.5 = 0.8 and the rejected's (-6) - (-3.1) = -2.9 give m = 3.7 -> log(1 + e^-0.37).
    other = ScoredTokens(t([[-3.0, -1.0, -2.0]]), t([[-1.0, -1.1, -1.0]]), t([[1, 1, 1]]))
    assert float(dpo.step_dpo_loss(chosen, other, [2], [2], beta=0.1)) == pytest.approx(expected, rel=1e-6)
    assert float(dpo.outcome_dpo_loss(chosen, other, beta=0.1)) == pytest.approx(softplus(-0.37), rel=1e-5)


def _tiny_model(seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def test_score_pairs_uses_the_learners_logprobs_and_action_masks():
    from envserve_trainer.policies.hf import sequence_logprobs
    model, reference = _tiny_model(0), _tiny_model(1)
    prompts, chosen, rejected = [[1, 2, 3], [4, 5]], [[6, 7, 8], [9]], [[10, 11], [6, 7, 8, 9]]
    # The second chosen row's only token and the rejected rows' second tokens are observations (mask 0).
    c, r = score_pairs(model, reference, prompts, chosen, rejected, chosen_action_masks=[[1, 1, 1], [0]],
                           rejected_action_masks=[[1, 0], [1, 0, 1, 1]], pad_token_id=0)
    with torch.no_grad():
        want_c, _ = sequence_logprobs(model, prompts, chosen, pad_token_id=0)
        want_r_ref, _ = sequence_logprobs(reference, prompts, rejected, pad_token_id=0)
    assert torch.allclose(c.policy[:, :3], want_c, atol=1e-5)
    assert torch.allclose(r.reference[:, :4], want_r_ref, atol=1e-5)
    assert c.mask.int().tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert r.mask.int().tolist() == [[1, 0, 0, 0], [1, 0, 1, 1]]
    assert c.policy.requires_grad and not r.reference.requires_grad
    # The loss reaches the policy's weights only.
    dpo.outcome_dpo_loss(c, r).backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert all(p.grad is None for p in reference.parameters())
    with pytest.raises(ValueError):
        score_pairs(model, reference, prompts, chosen, rejected, chosen_action_masks=[[1, 1], [1]])


# -- IPR ------------------------------------------------------------------------------------------------

EXPERT = [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [], [1.0, 0.5]]
ALTERNATIVE = [[0.0, 0.5], [1.0, 1.0], [0.0, 1.0], [1.0], [0.5, 0.0]]


def test_ipr_step_pairs_from_mean_returns():
    # t0: 1 vs 0.25 -> expert by 0.75; the expert's best rollout (1, 1: first) and the alternative's worst (0: #0).
    # t1: 0 vs 1: the alternative wins, not kept by IPR. t2: 0.5 vs 0.5, a tie. t3: no expert rollout.
    # t4: 0.75 vs 0.25 -> expert by 0.5; best expert rollout #0 (1.0), worst alternative #1 (0.0).
    assert ipr.ipr_step_pairs(EXPERT, ALTERNATIVE) == [ipr.StepPair(0, "expert", pytest.approx(0.75), 0, 0),
                                                       ipr.StepPair(4, "expert", pytest.approx(0.5), 0, 1)]


def test_ipr_step_pairs_margin_and_both_directions():
    # A margin of 0.5 keeps 0.75 and drops 0.5 (the gap must exceed it).
    assert [p.step for p in ipr.ipr_step_pairs(EXPERT, ALTERNATIVE, margin=0.5)] == [0]
    both = ipr.ipr_step_pairs(EXPERT, ALTERNATIVE, both_directions=True)
    assert [(p.step, p.chosen, p.rejected) for p in both] == [
        (0, "expert", "alternative"), (1, "alternative", "expert"), (4, "expert", "alternative")]
    assert ipr.ipr_step_pairs([[1.0]], [[1.0]]) == []                 # all-success: no pair
    assert ipr.ipr_step_pairs([], []) == []
    with pytest.raises(ValueError):
        ipr.ipr_step_pairs([[1.0]], [])


def test_ipr_loss_adds_outcome_step_and_sft_terms():
    outcome = _outcome_sides()                                          # log(1 + e^-0.1), see above
    zero = ScoredTokens(t([[-1.0]]), t([[-1.0]]), t([[1]]))             # margin 0: log 2
    sft = (t([[-1.0, -2.0, -3.0]]), t([[1, 1, 0]]))                     # (1 + 2) / 2 = 1.5
    out = ipr.ipr_loss(outcome, (zero, zero, [0], [0]), sft, beta=0.1, outcome_weight=1.0, step_weight=2.0,
                       sft_weight=0.5)
    # 1 * log(1 + e^-0.1) + 2 * ln 2 + 0.5 * 1.5
    assert float(out.total) == pytest.approx(softplus(-0.1) + 2 * math.log(2) + 0.75, rel=1e-6)
    assert float(out.sft) == pytest.approx(1.5) and float(out.step) == pytest.approx(math.log(2))


def test_ipr_loss_without_pairs_is_the_sft_term_and_nothing_is_an_error():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = ipr.ipr_loss(None, None, (logp, t([[1, 1]])))
    assert float(out.total) == pytest.approx(1.5) and float(out.outcome) == 0.0
    out.total.backward()
    assert logp.grad[0].tolist() == pytest.approx([-0.5, -0.5])       # d(-mean)/dlogp = -1/2 each
    with pytest.raises(ValueError):
        ipr.ipr_loss(None, None, None)


# -- RRO ------------------------------------------------------------------------------------------------

def test_process_reward_is_the_mean_outcome():
    assert rro.process_reward([1.0, 0.0, 1.0, 1.0]) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        rro.process_reward([])


def test_reward_rising_search_stops_at_the_second_candidate():
    pulled = []

    def candidates():                       # samples (and would roll out) a candidate only when asked
        for r in (0.2, 0.6, 0.9):
            pulled.append(r)
            yield r

    s = rro.reward_rising_search(candidates(), previous=0.5, max_candidates=8)
    # 0.2 < 0.5 goes on; 0.6 >= 0.5 stops: 2 explored, the third never sampled. Best 0.6 (#1), worst 0.2 (#0).
    assert (s.accepted, s.explored, s.best, s.worst, s.chosen, s.pair) == (1, 2, 1, 0, 1, (1, 0))
    assert pulled == [0.2, 0.6]


def test_reward_rising_search_cap_ties_and_single_candidate():
    # No candidate reaches 0.5 within the cap of 3 (the 0.9 is never looked at): best 0.3 (#1) continues,
    # the pair is (best 0.3, worst 0.05).
    capped = rro.reward_rising_search([0.1, 0.3, 0.05, 0.9], previous=0.5, max_candidates=3)
    assert (capped.accepted, capped.explored, capped.chosen, capped.pair) == (None, 3, 1, (1, 2))
    # The first candidate rises (equal counts as rising): one explored, no preference, no pair.
    first = rro.reward_rising_search([0.5], previous=0.5)
    assert (first.accepted, first.explored, first.pair) == (0, 1, None)
    # Tied candidates give no pair either.
    tied = rro.reward_rising_search([0.3, 0.3], previous=0.5, max_candidates=2)
    assert (tied.accepted, tied.best, tied.worst, tied.pair) == (None, 0, 0, None)
    with pytest.raises(ValueError):
        rro.reward_rising_search([], previous=0.0)


def test_mean_candidates_explored_per_step():
    searches = [rro.reward_rising_search(r, previous=0.5) for r in ([0.2, 0.6], [0.7], [0.1, 0.2, 0.8])]
    assert rro.mean_explored(searches) == pytest.approx((2 + 1 + 3) / 3)
    assert rro.mean_explored([]) == 0.0


# -- ARPO -----------------------------------------------------------------------------------------------

def test_token_entropy_uniform_peaked_and_worked():
    assert arpo.token_entropy(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)   # uniform: ln 4
    assert float(arpo.token_entropy(t([50.0, 0.0, 0.0, 0.0]))) < 1e-6                          # peaked: ~0
    # Logits (ln 2, 0, 0) -> p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2.
    assert float(arpo.token_entropy(t([math.log(2), 0.0, 0.0]))) == pytest.approx(1.5 * math.log(2), rel=1e-6)


def test_window_entropy_over_the_first_k_tokens():
    e = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]])
    # k = 3: (1 + 2 + 3) / 3 = 2; the second row has only 2 tokens: (5 + 6) / 2 = 5.5.
    assert arpo.window_entropy(e, t([[1, 1, 1, 1], [1, 1, 0, 0]]), k=3).tolist() == pytest.approx([2.0, 5.5])
    # The first token masked out: the first 3 counted are 2, 3, 4 -> 3. A row of nothing gives 0.
    assert arpo.window_entropy(e, t([[0, 1, 1, 1], [0, 0, 0, 0]]), k=3).tolist() == pytest.approx([3.0, 0.0])
    assert float(arpo.window_entropy(t([1.0, 3.0, 8.0]), k=2)) == pytest.approx(2.0)


def test_branching_decision_at_the_notes_defaults():
    cfg = ARPOConfig()
    assert (cfg.alpha, cfg.beta, cfg.threshold) == (0.5, 0.2, 0.5)
    # H = 2, H_0 = 1, |V| = 4: dH = 1 / ln 4 = 0.7213; P = 0.5 + 0.2 * 0.7213 = 0.6443 > 0.5: branch.
    dh = arpo.entropy_change(2.0, 1.0, vocab_size=4)
    assert dh == pytest.approx(1 / math.log(4))
    assert arpo.branching_score(dh) == pytest.approx(0.5 + 0.2 / math.log(4))
    assert arpo.should_branch(dh) is True
    # Entropy falls (0.5 against 1): P < 0.5; unchanged: P = 0.5, not above the threshold.
    assert arpo.should_branch(arpo.entropy_change(0.5, 1.0, vocab_size=4)) is False
    assert arpo.should_branch(arpo.entropy_change(1.0, 1.0, vocab_size=4)) is False


def test_branching_with_alpha_below_the_threshold_needs_a_large_rise():
    # Raw nats, alpha 0.4: dH 0.4 -> 0.4 + 0.08 = 0.48 <= 0.5; dH 0.6 -> 0.52 > 0.5.
    assert arpo.entropy_change(1.4, 1.0, scale="none") == pytest.approx(0.4)
    assert arpo.should_branch(0.4, alpha=0.4, beta=0.2, threshold=0.5) is False
    assert arpo.should_branch(0.6, alpha=0.4, beta=0.2, threshold=0.5) is True
    with pytest.raises(ValueError):
        arpo.entropy_change(1.0, 0.5, vocab_size=None)


def test_branch_plan_splits_the_budget():
    # M = 16, N = 8: 8 to branch, Z = 3 at each branching point in order: 3, 0, 3, then 2 left, then 0.
    plan = arpo.branch_plan([True, False, True, True, True], total=16, initial=8, branches=3)
    assert plan == arpo.BranchPlan(8, (3, 0, 3, 2, 0), 0) and plan.total == 16
    # One branching point: 3 branched, M - N - 3 = 5 independent rollouts; none: all 8 independent.
    assert arpo.branch_plan([True], 16, 8, 3) == arpo.BranchPlan(8, (3,), 5)
    assert arpo.branch_plan([], 16, 8, 3) == arpo.BranchPlan(8, (), 8)
    with pytest.raises(ValueError):
        arpo.branch_plan([True], total=4, initial=0)


def test_soft_advantage_of_two_branches_sharing_five_tokens():
    # Returns 1 and 0: GRPO with the sample std, mean 0.5, s = sqrt(2 * 0.25 / 1) = 1/sqrt(2): A = +-1/sqrt(2).
    a = grpo_advantages([1.0, 0.0])
    r2 = 1 / math.sqrt(2)
    assert a.tolist() == pytest.approx([r2, -r2], rel=1e-5)
    rows = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 9, 10]]          # 5 shared tokens, then 3 and 2 own
    soft = arpo.shared_prefix_advantages(rows, a, mode="soft")
    assert soft[0].tolist() == pytest.approx([r2] * 8, rel=1e-5)
    assert soft[1].tolist() == pytest.approx([-r2] * 7, rel=1e-5)
    # Summed over the two rows, each shared token receives r2 - r2 = 0 = 2 x the branches' mean advantage.
    assert (soft[0][:5] + soft[1][:5]).tolist() == pytest.approx([0.0] * 5, abs=1e-9)
    hard = arpo.shared_prefix_advantages(rows, a, mode="hard")
    # Hard: the shared tokens are given the mean (0) explicitly; own tokens keep +-1/sqrt(2).
    assert hard[0].tolist() == pytest.approx([0.0] * 5 + [r2] * 3, rel=1e-5, abs=1e-9)
    assert hard[1].tolist() == pytest.approx([0.0] * 5 + [-r2] * 2, rel=1e-5, abs=1e-9)
    # Both give every shared token the same summed advantage.
    assert np.allclose(soft[0][:5] + soft[1][:5], hard[0][:5] + hard[1][:5])


def test_hard_advantage_over_a_two_level_tree():
    # Rows (1 2 3), (1 2 4), (1 5) with A = 3, 0, -3. Node (1): all three, mean 0. Node (1 2): rows 0 and 1,
    # mean 1.5. Leaves keep their own A.
    out = arpo.shared_prefix_advantages([[1, 2, 3], [1, 2, 4], [1, 5]], [3.0, 0.0, -3.0], mode="hard")
    assert [o.tolist() for o in out] == [[0.0, 1.5, 3.0], [0.0, 1.5, 0.0], [0.0, -3.0]]
    assert arpo.shared_prefix_advantages([[]], [1.0], mode="hard")[0].size == 0
    with pytest.raises(ValueError):
        arpo.shared_prefix_advantages([[1]], [1.0], mode="mean")


# -- configs --------------------------------------------------------------------------------------------

def test_configs_build_from_mappings_and_refuse_bad_values():
    assert IPRConfig.from_mapping({"beta": 0.2, "margin": 0.1}).beta == 0.2
    assert RROConfig.from_mapping(None) == RROConfig()
    assert DPOConfig().beta == IPRConfig().beta == RROConfig().beta        # one DPO temperature by default
    with pytest.raises(ValueError, match="unknown"):
        ARPOConfig.from_mapping({"alpah": 0.5})
    with pytest.raises(ValueError):
        AgentPRMConfig.from_mapping({"gamma": "high"})
    bad = [lambda: ARPOConfig(initial_rollouts=20, total_rollouts=16), lambda: ARPOConfig(entropy_scale="bits"),
           lambda: ProgRMConfig(cluster_by="kmeans"), lambda: ProgRMConfig(jaccard_threshold=1.5),
           lambda: AgentPRMConfig(return_low=1.0, return_high=0.0), lambda: InversePRMConfig(gamma=1.2),
           lambda: IPRConfig(margin=-0.1), lambda: RROConfig(max_candidates=0), lambda: DPOConfig(beta=0.0)]
    for make in bad:
        with pytest.raises(ValueError):
            make()
