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
    FrozenLake.close()   # every session of the pool (the client, shared per address, closes at exit)

Each instance holds one session (opened on its first reset) through the client all adapters share
for the address (`_common`: routed over every replica, steps on one Interact stream per replica,
lost sessions rebuilt by replay). A tool call is one step: the tool's argument is written as a minimal answer in the
session's action format (`no_think` by default, so the server sees `<answer>Down</answer>`), which is how the same
parser and rewards apply as for text-only policies. Invalid actions and finished episodes come back as
text for the model, never as exceptions.

With `judge_address` (an `envserve judge`), the tools also take `observation` and `prediction` texts,
written into the format's `<observation>`/`<prediction>` tags; each step's texts go to the judge in
the background and `get_reward()` adds `judge_weight` times the mean over turns of the reasoning reward
(`envserve.client.judge.reasoning_reward` with the judge's own betas). A judge that fails scores the
turn 0; the reason is in `judge_errors`.
"""
from __future__ import annotations

import inspect
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, NamedTuple, Sequence, Union

from envserve.client import RecoverySettings
from envserve.client.experts import fields_answer, needs_observation, needs_prediction, plain_answer, session_settings
from envserve.client.judge import JudgeClient, JudgeTask, new_scope, reasoning_reward

from ._common import (Endpoint, Session, action_choices, close_quietly, content_blocks, error_text, is_cell_space,
                      pil_images, step_text)

# What a tool returns: the step's text or, with images, TRL's content blocks. A real type (not a
# string), because the tools' schemas are read from their evaluated type hints.
Observation = Union[str, list[dict[str, Any]]]

# The format's field that holds each text, and the judge's name for what it scores.
JUDGED_FIELDS = {"observation": "grounding", "prediction": "world_modeling"}


def environment_factory(address: "str | Sequence[str]", env_id: str, config: Mapping[str, Any] | None = None,
                        action_format: str = "no_think", token: str | None = None, *,
                        tools: str = "auto", include_rules: bool = True, timeout: float | None = 60.0,
                        root_certificates: "bytes | str | None" = None, tls: bool = False,
                        judge_address: str | None = None, judge_token: str | None = None,
                        judge_weight: float = 1.0, judge_scope: str | None = None, stream: bool = True,
                        recovery: "bool | RecoverySettings" = True, stats_scope: str = "") -> type:
    """A class for `GRPOTrainer(environment_factory=...)` whose instances are sessions of `env_id`.

    address: one replica's address, several (a list, or a string joined by commas) or a directory
    URL (`redis://host:6379/0`; None: ENVSERVE_ADDRESS, else `ray://` in a process of a Ray cluster):
    each instance's session goes to the least-loaded replica. stream:
    tool calls travel as items of one Interact stream per replica and process (False: a unary Step
    each; the same results). recovery: a session whose replica died or drained is rebuilt on a
    live one by replaying its history and the tool answers as if nothing happened (False: the
    rollout ends with the error as text; or RecoverySettings). stats_scope: the run's name, under which
    the replicas count each finished episode per task (the class's `task_stats()`; what
    `LearnabilitySampling` draws the dataset's rows by).

    config and action_format are Open's. tools: "auto" (typed tools from the spec's action space, e.g.
    `move(direction)` for Sokoban and FrozenLake, `reveal(row, col)` for Minesweeper) or "act" (one
    `act(action)` tool taking the action text). include_rules: reset returns the env's rules (the
    spec's system prompt; the format's answer instructions are left out, tools replace them) before
    the first observation. Reset reads `seed`, `task_id` and `split` from the dataset row; a row with none of
    them gets a task of the env's first split.

    judge_address: an `envserve judge` reading this server's sessions (judge_token its token; the
    timeout and TLS settings are the env's). The action format must have an `<observation>` and/or a
    `<prediction>` field (`grounding`, `worldmodeling`, `grounding_worldmodeling`); the tools then take
    optional `observation` (what the model sees now) and `prediction` (what it expects after the
    action) texts, judged against the true state of this turn and the next. `get_reward()` adds
    judge_weight * mean over the episode's turns of `reasoning_reward(grounding, world_modeling,
    beta_grounding, beta_world_modeling)` with the judge's betas (GetJudgeInfo); a turn without texts,
    or whose judging failed, earns 0. `judge_scores` and `judge_errors` hold the last episode's.
    judge_scope: whose repetition counts (VAGEN's penalty for a frequent low-scoring text) the
    factory's texts join; by default one new scope per factory, so another run on the same judge
    neither adds to nor reads them. Give one name to share counts, e.g. across trainer processes.
    """
    if tools not in ("auto", "act"):
        raise ValueError(f"tools must be 'auto' or 'act', got {tools!r}")
    plain_answer(action_format, ["x"])  # an unknown format fails here, not in the middle of training
    has = {"observation": needs_observation(action_format), "prediction": needs_prediction(action_format)}
    judged = [name for name in JUDGED_FIELDS if has[name]]
    if judge_address and not judged:
        raise ValueError(f"a judge scores <observation> and <prediction> texts; action format {action_format!r} "
                         "has neither (use grounding, worldmodeling or grounding_worldmodeling)")
    pool = _Pool(Endpoint(address, token, timeout, root_certificates, tls, stream, recovery, stats_scope))
    spec = pool.endpoint.spec(env_id)
    if spec.action_formats and action_format not in spec.action_formats:
        raise ValueError(f"{env_id} accepts action formats {list(spec.action_formats)}, not {action_format!r}")
    settings = session_settings(spec, config)
    judge = (_Judge(lambda: JudgeClient(judge_address, judge_token, root_certificates, tls, timeout),
                    float(judge_weight), judge_scope or new_scope("trl")) if judge_address else None)
    attrs: dict[str, Any] = dict(
        _pool=pool, _env_id=env_id, _config=dict(config or {}), _action_format=action_format,
        _separator=str(settings["action_separator"]), _rules=spec.system_prompt if include_rules else "",
        _judge=judge, _judged_fields=tuple(judged) if judge else (),
        __doc__=f"One envserve session of {env_id} at {pool.endpoint.where}; tools: see the methods.",
    )
    for tool in _tools_for(spec, settings, tools, attrs["_judged_fields"]):
        attrs[tool.__name__] = tool
    name = "EnvServe" + "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]+", env_id))
    return type(name, (EnvServeEnvironment,), attrs)


class _Pool:
    """The open sessions of a factory's instances, so that closing the pool closes them all in one
    call. The client is the one every adapter shares for the address (see _common), closed at exit."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self.sessions: set[str] = set()

    def client(self):
        return self.endpoint.client()

    def close(self) -> None:
        sids, self.sessions = sorted(self.sessions), set()
        close_quietly(self.endpoint, sids)  # best effort, with a short deadline: the replica may be gone


class _Judge:
    """A factory's judge: the client, the betas the judge service reports, and the threads that
    judge each step's texts while the rollout goes on (TRL calls the tools one rollout at a time).
    The client and threads are made again in a forked process (gRPC channels do not survive fork)."""

    def __init__(self, make_client: Callable[[], JudgeClient], weight: float, scope: str):
        self.make_client, self.weight, self.scope = make_client, weight, scope
        self._lock = threading.Lock()
        self._pid, self._client, self._executor = 0, None, None
        config = self.client().info().config   # also: a judge that is not there fails at factory time
        self.beta_grounding = float(config["beta_grounding"])
        self.beta_world_modeling = float(config["beta_world_modeling"])

    def client(self) -> JudgeClient:
        with self._lock:
            if self._client is None or self._pid != os.getpid():
                self._pid, self._client, self._executor = os.getpid(), self.make_client(), None
            return self._client

    def submit(self, tasks: list[JudgeTask]) -> Future:
        client = self.client()
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(4, thread_name_prefix="envserve-trl-judge")
            return self._executor.submit(client.judge, tasks)

    def close(self) -> None:
        """Stops the threads (a later step starts them again); judging not yet started is cancelled
        (a get_reward after close scores those turns 0, with the reason in judge_errors)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=False, cancel_futures=True)

    def reward(self, grounding: float | None, world_modeling: float | None) -> float:
        return reasoning_reward(grounding, world_modeling, self.beta_grounding, self.beta_world_modeling).total


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
    _judge: "_Judge | None"
    _judged_fields: tuple[str, ...]

    def __init__(self):
        # Opened on the first reset; closed on the server when TRL drops the instance (the session's
        # finalizer), and by the pool's close with all the others.
        self._session = Session(self._pool.endpoint, self._env_id, self._config, self._action_format,
                                tracker=self._pool.sessions)
        self._return = 0.0
        self._done = False
        self._last = None
        self._pending: list[tuple[int, dict[str, str], "Future | None"]] = []  # (turn, fields given, judging)
        self._judge_scores: list[dict[str, Any]] = []
        self._judge_errors: list[str] = []

    @classmethod
    def close(cls) -> None:
        """Closes every session of the pool (a later reset opens them again) and stops the judge's
        threads, where there is a judge."""
        cls._pool.close()
        if cls._judge is not None:
            cls._judge.close()

    @classmethod
    def task_stats(cls) -> list:
        """The outcome statistics of the factory's stats scope for its env (GetTaskStats)."""
        if not cls._pool.endpoint.stats_scope:
            raise ValueError("this factory counts no outcomes: environment_factory(..., stats_scope='my-run')")
        return cls._pool.client().task_stats(cls._env_id)

    @property
    def session_id(self) -> str:
        return self._session.id

    @property
    def last_result(self):
        """The latest StepResult (reward components, success, anchor...), or None before a reset."""
        return self._last

    @property
    def judge_scores(self) -> list[dict[str, Any]]:
        """The last episode's judged turns (filled by get_reward): per turn `turn`, the `grounding`
        and `world_modeling` scores given (None: no text, or judging failed) and its `reward`."""
        return self._judge_scores

    @property
    def judge_errors(self) -> list[str]:
        """Why judging failed for some of the last episode's texts (those turns earn 0)."""
        return self._judge_errors

    def reset(self, **row) -> Observation:
        """Starts an episode from the dataset row's seed (or task_id, or split); returns what the model
        reads first."""
        seed = row.get("seed")
        seed = None if seed is None else int(seed)
        # A session the server dropped (TRL may idle longer than the lease; a worker may die) is
        # opened again: a fresh session gives the same initial state for the same seed.
        result = self._session.reset(seed, str(row.get("task_id") or ""), str(row.get("split") or ""))
        self._return, self._done, self._last = 0.0, False, result
        self._pending, self._judge_scores, self._judge_errors = [], [], []
        # The rules may describe text answers; the tools are how this session takes actions.
        text = (f"{self._rules}\nAct by calling the tools.\n\n{result.observation.text}" if self._rules
                else result.observation.text)
        return _content(text, result)

    def get_reward(self) -> float:
        """The episode's summed env reward (every component: task, format, invalid-action penalties),
        plus judge_weight times the mean judged reasoning reward per turn where a judge is set."""
        if self._judge is None:
            return self._return
        if self._pending:
            self._collect()
        if not self._judge_scores:
            return self._return
        mean = sum(t["reward"] for t in self._judge_scores) / len(self._judge_scores)
        return self._return + self._judge.weight * mean

    def _collect(self) -> None:
        """Waits for the episode's judging; each turn's scores and reasoning reward into judge_scores."""
        pending, self._pending = self._pending, []
        for turn, given, future in pending:
            scores: dict[str, float | None] = {field: None for field in JUDGED_FIELDS.values()}
            if future is not None:
                try:
                    results = {r.key: r for r in future.result()}
                except Exception as e:  # the judge is down, too slow, refused the call...
                    self._judge_errors.append(f"turn {turn}: {type(e).__name__}: {e}")
                    results = {}
                for field in given:
                    r = results.get(f"{turn}:{field}")
                    if r is None:
                        if future.exception() is None:
                            self._judge_errors.append(f"turn {turn} {field}: no result")
                    elif r.status.code != 0:
                        self._judge_errors.append(f"turn {turn} {field}: {r.status.message}")
                    else:
                        scores[field] = float(r.score)
            self._judge_scores.append({"turn": turn, **scores,
                                       "reward": self._judge.reward(scores["grounding"], scores["world_modeling"])})

    def _step(self, action: str, texts: Mapping[str, "str | None"] | None = None) -> Observation:
        """One Step with `action` (and, with a judge, the observation/prediction texts) as the
        session's answer; what the model reads back."""
        if not self._session.id:
            return "Error: the environment has not been reset."
        if self._done:
            return "The episode is over; no more actions are accepted."
        texts = {k: str(v) for k, v in (texts or {}).items() if v is not None}
        before = self._last
        outcome = self._session.step(fields_answer(self._action_format, [action], texts, self._separator))
        if outcome.error is not None:
            # A lost or expired session, or a replica gone, ends this rollout; the model is told, the
            # trainer goes on.
            self._done = True
            return error_text(outcome.error)
        result = self._last = outcome.result
        self._return += result.reward
        if self._judge is not None:
            self._submit(before.turn, result)
        self._done = result.done or result.truncated
        return _content(step_text(result), result)

    def _submit(self, turn: int, result) -> None:
        """Hands the texts the server parsed from this step (the turn answered is the observation's,
        `turn`) to the judge in the background; get_reward collects the scores."""
        tasks = []
        for name in self._judged_fields:
            text = result.reasoning.get(name, "")
            if text and text != "-":    # "-": the placeholder of a text the model did not give
                field = JUDGED_FIELDS[name]
                tasks.append(JudgeTask(f"{turn}:{field}", self._session.real_id, turn, field, text,
                                       episode=result.episode, env_id=self._env_id, trial=result.trial,
                                       scope=self._judge.scope))
        future = self._judge.submit(tasks) if tasks else None
        self._pending.append((turn, {t.field: t.text for t in tasks}, future))

    def _texts(self, observation, prediction) -> dict[str, str]:
        """The judged fields' texts a tool was given (models may send other JSON types, or None)."""
        given = {"observation": observation, "prediction": prediction}
        return {k: str(given[k]) for k in self._judged_fields if given[k] not in (None, "")}

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

def _tools_for(spec, settings: Mapping[str, Any], mode: str, judged: tuple[str, ...] = ()) -> list[Callable]:
    space = spec.action_space.strip()
    if mode == "auto":
        choices = action_choices(spec)
        if choices:
            return [_with_texts(_move_tool(choices), judged)]
        if is_cell_space(spec):
            return [_with_texts(_reveal_tool(), judged)]
    return [_with_texts(_act_tool(space, int(settings["max_actions_per_turn"]), str(settings["action_separator"])),
                        judged)]


# The judged texts' descriptions in a tool's Args section (one line each: see _act_tool).
_TEXT_ARGS = {
    "observation": "observation: What you see now: where the things on the board are relative to you "
                   "(e.g. 'The goal is below and to the right of the player.'). Judged against the true state.",
    "prediction": "prediction: What you expect to see after this action, in the same words. Judged against "
                  "the state that follows.",
}


def _with_texts(tool: Callable, judged: tuple[str, ...]) -> Callable:
    """The tool's schema with the judged text parameters only (`observation`, `prediction`: every
    builder's function takes both, optional), each described in the Args section; the texts the model
    does not see in the schema are never sent, as the step writes only the judged fields."""
    sig = inspect.signature(tool)
    tool.__signature__ = sig.replace(parameters=[p for name, p in sig.parameters.items()
                                                 if name not in JUDGED_FIELDS or name in judged])
    tool.__annotations__ = {k: v for k, v in tool.__annotations__.items() if k not in JUDGED_FIELDS or k in judged}
    lines = "".join(f"\n        {_TEXT_ARGS[name]}" for name in judged)
    tool.__doc__ = tool.__doc__.replace("\n\n    Returns:", lines + "\n\n    Returns:", 1)
    return tool


def _move_tool(choices: list[str]) -> Callable:
    def move(self, direction: str, observation: str = "", prediction: str = "") -> Observation:
        direction = str(direction)  # models sometimes send other JSON types; the env judges the text
        why = self._one(direction)
        return why if why else self._step(direction, self._texts(observation, prediction))

    quoted = ", ".join(f'"{c}"' for c in choices)
    move.__doc__ = f"""Move one step in a direction.

    Args:
        direction: Where to move (choices: [{quoted}])

    Returns:
        What happened, the new observation and the reward.
    """
    return move


def _reveal_tool() -> Callable:
    def reveal(self, row: int, col: int, observation: str = "", prediction: str = "") -> Observation:
        try:
            row, col = int(row), int(col)
        except (TypeError, ValueError):
            return f"Invalid action: row and col must be whole numbers, got {row!r} and {col!r}."
        return self._step(f"({row}, {col})", self._texts(observation, prediction))

    reveal.__doc__ = """Reveal one hidden cell of the board.

    Args:
        row: Row of the cell, counted from 0 at the top.
        col: Column of the cell, counted from 0 at the left.

    Returns:
        What happened, the new board and the reward.
    """
    return reveal


def _act_tool(space: str, max_actions: int, separator: str) -> Callable:
    def act(self, action: str, observation: str = "", prediction: str = "") -> Observation:
        action = str(action)
        return self._step(action, self._texts(observation, prediction)) if action.strip() else "Invalid action: empty."

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


class LearnabilitySampling:
    """A mixin for TRL's GRPOTrainer that draws each generation batch's rows where the run can learn:

        class Trainer(LearnabilitySampling, GRPOTrainer): ...
        FrozenLake = environment_factory(address, "frozenlake", stats_scope="run-7")
        Trainer(model, args=..., train_dataset=exported_rows, environment_factory=FrozenLake).train()

    The rows name their tasks (`envserve tasks export ... --format trl`); before each generation batch
    the weights are read again from the factory's outcome statistics (p(1-p), unseen tasks explored,
    none below `task_sampler_floor` of the largest; `task_sampler_cost_power` divides by env steps per
    episode). Each drawn row is repeated num_generations times in a row (one GRPO group) and the
    batch reused as TRL's own sampler does. With several processes the main one reads the
    statistics and broadcasts them, so every process draws the same rows."""

    task_sampler_floor = 0.05
    task_sampler_cost_power = 0.0

    def _get_train_sampler(self, dataset=None):
        from .task_sampler import TaskSampler
        dataset = self.train_dataset if dataset is None else dataset
        factories = [f for f in (self.environment_factories or {}).values()
                     if isinstance(f, type) and issubclass(f, EnvServeEnvironment)]
        if len(factories) != 1:
            raise ValueError("LearnabilitySampling needs one envserve environment_factory (with a stats_scope)")
        stats = factories[0].task_stats
        stats()   # a factory without a scope fails here, before training starts
        if self.accelerator.num_processes > 1:
            stats = _broadcast_from_main(self.accelerator, stats)
        return TaskSampler(dataset, stats, "learnability", mini_repeat_count=self.num_generations,
                           batch_size=self.args.generation_batch_size // self.num_generations,
                           repeat_count=self.num_iterations * self.args.steps_per_generation, seed=self.args.seed,
                           floor=self.task_sampler_floor, cost_power=self.task_sampler_cost_power)


def _broadcast_from_main(accelerator, read: Callable[[], list]) -> Callable[[], list]:
    """read() on the main process, its result on every process: they draw from one table."""
    from accelerate.utils import broadcast_object_list

    def stats() -> list:
        box = [[(s.task_id, s.episodes, s.successes, s.turns_sum, s.tokens_sum) for s in read()]
               if accelerator.is_main_process
               else None]
        broadcast_object_list(box)
        return [_Stat(*row) for row in box[0]]
    return stats


class _Stat(NamedTuple):
    """What the samplers read of a TaskStat, as it travels between processes."""
    task_id: str
    episodes: int
    successes: int
    turns_sum: float
    tokens_sum: int
