"""GiGPO: episode advantages within the group plus step advantages within anchor-state groups."""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from ..config.algo import AdvantageConfig
from .common import (StepAdvantages, _as_1d, _check_same_lengths, _group_keys, _normalize, _trajectories,
                     discounted_returns)


def gigpo_advantages(step_rewards: Sequence[Sequence[float]], anchors: Sequence[Sequence[str]],
                     group_ids: Sequence[Hashable] | None = None, episode_returns: Any = None,
                     cfg: AdvantageConfig | None = None) -> StepAdvantages:
    """GiGPO (Feng et al. 2025): A_t = A_episode + omega * A_step.

    A_episode: GRPO over the group's episode returns (default: the undiscounted sum of step rewards).
    A_step: each step's discounted return R_t (gamma) normalised among the steps of the same group
    that were taken from the same anchor state; a state revisited within one trajectory adds one
    member per visit. `anchors[i][t]` is the key of the state step t acted *in*: the anchor of the
    result before it (the reset's for t=0), not the anchor that step t's own result reports.
    An empty anchor ("") means the env gave no key, and such a step gets no step advantage.
    """
    cfg = cfg or AdvantageConfig()
    rewards = [_as_1d(r, f"step_rewards[{i}]") for i, r in enumerate(_trajectories(step_rewards, "step_rewards"))]
    anchor_lists = _trajectories(anchors, "anchors")
    _check_same_lengths([list(r) for r in rewards], anchor_lists, "step_rewards", "anchors")
    groups = _group_keys(group_ids, len(rewards))
    if episode_returns is None:
        ep = np.array([r.sum() for r in rewards])
    else:
        ep = _as_1d(episode_returns, "episode_returns")
        if ep.size != len(rewards):
            raise ValueError(f"episode_returns has {ep.size} values for {len(rewards)} trajectories")
    a_episode = _normalize(ep, groups, cfg)

    # Flatten every step, key it by (group, anchor) and normalise the discounted returns in one pass.
    flat_returns, flat_keys, where = [], [], []
    for i, (r, anc) in enumerate(zip(rewards, anchor_lists)):
        for t, (ret, key) in enumerate(zip(discounted_returns(r, cfg.gigpo_gamma), anc)):
            flat_returns.append(ret)
            # A keyless step gets a key of its own (a fresh object): a singleton group, hence 0.
            flat_keys.append((groups[i], str(key)) if key else object())
            where.append((i, t))
    flat_adv = _normalize(flat_returns, flat_keys, cfg)
    a_step = [np.zeros(r.size) for r in rewards]
    for (i, t), a in zip(where, flat_adv):
        a_step[i][t] = a
    total = [a_episode[i] + cfg.gigpo_omega * a_step[i] for i in range(len(rewards))]
    return StepAdvantages(total, a_episode, a_step)
