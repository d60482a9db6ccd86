"""Gymnasium environments, unchanged, as envserve environments.

`gymnasium:<id>` resolves (core.registry's prefix families) to a class built for that id by
make_env_class: its spec comes from the env itself (spaces, max_episode_steps, render modes) and
from probes run once per process: whether a copied env steps identically (then forks copy it,
else the session replays seed + actions), whether the seed changes the initial state, whether
rgb_array rendering works here. Each session makes its own env with gym.make(id, **kwargs).
"""
from __future__ import annotations

import math
import pickle
import re
from typing import Any, Mapping

import numpy as np

from envserve.core.env import (ActionOutcome, Environment, EnvSpec, GroundTruth, arguments_bounds, integral_numbers,
                               seeded_splits)

# Ids `envserve ls` and the conformance suite try; those gymnasium cannot make here (a missing
# Box2D, another version suffix) are left out when listed.
EXAMPLE_IDS = ("FrozenLake-v1", "FrozenLake8x8-v1", "Taxi-v3", "Taxi-v4", "CliffWalking-v0", "CliffWalking-v1",
               "Blackjack-v1", "CartPole-v1", "MountainCar-v0", "MountainCarContinuous-v0", "Acrobot-v1",
               "Pendulum-v1", "LunarLander-v3", "BipedalWalker-v3")
# Turns per episode where the env registers no max_episode_steps.
DEFAULT_MAX_TURNS = 200
# Session config: gym.make keyword arguments, digits of the numbers in text observations, and
# the largest observation written out number by number (bigger ones, pixels, are summarised).
CONFIG_DEFAULTS = {"kwargs": {}, "ndigits": 3, "max_observation_numbers": 256}
CONFIG_BOUNDS = {
    "kwargs": arguments_bounds(),
    # A float has 17 significant digits at most.
    "ndigits": {"minimum": 0, "maximum": 17},
    # Numbers written into every text observation: 4,096 of them are about 40 KB of text a turn.
    "max_observation_numbers": {"minimum": 1, "maximum": 4096},
}
CONFIG_DOCS = {
    "kwargs": "keyword arguments of gymnasium.make (not render_mode, which the session picks)",
    "ndigits": "digits after the point of the numbers in the text observation",
    "max_observation_numbers": "observations with more numbers are summarised (shape, range) in the text",
}
# Steps the copy probe compares between an env and its copy.
COPY_PROBE_STEPS = 24
# Seeds the start probe resets with: any two different initial states mean the seed picks the task.
START_PROBE_SEEDS = 8
# Readable attributes of the unwrapped env in the ground truth: arrays up to this many numbers.
MAX_TRUTH_NUMBERS = 256
# gymnasium seeds must be non-negative: negative task seeds wrap around.
_SEED_MOD = 2 ** 64

# Action names gymnasium documents for its envs (in action-number order), by env class; envs
# exposing get_action_meanings() (ALE) name their own.
DOCUMENTED_ACTION_NAMES = {
    "FrozenLakeEnv": ("Left", "Down", "Right", "Up"),
    "TaxiEnv": ("South", "North", "East", "West", "Pickup", "Dropoff"),
    "CliffWalkingEnv": ("Up", "Right", "Down", "Left"),
    "BlackjackEnv": ("Stick", "Hit"),
    "CartPoleEnv": ("Left", "Right"),
    "MountainCarEnv": ("Left", "Idle", "Right"),
    "AcrobotEnv": ("Negative", "Zero", "Positive"),
}

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf|nan", re.IGNORECASE)


def _gym():
    # Imported on first use so listing environments stays light.
    import gymnasium
    return gymnasium


# -- the class factory ---------------------------------------------------------------------
def examples() -> list[str]:
    """The EXAMPLE_IDS gymnasium can make here."""
    gym = _gym()
    out = []
    for name in EXAMPLE_IDS:
        if name not in gym.registry:
            continue
        try:
            gym.make(name).close()
        except Exception:  # a missing optional dependency (Box2D, pygame...)
            continue
        out.append(name)
    return out


