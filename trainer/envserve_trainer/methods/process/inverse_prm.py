"""InversePRM: a PRM learned from expert demonstrations alone, as a transition classifier.

    z(s, a, s', a') = Q(s, a) - gamma * Q(s', a')            (Q(s', a') := 0 after a terminal step)
    L = - mean over expert transitions of log sigma(z) - mean over policy transitions of log(1 - sigma(z))

z is the reward that Q implies through the Bellman relation (inverse RL's shaping form); a
discriminator on it separates expert (label 1) from policy (label 0) transitions. Each class is
averaged on its own, the standard discriminator loss, so a batch with many more policy than expert
transitions does not drown the experts. A time-limit truncation is not terminal: there the caller
passes Q of the next state and the action the policy would take in it.
The RL step then rewards with sigma(Q_phi(s, a)) (agentprm.prm_step_rewards) and keeps a KL to the
previous iteration's policy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...config.process import InversePRMConfig


def transition_logits(q_sa: torch.Tensor, q_next: torch.Tensor, terminal: torch.Tensor | None = None,
                      gamma: float = InversePRMConfig.gamma) -> torch.Tensor:
    """z = Q(s, a) - gamma * Q(s', a') * (1 - terminal)."""
    nxt = q_next if terminal is None else q_next * (1.0 - terminal.to(q_next.dtype))
    return q_sa - gamma * nxt


def inverse_prm_loss(q_sa: torch.Tensor, q_next: torch.Tensor, expert: torch.Tensor,
                     terminal: torch.Tensor | None = None, gamma: float = InversePRMConfig.gamma) -> torch.Tensor:
    """The classification loss above; expert is 1 for an expert transition, 0 for the policy's.
    A class with no transition in the batch contributes 0."""
    z = transition_logits(q_sa, q_next, terminal, gamma)
    is_expert = expert.bool()
    loss = z.sum() * 0.0
    if is_expert.any():
        loss = loss - F.logsigmoid(z[is_expert]).mean()
    if (~is_expert).any():
        loss = loss - F.logsigmoid(-z[~is_expert]).mean()     # log(1 - sigma(z)) = log sigma(-z)
    return loss
