"""envserve environments for TRL's `GRPOTrainer(environment_factory=...)`.

TRL's contract, as of trl 1.16: the factory is called with no arguments and its instances are pooled
and reused across batches. Before each rollout TRL calls `reset(**row)` with the dataset row; a string
it returns is appended to the row's last user message (a list of content blocks when the observation
has images). Every other public function defined on the class becomes a tool: its name, type hints
and Google-style docstring are the schema the model sees, and TRL calls it with the model's arguments,
one rollout at a time. `get_reward()` is called once per finished rollout and becomes a reward
column named after the class.

    from envserve.integrations.trl import environment_factory
    FrozenLake = environment_factory("127.0.0.1:50051", "frozenlake")
    trainer = GRPOTrainer(model, args=GRPOConfig(...), train_dataset=rows_with_a_seed_column,
                          environment_factory=FrozenLake)
    trainer.train()
    FrozenLake.close()   # every session of the pool, and the channel

Each instance holds one session (opened on its first reset) on the gRPC channel its class shares. A
tool call is one Step: the tool's argument is written as a minimal answer in the session's action
format (`no_think` by default, so the server sees `<answer>Down</answer>`), which is how the same
parser and rewards apply as for text-only policies. Invalid actions and finished episodes come back as
text for the model, never as exceptions.
"""
from __future__ import annotations

import atexit
import re
import weakref
from typing import Any, Callable, Mapping, Union

from envserve.client import (EnvClient, EnvServeError, SessionLostError, SessionNotFoundError, decode_image,
                             item_error)
from envserve.client.experts import plain_answer, session_settings

# What a tool returns: the step's text or, with images, TRL's content blocks. A real type (not a
# string), because the tools' schemas are read from their evaluated type hints.
Observation = Union[str, list[dict[str, Any]]]

# Spec action spaces that get a typed tool (see `_tools_for`); anything else gets `act(action)`.
_CHOICES = re.compile(r"^one of (?P<choices>[^()]+?)\s*(\(.*\))?$")
_CELL = re.compile(r"^\(row, col\)")


def environment_factory(address: str, env_id: str, config: Mapping[str, Any] | None = None,
                        action_format: str = "no_think", token: str | None = None, *,
                        tools: str = "auto", include_rules: bool = True, timeout: float | None = 60.0,
                        root_certificates: "bytes | str | None" = None, tls: bool = False) -> type:
    """A class for `GRPOTrainer(environment_factory=...)` whose instances are sessions of `env_id`.

    config and action_format are Open's. tools: "auto" (typed tools from the spec's action space, e.g.
    `move(direction)` for Sokoban and FrozenLake, `reveal(row, col)` for Minesweeper) or "act" (one
    `act(action)` tool taking the action text). include_rules: reset returns the env's rules (the
    spec's system prompt; the format's answer instructions are left out, tools replace them) before
    the first observation. Reset reads `seed`, `task_id` and `split` from the dataset row; a row with none of
    them gets a task of the env's first split.
    """
    if tools not in ("auto", "act"):
        raise ValueError(f"tools must be 'auto' or 'act', got {tools!r}")
    plain_answer(action_format, ["x"])  # an unknown format fails here, not in the middle of training
    pool = _Pool(address, dict(token=token, timeout=timeout, root_certificates=root_certificates, tls=tls))
    spec = pool.client().get_spec(env_id)
    if spec.action_formats and action_format not in spec.action_formats:
        pool.close()
        raise ValueError(f"{env_id} accepts action formats {list(spec.action_formats)}, not {action_format!r}")
    settings = session_settings(spec, config)
    attrs: dict[str, Any] = dict(
        _pool=pool, _env_id=env_id, _config=dict(config or {}), _action_format=action_format,
        _separator=str(settings["action_separator"]), _rules=spec.system_prompt if include_rules else "",
        __doc__=f"One envserve session of {env_id} at {address}; tools: see the methods.",
    )
    for tool in _tools_for(spec, settings, tools):
        attrs[tool.__name__] = tool
    name = "EnvServe" + "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", env_id))
    cls = type(name, (EnvServeEnvironment,), attrs)
    # The pool outlives TRL's trainer (TRL never closes its environments): close at exit at the latest.
    atexit.register(pool.close)
    return cls


