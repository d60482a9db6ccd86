"""The judge's settings, with VAGEN's defaults.

One frozen dataclass shared by the rule judge, the repetition penalty and the reward assembly, so
that a service, a trainer and a test agree on the numbers. `JudgeConfig.from_mapping` takes a plain
dict (a YAML section, a gRPC Struct) and refuses unknown keys and wrong types; `Settings` gives the
judge's settings dataclasses (this one and LLMJudgeConfig) that method and `to_dict`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

from envserve.client.settings import typed_fields

_S = TypeVar("_S", bound="Settings")


class Settings:
    """`from_mapping` and `to_dict` of a settings dataclass; `WHAT` names it in refusals."""
    WHAT = "settings"

    @classmethod
    def from_mapping(cls: type[_S], values: Mapping[str, Any] | None) -> _S:
        """Defaults plus `values`; raises ValueError on an unknown key or a value of the wrong type."""
        return cls(**typed_fields(cls, values, cls.WHAT))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class JudgeConfig(Settings):
    WHAT = "judge config"
    # A response passes (verdict True) when its F1 against the ground truth is at least this.
    f1_threshold: float = 0.7
    # PrimitiveSkill: a claimed coordinate matches when every axis is within this many mm.
    coordinate_tolerance_mm: float = 10.0
    # Navigation: a claimed distance matches when it is within this many metres of the true one.
    distance_tolerance_m: float = 0.5
    # r_reason = beta_grounding * grounding + beta_world_modeling * world_modeling.
    beta_grounding: float = 0.5
    beta_world_modeling: float = 0.5
    # Repetition penalty (VAGEN's appendix): a response among the `repetition_top_k` most frequent
    # ones and below `f1_threshold` scores `repetition_penalty` instead of its F1. VAGEN keeps the
    # top 5 of at most 1000 tracked strings.
    repetition_top_k: int = 5
    repetition_max_tracked: int = 1000
    # A response seen fewer times than this is never "frequent" (with few distinct responses,
    # every one of them would otherwise be in the top k).
    repetition_min_count: int = 2
    repetition_penalty: float = -0.1
    # Counts are kept per scope (JudgeItem.scope: one training run's); the least recently used
    # scope is forgotten past this many.
    repetition_max_scopes: int = 256

    def __post_init__(self) -> None:
        if not 0.0 <= self.f1_threshold <= 1.0:
            raise ValueError(f"f1_threshold must be in [0, 1], got {self.f1_threshold}")
        if self.coordinate_tolerance_mm < 0 or self.distance_tolerance_m < 0:
            raise ValueError("tolerances must not be negative")
        if (self.repetition_top_k < 0 or self.repetition_max_tracked < 1 or self.repetition_min_count < 1
                or self.repetition_max_scopes < 1):
            raise ValueError("repetition_top_k >= 0, repetition_max_tracked >= 1, repetition_min_count >= 1 "
                             "and repetition_max_scopes >= 1")
        if self.repetition_max_tracked < self.repetition_top_k:
            raise ValueError("repetition_max_tracked must be at least repetition_top_k")
