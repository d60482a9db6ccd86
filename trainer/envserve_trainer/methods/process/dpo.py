"""The DPO family (IPR, RRO): sigmoid DPO on masked token log-probabilities, its outcome- and
step-level uses, and the SFT term.

Inputs are per-token log-probabilities as `policies.hf.sequence_logprobs` returns them ([B, T], 0
past a row's end) with a mask of the tokens that count (the action tokens: observations inside a
multi-turn completion are masked out by the caller). `update.losses.score_pairs` produces them for the policy and
the reference in the learner's own layout.

    s(y)  = sum over masked tokens of log pi(y_j | x, y_<j)                      (sequence log-prob)
    m     = (s_pi(y_w) - s_ref(y_w)) - (s_pi(y_l) - s_ref(y_l))                  (the log-ratio margin)
    L_DPO = mean over pairs of -log sigma(beta * m)                               (Rafailov et al. 2023)
    L_SFT = - sum of masked log-probs / number of masked tokens                   (token-mean NLL)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ...config.process import DPOConfig


class ScoredTokens(NamedTuple):
    """One side of a batch of pairs: the policy's and the reference's token log-probs, [B, T] each,
    and the mask of the tokens that count."""
    policy: torch.Tensor
    reference: torch.Tensor
    mask: torch.Tensor


def sequence_logprob(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s(y) = sum_j mask_j * log p_j, per row: [B, T] -> [B]."""
    return (token_logprobs * mask.to(token_logprobs.dtype)).sum(-1)


def dpo_margins(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                ref_rejected: torch.Tensor, beta: float = DPOConfig.beta) -> torch.Tensor:
    """beta * ((pi_w - ref_w) - (pi_l - ref_l)) per pair, from sequence log-probs: DPO's implicit
    reward difference (positive when the policy prefers the chosen more than the reference does)."""
    return beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float = DPOConfig.beta) -> torch.Tensor:
    """mean over pairs of -log sigma(dpo_margins(...)); 0 (still on the graph) for no pairs."""
    if policy_chosen.numel() == 0:
        return policy_chosen.sum() + policy_rejected.sum()
    return -F.logsigmoid(dpo_margins(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)).mean()


def _masked_dpo(chosen: ScoredTokens, rejected: ScoredTokens, beta: float) -> torch.Tensor:
    return dpo_loss(sequence_logprob(chosen.policy, chosen.mask), sequence_logprob(rejected.policy, rejected.mask),
                    sequence_logprob(chosen.reference, chosen.mask),
                    sequence_logprob(rejected.reference, rejected.mask), beta)


def outcome_dpo_loss(chosen: ScoredTokens, rejected: ScoredTokens, beta: float = DPOConfig.beta) -> torch.Tensor:
    """Outcome-level DPO: whole trajectories from the task's prompt, the successful (or better) one
    chosen, every action token of each scored."""
    return _masked_dpo(chosen, rejected, beta)


def _from(mask: torch.Tensor, start: Sequence[int] | torch.Tensor) -> torch.Tensor:
    start = torch.as_tensor(start, device=mask.device).reshape(-1, 1)
    return mask.bool() & (torch.arange(mask.shape[1], device=mask.device).unsqueeze(0) >= start)


def step_dpo_loss(chosen: ScoredTokens, rejected: ScoredTokens, chosen_start: Sequence[int] | torch.Tensor,
                  rejected_start: Sequence[int] | torch.Tensor, beta: float = DPOConfig.beta) -> torch.Tensor:
    """Step-level DPO: continuations from a step t, scored only from token start[i] on (the first
    token of step t in each row); the prefix before it is context, not a choice being compared.
    Where both rows hold the same prefix token for token, its terms cancel in the margin, so this
    equals outcome_dpo_loss on the full rows; the starts matter where prefixes differ."""
    return _masked_dpo(chosen._replace(mask=_from(chosen.mask, chosen_start)),
                       rejected._replace(mask=_from(rejected.mask, rejected_start)), beta)


def sft_loss(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-mean negative log-likelihood over masked tokens; 0 (on the graph) when none is masked in."""
    m = mask.to(token_logprobs.dtype)
    return -(token_logprobs * m).sum() / m.sum().clamp(min=1.0)