class _Pool:
    """The channel a factory's instances share, created on first use, and their open sessions, so
    that closing the pool closes them all in one call."""

    def __init__(self, address: str, client_kwargs: dict):
        self.address = address
        self.client_kwargs = client_kwargs
        self._client: EnvClient | None = None
        self.sessions: set[str] = set()

    def client(self) -> EnvClient:
        if self._client is None:
            self._client = EnvClient(self.address, **self.client_kwargs)
        return self._client

    def open(self, env_id: str, config: dict, action_format: str) -> str:
        sid = self.client().open(env_id, 1, config, action_format)[0]
        self.sessions.add(sid)
        return sid

    def release(self, sid: str) -> None:
        """Close one session; never raises (it runs from finalizers, the server may be gone)."""
        if sid in self.sessions and self._client is not None:
            self.sessions.discard(sid)
            try:
                self._client.close_sessions([sid])
            except Exception:
                pass

    def close(self) -> None:
        sids, self.sessions = sorted(self.sessions), set()
        client, self._client = self._client, None
        if client is None:
            return
        client.timeout = 5.0  # best effort: an unreachable replica must not hold up the exit
        try:
            if sids:
                client.close_sessions(sids)
        except Exception:
            pass  # a server that is gone has dropped the sessions already (leases)
        finally:
            client.close()


class EnvServeEnvironment:
    """Base of the classes `environment_factory` builds (they set the class attributes). Public
    functions of subclasses are TRL tools, so everything else here is private, a classmethod or a
    property."""

    _pool: _Pool
    _env_id: str
    _config: dict
    _action_format: str
    _separator: str
    _rules: str

    def __init__(self):
        # The session id lives in a list so the finalizer (which must not hold `self`) sees it change.
        self._sid: list[str] = []
        self._return = 0.0
        self._done = False
        self._last = None
        # Closes the session when TRL drops the instance; at exit the pool closes them all in one call.
        weakref.finalize(self, _release, self._pool, self._sid).atexit = False

    @classmethod
    def close(cls) -> None:
        """Closes every session of the pool and the channel (a later reset opens them again)."""
        cls._pool.close()

    @property
    def session_id(self) -> str:
        return self._sid[0] if self._sid else ""

    @property
    def last_result(self):
        """The latest StepResult (reward components, success, anchor...), or None before a reset."""
        return self._last

    def reset(self, **row) -> Observation:
        """Starts an episode from the dataset row's seed (or task_id, or split); returns what the model
        reads first."""
        seed = row.get("seed")
        kwargs = dict(task_id=str(row.get("task_id") or ""), split=str(row.get("split") or ""))
        seed = None if seed is None else int(seed)
        try:
            result = self._reset(seed, kwargs)
        except (SessionNotFoundError, SessionLostError):
            # The lease expired between batches (TRL may idle longer than the lease), or the replica's
            # worker died: a fresh session gives the same initial state for the same seed.
            self._pool.sessions.discard(self._sid.pop())
            result = self._reset(seed, kwargs)
        self._return, self._done, self._last = 0.0, False, result
        # The rules may describe text answers; the tools are how this session takes actions.
        text = (f"{self._rules}\nAct by calling the tools.\n\n{result.observation.text}" if self._rules
                else result.observation.text)
        return _content(text, result)

    def get_reward(self) -> float:
        """The episode's summed env reward (every component: task, format, invalid-action penalties)."""
        return self._return

    def _reset(self, seed, kwargs):
        if not self._sid:
            self._sid.append(self._pool.open(self._env_id, self._config, self._action_format))
        result = self._pool.client().reset([self._sid[0]], [seed], **kwargs)[0]
        err = item_error(result)
        if err is not None:
            raise err
        return result

    def _step(self, action: str) -> Observation:
        """One Step with `action` as the session's answer; what the model reads back."""
        if not self._sid:
            return "Error: the environment has not been reset."
        if self._done:
            return "The episode is over; no more actions are accepted."
        text = plain_answer(self._action_format, [action], self._separator)
        try:
            result = self._pool.client().step([(self._sid[0], text)])[0]
        except EnvServeError as e:  # the whole call failed (replica down, draining)
            result, err = None, e
        else:
            err = item_error(result)
        if err is not None:
            # A lost or expired session ends this rollout; the model is told, the trainer goes on.
            self._done = True
            return f"Error: the environment failed ({err.code.name}: {err.message}). The episode is over."
        self._last = result
        self._return += result.reward
        self._done = result.done or result.truncated
        return _content(_step_text(result), result)

    def _one(self, action: str) -> "str | None":
        """Why a typed tool's argument is not one action, or None: a separator inside it would make
        the session run several actions for one call."""
        action = action.strip()
        if not action:
            return "Invalid action: empty."
        if self._separator and self._separator in action:
            return f"Invalid action {action!r}: give exactly one action per call."
        return None


