"""Environments another server serves over ORS (the Open Reward Standard), as envserve environments.

`ors:<base url>#<env name>` (e.g. `ors:http://10.0.0.5:8080#wordle`) resolves, through core.registry's
prefix families, to a class built by make_env_class: it asks that server for the env's splits, their
sizes and its tools with the `ors-sdk` client, and opens one ORS session per envserve session. Only
the operator names such ids (a replica serves the env ids it was started with), so a caller cannot
point a replica at an address of their choosing. The client's API key is ORS's own: the
`ORS_API_KEY` variable of the replica's environment.

Tasks: split k of the remote env is envserve split k, its task i the seed `k * SPLIT_STRIDE + i`, so a
seed names one (split, index) in any process; a seed outside every split wraps into the first one.
Actions: the model's answer is one tool call, a JSON object {"tool": name, "input": {...}} (ORS's
{"name": ..., "input": ...} too), or, where the env has one tool taking one field, that field's
value as plain text. A tool's error (an unknown tool, an input its schema refuses) is an invalid
action with the server's message; the session goes on. A step's reward is the tool output's, the
episode ends with its `finished`, and success is its metadata's `success` where the env reports one,
else a finished episode with a positive last reward.

ORS has no state endpoint: the ground truth is what the session saw (the task spec, the last
output's metadata, rewards so far). An ORS session cannot be copied, and replaying one is only as
exact as the remote env, so forks and moves replay (spec.replay_exact is False).
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Mapping
from urllib.parse import urlparse

from envserve.core.env import ActionOutcome, Environment, EnvSpec, GroundTruth, Split, TaskDescription
from envserve.core.formats import json_object_in

# Turns per episode: ORS environments declare no step limit of their own.
DEFAULT_MAX_TURNS = 100
# Seeds of split k start at k * SPLIT_STRIDE: a split that grows never shifts another one's seeds.
SPLIT_STRIDE = 10_000_000
# The whole answer is one tool call (JSON objects hold commas).
CONFIG_DEFAULTS = {"action_separator": ""}
# Seconds one call to the ORS server may take before the step fails with a clear error.
CALL_TIMEOUT_S = 120.0
# Task specs kept per process for ListTasks' descriptions, fetched a range at a time.
TASK_CACHE_ENTRIES = 10_000
TASK_FETCH_RANGE = 100
# What a task's description is read from, in order, where its spec has such a text field.
_DESCRIPTION_KEYS = ("description", "goal", "instruction", "prompt", "question", "query")
_TYPE_KEYS = ("task_type", "type", "category", "kind")


# -- the one event loop each process talks ORS from ------------------------------------------
class _Loop:
    """A private event loop on a daemon thread: the sdk's client is asyncio (aiohttp), while envs
    are called synchronously, sometimes from a thread that already runs a loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._loop: "asyncio.AbstractEventLoop | None" = None
        self._pid = 0
        self._clients: dict[str, Any] = {}

    def run(self, make_coro, timeout: float = CALL_TIMEOUT_S):
        with self._lock:
            # A forked worker inherits the loop but not its thread: it starts its own.
            if self._loop is None or self._pid != os.getpid():
                self._pid, self._clients = os.getpid(), {}
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="envserve-ors", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(make_coro(), timeout), self._loop)
        try:
            return future.result()
        except (asyncio.TimeoutError, TimeoutError):
            raise RuntimeError(f"the ORS server did not answer within {timeout:.0f} s") from None

    def environment(self, base_url: str, name: str):
        """The sdk's AsyncEnvironment (made on the loop: its aiohttp session belongs to it)."""
        async def make():
            from ors.client import AsyncORS
            if base_url not in self._clients:
                self._clients[base_url] = AsyncORS(base_url=base_url)
            return self._clients[base_url].environment(name)
        return self.run(make)


_LOOP = _Loop()


