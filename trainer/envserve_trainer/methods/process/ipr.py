"""IPR (Iterative step-level Process Refinement): step pairs from forked rollouts along an expert
trajectory, and its loss.

At step t of an expert trajectory the session is forked; the expert's action a_t^e and the policy's
alternative a_t^p are each rolled out to the end by the policy, m times:

    R^e_t = mean of the m returns after a_t^e,   R^p_t = mean of the m returns after a_t^p
    a pair at t when |R^e_t - R^p_t| > margin: the winner's continuation chosen, the loser's rejected

IPR keeps the pairs the expert wins (both_directions adds the others). The loss, with a frozen
reference policy:

    L = w_o * outcome-DPO(expert trajectory > failed policy trajectory)
      + w_s * step-DPO(winning continuation > losing continuation, from the shared prefix)
      + w_sft * SFT(expert trajectory)
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from ...config.process import IPRConfig
from .dpo import ScoredTokens, outcome_dpo_loss, sft_loss, step_dpo_loss


class StepPair(NamedTuple):
    step: int                # t along the expert trajectory
    chosen: str              # "expert" or "alternative": whose continuation wins
    gap: float               # mean return of the winner minus the loser's (> margin)
    chosen_rollout: int      # the winner's highest-return rollout (first on ties), to train on
    rejected_rollout: int    # the loser's lowest-return rollout (first on ties)

    @property
    def rejected(self) -> str:
        return "alternative" if self.chosen == "expert" else "expert"


def _argbest(values: Sequence[float], sign: float) -> int:
    return max(range(len(values)), key=lambda i: (sign * values[i], -i))


def ipr_step_pairs(expert_returns: Sequence[Sequence[float]], alternative_returns: Sequence[Sequence[float]],
                   margin: float = IPRConfig.margin,
                   both_directions: bool = IPRConfig.both_directions) -> list[StepPair]:
    """Pairs from expert_returns[t] and alternative_returns[t], the m returns of the rollouts after
    each action at step t. A step with no rollouts on either side, a tie, or a gap within the margin
    gives none."""
    if len(expert_returns) != len(alternative_returns):
        raise ValueError(f"{len(expert_returns)} expert steps but {len(alternative_returns)} alternative steps")
    pairs = []
    for t, (e, a) in enumerate(zip(expert_returns, alternative_returns)):
        if not len(e) or not len(a):
            continue
        gap = sum(e) / len(e) - sum(a) / len(a)
        if gap > margin:
            pairs.append(StepPair(t, "expert", gap, _argbest(e, 1.0), _argbest(a, -1.0)))
        elif both_directions and -gap > margin:
            pairs.append(StepPair(t, "alternative", -gap, _argbest(a, 1.0), _argbest(e, -1.0)))
    return pairs


class IPRLoss(NamedTuple):
    total: torch.Tensor      # the weighted sum, to backpropagate
    outcome: torch.Tensor    # the three terms before their weights, detached, to log
    step: torch.Tensor
    sft: torch.Tensor


def ipr_loss(outcome: tuple[ScoredTokens, ScoredTokens] | None,
             step: tuple[ScoredTokens, ScoredTokens, Sequence[int], Sequence[int]] | None,
             sft: tuple[torch.Tensor, torch.Tensor] | None, beta: float = IPRConfig.beta,
             outcome_weight: float = IPRConfig.outcome_weight, step_weight: float = IPRConfig.step_weight,
             sft_weight: float = IPRConfig.sft_weight) -> IPRLoss:
    """w_o * outcome_dpo_loss(*outcome) + w_s * step_dpo_loss(*step) + w_sft * sft_loss(*sft).
    outcome is (chosen, rejected); step is (chosen, rejected, chosen_start, rejected_start); sft is
    (expert token log-probs, mask). A part that is None (no pairs this iteration) adds 0."""
    parts = [p for p in (outcome, step, sft) if p is not None]
    if not parts:
        raise ValueError("IPR loss of nothing: no outcome pairs, step pairs or expert tokens")
    anchor = parts[0][0]
    zero = (anchor.policy if isinstance(anchor, ScoredTokens) else anchor).sum() * 0.0
    o = outcome_dpo_loss(*outcome, beta=beta) if outcome is not None else zero
    s = step_dpo_loss(*step, beta=beta) if step is not None else zero
    f = sft_loss(*sft) if sft is not None else zero
    return IPRLoss(outcome_weight * o + step_weight * s + sft_weight * f, o.detach(), s.detach(), f.detach())
