"""A session: one environment instance plus everything every environment shares.

It parses the model's text with the session's action format, runs up to the allowed number
of actions, counts turns and episodes, applies format rewards, records the ground truth of
each turn, computes anchor and transition keys, and can be copied (snapshot or replay).
"""
from __future__ import annotations

import collections
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import limits
from .env import REWARD_BOUNDS, Environment, EnvSpec, resolve_config
from .formats import get_format
from .registry import get_env_class

# Keys every session has, beside the env's own. Env specs may change these defaults.
COMMON_CONFIG_DOCS = {
    "max_turns": "turns per episode before it is truncated",
    "max_actions_per_turn": "primitive actions executed per turn at most",
    "render_image": "add a PNG image to each observation",
    "image_only": "with render_image: the picture is the whole observation (its text says only that)",
    "image_size": "image side in pixels",
    "format_reward": "added when the turn parses and every action is valid",
    "format_penalty": "reward of a turn whose text the action format cannot parse",
    "invalid_action_penalty": "added when a parsed action is not a legal action",
    "action_separator": "separator between several actions in one answer",
    "max_action_chars": "longer action texts are invalid",
    "history_turns": "ground-truth records kept per session for GetState",
    "include_valid_actions": "list the legal actions in each result's info (valid_actions)",
    "max_replay_chars": "characters of an episode's action texts kept to copy it by replay (Fork of an env "
                        "without snapshots, Restore, a drain's move); past them the session steps on but "
                        "cannot be copied so until its next reset",
}


# Bounds of the session keys (replica operators may replace them: core/limits.py). Envs may set
# their own for a key (EnvSpec.config_bounds), keyword by keyword over these.
COMMON_CONFIG_BOUNDS: dict[str, dict[str, Any]] = {
    # Episode length in turns. Each turn is a request of the caller's own; throughput benchmarks
    # step one episode for up to a million turns. The built-in defaults are 2 to 500 (gymnasium
    # takes an env's max_episode_steps, at most 2,000 among its own envs). A session keeps the
    # episode's action texts for replay (Fork, Restore), which the replica's item time limit bounds.
    "max_turns": {"minimum": 1, "maximum": 1_000_000},
    # Actions executed per request: each is an env step (a physics step of primitive_skill costs
    # tens of milliseconds), so a request's work is bounded by this. VAGEN uses up to 5.
    "max_actions_per_turn": {"minimum": 1, "maximum": 64},
    # Pixels per observation: on a 2-core machine a 1024 px Sokoban image renders in 8 ms and
    # encodes as PNG in 38 ms (3 MiB raw); 16 px is the smallest a model reads.
    "image_size": {"minimum": 16, "maximum": 1024},
    "format_reward": REWARD_BOUNDS,
    "format_penalty": REWARD_BOUNDS,
    "invalid_action_penalty": REWARD_BOUNDS,
    # ",", ";", "|" or "" (no split); a longer one is never a separator.
    "action_separator": {"maxLength": 16},
    # The front cuts an action text at 1 MiB before any worker sees it (server/service.py).
    "max_action_chars": {"minimum": 1, "maximum": 1_048_576},
    # Ground-truth records kept for GetState; each holds a state (up to ~100 KB for svg), so 1024
    # of them are at most ~100 MB a session.
    "history_turns": {"minimum": 1, "maximum": 1024},
    # The episode's action texts a session keeps for replay: what max_turns and max_action_chars
    # alone would let grow to gigabytes (a million turns of 1 MiB). 1 MiB is 20 times a 50-turn
    # episode of 1,000-character answers; a caller can only lower it.
    "max_replay_chars": {"minimum": 0, "maximum": 1_048_576},
}


# The observation text of an image-only session.
IMAGE_ONLY_TEXT = "The observation is the image."