def parse_name(name: str) -> tuple[str, str]:
    """(base url, env name) of `<base url>#<env name>`; KeyError naming the expected form."""
    url, sep, env = name.rpartition("#")
    parsed = urlparse(url)
    if not sep or not env or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise KeyError(f"expected ors:<http(s) base url>#<env name>, e.g. ors:http://127.0.0.1:8080#wordle; got {name!r}")
    return url.rstrip("/"), env


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


# -- the class factory ---------------------------------------------------------------------
def make_env_class(name: str) -> type:
    """The Environment class serving the ORS env at `name` ("<base url>#<env name>"); KeyError for a
    malformed name or an env the server does not have, ValueError for a server that cannot be asked."""
    base_url, env_name = parse_name(name)
    remote = _LOOP.environment(base_url, env_name)
    try:
        split_names = _LOOP.run(remote.list_splits)
        sizes = [_LOOP.run(lambda s=s: remote.num_tasks(s)) for s in split_names]
        tools = _LOOP.run(remote.list_tools)
    except Exception as e:  # no server there, another protocol, or an env it does not serve
        text = _error(e)
        if "404" in text or "unknown environment" in text:
            raise KeyError(f"the ORS server at {base_url} has no environment {env_name!r}: {text}") from None
        raise ValueError(f"cannot read the ORS environment {env_name!r} at {base_url}: {text}") from None
    splits = tuple(Split(s, f"ORS split {s!r} of {env_name} ({n} tasks)", k * SPLIT_STRIDE, n)
                   for k, (s, n) in enumerate(zip(split_names, sizes)) if n > 0)
    if not splits:
        raise ValueError(f"the ORS environment {env_name!r} at {base_url} lists no split with tasks")
    codec = ToolCodec([(t.name, t.description, t.input_schema) for t in tools])
    images = _probe_images(remote, splits[0].name)
    env_id = f"ors:{name}"
    spec = EnvSpec(
        env_id=env_id,
        description=f"ORS environment {env_name} served at {base_url}",
        system_prompt=_system_prompt(env_name, codec),
        action_space=codec.describe(),
        max_turns=DEFAULT_MAX_TURNS,
        max_actions_per_turn=1,
        modalities=("text", "image") if images else ("text",),
        config_defaults=dict(CONFIG_DEFAULTS),
        splits=splits,
        supports_snapshot=False,
        replay_exact=False,
        seed_varies_start=sum(s.num_tasks for s in splits) > 1,
        default_action_format="no_think",
    )
    safe = re.sub(r"\W", "_", f"{base_url}_{env_name}")
    return type(f"ORS_{safe}", (OrsEnv,), {"spec": spec, "base_url": base_url, "env_name": env_name,
                                           "codec": codec, "__module__": __name__})


def _probe_images(remote, split: str) -> bool:
    """Whether the env's first prompt holds a picture: then the session shows the latest one."""
    from ors.client import Task

    async def probe():
        [first] = await remote.get_task_range(split, 0, 1)
        async with remote.session(task=Task(environment_name=remote.name, task_spec=first.task_spec)) as session:
            return any(getattr(b, "type", "") == "image" for b in await session.get_prompt())
    try:
        return _LOOP.run(probe)
    except Exception:  # a server that refuses a probe session still serves text
        return False


def _system_prompt(env_name: str, codec: "ToolCodec") -> str:
    return (f"You are acting in the environment {env_name}.\n"
            f"Each turn you see what the last tool call returned, and you answer with one tool call: "
            f"{codec.describe()}\nThe tools:\n{codec.listing()}\n"
            f"The reward of each call is the environment's own; the episode ends when it says so.")


def split_and_index(spec: EnvSpec, seed: int) -> tuple[str, int]:
    for s in spec.splits:
        if s.seed_offset <= seed < s.seed_offset + s.num_tasks:
            return s.name, seed - s.seed_offset
    first = spec.splits[0]
    return first.name, seed % first.num_tasks


