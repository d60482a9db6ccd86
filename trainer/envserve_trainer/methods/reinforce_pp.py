"""REINFORCE++: discounted rewards-to-go normalised over the whole batch."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..config.algo import AdvantageConfig
from .common import _as_1d, _normalize, _trajectories, discounted_returns


def reinforce_pp_advantages(step_rewards: Sequence[Sequence[float]], gamma: float,
                            cfg: AdvantageConfig | None = None) -> list[np.ndarray]:
    """REINFORCE++ (Hu 2025): each step's discounted reward-to-go R_t, normalised over every step of
    the batch at once (one global mean and std, no per-prompt group), so per-step rewards such as a
    process reward move each step's advantage on their own. ProgRM trains with it; so can AgentPRM."""
    cfg = cfg or AdvantageConfig()
    rewards = [_as_1d(r, f"step_rewards[{i}]") for i, r in enumerate(_trajectories(step_rewards, "step_rewards"))]
    returns = [discounted_returns(r, gamma) for r in rewards]
    flat = _normalize(np.concatenate(returns), None, cfg)
    out, start = [], 0
    for r in returns:
        out.append(flat[start:start + r.size].copy())
        start += r.size
    return out
