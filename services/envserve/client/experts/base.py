"""What every expert shares: the ground truth it reads, the move it answers, the session settings.

An expert reads the true state of a turn (StateService.GetState) and decides the primitive actions
of that turn. It never steps anything itself, so one driver (play.py) runs every expert, in batches,
and records what SFT and process-reward methods need.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from envserve.v1 import envserve_pb2 as pb

from ..client import state_dict

# How a move relates to the plan: RLVMR's meta-reasoning tags are chosen from it (answers.py).
PLAN, CONTINUE, EXPLORE, REFLECT = "plan", "continue", "explore", "reflect"
MOVE_KINDS = (PLAN, CONTINUE, EXPLORE, REFLECT)


@dataclass(frozen=True)
class Truth:
    """The ground truth of one turn, as GetState returned it."""
    state: dict[str, Any]
    relations: list[str]
    turn: int
    anchor: str
    observation: str = ""

    @classmethod
    def from_response(cls, response: pb.GetStateResponse) -> "Truth":
        return cls(state_dict(response), list(response.relations), int(response.turn), response.anchor,
                   response.observation_text)


@dataclass
class Move:
    """One turn of an expert: the primitive actions and a short, true account of why."""
    actions: list[str]
    reasoning: str
    kind: str = CONTINUE
    # The whole plan, where the expert has one (RLVMR's <planning> text on the first turn).
    plan: str = ""
    # Minesweeper: the reveal was a guess (no safe cell could be deduced).
    guessed: bool = False

    def __post_init__(self) -> None:
        if not self.actions:
            raise ValueError("a move needs at least one action")
        if self.kind not in MOVE_KINDS:
            raise ValueError(f"move kind must be one of {MOVE_KINDS}, got {self.kind!r}")


class Expert:
    """One instance plays one episode, so it may remember earlier turns (navigation does).

    `settings` is the session's resolved config: the env's defaults from GetSpec overlaid with the
    config the session was opened with (step lengths, distances, board sizes...)."""

    env_id: ClassVar[str] = ""
    # Config keys the session must be opened with for this expert to see what it needs.
    session_config: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, settings: Mapping[str, Any] | None = None):
        self.settings = dict(settings or {})

    def act(self, truth: Truth, max_actions: int) -> Move:
        raise NotImplementedError

    def describe(self, truth: Truth) -> str:
        """What a perfect <observation> / <prediction> of this state says: its relation sentences,
        the text the judges compare against."""
        return relation_text(truth.relations) or truth.observation


def relation_text(relations: list[str]) -> str:
    # Joined as the rule judge joins the env's own sentences (judge/relations.py).
    return ". ".join(r.rstrip(".") for r in relations) + "." if relations else ""


def session_settings(spec: pb.EnvSpec, config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every config key of a session: the spec's defaults, then the session's overrides."""
    props = json.loads(spec.config_schema_json or "{}").get("properties", {})
    out = {key: prop.get("default") for key, prop in props.items()}
    out.update(config or {})
    out.setdefault("max_actions_per_turn", spec.max_actions_per_turn)
    out.setdefault("max_turns", spec.max_turns)
    out.setdefault("action_separator", ",")
    return out


def cells(items) -> list[tuple[int, int]]:
    # Ground truth crosses the wire as a protobuf Struct, where every number is a float.
    return [(int(r), int(c)) for r, c in items]


def cell(item) -> tuple[int, int]:
    return int(item[0]), int(item[1])


def rc(p: tuple[int, int]) -> str:
    return f"({p[0]}, {p[1]})"
