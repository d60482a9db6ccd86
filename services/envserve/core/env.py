"""The Environment interface: what an environment author writes.

An environment executes one primitive action at a time. Parsing the model's raw text,
several actions per turn, turn limits, format rewards and ground-truth history are the
session's job (core/session.py), so every environment gets them the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Split:
    name: str
    description: str = ""
    # Grid environments draw task seeds from [seed_offset, seed_offset + num_tasks).
    seed_offset: int = 0
    num_tasks: int = 1_000_000


def seeded_splits(what: str, train_tasks: int = 1_000_000, test_offset: int = 10_000_000,
                  test_tasks: int = 100_000) -> tuple[Split, ...]:
    """Train and test splits of a generated family: disjoint seed ranges."""
    return (
        Split("train", f"{what}, seeds [0, {train_tasks:.0e})", 0, train_tasks),
        Split("test", f"{what}, seeds [{test_offset:.0e}, {test_offset:.0e}+{test_tasks:.0e})", test_offset, test_tasks),
    )


@dataclass(frozen=True)
class EnvSpec:
    env_id: str
    description: str
    system_prompt: str
    action_space: str
    max_turns: int
    max_actions_per_turn: int
    modalities: tuple[str, ...] = ("text",)
    # Every config key with its default; Open overrides them per session.
    config_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Optional per-key descriptions for the JSON schema.
    config_docs: Mapping[str, str] = field(default_factory=dict)
    splits: tuple[Split, ...] = (Split("train"),)
    default_action_format: str = "free_think"
    action_formats: tuple[str, ...] = ()
    supports_snapshot: bool = True
    # Replaying the reset arguments and actions rebuilds the same state (the same anchors) in any
    # process: what lets a client carry a session over to another replica. False where the
    # simulation is not reproducible (GPU physics); such a session is lost with its replica.
    replay_exact: bool = True
    # Different seeds give different initial states. False where the start is fixed and the seed
    # only drives the randomness that follows (a fixed map with slippery ice).
    seed_varies_start: bool = True
    # Players of a game whose seats can be separate sessions at a table (envserve.common.tables); 1
    # for everything else.
    seats: int = 1

    def config_schema(self) -> dict:
        """JSON schema of the session config, with defaults."""
        props = {}
        for key, value in self.config_defaults.items():
            props[key] = {"type": _json_type(value), "default": value}
            if key in self.config_docs:
                props[key]["description"] = self.config_docs[key]
        return {"type": "object", "properties": props, "additionalProperties": False}

    def split(self, name: str) -> Split:
        for s in self.splits:
            if s.name == name:
                return s
        raise KeyError(f"unknown split {name!r}; this env has {[s.name for s in self.splits]}")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if value is None:
        return "null"
    return "object"


def resolve_config(spec: EnvSpec, overrides: Mapping[str, Any] | None) -> dict:
    """Defaults plus overrides, with types checked; raises ValueError on bad keys or types."""
    config = dict(spec.config_defaults)
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(f"unknown config key {key!r} for {spec.env_id}; known: {sorted(config)}")
        default = config[key]
        # Struct carries every number as a float: accept integral floats for int keys.
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"config {key!r} must be a boolean, got {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                raise ValueError(f"config {key!r} must be an integer, got {value!r}")
            value = int(value)
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"config {key!r} must be a number, got {value!r}")
            value = float(value)
        elif isinstance(default, str) and not isinstance(value, str):
            raise ValueError(f"config {key!r} must be a string, got {value!r}")
        config[key] = value
    return config


@dataclass
class ActionOutcome:
    """What one primitive action did."""
    reward: float = 0.0
    done: bool = False
    # The env cut the episode short (its own time limit): it ends, as truncated rather than done.
    truncated: bool = False
    success: bool = False
    valid: bool = True
    # Why an action was invalid or what happened, shown to the agent.
    feedback: str = ""
    # Named reward parts; they sum to `reward`.
    components: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroundTruth:
    """The true state at one turn, for judges and for GiGPO anchors."""
    state: dict[str, Any]
    relations: list[str] = field(default_factory=list)


# A game with spec.seats > 1 can seat each player as its own session (envserve.common.tables): the
# server seats them around one session of the game opened with `opponent: "self"`, so such an env
# accepts "self" and reports whose turn it is (seat_to_move()) and, at the game's end, how each
# seat came out (info["rewards"] and info["successes"], seat -> value, seats as strings).


class Environment:
    """Base class of every environment.

    Subclasses set `spec` (a class attribute or in __init__) and implement reset, step,
    render_text and ground_truth. `config` is the resolved session config.
    """

    spec: EnvSpec

    def __init__(self, config: Mapping[str, Any]):
        self.config = dict(config)

    # -- the five methods -------------------------------------------------------------
    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        """Build the initial state for `seed`. Same seed, same state, in any process."""
        raise NotImplementedError

    def step(self, action: str) -> ActionOutcome:
        """Execute one primitive action (already split from the model's text)."""
        raise NotImplementedError

    def render_text(self) -> str:
        """The text observation of the current state."""
        raise NotImplementedError

    def ground_truth(self) -> GroundTruth:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # -- optional -----------------------------------------------------------------------
    def render_image(self, size: int) -> "Any":
        """An RGB uint8 array (H, W, 3) of the current state; only envs with 'image' modality."""
        raise NotImplementedError(f"{self.spec.env_id} has no image observation")

    def valid_actions(self) -> "list[str] | None":
        """The legal primitive actions now (ALFWorld's admissible commands, the open cells of a
        board...), or None when the env cannot list them."""
        return None

    def seat_to_move(self) -> "int | None":
        """The seat to move in a game of spec.seats > 1 played by one session for every seat; None
        when the game is over or the env has no seats (the session then reports no seat)."""
        return None

    def anchor_data(self) -> Any:
        """What identifies the state for the anchor key; defaults to the ground-truth map."""
        return self.ground_truth().state

    def snapshot(self) -> Any:
        """A picklable copy of the full state. The default copies the instance's fields;
        environments holding handles (simulators, JVMs) override it or set
        spec.supports_snapshot=False to fall back to replay. It may return None when this
        instance cannot copy itself (its configuration says replay): the session then replays."""
        return copy_state(self.__dict__)

    def restore(self, snap: Any) -> None:
        self.__dict__.update(copy_state(snap))


def copy_state(obj: Any) -> Any:
    import copy
    return copy.deepcopy(obj)


def integral_numbers(value: Any) -> Any:
    """A config value with its integral floats back to ints: a Struct (how Open carries a session's
    config) holds every number as a double, and packages' own arguments (gym.make's, a dataset's)
    often want ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: integral_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [integral_numbers(v) for v in value]
    return value