class SessionError(Exception):
    """A client error on a session; `code` is a gRPC status code name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def session_config_defaults(spec: EnvSpec) -> dict:
    common = {
        "max_turns": spec.max_turns,
        "max_actions_per_turn": spec.max_actions_per_turn,
        "render_image": False,
        "image_only": False,
        "image_size": 128,
        "format_reward": 0.0,
        "format_penalty": -0.1,
        "invalid_action_penalty": -0.1,
        "action_separator": ",",
        "max_action_chars": 16384,
        "history_turns": 64,
        "include_valid_actions": False,
        "max_replay_chars": 1_048_576,
    }
    common.update(spec.config_defaults)
    return common


def spec_with_limits(spec: EnvSpec, operator: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> EnvSpec:
    """The spec with the common session keys in its config schema, and every key's bounds: the
    common ones, the env's own over them, then the operator's (core/limits.py: '*' for the common
    keys, then the env id), keyword by keyword; an operator's "default" replaces the default."""
    import dataclasses
    docs = dict(COMMON_CONFIG_DOCS)
    docs.update(spec.config_docs)
    defaults = session_config_defaults(spec)
    bounds = {k: dict(v) for k, v in COMMON_CONFIG_BOUNDS.items()}
    for key, keywords in spec.config_bounds.items():
        bounds[key] = {**bounds.get(key, {}), **keywords}
    common = {k: v for k, v in operator.get("*", {}).items() if k in COMMON_CONFIG_DOCS}
    for layer in (common, operator.get(spec.env_id, {})):
        for key, keywords in layer.items():
            if key not in defaults:
                continue
            keywords = dict(keywords)
            if "default" in keywords:
                defaults[key] = keywords.pop("default")
            merged = {**bounds.get(key, {}), **keywords}
            bounds[key] = {k: v for k, v in merged.items() if v is not None}  # null drops a built-in keyword
    return dataclasses.replace(spec, config_defaults=defaults, config_docs=docs, config_bounds=bounds,
                               max_turns=defaults["max_turns"], max_actions_per_turn=defaults["max_actions_per_turn"])


# full_spec's results by spec object, for the limits generation they were built with: Open resolves
# a config against its env's full spec on the hot path, and resolve_config caches its compiled
# validator by that spec object.
_FULL_SPECS: dict[int, tuple[EnvSpec, int, EnvSpec]] = {}


def full_spec(spec: EnvSpec) -> EnvSpec:
    """The spec with the common session keys and the bounds in force in this process (the
    operator's limits installed by core/limits.install over the built-in ones)."""
    generation = limits.generation()
    entry = _FULL_SPECS.get(id(spec))
    if entry is not None and entry[0] is spec and entry[1] == generation:
        return entry[2]
    full = spec_with_limits(spec, limits.installed())
    if len(_FULL_SPECS) >= 1024:
        _FULL_SPECS.clear()
    _FULL_SPECS[id(spec)] = (spec, generation, full)
    return full


def state_key(data: Any) -> str:
    """A short canonical hash; strings are hashed as they are, anything else as sorted JSON."""
    blob = data if isinstance(data, str) else json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


@dataclass
class TurnResult:
    text: str
    image: Any = None  # RGB uint8 array or None
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    done: bool = False
    truncated: bool = False
    success: bool = False
    valid: bool = True
    actions_executed: int = 0
    parsed_actions: list[str] = field(default_factory=list)
    reasoning: dict[str, str] = field(default_factory=dict)
    anchor: str = ""
    transition: str = ""
    feedback: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    turn: int = 0
    episode: int = 0
    trial: int = 0


