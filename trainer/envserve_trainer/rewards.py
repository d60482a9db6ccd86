"""RLVMR meta-reasoning rewards and reward aggregation: pure functions over per-step records.

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
from typing import Any, Mapping, Sequence

import numpy as np

from .algo_config import RewardConfig

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


# -- aggregation ---------------------------------------------------------------------------------

def reasoning_reward(grounding: float | None, world_modeling: float | None, cfg: RewardConfig | None = None,
                     format_valid: bool = True) -> float:
    """The judged reasoning reward r = beta_g * grounding + beta_w * world_modeling, assembled by
    envserve.client.judge (one definition for the judge service and the trainer); the betas are the
    trainer's own config. A missing score adds nothing; an unparsed turn earns nothing (VAGEN)."""
    from envserve.client.judge import reasoning_reward as assemble
    cfg = cfg or RewardConfig()
    return assemble(grounding, world_modeling, cfg.beta_grounding, cfg.beta_world_modeling, format_valid).total


def step_reward(env_reward: float, components: Mapping[str, float] | None = None) -> float:
    """A step's training reward: the env's reward plus trainer-side components (judge, meta, ...).

    The env's own components (task, format, invalid_action) are already inside `env_reward`;
    `components` holds only what the trainer adds, so nothing is counted twice.
    """
    total = float(env_reward)
    for name, value in (components or {}).items():
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"reward component {name!r} is not finite: {value}")
        total += value
    return total
