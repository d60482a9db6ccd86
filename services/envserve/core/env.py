"""The Environment interface: what an environment author writes.

An environment executes one primitive action at a time. Parsing the model's raw text,
several actions per turn, turn limits, format rewards and ground-truth history are the
session's job (core/session.py), so every environment gets them the same way.
"""
from __future__ import annotations

import math
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


# Bounds several envs state in EnvSpec.config_bounds.
# A reward is the trainer's scale: 100x the largest built-in one (10); bounded so sums stay finite.
REWARD_BOUNDS: Mapping[str, Any] = {"minimum": -1000.0, "maximum": 1000.0}
# A key naming a file or folder on the server: only the built-in default ("", which means the env's
# own source) unless the replica's operator allows more (core/limits.py, e.g. {"enum": ["",
# "/data/icons"]}). So a caller can neither read an arbitrary folder nor learn whether a path exists:
# a value outside the list is refused before the filesystem is touched.
SERVER_PATH_BOUNDS: Mapping[str, Any] = {"enum": [""]}
# A seed of a package's generator (random.Random, numpy's): a 32-bit word.
SEED_BOUNDS: Mapping[str, Any] = {"minimum": 0, "maximum": 2 ** 32 - 1}


_NO_PATH_SEPARATOR = "^[^/\\\\]*$"


def arguments_bounds(max_properties: int = 16, max_number: float = 1e6, max_chars: int = 256,
                     max_items: int = 64) -> dict:
    """Bounds of an object of keyword arguments handed to another package (gymnasium.make's,
    textarena.make's, a reasoning-gym dataset's): at most max_properties names, each value a boolean,
    null, a number within +-max_number, a string of at most max_chars without a path separator (so
    no argument names a file on the server), or a list of at most max_items of those (or of such
    lists: a map's rows). The package checks what its arguments mean; these keep their size bounded.
    An operator narrows them per env (core/limits.py), e.g. {"maxProperties": 0} to refuse any."""
    scalar = [{"type": ["boolean", "null"]},
              {"type": "number", "minimum": -max_number, "maximum": max_number},
              {"type": "string", "maxLength": max_chars, "pattern": _NO_PATH_SEPARATOR}]
    row = {"type": "array", "maxItems": max_items, "items": {"anyOf": scalar}}
    return {"maxProperties": max_properties, "propertyNames": {"maxLength": 64},
            "additionalProperties": {"anyOf": [*scalar, {"type": "array", "maxItems": max_items,
                                                         "items": {"anyOf": [*scalar, row]}}]}}


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
    # Per-key JSON Schema keywords bounding what a caller may choose (minimum/maximum, maxLength,
    # enum...), merged into config_schema() and enforced by resolve_config. Every key needs some:
    # the conformance suite checks that numbers are bounded above and strings by maxLength or enum.
    # A replica's operator may replace them per key (core/limits.py).
    config_bounds: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    splits: tuple[Split, ...] = (Split("train"),)
    # The config keys that set a task's difficulty (board size, boxes...): ListTasks shows their
    # defaults as each task's parameters unless the env's describe_task says more.
    difficulty_keys: tuple[str, ...] = ()
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
    # A step, reset, fork or replay past the replica's time limit (or whose call was cancelled) may
    # be stopped inside the env's Python code, leaving the session to be reset. False where the env
    # talks to a process whose protocol an interrupted call would leave out of step (a JVM over
    # py4j, a simulator's socket): such an env runs on, and a worker stuck past the limit and its
    # grace is replaced instead (its sessions lost, as after a crash).
    interruptible: bool = True

    def config_schema(self) -> dict:
        """JSON schema of the session config, with defaults."""
        props = {}
        for key, value in self.config_defaults.items():
            props[key] = {"type": _json_type(value), **self.config_bounds.get(key, {}), "default": value}
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


# Integral floats up to this magnitude become ints for integer keys: every integer a double holds
# exactly. A larger one (1e300) stays a float, so an error message shows it as the caller wrote it.
_EXACT_INTEGERS = 2 ** 53
# Compiled validators by spec object: Open checks its config on the hot path, and compiling a
# schema costs about a millisecond. Specs are long-lived (full_spec caches its own), so the cache
# stays small; it forgets everything past this many.
_VALIDATORS: dict[int, tuple[EnvSpec, Any, frozenset, frozenset]] = {}
_VALIDATORS_MAX = 1024
# Overrides already checked, by (spec object, their items): an Open of many sessions, and a trainer
# opening with the same config again and again, check it once (a check costs ~30 us).
_RESOLVED: dict[tuple, tuple[EnvSpec, dict]] = {}


