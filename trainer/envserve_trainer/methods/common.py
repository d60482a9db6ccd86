"""The advantage estimators' shared pieces (methods.grpo, gigpo, grpo_mr, lamer, reinforce_pp, gae): pure
functions, numpy in and numpy out (float64).

Trajectory-level estimators take ragged Python sequences (one entry per trajectory, one value per
step) and return one float64 array of step advantages per trajectory; token-level GAE takes [T] or
[B, T] arrays. Nothing here knows about models, tokenizers or envserve.

Group normalisation, shared by GRPO, GiGPO, GRPO-MR and LaMer:

    A_i = (R_i - mean(R_G)) / (std(R_G) + eps)      (or R_i - mean(R_G) when scale_by_std=False)

std is the sample std (ddof=1, torch.std's default, as verl/verl-agent/RLVMR compute it) unless
`std_ddof=0` asks for the population std. A group of one member has no baseline to compare against,
so its advantage is 0 (verl instead uses mean 0, std 1 there, passing the raw reward through; a lone
sample then pushes the policy by its absolute reward, which GRPO's relative signal never intends).
A group of identical values gives 0, not NaN: the numerator is exactly 0 and eps keeps the
denominator positive.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from ..config.algo import AdvantageConfig


@dataclass(frozen=True)
class StepAdvantages:
    """Per-trajectory step advantages with the two terms they are made of (for logging)."""
    advantages: list[np.ndarray]   # the combined advantage, one array of steps per trajectory
    outcome: np.ndarray            # the trajectory-level term, one value per trajectory
    step: list[np.ndarray]         # the step-level term (before its weight), per trajectory


# -- group normalisation ------------------------------------------------------------------------

def _as_1d(values: Any, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds a NaN or an infinity")
    return arr


def _group_keys(group_ids: Sequence[Hashable] | None, n: int, name: str = "group_ids") -> list:
    if group_ids is None:
        return [0] * n
    keys = list(group_ids)
    if len(keys) != n:
        raise ValueError(f"{name} has {len(keys)} entries for {n} values")
    return keys


def group_normalize(values: Any, group_ids: Sequence[Hashable] | None = None, *, scale_by_std: bool = True,
                    eps: float = 1e-6, ddof: int = 1) -> np.ndarray:
    """Normalise `values` within the groups given by `group_ids` (one group when None)."""
    v = _as_1d(values, "values")
    if v.size == 0:
        raise ValueError("nothing to normalise: no values")
    keys = _group_keys(group_ids, v.size)
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        members[k].append(i)
    out = np.zeros_like(v)
    for idx in members.values():
        if len(idx) < 2:
            continue  # singleton: no baseline, advantage 0
        g = v[idx]
        centred = g - g.mean()
        out[idx] = centred / (g.std(ddof=ddof) + eps) if scale_by_std else centred
    return out


def _normalize(values: Any, keys: Sequence[Hashable] | None, cfg: AdvantageConfig) -> np.ndarray:
    return group_normalize(values, keys, scale_by_std=cfg.scale_by_std, eps=cfg.eps, ddof=cfg.std_ddof)


# -- helpers on ragged trajectories ---------------------------------------------------------------

def discounted_returns(rewards: Any, gamma: float) -> np.ndarray:
    """R_t = sum_k gamma^k r_{t+k}: each step's discounted reward-to-go within its trajectory."""
    r = _as_1d(rewards, "rewards")
    out = np.zeros_like(r)
    running = 0.0
    for t in range(r.size - 1, -1, -1):
        running = r[t] + gamma * running
        out[t] = running
    return out


def _trajectories(steps: Sequence[Sequence[Any]], name: str) -> list[list]:
    trajs = [list(s) for s in steps]
    if not trajs:
        raise ValueError(f"{name}: no trajectories")
    for i, s in enumerate(trajs):
        if not s:
            raise ValueError(f"{name}[{i}] has no steps: an empty trajectory (or episode) has nothing "
                             "to credit; drop it before computing advantages")
    return trajs


def _check_same_lengths(a: list[list], b: list[list], a_name: str, b_name: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{a_name} has {len(a)} trajectories but {b_name} has {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        if len(x) != len(y):
            raise ValueError(f"trajectory {i}: {len(x)} {a_name} but {len(y)} {b_name}")