# -- actions ------------------------------------------------------------------------------
class ToolCodec:
    """Reads one tool call from the model's text, by the tools' input schemas."""

    def __init__(self, tools: list[tuple[str, str, "Mapping[str, Any] | None"]]):
        self.tools = {name: (doc, dict(schema or {})) for name, doc, schema in tools}
        # One tool taking one field: the plain answer is that field's value.
        self.plain: "tuple[str, str] | None" = None
        if len(self.tools) == 1:
            (tool, (_, schema)), = self.tools.items()
            props = list(schema.get("properties", {}))
            if len(props) == 1:
                self.plain = (tool, props[0])

    def describe(self) -> str:
        call = 'a JSON object {"tool": <name>, "input": {<the tool\'s fields>}}'
        if self.plain:
            return f"the {self.plain[1]} for {self.plain[0]} as plain text, or {call}"
        return call

    def listing(self) -> str:
        lines = []
        for name, (doc, schema) in self.tools.items():
            fields = ", ".join(f"{k} ({v.get('type', 'value')})" for k, v in schema.get("properties", {}).items())
            lines.append(f"- {name}({fields})" + (f": {doc}" if doc else ""))
        return "\n".join(lines)

    def parse(self, text: str) -> "tuple[str, dict] | tuple[None, str]":
        """(tool, input), or (None, why the text is not a call, naming the tools)."""
        text = text.strip()
        data = json_object_in(text)
        if isinstance(data, dict) and isinstance(data.get("tool", data.get("name")), str):
            tool = data.get("tool", data.get("name"))
            args = data.get("input", data.get("arguments", {}))
            if tool not in self.tools:
                return None, f"Invalid action: no tool {tool!r}; the tools are {sorted(self.tools)}."
            if not isinstance(args, dict):
                return None, f"Invalid action: the input of {tool} must be a JSON object."
            return tool, args
        if self.plain and text:
            tool, key = self.plain
            return tool, {key: _typed(text, self.tools[tool][1]["properties"][key])}
        return None, f"Invalid action {text[:80]!r}: expected {self.describe()}."


def _typed(text: str, schema: Mapping[str, Any]) -> Any:
    """The plain answer as its field's JSON type where it reads as one (a number for an integer)."""
    kind = schema.get("type")
    if kind in ("integer", "number", "boolean"):
        try:
            value = json.loads(text)
        except ValueError:
            return text
        if kind == "integer" and isinstance(value, int) or kind == "number" and isinstance(value, (int, float)) \
                or kind == "boolean" and isinstance(value, bool):
            return value
    return text


# -- task descriptions ---------------------------------------------------------------------
_TASKS: "OrderedDict[tuple[str, str, int], Any]" = OrderedDict()
_TASKS_LOCK = threading.Lock()


def _task_spec(cls, split: str, index: int) -> Any:
    key = (cls.spec.env_id, split, index)
    with _TASKS_LOCK:
        if key in _TASKS:
            _TASKS.move_to_end(key)
            return _TASKS[key]
    remote = _LOOP.environment(cls.base_url, cls.env_name)
    got = _LOOP.run(lambda: remote.get_task_range(split, index, index + TASK_FETCH_RANGE))
    with _TASKS_LOCK:
        for i, task in enumerate(got):
            _TASKS[(cls.spec.env_id, split, index + i)] = task.task_spec
        while len(_TASKS) > TASK_CACHE_ENTRIES:
            _TASKS.popitem(last=False)
        return _TASKS.get(key)


def describe_spec(task: Any) -> TaskDescription:
    """A task spec (any JSON) as a description: its text field, its type, its scalar fields."""
    if not isinstance(task, Mapping):
        return TaskDescription(description=json.dumps(task)[:200])
    text = next((task[k] for k in _DESCRIPTION_KEYS if isinstance(task.get(k), str)), "")
    kind = next((task[k] for k in _TYPE_KEYS if isinstance(task.get(k), str)), "")
    params = {k: v for k, v in task.items() if isinstance(v, (int, float, bool)) or
              isinstance(v, str) and len(v) <= 64 and v not in (text, kind)}
    return TaskDescription(description=text or json.dumps(task, sort_keys=True)[:200], task_type=kind,
                           parameters=dict(list(params.items())[:16]))


