"""GRPO: the outcome advantage, a trajectory's return normalised within its group."""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np

from ..config.algo import AdvantageConfig
from .common import _normalize


def grpo_advantages(returns: Any, group_ids: Sequence[Hashable] | None = None,
                    cfg: AdvantageConfig | None = None) -> np.ndarray:
    """Outcome advantage per trajectory: its return normalised within its group (same task/prompt).

    Every token of a trajectory gets its trajectory's value; broadcasting is the caller's.
    """
    return _normalize(returns, group_ids, cfg or AdvantageConfig())
