"""ARPO (Agentic Reinforced Policy Optimisation): entropy-guided branching after environment responses,
and the advantages of trajectories that share a prefix.

    H           = mean over the first k response tokens of -sum_v p_v log p_v        (nats)
    dH_t        = (H_t - H_initial) / ln|V|       ("log_vocab"; raw nats with "none")
    P_t         = alpha + beta * dH_t;   branch Z continuations at turn t when P_t > threshold

H_initial is the entropy of the first response (before any environment feedback). Budget: of the
global M rollouts, N are sampled whole first; branching spends the remaining M - N, Z per branching
point, in order, until it is gone; what branching leaves unspent goes to independent whole rollouts.

Advantages: the group's returns are normalised as GRPO does (advantages.grpo_advantages over the
initial, branched and independent rollouts of one task), then spread over tokens:
  soft: every token of trajectory i gets A_i, shared tokens included. A shared prefix token appears
        in every branch through it with the same log-prob, so a loss summed over rows gives it the
        sum of those branches' A_i: the mean advantage of the branches, times their number.
  hard: each token explicitly gets the mean A of all trajectories holding the same tokens up to
        and including it (the prefix tree's node), its own A once it is the only one.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ...config.process import ARPOConfig


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log p_v in nats for each position of logits [..., V]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def window_entropy(entropies: torch.Tensor, mask: torch.Tensor | None = None,
                   k: int = ARPOConfig.entropy_tokens) -> torch.Tensor:
    """Mean entropy over each row's first k masked-in tokens; entropies [T] or [B, T], as
    sequence_logprobs(return_entropy=True) gives them. A row with no token gets 0."""
    single = entropies.dim() == 1
    e = entropies.unsqueeze(0) if single else entropies
    m = torch.ones_like(e, dtype=torch.bool) if mask is None else (mask.unsqueeze(0) if single else mask).bool()
    first_k = m & (torch.cumsum(m.long(), dim=-1) <= k)
    out = (e * first_k).sum(-1) / first_k.sum(-1).clamp(min=1)
    return out[0] if single else out


def entropy_change(entropy: float, initial_entropy: float, vocab_size: int | None = None,
                   scale: str = ARPOConfig.entropy_scale) -> float:
    """dH = (H - H_initial) / ln|V| ("log_vocab") or H - H_initial ("none")."""
    dh = entropy - initial_entropy
    if scale == "none":
        return dh
    if scale != "log_vocab":
        raise ValueError(f"unknown entropy scale {scale!r}")
    if vocab_size is None or vocab_size < 2:
        raise ValueError("the log_vocab scale needs a vocabulary of at least 2 tokens")
    return dh / math.log(vocab_size)


def branching_score(dh: float, alpha: float = ARPOConfig.alpha, beta: float = ARPOConfig.beta) -> float:
    """P = alpha + beta * dH."""
    return alpha + beta * dh


def should_branch(dh: float, alpha: float = ARPOConfig.alpha, beta: float = ARPOConfig.beta,
                  threshold: float = ARPOConfig.threshold) -> bool:
    """P > threshold (strictly: at the defaults an unchanged entropy does not branch)."""
    return branching_score(dh, alpha, beta) > threshold


class BranchPlan(NamedTuple):
    initial: int                   # N whole rollouts sampled first
    branches: tuple[int, ...]      # continuations forked at each branching point, in order
    independent: int               # budget branching left unspent: more whole rollouts

    @property
    def total(self) -> int:
        return self.initial + sum(self.branches) + self.independent


def branch_plan(decisions: Sequence[bool], total: int = ARPOConfig.total_rollouts,
                initial: int = ARPOConfig.initial_rollouts, branches: int = ARPOConfig.branches) -> BranchPlan:
    """Spend M - N over the branching decisions in order: min(Z, what is left) at each True, 0 at
    each False; the rest becomes independent rollouts, so initial + branched + independent = M."""
    if not 0 < initial <= total:
        raise ValueError(f"need 0 < initial ({initial}) <= total ({total})")
    if branches < 1:
        raise ValueError("branches (Z) must be >= 1")
    left = total - initial
    spent = []
    for d in decisions:
        z = min(branches, left) if d else 0
        spent.append(z)
        left -= z
    return BranchPlan(initial, tuple(spent), left)


def shared_prefix_advantages(token_ids: Sequence[Sequence[int]], advantages: Sequence[float],
                             mode: str = ARPOConfig.advantage_mode) -> list[np.ndarray]:
    """Per-token advantages of a group of trajectories that may share prefixes (rows of response
    tokens; branches repeat their parent's tokens up to the branching point). soft: row i is A_i
    throughout. hard: position j of row i is the mean A over rows whose first j + 1 tokens equal row i's."""
    if len(token_ids) != len(advantages):
        raise ValueError(f"{len(token_ids)} rows for {len(advantages)} advantages")
    adv = np.asarray(advantages, dtype=np.float64)
    if mode == "soft":
        return [np.full(len(row), adv[i]) for i, row in enumerate(token_ids)]
    if mode != "hard":
        raise ValueError(f"unknown advantage mode {mode!r}")
    # A prefix tree over the rows: node ids per position, then the mean A of the rows through each node.
    children: list[dict[int, int]] = [{}]
    paths = []
    for row in token_ids:
        node, path = 0, []
        for tok in row:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = children[node][tok] = len(children)
                children.append({})
            node = nxt
            path.append(node)
        paths.append(path)
    sums = np.zeros(len(children))
    counts = np.zeros(len(children))
    for i, path in enumerate(paths):
        np.add.at(sums, path, adv[i])
        np.add.at(counts, path, 1)
    return [sums[path] / counts[path] if path else np.zeros(0) for path in paths]