def _release(pool: _Pool, sid: list[str]) -> None:
    if sid:
        pool.release(sid[0])


def _step_text(result) -> str:
    parts = []
    if not result.action_valid:
        parts.append(result.feedback or "Invalid action.")
    elif result.feedback:
        parts.append(result.feedback)
    parts.append(result.observation.text)
    parts.append(f"Reward: {result.reward:g}.")
    if result.done:
        parts.append("The episode is over: " + ("success." if result.success else "failure."))
    elif result.truncated:
        parts.append("The episode is over: turn limit reached.")
    return "\n".join(p for p in parts if p)


def _content(text: str, result) -> Observation:
    """Text alone, or TRL's content blocks (images first, as PIL images) when the session sends images."""
    if not result.observation.images:
        return text
    from PIL import Image
    blocks = [{"type": "image", "image": Image.fromarray(decode_image(im))} for im in result.observation.images]
    return blocks + [{"type": "text", "text": text}]


# -- tools -----------------------------------------------------------------------------------------
# Each builder returns a plain function (a method of the generated class). TRL reads the schema from
# the function itself (transformers' get_json_schema): real parameters with type hints, and a
# docstring whose Args section describes each one; "(choices: [...])" becomes an enum.

def _tools_for(spec, settings: Mapping[str, Any], mode: str) -> list[Callable]:
    space = spec.action_space.strip()
    if mode == "auto":
        m = _CHOICES.match(space)
        if m:
            return [_move_tool([c.strip() for c in m.group("choices").split(",") if c.strip()])]
        if _CELL.match(space):
            return [_reveal_tool()]
    return [_act_tool(space, int(settings["max_actions_per_turn"]), str(settings["action_separator"]))]


def _move_tool(choices: list[str]) -> Callable:
    def move(self, direction: str) -> Observation:
        direction = str(direction)  # models sometimes send other JSON types; the env judges the text
        why = self._one(direction)
        return why if why else self._step(direction)

    quoted = ", ".join(f'"{c}"' for c in choices)
    move.__doc__ = f"""Move one step in a direction.

    Args:
        direction: Where to move (choices: [{quoted}])

    Returns:
        What happened, the new observation and the reward.
    """
    return move


def _reveal_tool() -> Callable:
    def reveal(self, row: int, col: int) -> Observation:
        try:
            row, col = int(row), int(col)
        except (TypeError, ValueError):
            return f"Invalid action: row and col must be whole numbers, got {row!r} and {col!r}."
        return self._step(f"({row}, {col})")

    reveal.__doc__ = """Reveal one hidden cell of the board.

    Args:
        row: Row of the cell, counted from 0 at the top.
        col: Column of the cell, counted from 0 at the left.

    Returns:
        What happened, the new board and the reward.
    """
    return reveal


def _act_tool(space: str, max_actions: int, separator: str) -> Callable:
    def act(self, action: str) -> Observation:
        action = str(action)
        return self._step(action) if action.strip() else "Invalid action: empty."

    several = (f" Up to {max_actions} actions may be given, separated by '{separator}'."
               if max_actions > 1 else "")
    # The description is one line: the docstring parser reads each argument's text up to the next line.
    act.__doc__ = f"""Take an action in the environment.

    Args:
        action: The action: {" ".join(space.split())}.{several}

    Returns:
        What happened, the new observation and the reward.
    """
    return act
