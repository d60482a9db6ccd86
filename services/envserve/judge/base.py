"""What every judge takes and gives, so the service can route each environment to its own judge.

A judge scores one agent text against one ground-truth record: the GetState record of turn t for
grounding, of turn t+1 for world modelling (with turn t's record beside it, since a prediction is
about a change). It returns a score in [0, 1] (an F1, or 1/0 for a YES/NO judge), a verdict, and
its reasoning. Judges are asynchronous because the LLM judge waits on a network endpoint; the rule
judge answers at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable


@dataclass(frozen=True)
class JudgeInput:
    env_id: str
    field: str                       # "grounding" | "world_modeling"
    text: str                        # the agent's <observation> or <prediction> text
    truth: Mapping[str, Any]         # GetState record: state, relations, anchor, observation_text
    previous: Mapping[str, Any] | None = None   # world modelling: the record of turn t


@dataclass
class Judgment:
    score: float
    verdict: bool
    reasoning: str
    judge: str                       # which judge answered: "rule", "llm:<model>", ...
    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    cached: bool = False
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Judge(Protocol):
    name: str

    def supports(self, env_id: str, state: Mapping[str, Any] | None = None) -> bool:
        """Whether this judge can score texts of `env_id` (for the service's per-env choice)."""

    async def judge(self, item: JudgeInput) -> Judgment:
        """Scores one text; raises JudgeError on a failure that should reach the caller as a status."""

    async def aclose(self) -> None:
        """Releases connections."""


class JudgeError(Exception):
    """A judge could not score an item. `code` is a gRPC status name (UNAVAILABLE, INVALID_ARGUMENT...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message
