"""OpenEnv environments, unchanged, as envserve environments.

`openenv:<module>:<Class>` resolves (core.registry's prefix families) to a class built by
make_env_class: envserve imports <module>, takes its OpenEnv Environment subclass <Class>, and
reads its typed Action and Observation models from the class's annotations (step's `action`
parameter and reset's return type) or from its generic parameters (Environment[A, O, S]). Each
session constructs its own instance with no arguments, as OpenEnv's own server does.

The model's answer is one action: a JSON object validated by the Action model, or, where the
Action has a single field, the plain text as that field's value. Probes run once per process
decide whether a pickled copy of a reset env is the same env (then forks copy, else replay) and
whether the seed changes the first observation.
"""
from __future__ import annotations

import importlib
import inspect
import json
import pickle
import re
import typing
from typing import Any, Mapping

from envserve.core.env import ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits
from envserve.core.formats import json_object_in

# Turns per episode: OpenEnv environments declare no step limit of their own.
DEFAULT_MAX_TURNS = 100
# The whole answer is one action (JSON objects hold commas), as the spec's config default.
CONFIG_DEFAULTS = {"action_separator": ""}
# Seeds the start probe resets with: two different first observations mean the seed picks the task.
START_PROBE_SEEDS = 8
# Fields every OpenEnv Observation has; the rest are the environment's own and make the text.
_OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")
# Field every OpenEnv Action has; it is not part of what the model writes.
_ACTION_BASE_FIELDS = ("metadata",)


def _openenv():
    # Imported on first use so listing environments stays light.
    from openenv.core.env_server import interfaces, types
    return interfaces, types


