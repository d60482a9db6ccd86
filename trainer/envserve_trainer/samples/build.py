"""From collected trials to training samples: rewards, then the configured advantage estimator.

One sample per policy call (a turn, or a LaMer reflection): its prompt ids, its completion ids and a
per-token advantage. Only completion (action) tokens are trained; the prompt, which holds the
observations and earlier turns, is context. Trials whose session failed are dropped here.

Estimators and what each turn's tokens get:
  grpo         the trajectory's return (sum of its step rewards) normalised within its task group;
  gigpo        GRPO's episode term + omega * the step term within anchor-state groups;
  grpo_mr      the outcome return (RLVMR: r_success on success + format penalties) normalised in
               the group + alpha * the meta reward normalised within (group, tag);
  lamer        the cross-episode return G_0^(n) of the episode, normalised among the group's trials
               at the same episode index; a reflection is credited with the advantage of the
               episode it led to (it was written to help that one);
  gae          token-level GAE over the trajectory's action tokens, the step reward on each turn's
               last token, values from the critic;
  bilevel_gae  VAGEN's turn-level GAE seeding token-level GAE inside each turn;
  reinforce_pp the step's discounted reward-to-go normalised over the whole batch (REINFORCE++).

A turn's reward is the env's, plus the judged reasoning reward with a judge, plus
process.reward_coef x the process reward a process method gave the turn (process_training.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .. import methods as adv
from ..config.train_config import TrainConfig
from ..methods.grpo_mr import MetaStep, rlvmr_rewards
from ..methods.rewards import reasoning_reward, step_reward
from ..rollout.trajectory import Episode, Trial, Turn


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    advantages: np.ndarray          # one per completion token
    returns: np.ndarray | None = None   # critic targets per token (GAE estimators)
    group: str = ""
    images: list[bytes] = field(default_factory=list)   # the PNGs prompt_ids holds (a VLM's), in order


def turn_reward(turn: Turn, cfg: TrainConfig) -> float:
    """The env's reward (its own components already inside) plus the judged reasoning reward."""
    extra = {}
    if cfg.algo.use_judge and turn.judge_scores:
        extra["reasoning"] = reasoning_reward(turn.judge_scores.get("grounding"),
                                              turn.judge_scores.get("world_modeling"), cfg.algo.reward,
                                              format_valid=turn.parsed)
    if turn.process_reward is not None:
        extra["process"] = cfg.process.reward_coef * turn.process_reward
    return step_reward(turn.reward, extra)


def usable(trials: Sequence[Trial]) -> list[Trial]:
    """Trials that ran to the end with at least one turn (failed sessions are left out)."""
    return [t for t in trials if "error" not in t.info and t.episodes and all(e.turns for e in t.episodes)]


def _turn_sample(turn: Turn, values: np.ndarray, group: str, returns: np.ndarray | None = None) -> Sample:
    n = len(turn.completion_ids)
    return Sample(turn.prompt_ids, turn.completion_ids, turn.logprobs,
                  np.broadcast_to(np.asarray(values, dtype=np.float64), (n,)).copy(), returns, group,
                  turn.prompt_images)


def _whiten(samples: Sequence[Sample], eps: float) -> None:
    """Advantages to mean 0 and std 1 over all the samples' tokens (one group), in place; the
    returns stay as they are."""
    if not samples:
        return
    flat = adv.group_normalize(np.concatenate([s.advantages for s in samples]), eps=eps, ddof=0)
    start = 0
    for s in samples:
        s.advantages[:] = flat[start:start + len(s.advantages)]
        start += len(s.advantages)


ValueFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], list[np.ndarray]]


