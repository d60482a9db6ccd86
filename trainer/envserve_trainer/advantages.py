"""Advantage estimators: pure functions, numpy in and numpy out (float64).

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

from .algo_config import AdvantageConfig

# Steps whose tag is one of these carry no meta-reasoning advantage (unparsed or invalid steps).
NO_TAG = ("", "none", None)


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


# -- GRPO ---------------------------------------------------------------------------------------

def grpo_advantages(returns: Any, group_ids: Sequence[Hashable] | None = None,
                    cfg: AdvantageConfig | None = None) -> np.ndarray:
    """Outcome advantage per trajectory: its return normalised within its group (same task/prompt).

    Every token of a trajectory gets its trajectory's value; broadcasting is the caller's.
    """
    return _normalize(returns, group_ids, cfg or AdvantageConfig())


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


# -- GiGPO ----------------------------------------------------------------------------------------

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


# -- REINFORCE++ --------------------------------------------------------------------------------

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


# -- GRPO-MR (RLVMR) -----------------------------------------------------------------------------

def grpo_mr_advantages(outcome_returns: Any, meta_rewards: Sequence[Sequence[float]],
                       tags: Sequence[Sequence[str | None]], group_ids: Sequence[Hashable] | None = None,
                       cfg: AdvantageConfig | None = None) -> StepAdvantages:
    """GRPO-MR (RLVMR, Algorithm 2): A_t = A_outcome + alpha * A_meta,t.

    A_outcome: each trajectory's outcome return normalised within its group (the trajectories of one
    task in one environment). A_meta: each step's meta-reasoning reward normalised among the steps of
    the same group that carry the same tag (planning, explore, reflection, monitor), pooled across the
    group's trajectories. Steps with no tag ("", "none" or None: unparsed or invalid steps) have no
    meta advantage, as in RLVMR's code where they form a tag group of zero rewards. alpha weights the
    meta term alone, the way RLVMR's trainer adds `step_advantage_w` times the step advantage.
    """
    cfg = cfg or AdvantageConfig()
    meta = [_as_1d(m, f"meta_rewards[{i}]") for i, m in enumerate(_trajectories(meta_rewards, "meta_rewards"))]
    tag_lists = _trajectories(tags, "tags")
    _check_same_lengths([list(m) for m in meta], tag_lists, "meta_rewards", "tags")
    out = _as_1d(outcome_returns, "outcome_returns")
    if out.size != len(meta):
        raise ValueError(f"outcome_returns has {out.size} values for {len(meta)} trajectories")
    groups = _group_keys(group_ids, len(meta))
    a_outcome = _normalize(out, groups, cfg)

    flat, keys, where = [], [], []
    for i, (m, tg) in enumerate(zip(meta, tag_lists)):
        for t, (value, tag) in enumerate(zip(m, tg)):
            if tag in NO_TAG:
                continue
            flat.append(value)
            keys.append((groups[i], tag))
            where.append((i, t))
    a_meta = [np.zeros(m.size) for m in meta]
    if flat:
        for (i, t), a in zip(where, _normalize(flat, keys, cfg)):
            a_meta[i][t] = a
    total = [a_outcome[i] + cfg.rlvmr_alpha * a_meta[i] for i in range(len(meta))]
    return StepAdvantages(total, a_outcome, a_meta)


# -- LaMer cross-episode returns -------------------------------------------------------------------

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
