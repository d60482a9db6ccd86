"""AgentPRM (and the PRM loss InversePRM and ProgRM's progress model share).

    Q-hat(s, a) = mean over the visits of (s, a) of G_t,  G_t = sum_k gamma^k r_{t+k}   (every-visit MC)
    y(s, a)     = clip((Q-hat - low) / (high - low), 0, 1)                             (the BCE target)
    L_PRM       = mean over scored steps of BCE(sigma(Q_phi(s, a)), y)
    r_t         = sigma(Q_phi(s_t, a_t))                                                (the RL step's reward)

Q_phi outputs a logit; sigma of it is the PRM's estimate of the normalised Q. The RL step that uses
r_t keeps a KL to the previous iteration's policy (the learner's reference, refreshed each iteration).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Hashable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ...config.process import AgentPRMConfig
from ..common import discounted_returns


class QHat(NamedTuple):
    value: float      # mean discounted return from (s, a)
    visits: int       # how many returns it averages


def q_hat_targets(step_rewards: Sequence[Sequence[float]], keys: Sequence[Sequence[Hashable | None]],
                  gamma: float = AgentPRMConfig.gamma) -> dict[Hashable, QHat]:
    """Q-hat per (state, action) key over trajectories: each step's discounted return-to-go, averaged
    over every visit of its key (within one trajectory and across trajectories, forks included).
    keys[i][t] names (s_t, a_t) of trajectory i; a None key is not estimated."""
    if len(step_rewards) != len(keys):
        raise ValueError(f"{len(step_rewards)} reward sequences for {len(keys)} key sequences")
    totals: dict[Hashable, list[float]] = defaultdict(list)
    for i, (rewards, names) in enumerate(zip(step_rewards, keys)):
        if len(rewards) != len(names):
            raise ValueError(f"trajectory {i}: {len(rewards)} rewards for {len(names)} keys")
        if not len(rewards):
            continue
        for ret, key in zip(discounted_returns(rewards, gamma), names):
            if key is not None:
                totals[key].append(float(ret))
    return {k: QHat(sum(v) / len(v), len(v)) for k, v in totals.items()}


def bce_target(q: float, low: float = AgentPRMConfig.return_low,
               high: float = AgentPRMConfig.return_high) -> float:
    """(q - low) / (high - low), clipped to [0, 1]."""
    if high <= low:
        raise ValueError(f"high ({high}) must exceed low ({low})")
    return min(1.0, max(0.0, (q - low) / (high - low)))


def prm_bce_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean binary cross-entropy of sigma(logits) against soft targets in [0, 1] over masked
    entries: -(y log sigma(z) + (1 - y) log(1 - sigma(z))). 0 (on the graph) when nothing is masked in."""
    if targets.numel() and (targets.min() < 0 or targets.max() > 1):
        raise ValueError("BCE targets must lie in [0, 1]")
    per = F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype), reduction="none")
    if mask is None:
        return per.mean() if per.numel() else logits.sum()
    m = mask.to(per.dtype)
    return (per * m).sum() / m.sum().clamp(min=1.0)


def prm_step_rewards(logits: torch.Tensor) -> torch.Tensor:
    """r_t = sigma(Q_phi(s_t, a_t)): the PRM's normalised Q of each step, the per-step reward of the
    RL step (AgentPRM; InversePRM uses its Q_phi the same way)."""
    return torch.sigmoid(logits)