def build_samples(trials: Sequence[Trial], cfg: TrainConfig, value_fn: ValueFn | None = None) -> list[Sample]:
    """Samples for the update; `value_fn(prompts, completions)` gives the critic's per-token values
    (required by gae and bilevel_gae)."""
    trials = usable(trials)
    est, acfg, rcfg = cfg.algo.estimator, cfg.algo.advantage, cfg.algo.reward
    out: list[Sample] = []
    if not trials:
        return out
    if est == "lamer":
        per_trial = [[[turn_reward(t, cfg) for t in ep.turns] for ep in tr.episodes] for tr in trials]
        advs = adv.lamer_advantages(per_trial, [tr.group for tr in trials], acfg)
        for tr, trial_advs in zip(trials, advs):
            for n, (ep, a) in enumerate(zip(tr.episodes, trial_advs)):
                out += [_turn_sample(t, a[i], tr.group) for i, t in enumerate(ep.turns)]
                if ep.reflection_ids is not None and n + 1 < len(trial_advs):
                    prompt, completion, logps = ep.reflection_ids
                    nxt = float(trial_advs[n + 1][0]) if len(trial_advs[n + 1]) else 0.0
                    out.append(Sample(prompt, completion, logps, np.full(len(completion), nxt), None, tr.group,
                                      ep.reflection_images))
        return out

    # The other estimators train on episodes: every episode of every trial, grouped by task.
    episodes: list[Episode] = [ep for tr in trials for ep in tr.episodes]
    groups = [f"{ep.group}#{ep.episode}" for ep in episodes]
    rewards = [[turn_reward(t, cfg) for t in ep.turns] for ep in episodes]
    if est == "grpo":
        a = adv.grpo_advantages([sum(r) for r in rewards], groups, acfg)
        for ep, g, ai in zip(episodes, groups, a):
            out += [_turn_sample(t, ai, g) for t in ep.turns]
    elif est == "gigpo":
        res = adv.gigpo_advantages(rewards, [[t.state_anchor for t in ep.turns] for ep in episodes], groups,
                                   cfg=acfg)
        for ep, g, ai in zip(episodes, groups, res.advantages):
            out += [_turn_sample(t, ai[i], g) for i, t in enumerate(ep.turns)]
    elif est == "grpo_mr":
        metas = [rlvmr_rewards([MetaStep.from_result(t) for t in ep.turns], ep.success, rcfg) for ep in episodes]
        res = adv.grpo_mr_advantages([m.outcome_return() for m in metas], [m.meta for m in metas],
                                     [m.tags for m in metas], groups, acfg)
        for ep, g, ai in zip(episodes, groups, res.advantages):
            out += [_turn_sample(t, ai[i], g) for i, t in enumerate(ep.turns)]
    elif est == "reinforce_pp":
        advs = adv.reinforce_pp_advantages(rewards, acfg.reinforce_gamma, acfg)
        for ep, g, ai in zip(episodes, groups, advs):
            out += [_turn_sample(t, ai[i], g) for i, t in enumerate(ep.turns)]
    elif est in ("gae", "bilevel_gae"):
        if value_fn is None:
            raise ValueError(f"estimator {est!r} needs a critic (value_fn)")
        for ep, g, r in zip(episodes, groups, rewards):
            args = [[t.prompt_ids for t in ep.turns], [t.completion_ids for t in ep.turns]]
            if any(t.prompt_images for t in ep.turns):
                args.append([t.prompt_images for t in ep.turns])   # a VLM's critic reads them too
            values = value_fn(*args)
            lengths = [len(t.completion_ids) for t in ep.turns]
            v = np.concatenate(values) if values else np.zeros(0)
            mask = np.ones(len(v))
            turn_ids = np.repeat(np.arange(len(lengths)), lengths)
            if est == "gae":
                token_rewards = np.zeros(len(v))
                ends = np.cumsum(lengths) - 1
                for k, end in enumerate(ends):
                    if lengths[k]:
                        token_rewards[end] += r[k]
                a, ret = adv.masked_gae(token_rewards, v, mask, cfg=acfg)
            else:
                a, ret = adv.bilevel_gae(np.asarray(r, dtype=np.float64), v, mask, turn_ids, cfg=acfg)
            start = 0
            for t, n in zip(ep.turns, lengths):
                out.append(Sample(t.prompt_ids, t.completion_ids, t.logprobs, a[start:start + n].copy(),
                                  ret[start:start + n].copy(), g, t.prompt_images))
                start += n
        if acfg.whiten:
            _whiten([s for s in out if len(s.completion_ids)], acfg.eps)
    else:  # config validation makes this unreachable
        raise ValueError(f"unknown estimator {est!r}")
    return [s for s in out if len(s.completion_ids)]
