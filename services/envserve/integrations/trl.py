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
    FrozenLake.close()   # every session of the pool (the channel, shared per address, closes at exit)

Each instance holds one session (opened on its first reset) on the gRPC channel all adapters share
for the address. A tool call is one Step: the tool's argument is written as a minimal answer in the
session's action format (`no_think` by default, so the server sees `<answer>Down</answer>`), which is how the same
parser and rewards apply as for text-only policies. Invalid actions and finished episodes come back as
text for the model, never as exceptions.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Union

from envserve.client.experts import plain_answer, session_settings

from ._common import (Endpoint, Session, action_choices, close_quietly, content_blocks, error_text, is_cell_space,
                      pil_images, step_text)

# What a tool returns: the step's text or, with images, TRL's content blocks. A real type (not a
# string), because the tools' schemas are read from their evaluated type hints.
Observation = Union[str, list[dict[str, Any]]]


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
    pool = _Pool(Endpoint(address, token, timeout, root_certificates, tls))
    spec = pool.endpoint.spec(env_id)
    if spec.action_formats and action_format not in spec.action_formats:
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
    return type(name, (EnvServeEnvironment,), attrs)


class _Pool:
    """The open sessions of a factory's instances, so that closing the pool closes them all in one
    call. The channel is the one every adapter shares for the address (see _common), closed at exit."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.sessions: set[str] = set()

    def client(self):
        return self.endpoint.client()

    def close(self) -> None:
        sids, self.sessions = sorted(self.sessions), set()
        close_quietly(self.endpoint, sids)  # best effort, with a short deadline: the replica may be gone


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
        # Opened on the first reset; closed on the server when TRL drops the instance (the session's
        # finalizer), and by the pool's close with all the others.
        self._session = Session(self._pool.endpoint, self._env_id, self._config, self._action_format,
                                tracker=self._pool.sessions)
        self._return = 0.0
        self._done = False
        self._last = None

    @classmethod
    def close(cls) -> None:
        """Closes every session of the pool (a later reset opens them again)."""
        cls._pool.close()

    @property
    def session_id(self) -> str:
        return self._session.id

    @property
    def last_result(self):
        """The latest StepResult (reward components, success, anchor...), or None before a reset."""
        return self._last

    def reset(self, **row) -> Observation:
        """Starts an episode from the dataset row's seed (or task_id, or split); returns what the model
        reads first."""
        seed = row.get("seed")
        seed = None if seed is None else int(seed)
        # A session the server dropped (TRL may idle longer than the lease; a worker may die) is
        # opened again: a fresh session gives the same initial state for the same seed.
        result = self._session.reset(seed, str(row.get("task_id") or ""), str(row.get("split") or ""))
        self._return, self._done, self._last = 0.0, False, result
        # The rules may describe text answers; the tools are how this session takes actions.
        text = (f"{self._rules}\nAct by calling the tools.\n\n{result.observation.text}" if self._rules
                else result.observation.text)
        return _content(text, result)

    def get_reward(self) -> float:
        """The episode's summed env reward (every component: task, format, invalid-action penalties)."""
        return self._return

    def _step(self, action: str) -> Observation:
        """One Step with `action` as the session's answer; what the model reads back."""
        if not self._session.id:
            return "Error: the environment has not been reset."
        if self._done:
            return "The episode is over; no more actions are accepted."
        outcome = self._session.step(plain_answer(self._action_format, [action], self._separator))
        if outcome.error is not None:
            # A lost or expired session, or a replica gone, ends this rollout; the model is told, the
            # trainer goes on.
            self._done = True
            return error_text(outcome.error)
        result = self._last = outcome.result
        self._return += result.reward
        self._done = result.done or result.truncated
        return _content(step_text(result), result)

    def _one(self, action: str) -> "str | None":
        """Why a typed tool's argument is not one action, or None: a separator inside it would make
        the session run several actions for one call."""
        action = action.strip()
        if not action:
            return "Invalid action: empty."
        if self._separator and self._separator in action:
            return f"Invalid action {action!r}: give exactly one action per call."
        return None


def _content(text: str, result) -> Observation:
    """Text alone, or TRL's content blocks (images first, as PIL images) when the session sends images."""
    return content_blocks(text, pil_images(result))


# -- tools -----------------------------------------------------------------------------------------
# Each builder returns a plain function (a method of the generated class). TRL reads the schema from
# the function itself (transformers' get_json_schema): real parameters with type hints, and a
# docstring whose Args section describes each one; "(choices: [...])" becomes an enum.

def _tools_for(spec, settings: Mapping[str, Any], mode: str) -> list[Callable]:
    space = spec.action_space.strip()
    if mode == "auto":
        choices = action_choices(spec)
        if choices:
            return [_move_tool(choices)]
        if is_cell_space(spec):
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
