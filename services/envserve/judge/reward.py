"""Reward assembly: r_reason = beta_g * grounding + beta_w * world_modeling.

A turn may carry only one of the two fields (the grounding or the worldmodeling format); the missing
one adds nothing. As in VAGEN, a turn whose text did not parse (no format reward) earns no reasoning
reward at all, whatever its fields say.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import JudgeConfig


@dataclass(frozen=True)
class ReasoningReward:
    total: float
    components: dict[str, float] = field(default_factory=dict)


def reasoning_reward(grounding: float | None, world_modeling: float | None, config: JudgeConfig | None = None,
                     format_valid: bool = True) -> ReasoningReward:
    """The weighted sum of the two judged scores (each an F1 or the repetition penalty)."""
    c = config or JudgeConfig()
    components: dict[str, float] = {}
    if format_valid:
        if grounding is not None:
            components["grounding"] = c.beta_grounding * float(grounding)
        if world_modeling is not None:
            components["world_modeling"] = c.beta_world_modeling * float(world_modeling)
    return ReasoningReward(sum(components.values()), components)
