"""Reward aggregation: a step's training reward from the env's reward and the trainer's components,
and the judged reasoning reward."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..config.algo import RewardConfig


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
