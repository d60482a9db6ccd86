"""Reward assembly with the judge's configured weights: r_reason = beta_g * grounding + beta_w *
world_modeling (the formula itself is envserve.client.judge.reasoning_reward, shared with trainers)."""
from __future__ import annotations

from envserve.client.judge import ReasoningReward, reasoning_reward as _weighted

from .config import JudgeConfig

__all__ = ["ReasoningReward", "reasoning_reward"]


def reasoning_reward(grounding: float | None, world_modeling: float | None, config: JudgeConfig | None = None,
                     format_valid: bool = True) -> ReasoningReward:
    """The weighted sum of the two judged scores with `config`'s betas (JudgeConfig defaults)."""
    c = config or JudgeConfig()
    return _weighted(grounding, world_modeling, c.beta_grounding, c.beta_world_modeling, format_valid)
