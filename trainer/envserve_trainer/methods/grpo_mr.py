"""GRPO-MR (RLVMR): the meta-reasoning rewards and the GRPO-MR advantage, pure functions over per-step records.

RLVMR (Zhang et al. 2025, "Reinforcement Learning with Verifiable Meta-Reasoning Rewards") has the
agent open each step with one tag, <planning>, <explore>, <reflection> or <monitor> (envserve's
`meta_reasoning` action format parses it into `reasoning["meta_tag"]`), and rewards the tag when a
rule checkable on the trajectory says the behaviour helped:

  planning    r_plan * plan_decay**k when the trajectory succeeded, k = planning steps after this
              one (the last plan, the one followed to success, gets the full r_plan);
  explore     r_explore when the step's (s, a, s') transition is new within the trajectory
              (envserve's `transition` key; a step that executed nothing has none and is not new);
  reflection  r_reflect when the previous step was invalid (an illegal action or unparsable output)
              and this step's action differs from that one (it corrects rather than repeats);
  monitor     r_monitor, 0 by default: RLVMR gives monitoring no verifiable rule of its own.

A step whose output did not parse earns the format penalty r_format instead; a step that parsed but
whose action was invalid earns no meta reward at all (the env's invalid-action penalty covers it).

The format penalty belongs in the trajectory's outcome return, not in the meta reward: GRPO-MR
normalises meta rewards within (group, tag) groups, and unparsed steps have no tag, so a constant
penalty there would normalise to nothing. `outcome_return` adds it. When the envserve session
already applies its own `format_penalty` to the env reward and that reward feeds the outcome, set
RewardConfig.r_format to 0 so the penalty is not counted twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ..config.algo import AdvantageConfig, RewardConfig
from .common import StepAdvantages, _as_1d, _check_same_lengths, _group_keys, _normalize, _trajectories

META_TAGS = ("planning", "explore", "reflection", "monitor")
# The group tag of a step that has no rewardable tag (unparsed, invalid, or untagged).
NO_TAG = "none"


@dataclass(frozen=True)
class MetaStep:
    """What the RLVMR rules read from one step."""
    tag: str | None      # meta-reasoning tag; None when the output did not parse or carried none
    parsed: bool         # the action format parsed the output
    valid: bool          # parsed, and every action was legal
    action: str = ""     # the action text (parsed actions joined), compared by the reflection rule
    transition: str = ""  # the env's (s, a, s') key; "" when no action was executed

    def __post_init__(self) -> None:
        if self.tag is not None and self.tag not in META_TAGS:
            raise ValueError(f"unknown meta tag {self.tag!r}; known: {META_TAGS}")
        if self.valid and not self.parsed:
            raise ValueError("a step cannot be valid without having parsed")

    @classmethod
    def from_result(cls, result: Any) -> "MetaStep":
        """From an envserve StepResult (or anything with its field names, attributes or keys).

        A parse that failed leaves `parsed_actions` empty (the session fills it only on a parse), so
        that is the parse signal; `meta_tag` only counts when the output parsed.
        """
        get = result.get if isinstance(result, Mapping) else (lambda k, d=None: getattr(result, k, d))
        actions = [str(a) for a in (get("parsed_actions", None) or [])]
        parsed = bool(actions)
        reasoning = dict(get("reasoning", None) or {})
        tag = (reasoning.get("meta_tag") or None) if parsed else None
        return cls(tag=tag, parsed=parsed, valid=parsed and bool(get("action_valid", False)),
                   action=", ".join(actions), transition=str(get("transition", "") or ""))


@dataclass(frozen=True)
class MetaRewards:
    """Per-step RLVMR rewards of one trajectory."""
    meta: np.ndarray       # the tag's reward (0 where no rule fired)
    format: np.ndarray     # the format penalty (r_format where the output did not parse, else 0)
    tags: list[str]        # the step's tag for GRPO-MR grouping: its tag when valid, else "none"
    outcome: float         # r_success if the trajectory succeeded, else 0

    def outcome_return(self) -> float:
        """The trajectory's outcome return for GRPO-MR: success reward plus format penalties."""
        return float(self.outcome + self.format.sum())


def rlvmr_rewards(steps: Sequence[MetaStep], success: bool, cfg: RewardConfig | None = None) -> MetaRewards:
    """Apply RLVMR's rules to one trajectory's steps (in order)."""
    cfg = cfg or RewardConfig()
    steps = list(steps)
    if not steps:
        raise ValueError("rlvmr_rewards: the trajectory has no steps")
    n = len(steps)
    meta = np.zeros(n)
    fmt = np.zeros(n)
    tags = [NO_TAG] * n
    rewardable = [s.valid and s.tag is not None for s in steps]
    # Planning steps still to come after step t, counted backwards once.
    later_plans = [0] * n
    count = 0
    for t in range(n - 1, -1, -1):
        later_plans[t] = count
        if rewardable[t] and steps[t].tag == "planning":
            count += 1
    seen: set[str] = set()
    for t, s in enumerate(steps):
        if not s.parsed:
            fmt[t] = cfg.r_format
        elif rewardable[t]:
            tags[t] = s.tag
            if s.tag == "planning":
                meta[t] = cfg.r_plan * cfg.plan_decay ** later_plans[t] if success else 0.0
            elif s.tag == "explore":
                meta[t] = cfg.r_explore if s.transition and s.transition not in seen else 0.0
            elif s.tag == "reflection":
                prev = steps[t - 1] if t > 0 else None
                meta[t] = cfg.r_reflect if prev is not None and not prev.valid and s.action != prev.action else 0.0
            else:  # monitor
                meta[t] = cfg.r_monitor
        # Every executed transition counts as seen, whatever the step's tag or validity.
        if s.transition:
            seen.add(s.transition)
    return MetaRewards(meta, fmt, tags, cfg.r_success if success else 0.0)


# Steps whose tag is one of these carry no meta-reasoning advantage (unparsed or invalid steps).
UNTAGGED = ("", "none", None)


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
            if tag in UNTAGGED:
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