# -- the class factory ---------------------------------------------------------------------
def make_env_class(name: str) -> type:
    """The Environment class serving the OpenEnv class at `name` ("module:Class"); KeyError for a
    module or class that cannot be found, ValueError for one that is not a usable OpenEnv env."""
    module_name, sep, class_name = name.rpartition(":")
    if not sep or not module_name or not class_name:
        raise KeyError(f"expected openenv:<module>:<Class> (an importable module and its OpenEnv "
                       f"Environment subclass), got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise KeyError(f"cannot import module {module_name!r}: {e}") from None
    except Exception as e:  # the user's module fails while importing
        raise ValueError(f"importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    target = getattr(module, class_name, None)
    if target is None:
        raise KeyError(f"module {module_name!r} has no {class_name!r}")
    interfaces, types = _openenv()
    if not (inspect.isclass(target) and issubclass(target, interfaces.Environment)):
        raise ValueError(f"{name!r} is not an OpenEnv Environment subclass "
                         f"(openenv.core.env_server.interfaces.Environment): {target!r}")
    if inspect.isabstract(target):
        raise ValueError(f"{name!r} is abstract: it does not implement {sorted(target.__abstractmethods__)}")
    action_cls = _model_of(target, "step", "action", types.Action, 0)
    observation_cls = _model_of(target, "reset", "return", types.Observation, 1)
    if action_cls is None:
        raise ValueError(f"{name!r} names no Action model: annotate step's action parameter with it, "
                         f"or subclass Environment[MyAction, MyObservation, MyState]")
    codec = ActionCodec(action_cls)
    try:
        env = target()
    except Exception as e:
        raise ValueError(f"{name!r} cannot be constructed without arguments: {type(e).__name__}: {e}") from None
    try:
        accepts = _reset_parameters(target)
        first = _reset(env, accepts, 0)
        if not isinstance(first, types.Observation):
            raise ValueError(f"{name!r}.reset returned {type(first).__name__}, not an OpenEnv Observation")
        starts = {_start_key(env, _reset(env, accepts, s)) for s in range(START_PROBE_SEEDS)}
        copies = _copies(env, accepts)
        # Without a seed parameter the env cannot be told which task to start: replay is not exact.
        replay_exact = "seed" in accepts or "**" in accepts
    finally:
        _close(env)
    env_id = f"openenv:{name}"
    doc = inspect.getdoc(target) or f"{class_name} environment"
    spec = EnvSpec(
        env_id=env_id,
        description=f"OpenEnv {class_name} ({module_name}): {doc.splitlines()[0]}",
        system_prompt=_system_prompt(class_name, doc, codec),
        action_space=codec.describe(),
        max_turns=DEFAULT_MAX_TURNS,
        max_actions_per_turn=1,
        config_defaults=dict(CONFIG_DEFAULTS),
        splits=seeded_splits("reset seeds"),
        supports_snapshot=copies,
        replay_exact=replay_exact,
        seed_varies_start=len(starts) > 1,
    )
    safe = re.sub(r"\W", "_", name)
    return type(f"OpenEnv_{safe}", (OpenEnvEnv,), {
        "spec": spec, "openenv_class": target, "codec": codec, "reset_accepts": accepts,
        "observation_cls": observation_cls, "__module__": __name__})


def _model_of(cls, method: str, param: str, base: type, generic_index: int):
    """The pydantic model a method's annotation names, else the Environment[...] parameter."""
    try:
        hinted = typing.get_type_hints(getattr(cls, method)).get(param)
    except Exception:  # annotations naming what the module cannot resolve
        hinted = None
    if inspect.isclass(hinted) and issubclass(hinted, base) and hinted is not base:
        return hinted
    for klass in cls.__mro__:
        for orig in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(orig)
            if len(args) > generic_index and inspect.isclass(args[generic_index]) \
                    and issubclass(args[generic_index], base):
                return args[generic_index]
    return None


def _reset_parameters(cls) -> frozenset:
    """The reset keywords the class takes ("**" where it takes any)."""
    params = inspect.signature(cls.reset).parameters.values()
    return frozenset("**" if p.kind is p.VAR_KEYWORD else p.name for p in params)


def _reset(env, accepts: frozenset, seed: int, options: Mapping[str, Any] | None = None):
    kwargs: dict[str, Any] = dict(options or {})
    if "seed" in accepts or "**" in accepts:
        kwargs["seed"] = seed
    # The episode id follows the seed so the state (the ground truth) is the same in any process.
    if "episode_id" in accepts or "**" in accepts:
        kwargs["episode_id"] = f"seed-{seed}"
    return env.reset(**kwargs)


def _start_key(env, obs) -> str:
    # The state counts too: a hidden target drawn from the seed is a different task.
    state = {k: v for k, v in _state_json(env).items() if k != "episode_id"}
    return render_observation(obs) + json.dumps(state, sort_keys=True)


def _copies(env, accepts: frozenset) -> bool:
    """Whether a pickled copy of a reset env has the same state and observation."""
    try:
        obs = _reset(env, accepts, 0)
        copy = pickle.loads(pickle.dumps(env))
        return _state_json(copy) == _state_json(env) and render_observation(obs) == render_observation(
            _reset(copy, accepts, 0))
    except Exception:  # threads, sockets, open files: forks replay
        return False


def _close(env) -> None:
    try:
        env.close()
    except Exception:  # a close that fails loses nothing envserve keeps
        pass


def _system_prompt(class_name: str, doc: str, codec: "ActionCodec") -> str:
    return (f"You are acting in the OpenEnv environment {class_name}.\n{doc}\n"
            f"Each turn you see the observation's fields, and you answer with one action: {codec.describe()}.\n"
            f"The reward of each step is the environment's own; the episode ends when the environment says so.")


# -- actions ------------------------------------------------------------------------------
class ActionCodec:
    """Reads one Action model instance from the model's text, by the model's JSON schema."""

    def __init__(self, action_cls):
        self.action_cls = action_cls
        self.fields = {k: f for k, f in action_cls.model_fields.items() if k not in _ACTION_BASE_FIELDS}
        # A single field takes the plain text as its value (pydantic converts "5" for an int field).
        self.plain_field = next(iter(self.fields)) if len(self.fields) == 1 else None

    def _field_line(self, key: str, field) -> str:
        schema = self.action_cls.model_json_schema().get("properties", {}).get(key, {})
        if "enum" in schema:
            kind = "one of " + " | ".join(json.dumps(v) for v in schema["enum"])
        else:
            kind = schema.get("type", "value")
        bits = [f"{key} ({kind}{'' if field.is_required() else ', optional'})"]
        if field.description:
            bits.append(field.description)
        return ": ".join(bits)

    def describe(self) -> str:
        fields = "; ".join(self._field_line(k, f) for k, f in self.fields.items())
        if self.plain_field:
            return f"the {self.plain_field} as plain text, or a JSON object with the field {fields}"
        return f"a JSON object with the fields {fields}"

    def parse(self, text: str):
        """(the Action, "") or (None, why it is not one, naming the fields)."""
        from pydantic import ValidationError
        text = text.strip()
        data = json_object_in(text)
        if not isinstance(data, dict):
            if self.plain_field is None:
                return None, f"Invalid action {text[:80]!r}: expected {self.describe()}."
            data = {self.plain_field: text}
        try:
            return self.action_cls.model_validate(data), ""
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'action'}: {err['msg']}"
                                 for err in e.errors())
            return None, f"Invalid action {text[:80]!r}: {problems}. Expected {self.describe()}."

    def write(self, action: Mapping[str, Any]) -> str:
        """The text that parses back to this action (a listed legal action)."""
        if self.plain_field and set(action) == {self.plain_field} and isinstance(action[self.plain_field], str):
            return action[self.plain_field]
        return json.dumps(dict(action), separators=(", ", ": "))