# -- the environment -----------------------------------------------------------------------
class OrsEnv(Environment):
    """One ORS session per envserve session. Subclasses built by make_env_class set spec, base_url,
    env_name and codec."""

    spec: EnvSpec
    base_url: str
    env_name: str
    codec: ToolCodec

    @classmethod
    def describe_task(cls, spec: EnvSpec, seed: int) -> TaskDescription:
        split, index = split_and_index(spec, seed)
        return describe_spec(_task_spec(cls, split, index))

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        self._remote = _LOOP.environment(self.base_url, self.env_name)
        self._session: Any = None
        self._blocks: list = []
        self._image: "bytes | None" = None
        self._task: Any = None
        self._where: tuple[str, int] = ("", 0)
        self._metadata: Any = None
        self._rewards: list[float] = []
        self._done = False

    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        self._end_session()
        split, index = split_and_index(self.spec, int(seed or 0))
        from ors.client import Task
        task = _task_spec(type(self), split, index)
        # Opened on the task itself, which names its env: a session opened by split and index is
        # created on the server's default env.
        session = self._remote.session(task=Task(environment_name=self.env_name, task_spec=task))

        async def start():
            await session.__aenter__()
            try:
                return await session.get_prompt()
            except BaseException:
                await session.__aexit__(None, None, None)
                raise
        try:
            blocks = _LOOP.run(start)
        except Exception as e:
            raise RuntimeError(f"the ORS server at {self.base_url} could not start "
                               f"{self.env_name} {split}[{index}]: {_error(e)}") from None
        self._session, self._where, self._task = session, (split, index), task
        self._show(blocks)
        self._metadata, self._rewards, self._done = None, [], False

    def step(self, action: str) -> ActionOutcome:
        if not isinstance(action, str):
            return ActionOutcome(valid=False, feedback="Invalid action: expected text.")
        if self._done or self._session is None:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        tool, args = self.codec.parse(action)
        if tool is None:
            return ActionOutcome(valid=False, feedback=args)
        from ors.client._types import ToolCallError
        try:
            out = _LOOP.run(lambda: self._session.call_tool(tool, args))
        except ToolCallError as e:  # the tool refused this call: the session goes on
            return ActionOutcome(valid=False, feedback=f"Invalid action: {tool} failed: {e}")
        except Exception as e:
            raise RuntimeError(f"the ORS server at {self.base_url} failed the call to {tool}: {_error(e)}") from None
        self._show(out.blocks)
        self._metadata = out.metadata
        reward = float(out.reward or 0.0)
        self._rewards.append(reward)
        self._done = bool(out.finished)
        meta = out.metadata if isinstance(out.metadata, Mapping) else {}
        success = self._done and bool(meta["success"] if "success" in meta else reward > 0)
        return ActionOutcome(reward=reward, done=self._done, success=success, components={"env": reward})

    def _show(self, blocks) -> None:
        self._blocks = [b.text for b in blocks if getattr(b, "type", "") == "text"]
        images = [b for b in blocks if getattr(b, "type", "") == "image"]
        if images:
            self._image = base64.b64decode(images[-1].data)

    def render_text(self) -> str:
        return "\n".join(self._blocks)

    def render_image(self, size: int):
        import numpy as np
        from PIL import Image
        if self._image is None:
            return np.zeros((size, size, 3), np.uint8)
        with Image.open(io.BytesIO(self._image)) as im:
            return np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR))

    def ground_truth(self) -> GroundTruth:
        split, index = self._where
        return GroundTruth({"split": split, "index": index, "task": self._task, "finished": self._done,
                            "rewards": list(self._rewards), "metadata": self._metadata})

    def anchor_data(self) -> Any:
        return {"task": self._task, "observation": self.render_text(), "rewards": self._rewards}

    def close(self) -> None:
        self._end_session()

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                _LOOP.run(lambda: session.__aexit__(None, None, None), timeout=10.0)
            except Exception:  # the server already dropped it: nothing envserve keeps is lost
                pass