def make_env_class(name: str) -> type:
    """The Environment class serving gymnasium's `name`; KeyError for an id gymnasium does not
    know, ValueError for one it cannot make here or whose spaces envserve cannot express."""
    gym = _gym()
    if name not in gym.registry:
        raise KeyError(f"gymnasium has no environment {name!r} (gymnasium {gym.__version__}); "
                       f"for example {', '.join(examples()[:6])}")
    try:
        env = gym.make(name)
    except Exception as e:
        raise ValueError(f"gymnasium cannot make {name!r} here: {type(e).__name__}: {e}") from None
    try:
        modes = tuple(env.metadata.get("render_modes") or ())
        if "ansi" not in modes and "rgb_array" not in modes:
            raise ValueError(f"{name!r} renders neither text (ansi) nor images (rgb_array): {list(modes)}")
        codec = ActionCodec.for_env(env)
        env_id = f"gymnasium:{name}"
        steps = env.spec.max_episode_steps if env.spec is not None else None
        spec = EnvSpec(
            env_id=env_id,
            description=f"gymnasium {name}: observations {env.observation_space}, actions {env.action_space}.",
            system_prompt=_system_prompt(name, codec, "ansi" in modes),
            action_space=codec.describe(),
            max_turns=int(steps or DEFAULT_MAX_TURNS),
            max_actions_per_turn=1,
            modalities=("text", "image") if "rgb_array" in modes and _renders_images(name) else ("text",),
            # Vector actions are written with commas inside: split several actions on ';' instead.
            config_defaults={**CONFIG_DEFAULTS, **({} if codec.kind == "discrete" else {"action_separator": ";"})},
            config_docs=CONFIG_DOCS,
            config_bounds=CONFIG_BOUNDS,
            splits=seeded_splits("gymnasium reset seeds"),
            supports_snapshot=_copies_step_identically(env),
            seed_varies_start=_seed_varies_start(env),
        )
    finally:
        env.close()
    safe = re.sub(r"\W", "_", name)
    return type(f"Gymnasium_{safe}", (GymnasiumEnv,), {"spec": spec, "gym_id": name, "__module__": __name__})


def _system_prompt(name: str, codec: "ActionCodec", ansi: bool) -> str:
    view = "the environment's text rendering and its observation" if ansi else "the observation, numbers rounded"
    return (f"You are acting in the Gymnasium environment {name}.\n"
            f"Each turn you see {view}, and you answer with one action.\n"
            f"Actions: {codec.describe()}.\n"
            f"The reward of each step is the environment's own; the episode ends when the environment "
            f"terminates it or its step limit is reached.")


def _renders_images(name: str) -> bool:
    try:
        env = _gym().make(name, render_mode="rgb_array")
        try:
            env.reset(seed=0)
            frame = env.render()
        finally:
            env.close()
    except Exception:  # the renderer's package (pygame) is missing here
        return False
    return isinstance(frame, np.ndarray) and frame.ndim == 3


def _copies_step_identically(env) -> bool:
    """Whether a pickled copy of a stepped env continues exactly as the env does."""
    try:
        env.reset(seed=0)
        env.action_space.seed(0)
        copy = pickle.loads(pickle.dumps(env))
        for _ in range(COPY_PROBE_STEPS):
            action = env.action_space.sample()
            a, b = env.step(action), copy.step(action)
            if _fingerprint(a) != _fingerprint(b):
                return False
            if a[2] or a[3]:
                break
        return True
    except Exception:
        return False


def _seed_varies_start(env) -> bool:
    starts = {_fingerprint(env.reset(seed=s)[0]) for s in range(START_PROBE_SEEDS)}
    return len(starts) > 1


def _fingerprint(value: Any) -> str:
    return repr(to_json(value, ndigits=None))