class Session:
    def __init__(self, env_id: str, config: Mapping[str, Any] | None = None, action_format: str = ""):
        cls = get_env_class(env_id)
        self.env_id = env_id
        self.spec: EnvSpec = cls.spec
        try:
            self.config = resolve_config(full_spec(cls.spec), config)
        except ValueError as e:
            raise SessionError("INVALID_ARGUMENT", str(e)) from None
        name = action_format or cls.spec.default_action_format
        allowed = cls.spec.action_formats
        if allowed and name not in allowed:
            raise SessionError("INVALID_ARGUMENT", f"{env_id} accepts action formats {list(allowed)}, not {name!r}")
        try:
            self.format = get_format(name)
        except KeyError as e:
            raise SessionError("INVALID_ARGUMENT", str(e.args[0])) from None
        if self.config["render_image"] and "image" not in cls.spec.modalities:
            raise SessionError("INVALID_ARGUMENT", f"{env_id} has no image observation")
        if self.config["image_only"] and not self.config["render_image"]:
            raise SessionError("INVALID_ARGUMENT", "image_only needs render_image: without the picture "
                                                   "the observation would be empty")
        self.action_format = name
        try:
            self.env: Environment = cls(self.config)
        except ValueError as e:  # an env's own check of its config values
            raise SessionError("INVALID_ARGUMENT", f"{env_id}: {e}") from None
        self.seed: int | None = None
        self.task_options: dict = {}
        self.episode = -1
        # A reset to a new task starts the next trial; its episodes count from 0 again.
        self.trial = -1
        self.turn = 0
        self.done = False
        self.anchor = ""
        # Texts stepped since the last reset: the replay log for envs that cannot snapshot.
        self.replay_log: list[str] | None = []   # None: past max_replay_chars this episode
        self.replay_chars = 0
        self.history: collections.deque = collections.deque(maxlen=max(1, int(self.config["history_turns"])))
        # The latest turn at a glance, for monitors (summary()); the observation text is history[-1].
        self.last_action = ""
        self.last_reward = 0.0
        self.episode_return = 0.0
        self.success = False
        self.truncated = False
        self.updated_unix = time.time()
        self._replaying = False
        # Why the session cannot step until its next reset ("" when it can): an item of it was
        # stopped part way (time limit, cancel), so its state may be half-changed.
        self.broken = ""

    def system_prompt(self) -> str:
        """The env's system prompt plus how to answer in this session's action format."""
        instruction = self.format.instruction_for(self.config["action_separator"], self.config["max_actions_per_turn"])
        return f"{self.spec.system_prompt}\n\n{instruction}"

    # -- lifecycle --------------------------------------------------------------------------
    def reset(self, seed: int | None = None, task_id: str = "", split: str = "", same_task: bool = False) -> TurnResult:
        if same_task:
            if self.seed is None:
                raise SessionError("FAILED_PRECONDITION", "same_task needs an earlier reset of this session")
            self.episode += 1
        else:
            self.seed, self.task_options = self._choose_task(seed, task_id, split)
            self.episode = 0
            # A new task starts a new trial. The last trial's turns stay in the history (bounded),
            # so a judge that reads them after this reset still finds them by trial.
            self.trial += 1
        return self._begin_episode({"seed": self.seed, **({"split": split} if split else {})})

    def interrupted(self, why: str) -> None:
        """An item of this session was stopped part way: nothing but a reset is allowed now."""
        self.broken = why
        self.done = True

    def _begin_episode(self, info: dict) -> TurnResult:
        self.env.reset(self.seed, dict(self.task_options))
        self.broken = ""
        self.turn = 0
        self.done = False
        self.replay_log, self.replay_chars = [], 0
        self.last_action, self.last_reward, self.episode_return = "", 0.0, 0.0
        self.success = self.truncated = False
        result = TurnResult(text="")
        result.info = info
        self.anchor = ""
        return self._finish(result, executed=[])

    def _choose_task(self, seed, task_id, split):
        spec = self.spec
        if seed is not None:
            return int(seed), {}
        if task_id:
            try:
                return int(task_id), {}
            except ValueError:
                raise SessionError("INVALID_ARGUMENT", f"task_id of {self.env_id} is an integer seed, got {task_id!r}") from None
        try:
            sp = spec.split(split) if split else spec.splits[0]
        except KeyError as e:
            raise SessionError("INVALID_ARGUMENT", str(e.args[0])) from None
        return sp.seed_offset + secrets.randbelow(sp.num_tasks), {}

    def step(self, text: str) -> TurnResult:
        if self.broken:
            raise SessionError("FAILED_PRECONDITION", f"{self.broken}; reset the session")
        if self.seed is None:
            raise SessionError("FAILED_PRECONDITION", "session has not been reset")
        if self.done:
            raise SessionError("FAILED_PRECONDITION", "episode is over; reset the session")
        if self.replay_log is not None:
            self.replay_chars += len(text) if isinstance(text, str) else 0
            if self.replay_chars > self.config["max_replay_chars"]:
                self.replay_log = None   # stepping goes on; copying by replay does not
            else:
                self.replay_log.append(text)
        cfg = self.config
        result = TurnResult(text="")
        executed: list[str] = []
        if not isinstance(text, str) or len(text) > cfg["max_action_chars"]:
            result.valid = False
            result.feedback = f"Invalid action: longer than {cfg['max_action_chars']} characters."
            result.components["format"] = cfg["format_penalty"]
        else:
            parsed = self.format.parse(text, cfg["action_separator"])
            result.reasoning = parsed.fields
            if not parsed.valid:
                result.valid = False
                result.feedback = parsed.feedback
                result.components["format"] = cfg["format_penalty"]
            else:
                limit = cfg["max_actions_per_turn"]
                actions = parsed.actions[:limit]
                result.parsed_actions = actions
                notes = []
                if len(parsed.actions) > limit:
                    notes.append(f"Only the first {limit} actions were executed.")
                for action in actions:
                    outcome = self.env.step(action)
                    if not outcome.valid:
                        result.valid = False
                        notes.append(outcome.feedback or f"Invalid action: {action!r}.")
                        _add(result.components, "invalid_action", cfg["invalid_action_penalty"])
                        break
                    executed.append(action)
                    for k, v in (outcome.components or {"task": outcome.reward}).items():
                        _add(result.components, k, v)
                    if outcome.feedback:
                        notes.append(outcome.feedback)
                    result.info.update(outcome.info)
                    if outcome.truncated and not outcome.done:
                        result.truncated = True
                        break
                    if outcome.done:
                        result.done = True
                        result.success = outcome.success
                        break
                if result.valid and cfg["format_reward"]:
                    _add(result.components, "format", cfg["format_reward"])
                result.feedback = " ".join(notes)
        result.actions_executed = len(executed)
        result.reward = float(sum(result.components.values()))
        self.turn += 1
        self.done = result.done or result.truncated
        if not result.done and self.turn >= cfg["max_turns"]:
            result.truncated = True
            self.done = True
        self.last_action = text
        self.last_reward = result.reward
        self.episode_return += result.reward
        self.success, self.truncated = result.success, result.truncated
        return self._finish(result, executed)

    def _finish(self, result: TurnResult, executed: list[str]) -> TurnResult:
        truth = self.env.ground_truth()
        text = self.env.render_text()
        data = self.env.anchor_data()
        anchor = state_key(f"{self.env_id}\x1f{data}" if isinstance(data, str) else [self.env_id, data])
        result.transition = state_key("\x1f".join([self.anchor, *executed, anchor])) if executed else ""
        self.anchor = anchor
        result.anchor = anchor
        # Image-only (VAGEN's visual setting): the policy sees the picture alone; the ground truth
        # and the monitors keep the text.
        result.text = IMAGE_ONLY_TEXT if self.config["image_only"] else text
        result.turn = self.turn
        result.episode = self.episode
        result.trial = self.trial
        seat = self.env.seat_to_move()
        if seat is not None:
            result.info["seat_to_move"] = int(seat)
        if self._replaying:
            pass  # nobody sees a replayed turn's result: skip the listing and the picture
        elif self.config["include_valid_actions"]:
            result.info["valid_actions"] = list(self.env.valid_actions() or [])
        if self.config["render_image"] and not self._replaying:
            result.image = self.env.render_image(int(self.config["image_size"]))
        self.history.append({
            "trial": self.trial, "episode": self.episode, "turn": self.turn, "state": truth.state,
            "relations": list(truth.relations), "anchor": anchor, "observation_text": text,
        })
        self.updated_unix = time.time()
        return result

    def summary(self) -> dict:
        """The latest turn at a glance (for monitors): no image, which the server keeps encoded."""
        return {
            "env_id": self.env_id, "action_format": self.action_format, "started": self.seed is not None,
            "episode": max(self.episode, 0), "turn": self.turn, "reward": self.last_reward,
            "episode_return": self.episode_return, "done": self.done and not self.truncated,
            "truncated": self.truncated, "success": self.success, "last_action": self.last_action,
            "updated_unix": self.updated_unix,
            "observation_text": self.history[-1]["observation_text"] if self.history else "",
        }

    def get_state(self, turn: int = -1, episode: int | None = None, trial: int | None = None) -> dict:
        if not self.history:
            raise SessionError("FAILED_PRECONDITION", "session has not been reset")
        if trial is None:
            trial = self.trial
        elif trial < 0:
            trial = self.trial + 1 + trial
        in_trial = [r for r in self.history if r.get("trial", 0) == trial]
        if not in_trial:
            raise SessionError("NOT_FOUND", f"trial {trial} is not kept (current trial {self.trial})")
        last_episode = in_trial[-1]["episode"]
        if episode is None:
            episode = last_episode
        elif episode < 0:
            episode = last_episode + 1 + episode
        records = [r for r in in_trial if r["episode"] == episode]
        if not records:
            raise SessionError("NOT_FOUND", f"episode {episode} of trial {trial} is not kept "
                                            f"(latest episode {last_episode})")
        if turn < 0:
            turn = records[-1]["turn"] + 1 + turn
        for r in records:
            if r["turn"] == turn:
                return r
        raise SessionError("NOT_FOUND", f"turn {turn} of episode {episode} (trial {trial}) is not kept; kept turns "
                                        f"{records[0]['turn']}..{records[-1]['turn']}")

    def close(self) -> None:
        self.env.close()

    # -- copies -----------------------------------------------------------------------------
    def to_blob(self) -> dict:
        """A picklable copy: a snapshot where the env can make one, else what replay needs."""
        snap = self.env.snapshot() if self.spec.supports_snapshot and self.seed is not None else None
        if self.replay_log is None and snap is None and self.seed is not None:
            raise SessionError("FAILED_PRECONDITION", self._past_replay())
        blob = {
            "env_id": self.env_id, "config": dict(self.config), "action_format": self.action_format,
            "seed": self.seed, "task_options": self.task_options, "episode": self.episode, "trial": self.trial,
            "turn": self.turn, "done": self.done, "anchor": self.anchor,
            "replay_log": None if self.replay_log is None else list(self.replay_log), "history": list(self.history),
            "progress": (self.last_action, self.last_reward, self.episode_return, self.success, self.truncated),
            "replay_chars": self.replay_chars,
        }
        if snap is not None:      # None: this instance cannot copy itself now; replay
            blob["env_snapshot"] = snap
        return blob

    def _past_replay(self) -> str:
        return (f"this episode's actions passed max_replay_chars ({self.config['max_replay_chars']} characters): "
                f"it cannot be copied by replay until the session is reset")

    def replay_record(self) -> dict | None:
        """What Session.restore needs to rebuild this session elsewhere: its reset arguments and
        the current episode's actions, with the anchors the kept history still holds (None when
        the episode's actions passed max_replay_chars)."""
        if self.replay_log is None:
            return None
        kept = {r["turn"]: r["anchor"] for r in self.history
                if r.get("trial", 0) == self.trial and r["episode"] == self.episode}
        return {"env_id": self.env_id, "config": dict(self.config), "action_format": self.action_format,
                "seed": self.seed, "trial": self.trial, "episode": self.episode, "reset_anchor": kept.get(0, ""),
                "actions": list(self.replay_log),
                "anchors": [kept.get(t + 1, "") for t in range(len(self.replay_log))]}

    @classmethod
    def from_blob(cls, blob: dict) -> "Session":
        s = cls(blob["env_id"], blob["config"], blob["action_format"])
        if blob["seed"] is None:
            return s
        s.seed, s.task_options = blob["seed"], dict(blob["task_options"])
        if "env_snapshot" in blob:
            s.env.restore(blob["env_snapshot"])
        else:
            # Envs that cannot snapshot are copied by replay, the same way a client rebuilds a
            # session on another replica (Session.restore); the copy must end where its parent is.
            s.trial, s.episode = blob.get("trial", 0), blob["episode"]
            s.replay(blob["replay_log"], final_anchor=blob["anchor"])
        s.episode, s.turn, s.done, s.anchor = blob["episode"], blob["turn"], blob["done"], blob["anchor"]
        s.trial = blob.get("trial", 0)
        s.replay_log = None if blob["replay_log"] is None else list(blob["replay_log"])
        s.replay_chars = blob.get("replay_chars", 0)
        s.history.clear()
        s.history.extend(blob["history"])
        if "progress" in blob:
            s.last_action, s.last_reward, s.episode_return, s.success, s.truncated = blob["progress"]
        return s

    @classmethod
    def restore(cls, env_id: str, config: Mapping[str, Any] | None, action_format: str, seed: int | None,
                trial: int, episode: int, actions: "list[str]", anchors: "list[str] | None" = None,
                reset_anchor: str = "") -> "Session":
        """A session rebuilt from its history: the reset that began its episode (seed, trial,
        episode), then its actions. Each non-empty anchor is checked against the replayed one;
        a mismatch is a FAILED_PRECONDITION naming the turn."""
        s = cls(env_id, config, action_format)
        if seed is None:
            return s
        if not s.spec.replay_exact:
            raise SessionError("FAILED_PRECONDITION", f"{env_id}'s replay is not exact: a session cannot be rebuilt")
        s.seed, s.task_options = int(seed), {}
        s.trial, s.episode = int(trial), int(episode)
        s.replay(actions, anchors, reset_anchor)
        return s

    def replay(self, actions: "list[str]", anchors: "list[str] | None" = None, reset_anchor: str = "",
               final_anchor: str = "") -> None:
        """Begins the episode of self.seed again and steps `actions` through the ordinary step
        path (the ground-truth history is rebuilt with it), checking anchors where given."""
        self._replaying = True
        try:
            first = self._begin_episode({"seed": self.seed})
            _check_anchor(first.anchor, reset_anchor, 0, self.env_id)
            for i, text in enumerate(actions):
                if self.done:
                    raise SessionError("FAILED_PRECONDITION",
                                       f"replay of {self.env_id} diverged at turn {i + 1}: the episode already ended")
                r = self.step(text)
                _check_anchor(r.anchor, anchors[i] if anchors and i < len(anchors) else "", i + 1, self.env_id)
            _check_anchor(self.anchor, final_anchor, len(actions), self.env_id)
        finally:
            self._replaying = False


def _check_anchor(replayed: str, expected: str, turn: int, env_id: str) -> None:
    if expected and replayed != expected:
        raise SessionError("FAILED_PRECONDITION",
                           f"replay of {env_id} diverged at turn {turn}: anchor {replayed} where the session "
                           f"had {expected}")


def _add(components: dict, key: str, value: float) -> None:
    components[key] = components.get(key, 0.0) + float(value)
