"""LaMer: cross-episode returns of a trial's episodes and their group-normalised advantages."""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from ..config.algo import AdvantageConfig
from .common import _as_1d, _group_keys, _normalize, _trajectories, discounted_returns


def lamer_returns(episode_rewards: Sequence[Sequence[float]], gamma_step: float | None = None,
                  gamma_traj: float | None = None, cfg: AdvantageConfig | None = None) -> list[np.ndarray]:
    """LaMer (Jiang et al. 2025): per-step returns of one trial's episodes, in episode order.

        g_t^(n) = sum_{l>=t} gamma_step^(l-t) r_l^(n)                  (in-episode return)
        G_t^(n) = g_t^(n) + sum_{m>n} gamma_traj^(m-n) g_0^(m)          (cross-episode return)

    so an early episode is credited with what the later ones, which learned from it, earned.
    """
    cfg = cfg or AdvantageConfig()
    gs = cfg.lamer_gamma_step if gamma_step is None else gamma_step
    gt = cfg.lamer_gamma_traj if gamma_traj is None else gamma_traj
    raw = _trajectories(episode_rewards, "episode_rewards")
    episodes = [_as_1d(e, f"episode_rewards[{n}]") for n, e in enumerate(raw)]
    g = [discounted_returns(e, gs) for e in episodes]
    out: list[np.ndarray] = [np.empty(0)] * len(g)
    future = 0.0  # sum_{m>n} gt^(m-n) g_0^(m), built from the last episode backwards
    for n in range(len(g) - 1, -1, -1):
        out[n] = g[n] + future
        future = gt * (g[n][0] + future)
    return out


def lamer_advantages(trials: Sequence[Sequence[Sequence[float]]], group_ids: Sequence[Hashable] | None = None,
                     cfg: AdvantageConfig | None = None) -> list[list[np.ndarray]]:
    """Group-normalised LaMer advantages: trials[k][n] holds the step rewards of episode n of trial k.

    Like GRPO over trials: episode n's score is its cross-episode return from its first step,
    G_0^(n), normalised among the trials of the same group at the same episode index n (the same
    position in the trial, so episodes compared have had as many earlier attempts); every step of
    the episode gets that value. A trial that stopped early (it succeeded) has no later episodes and
    simply is not a member of the later indices' groups.
    """
    cfg = cfg or AdvantageConfig()
    trial_list = [list(t) for t in trials]
    if not trial_list:
        raise ValueError("trials: no trials")
    returns = []
    for k, t in enumerate(trial_list):
        if not t:
            raise ValueError(f"trials: trial {k} has no episodes")
        returns.append(lamer_returns(t, cfg=cfg))
    groups = _group_keys(group_ids, len(trial_list))
    scores, keys, where = [], [], []
    for k, rets in enumerate(returns):
        for n, g in enumerate(rets):
            scores.append(g[0])
            keys.append((groups[k], n))
            where.append((k, n))
    adv = _normalize(scores, keys, cfg)
    out = [[np.zeros(g.size) for g in rets] for rets in returns]
    for (k, n), a in zip(where, adv):
        out[k][n][:] = a
    return out