def _validator(spec: EnvSpec) -> tuple[Any, frozenset, frozenset]:
    """(compiled validator of spec's config schema, its integer keys, its number keys)."""
    entry = _VALIDATORS.get(id(spec))
    if entry is not None and entry[0] is spec:
        return entry[1], entry[2], entry[3]
    from jsonschema import Draft202012Validator
    schema = spec.config_schema()
    Draft202012Validator.check_schema(schema)
    props = schema["properties"]
    integers = frozenset(k for k, p in props.items() if p.get("type") == "integer")
    numbers = frozenset(k for k, p in props.items() if p.get("type") == "number")
    validator = Draft202012Validator(schema)
    if len(_VALIDATORS) >= _VALIDATORS_MAX:
        _VALIDATORS.clear()
    _VALIDATORS[id(spec)] = (spec, validator, integers, numbers)
    return validator, integers, numbers


def config_error(path: "Sequence[Any]", message: str) -> str:
    """'config.a.b[2]: message', the form every config error takes."""
    where = "config"
    for part in path:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    return f"{where}: {message}"


def non_finite(value: Any, path: tuple = ()) -> "tuple[tuple, float] | None":
    """(path, number) of the first NaN or infinity in value (dicts and lists walked), or None. JSON
    Schema's bounds cannot catch them: NaN compares false with every bound."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        found = non_finite(v, (*path, k))
        if found is not None:
            return found
    return None


# Longest message an error quotes: jsonschema's quote the value, which may be a megabyte of text.
_MESSAGE_CHARS = 300


def _message(error: Any) -> str:
    if error.validator == "maxLength" and isinstance(error.instance, str):
        return f"{len(error.instance)} characters, more than the maxLength of {error.validator_value}"
    if error.validator == "pattern" and error.validator_value == _NO_PATH_SEPARATOR:
        return f"{error.instance[:_MESSAGE_CHARS]!r} names a path: a path separator is not allowed here"
    message = error.message
    return message if len(message) <= _MESSAGE_CHARS else message[:_MESSAGE_CHARS] + "..."


def resolve_config(spec: EnvSpec, overrides: Mapping[str, Any] | None) -> dict:
    """Defaults plus overrides, checked against the spec's config schema (types and bounds, with
    jsonschema); raises ValueError naming the field, e.g. 'config.dim_room: 40 is greater than the
    maximum of 12'. Integral floats become ints for integer keys (a Struct, which carries Open's
    config, holds every number as a double) and numbers floats for number keys."""
    config = dict(spec.config_defaults)
    if not overrides:
        return config
    unknown = [k for k in overrides if k not in config]
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]!r} for {spec.env_id}; known: {sorted(config)}")
    # A value that is its key's default (of the same type) needs no check: a Fork's or a Restore's
    # config names every key, most of them at their defaults.
    overrides = {k: v for k, v in overrides.items() if type(v) is not type(config[k]) or v != config[k]}
    if not overrides:
        return config
    try:  # the same overrides again (Open with a count, a trainer's every Open): checked already
        # Types too: 1, 1.0 and True are equal keys, but not equally valid values.
        memo_key = (id(spec), tuple((k, type(v), v) for k, v in overrides.items()))
        values = _RESOLVED.get(memo_key)
    except TypeError:  # an object or a list among the values: not hashable, checked every time
        memo_key = values = None
    if values is not None and values[0] is spec:
        config.update(values[1])
        return config
    validator, integers, numbers = _validator(spec)
    values = {}
    for key, value in overrides.items():
        bad = non_finite(value, (key,))
        if bad is not None:
            raise ValueError(config_error(bad[0], f"{bad[1]} is not a finite number"))
        if type(value) is float and key in integers and value.is_integer() and abs(value) <= _EXACT_INTEGERS:
            value = int(value)
        elif key in numbers and type(value) is int:
            value = float(value)
        values[key] = value
    error = next(validator.iter_errors(values), None)
    if error is not None:
        from jsonschema.exceptions import best_match
        error = best_match(validator.iter_errors(values))
        raise ValueError(config_error(error.absolute_path, _message(error)))
    if memo_key is not None:
        if len(_RESOLVED) >= _VALIDATORS_MAX:
            _RESOLVED.clear()
        _RESOLVED[memo_key] = (spec, values)
    config.update(values)
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


@dataclass(frozen=True)
class TaskDescription:
    """What an env can say of a task without building it (ListTasks): its goal or a line naming
    it, its kind, and what sets its difficulty."""
    description: str = ""
    task_type: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of every environment.

    Subclasses set `spec` (a class attribute or in __init__) and implement reset, step,
    render_text and ground_truth. `config` is the resolved session config.
    """

    spec: EnvSpec

    def __init__(self, config: Mapping[str, Any]):
        self.config = dict(config)

    @classmethod
    def describe_task(cls, spec: EnvSpec, seed: int) -> TaskDescription:
        """The task `seed` starts under the env's default config, said without building it (no
        simulator, no generation): ListTasks calls it for every task of a page. Default: nothing
        beyond the seed and the defaults of spec.difficulty_keys."""
        return TaskDescription(parameters={k: spec.config_defaults[k] for k in spec.difficulty_keys})

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