# -- observations --------------------------------------------------------------------------
def render_observation(obs) -> str:
    """The Observation's own fields, one a line: text as it is, anything else as compact JSON."""
    data = obs.model_dump(mode="json")
    lines = []
    for key, value in data.items():
        if key in _OBSERVATION_BASE_FIELDS:
            continue
        lines.append(f"{key}: {value if isinstance(value, str) else json.dumps(value, separators=(',', ':'))}")
    return "\n".join(lines)


def _state_json(env) -> dict:
    state = env.state
    return state.model_dump(mode="json") if hasattr(state, "model_dump") else {"state": repr(state)}


# -- the environment -----------------------------------------------------------------------
class OpenEnvEnv(Environment):
    """One OpenEnv environment instance per session. Subclasses built by make_env_class set spec,
    openenv_class, codec, reset_accepts and observation_cls."""

    spec: EnvSpec
    openenv_class: type
    codec: ActionCodec
    reset_accepts: frozenset
    observation_cls: "type | None"

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        self._env = self.openenv_class()
        self._obs: Any = None
        self._done = False

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        seed = int(seed) if seed is not None else 0
        try:
            self._obs = _reset(self._env, self.reset_accepts, seed, options)
        except TypeError as e:  # options the class's reset does not take
            raise ValueError(f"{self.openenv_class.__name__}.reset: {e}") from None
        self._done = bool(self._obs.done)

    def step(self, action: str) -> ActionOutcome:
        if not isinstance(action, str):
            return ActionOutcome(valid=False, feedback="Invalid action: expected text.")
        parsed, why = self.codec.parse(action)
        if parsed is None:
            return ActionOutcome(valid=False, feedback=why)
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        try:
            obs = self._env.step(parsed)
        except Exception as e:  # the env's own refusal of this action (an illegal move)
            return ActionOutcome(valid=False, feedback=f"Invalid action: {type(e).__name__}: {e}")
        self._obs = obs
        self._done = bool(obs.done)
        reward = float(obs.reward or 0.0)
        # OpenEnv has no success flag; envs that report one put it in the observation's metadata.
        success = self._done and bool(obs.metadata.get("success", False))
        return ActionOutcome(reward=reward, done=self._done, success=success, components={"env": reward})

    def render_text(self) -> str:
        return render_observation(self._obs)

    def valid_actions(self) -> "list[str] | None":
        # OpenEnv's own hook for one-click legal moves (web_actions), where the class fills it in.
        if self._done:
            return []
        try:
            listed = self._env.web_actions(self._obs.model_dump(mode="json"))
        except Exception:
            return None
        return [self.codec.write(a) for _, a in listed] or None

    def ground_truth(self) -> GroundTruth:
        return GroundTruth(_state_json(self._env))

    def anchor_data(self) -> Any:
        # The episode id names the seed, not the state: identical states share an anchor.
        state = {k: v for k, v in _state_json(self._env).items() if k != "episode_id"}
        return {"observation": self.render_text(), "state": state}

    def close(self) -> None:
        _close(self._env)

    # -- copies ---------------------------------------------------------------------------
    def snapshot(self):
        if not self.spec.supports_snapshot:
            return None
        try:
            return pickle.dumps((self._env, self._obs, self._done))
        except Exception:  # this instance holds something that cannot be copied now: replay
            return None

    def restore(self, snap) -> None:
        self._env, self._obs, self._done = pickle.loads(snap)