# -- actions ------------------------------------------------------------------------------
class ActionCodec:
    """Reads one action from the model's text for the env's action space."""

    def __init__(self, space, kind: str, names: tuple[str, ...] = ()):
        self.space, self.kind, self.names = space, kind, names

    @classmethod
    def for_env(cls, env) -> "ActionCodec":
        spaces = _gym().spaces
        space = env.action_space
        if isinstance(space, spaces.Discrete):
            unwrapped = env.unwrapped
            names: tuple = ()
            if hasattr(unwrapped, "get_action_meanings"):
                names = tuple(str(m) for m in unwrapped.get_action_meanings())
            else:
                names = DOCUMENTED_ACTION_NAMES.get(type(unwrapped).__name__, ())
            return cls(space, "discrete", names if len(names) == int(space.n) else ())
        if isinstance(space, spaces.MultiDiscrete) and space.nvec.ndim == 1:
            return cls(space, "multidiscrete")
        if isinstance(space, spaces.MultiBinary) and np.ndim(space.n) == 0:
            return cls(space, "multibinary")
        if isinstance(space, spaces.Box):
            return cls(space, "box")
        raise ValueError(f"envserve reads Discrete, MultiDiscrete, MultiBinary and Box actions, not {space}")

    def describe(self) -> str:
        s = self.space
        if self.kind == "discrete":
            lo, hi = int(s.start), int(s.start + s.n - 1)
            if self.names:
                return f"one of {', '.join(self.names)} (case-insensitive), or its number {lo}..{hi} in that order"
            return f"an integer from {lo} to {hi}"
        if self.kind == "multidiscrete":
            ranges = " ".join(f"{int(a)}..{int(a + n - 1)}" for a, n in zip(s.start, s.nvec))
            return f"{len(s.nvec)} integers separated by spaces, in the ranges {ranges}"
        if self.kind == "multibinary":
            return f"{int(s.n)} values, each 0 or 1, separated by spaces"
        size = int(np.prod(s.shape))
        return f"{size} number{'s separated by spaces' if size > 1 else ''}, each within {self._bounds()}"

    def _bounds(self) -> str:
        lo, hi = self.space.low.ravel(), self.space.high.ravel()
        if np.all(lo == lo[0]) and np.all(hi == hi[0]):
            return f"[{_num(lo[0])}, {_num(hi[0])}]"
        return "the bounds " + ", ".join(f"[{_num(a)}, {_num(b)}]" for a, b in zip(lo, hi))

    def parse(self, text: str) -> "tuple[Any, str]":
        """(the action, "") or (None, why it is not one)."""
        text = text.strip()
        if self.kind == "discrete":
            return self._discrete(text)
        numbers = _NUMBER.findall(text)
        leftover = _NUMBER.sub(" ", text).translate(str.maketrans("", "", "[](),")).strip()
        if leftover or not numbers:
            return None, f"Invalid action {text[:80]!r}: expected {self.describe()}."
        values = np.array([float(n) for n in numbers], dtype=np.float64)
        if self.kind == "box":
            return self._box(text, values)
        size = len(self.space.nvec) if self.kind == "multidiscrete" else int(self.space.n)
        if values.size != size or not np.all(values == np.round(values)):
            return None, f"Invalid action {text[:80]!r}: expected {self.describe()}."
        ints = values.astype(np.int64)
        if self.kind == "multidiscrete":
            lo, hi = self.space.start, self.space.start + self.space.nvec - 1
        else:
            lo, hi = np.zeros(size, np.int64), np.ones(size, np.int64)
        if np.any(ints < lo) or np.any(ints > hi):
            return None, f"Invalid action {text[:80]!r}: out of range; expected {self.describe()}."
        return ints.astype(self.space.dtype), ""

    def _discrete(self, text: str):
        s = self.space
        lowered = text.lower()
        for i, n in enumerate(self.names):
            if n.lower() == lowered:
                return int(s.start) + i, ""
        if re.fullmatch(r"[-+]?\d+", text):
            k = int(text)
            if s.start <= k < s.start + s.n:
                return k, ""
        return None, f"Invalid action {text[:80]!r}. Valid actions: {self.describe()}."

    def _box(self, text: str, values: np.ndarray):
        s = self.space
        if values.size != int(np.prod(s.shape)):
            return None, f"Invalid action {text[:80]!r}: expected {self.describe()}."
        lo, hi = s.low.ravel().astype(np.float64), s.high.ravel().astype(np.float64)
        if np.any(np.isnan(values)) or np.any(values < lo) or np.any(values > hi):
            return None, f"Invalid action {text[:80]!r}: out of bounds; each number must be within {self._bounds()}."
        action = values.reshape(s.shape).astype(s.dtype)
        if not s.contains(action):
            return None, f"Invalid action {text[:80]!r}: expected {self.describe()}."
        return action, ""

    def listed(self) -> list[str]:
        """Every discrete action; for vector spaces, examples: the lowest, middle and highest."""
        s = self.space
        if self.kind == "discrete":
            return list(self.names) or [str(int(s.start) + i) for i in range(int(s.n))]
        if self.kind == "multibinary":
            size = int(s.n)
            return [" ".join(["0"] * size), " ".join(["1"] * size)]
        if self.kind == "multidiscrete":
            lo, hi = s.start, s.start + s.nvec - 1
            return [" ".join(str(int(v)) for v in vec) for vec in (lo, (lo + hi) // 2, hi)]
        lo, hi = s.low.ravel().astype(np.float64), s.high.ravel().astype(np.float64)
        mid = np.clip(np.where(np.isfinite(lo) & np.isfinite(hi), (lo + hi) / 2, 0.0), lo, hi)
        picks = [mid] + [v for v in (lo, hi) if np.all(np.isfinite(v))]
        return [" ".join(_num(x) for x in vec) for vec in picks]


def _num(x) -> str:
    # Shortest text that reads back as this float: a listed bound parses to the bound itself.
    f = float(x)
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


# -- JSON-safe values ----------------------------------------------------------------------
def to_json(value: Any, ndigits: "int | None" = None, limit: "int | None" = None) -> Any:
    """Plain JSON data of a gymnasium value (numpy arrays, tuples, dicts, bytes); None where the
    value is not plain data or holds more than `limit` numbers. Non-finite floats become strings."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        f = float(value)
        if not math.isfinite(f):
            return str(f)
        return round(f, ndigits) if ndigits is not None else f
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", "replace")
    if value is None:
        return None
    if isinstance(value, np.ndarray):
        if limit is not None and value.size > limit:
            return None
        if value.dtype.kind not in "biufSU":
            return None
        return to_json(value.tolist(), ndigits, None)
    if isinstance(value, (list, tuple)):
        if limit is not None and len(value) > limit:
            return None
        items = [to_json(v, ndigits, limit) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            j = to_json(v, ndigits, limit)
            if j is not None or v is None:
                out[str(k)] = j
        return out
    return None


# -- the environment -----------------------------------------------------------------------
class GymnasiumEnv(Environment):
    """One gymnasium env per session. Subclasses built by make_env_class set spec and gym_id."""

    spec: EnvSpec
    gym_id: str

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        kwargs = self.config["kwargs"]
        if "render_mode" in kwargs:
            raise ValueError("kwargs cannot set render_mode: render_image picks it")
        self._ndigits = int(self.config["ndigits"])
        self._max_numbers = int(self.config["max_observation_numbers"])
        # Images come from rgb_array; the text view switches to ansi only while it renders.
        render_mode = "rgb_array" if self.config.get("render_image") else None
        try:
            env = _gym().make(self.gym_id, render_mode=render_mode, **integral_numbers(dict(kwargs)))
        except Exception as e:  # unknown keyword, bad value: the session's config is wrong
            raise ValueError(f"gymnasium.make({self.gym_id!r}, **{dict(kwargs)!r}) failed: "
                             f"{type(e).__name__}: {e}") from None
        self._env = env
        self._ansi = "ansi" in (env.metadata.get("render_modes") or ())
        self._codec = ActionCodec.for_env(env)
        self._obs: Any = None
        self._info: dict = {}
        self._done = False
        self._last_reward = 0.0

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        seed = (int(seed) if seed is not None else 0) % _SEED_MOD
        # Seeding both makes every draw of the episode (the env's and a sampled action's) reproducible.
        self._env.action_space.seed(seed)
        self._obs, info = self._env.reset(seed=seed, options=dict(options) if options else None)
        self._info = dict(info)
        self._done = False
        self._last_reward = 0.0

    def step(self, action: str) -> ActionOutcome:
        if not isinstance(action, str):
            return ActionOutcome(valid=False, feedback="Invalid action: expected text.")
        parsed, why = self._codec.parse(action)
        if parsed is None:
            return ActionOutcome(valid=False, feedback=why)
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        obs, reward, terminated, truncated, info = self._env.step(parsed)
        self._obs, self._info = obs, dict(info)
        self._done = bool(terminated or truncated)
        reward = float(reward)
        self._last_reward = reward
        # gymnasium has no success flag; envs that report one use info["is_success"].
        success = bool(terminated) and bool(info.get("is_success", False))
        return ActionOutcome(reward=reward, done=bool(terminated), truncated=bool(truncated) and not terminated,
                             success=success, components={"env": reward})

    # -- observations ---------------------------------------------------------------------
    def observation_json(self) -> Any:
        compact = to_json(self._obs, self._ndigits, self._max_numbers)
        if compact is None and self._obs is not None:
            arr = np.asarray(self._obs)
            return {"shape": list(arr.shape), "dtype": str(arr.dtype),
                    "min": to_json(arr.min(), self._ndigits), "max": to_json(arr.max(), self._ndigits)}
        return compact

    def _observation_line(self) -> str:
        import json
        return "Observation: " + json.dumps(self.observation_json(), separators=(", ", ": "))

    def _ansi_text(self) -> str:
        # The env's own text view; its colours (the only mark of the player on some maps) are
        # escape codes, dropped here, which is why the observation line follows it.
        unwrapped = self._env.unwrapped
        saved = unwrapped.render_mode
        unwrapped.render_mode = "ansi"
        try:
            text = unwrapped.render()
        finally:
            unwrapped.render_mode = saved
        return _ANSI_ESCAPE.sub("", str(text)).rstrip()

    def render_text(self) -> str:
        if self._ansi:
            return f"{self._ansi_text()}\n{self._observation_line()}"
        return self._observation_line()

    def render_image(self, size: int):
        from PIL import Image
        frame = np.asarray(self._env.render(), dtype=np.uint8)
        h, w = frame.shape[:2]
        side = max(h, w)
        # Letterboxed to a square so the picture keeps its proportions.
        canvas = np.zeros((side, side, 3), np.uint8)
        canvas[(side - h) // 2:(side - h) // 2 + h, (side - w) // 2:(side - w) // 2 + w] = frame[..., :3]
        return np.asarray(Image.fromarray(canvas).resize((size, size), Image.BILINEAR))

    def valid_actions(self) -> list[str]:
        return [] if self._done else self._codec.listed()

    def ground_truth(self) -> GroundTruth:
        state = {
            "observation": self.observation_json(),
            "info": to_json(self._info, self._ndigits, MAX_TRUTH_NUMBERS) or {},
            "env": self._readable_attributes(),
        }
        return GroundTruth(state)

    def _readable_attributes(self) -> dict:
        """The unwrapped env's public fields that are plain data (positions, last action, physics
        state); spaces, generators, renderers and large tables are left out."""
        out = {}
        for key, value in sorted(vars(self._env.unwrapped).items()):
            if key.startswith("_") or isinstance(value, Mapping):
                continue
            j = to_json(value, None, MAX_TRUTH_NUMBERS)
            if j is not None:
                out[key] = j
        return out

    def anchor_data(self) -> Any:
        return self.render_text()

    # -- copies ---------------------------------------------------------------------------
    def snapshot(self):
        if not self.spec.supports_snapshot:
            return None
        try:
            return pickle.dumps((self._env, self._obs, self._info, self._done, self._last_reward))
        except Exception:  # a renderer's handles (pygame surfaces) cannot be copied: replay instead
            return None

    def restore(self, snap) -> None:
        self._env, self._obs, self._info, self._done, self._last_reward = pickle.loads(snap)
