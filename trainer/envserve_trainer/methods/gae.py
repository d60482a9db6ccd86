"""Token-level GAE over a mask (masked_gae) and VAGEN's bi-level GAE (turn-level, then token-level)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..config.algo import AdvantageConfig
from .common import _as_1d


# -- token-level GAE --------------------------------------------------------------------------------

def _token_arrays(rewards: Any, values: Any, mask: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    r = np.asarray(rewards, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    m = np.asarray(mask)
    if not (r.shape == v.shape == m.shape):
        raise ValueError(f"rewards {r.shape}, values {v.shape} and mask {m.shape} must have one shape")
    if r.ndim not in (1, 2):
        raise ValueError(f"expected [T] or [B, T] arrays, got shape {r.shape}")
    single = r.ndim == 1
    if single:
        r, v, m = r[None], v[None], m[None]
    m = m.astype(bool)
    if r.shape[1] == 0 or not m.any(axis=1).all():
        rows = [int(i) for i in np.flatnonzero(~m.any(axis=1))] if r.shape[1] else list(range(r.shape[0]))
        raise ValueError(f"no action tokens (mask all 0) in row(s) {rows}")
    if np.any(r[~m] != 0):
        # Skipping a masked token would silently drop its reward; put it on an action token instead.
        raise ValueError("a reward sits on a masked (observation) token; rewards belong on action tokens")
    if not (np.all(np.isfinite(r[m])) and np.all(np.isfinite(v[m]))):
        raise ValueError("rewards or values hold a NaN or an infinity on action tokens")
    return r, v, m, single


def masked_gae(rewards: Any, values: Any, mask: Any, gamma: float | None = None, lam: float | None = None,
               last_value: Any = 0.0, cfg: AdvantageConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """GAE over action tokens only; returns (advantages, returns), 0 on masked tokens.

    Tokens with mask 0 (observations, prompts, padding) are skipped as if the sequence did not hold
    them: an action token's "next value" is the value of the next *action* token, so the result on
    the action tokens equals GAE run on the sequence with the masked tokens removed.

        delta_t = r_t + gamma * V(next action token) - V_t;  A_t = delta_t + gamma * lam * A_next

    The last action token bootstraps from `last_value` (0 for a finished episode; a value estimate,
    one per row, for a truncated one). Defaults gamma=1.0, lam=0.95 (AdvantageConfig).
    """
    cfg = cfg or AdvantageConfig()
    gamma = cfg.gae_gamma if gamma is None else gamma
    lam = cfg.gae_lam if lam is None else lam
    r, v, m, single = _token_arrays(rewards, values, mask)
    b, length = r.shape
    next_value = np.broadcast_to(np.asarray(last_value, dtype=np.float64), (b,)).copy()
    running = np.zeros(b)
    adv = np.zeros_like(r)
    # Backwards over time, vectorised over rows: a row whose token is masked keeps its carry untouched.
    for t in range(length - 1, -1, -1):
        on = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = np.where(on, delta + gamma * lam * running, running)
        next_value = np.where(on, v[:, t], next_value)
        adv[:, t] = np.where(on, running, 0.0)
    ret = np.where(m, adv + v, 0.0)
    return (adv[0], ret[0]) if single else (adv, ret)


# -- VAGEN bi-level GAE ------------------------------------------------------------------------------

def turn_spans(mask: Any, turn_ids: Any = None) -> list[np.ndarray]:
    """The action-token positions of each turn, in order.

    Without `turn_ids` a turn is a maximal run of consecutive mask-1 tokens (an observation always
    sits between two turns of a chat). With them, turn_ids[j] numbers the turn of action token j.
    """
    m = np.asarray(mask).astype(bool)
    if m.ndim != 1:
        raise ValueError(f"mask must be one-dimensional here, got shape {m.shape}")
    pos = np.flatnonzero(m)
    if pos.size == 0:
        raise ValueError("no action tokens (mask all 0): an empty trajectory has no turns")
    if turn_ids is None:
        breaks = np.flatnonzero(np.diff(pos) > 1) + 1
    else:
        ids = np.asarray(turn_ids)
        if ids.shape != m.shape:
            raise ValueError(f"turn_ids {ids.shape} and mask {m.shape} must have one shape")
        ids = ids[pos]
        if np.any(np.diff(ids) < 0):
            raise ValueError("turn_ids must not decrease along the action tokens")
        breaks = np.flatnonzero(np.diff(ids) != 0) + 1
    return np.split(pos, breaks)


def bilevel_gae(turn_rewards: Any, values: Any, mask: Any, turn_ids: Any = None, last_value: float = 0.0,
                cfg: AdvantageConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """VAGEN's bi-level GAE for one trajectory; returns (advantages, returns) per token, 0 off-action.

    1. Turn level, over turns k with the value read at each turn's last action token e_k:
           delta_k = R_k + gamma_turn * V(e_{k+1}) - V(e_k);   A_k = delta_k + gamma_turn*lambda_turn*A_{k+1}
       (after the last turn V = last_value).
    2. A_k seeds the last token of turn k: its advantage is A_k and its return A_k + V(e_k).
    3. Token level inside each turn, backwards from the seed, with no reward on inner tokens:
           delta_j = gamma_token * V(j+1) - V(j);   A_j = delta_j + gamma_token*lambda_token*A_{j+1}
       where j+1 is the next action token of the same turn.
    Defaults: turn (0.95, 0.95), token (1.0, 1.0); see AdvantageConfig for where they come from.
    """
    cfg = cfg or AdvantageConfig()
    v = np.asarray(values, dtype=np.float64)
    m = np.asarray(mask)
    if v.shape != m.shape or v.ndim != 1:
        raise ValueError(f"values {v.shape} and mask {m.shape} must be one-dimensional and of one shape")
    spans = turn_spans(m, turn_ids)
    rt = _as_1d(turn_rewards, "turn_rewards")
    if rt.size != len(spans):
        raise ValueError(f"{rt.size} turn rewards for {len(spans)} turns in the mask")
    if not np.all(np.isfinite(v[m.astype(bool)])):
        raise ValueError("values hold a NaN or an infinity on action tokens")

    ends = [int(s[-1]) for s in spans]
    turn_adv = np.zeros(len(spans))
    running, next_v = 0.0, float(last_value)
    for k in range(len(spans) - 1, -1, -1):
        delta = rt[k] + cfg.gamma_turn * next_v - v[ends[k]]
        running = delta + cfg.gamma_turn * cfg.lambda_turn * running
        turn_adv[k] = running
        next_v = v[ends[k]]

    adv = np.zeros_like(v)
    for k, span in enumerate(spans):
        running = turn_adv[k]
        adv[span[-1]] = running
        for idx in range(len(span) - 2, -1, -1):
            j, nxt = int(span[idx]), int(span[idx + 1])
            delta = cfg.gamma_token * v[nxt] - v[j]
            running = delta + cfg.gamma_token * cfg.lambda_token * running
            adv[j] = running
    on = m.astype(bool)
    ret = np.where(on, adv + v, 0.0)
    return adv, ret
