"""What the framework adapters (trl, skyrl, gem) share: one client per target and process, cached
specs, a session wrapper whose steps never raise, the text a step reads as, and the actions a spec
lists.

Only `envserve.client` is used. A target is where sessions live: one replica's address, several
(a list, or a string joined by commas), or a directory URL (`redis://host:6379/0`, `ray://`);
where an adapter is given none, ENVSERVE_ADDRESS, else, in a process of a Ray cluster (a driver
after `ray.init()`, a Ray task or actor), `ray://`: the directory of the fleet `envserve.ray` runs
there (`resolve_target`). Sessions spread over the replicas, least loaded first, and a session whose replica died or drained is
rebuilt on a live one by replaying its history (RoutedClient's recovery), the caller none the
wiser. Every adapter in the process shares one StreamingClient per target (a trainer makes an
environment object per rollout): its steps travel as items on one Interact stream per replica,
driven by a background event loop, or as unary Step calls with `stream=False`. Clients live until
`close_channels()` or the interpreter's exit, and are made again in a forked child. At exit the
sessions still open are closed first (frameworks often never close their environments).
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import re
import sys
import threading
import weakref
from typing import Any, Mapping, Sequence

import grpc

from envserve.client import (EnvNotFoundError, EnvServeError, RecoverySettings, SessionLostError, SessionNotFoundError,
                             StreamingClient, decode_image, item_error)
from envserve.client.experts import plain_answer, session_settings

# Spec action spaces: "one of Up, Down, Left, Right (case-insensitive)", "(row, col), 0-based; ...".
_CHOICES = re.compile(r"^one of (?P<choices>[^()]+?)\s*(\(.*\))?$")
_CELL = re.compile(r"^\(row, col\)")

# How long closing a session may take: a replica that is gone must not hold up a rollout or the exit.
CLOSE_TIMEOUT = 5.0


def action_choices(spec) -> list[str] | None:
    """The primitive actions a spec lists ("one of A, B, C"), in the env's order, or None."""
    m = _CHOICES.match(spec.action_space.strip())
    return [c.strip() for c in m.group("choices").split(",") if c.strip()] if m else None


def is_cell_space(spec) -> bool:
    """Whether an action is a board cell "(row, col)" (Minesweeper)."""
    return bool(_CELL.match(spec.action_space.strip()))


def target_key(target: "str | Sequence[str]") -> "str | tuple[str, ...]":
    """A target as a hashable value: a URL or address string as is, a sequence as a tuple."""
    if isinstance(target, str):
        if not target.strip():
            raise ValueError("an address, several addresses or a directory URL is needed")
        return target.strip()
    addresses = tuple(str(a).strip() for a in target if str(a).strip())
    if not addresses:
        raise ValueError(f"no replica address in {target!r}")
    return addresses


# Where envserve's fleet on a Ray cluster registers its replicas (envserve.ray, `envserve ray up`).
RAY_DIRECTORY = "ray://"


def in_ray_cluster() -> bool:
    """Whether this process belongs to a Ray cluster: a driver that ran `ray.init()`, or a Ray task or
    actor. Ray is not imported to find out: a process that never imported it has not joined one."""
    ray = sys.modules.get("ray")
    is_initialized = getattr(ray, "is_initialized", None)
    try:
        return bool(is_initialized and is_initialized())
    except Exception:  # a half-torn-down Ray at exit: not a cluster to use
        return False


def resolve_target(target: "str | Sequence[str] | None", what: str = "envserve") -> "str | tuple[str, ...]":
    """Where an adapter's sessions live: `target` where given (as target_key reads it), else the
    ENVSERVE_ADDRESS variable, else `ray://` when this process is in a Ray cluster (the fleet's
    directory). With none of them, a ValueError that says so, naming `what` (the adapter's setting)."""
    if target is not None and not (isinstance(target, str) and not target.strip()):
        return target_key(target)
    from_env = os.environ.get("ENVSERVE_ADDRESS", "").strip()
    if from_env:
        return target_key(from_env)
    if in_ray_cluster():
        return RAY_DIRECTORY
    raise ValueError(f"{what} needs an address: one replica's (host:port), several, or a directory URL "
                     f"(redis://..., ray://); none was given, ENVSERVE_ADDRESS is not set and this process "
                     f"is not in a Ray cluster (where ray:// is the default)")


# -- clients and specs -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where sessions live and how to reach them; hashable, so equal endpoints share a client.
    address: one address, a tuple of them, or a directory URL; None (or "") is resolve_target's
    (ENVSERVE_ADDRESS, else `ray://` inside a Ray cluster). stream: steps as items of the
    replicas' Interact streams (False: a unary Step each). recovery: rebuild a lost session on a
    live replica (True), not (False), or RecoverySettings. stats_scope: the run's name its sessions'
    finished episodes are counted under (GetTaskStats; empty: not counted)."""
    address: "str | tuple[str, ...]"
    token: str | None = None
    timeout: float | None = 60.0
    root_certificates: "bytes | str | None" = None
    tls: bool = False
    stream: bool = True
    recovery: "bool | RecoverySettings" = True
    stats_scope: str = ""

    def __post_init__(self):
        object.__setattr__(self, "address", resolve_target(self.address))

    @property
    def where(self) -> str:
        return self.address if isinstance(self.address, str) else ",".join(self.address)

    def client(self) -> StreamingClient:
        """This process's client for the endpoint (shared: never close it)."""
        with _LOCK:
            c = _CLIENTS.get(self)
            if c is None:
                c = _CLIENTS[self] = StreamingClient(self.address, token=self.token, root_certificates=self.root_certificates,
                                                     tls=self.tls, timeout=self.timeout, recovery=self.recovery,
                                                     stream_steps=self.stream, stats_scope=self.stats_scope)
            return c

    def spec(self, env_id: str):
        """GetSpec, once per endpoint and env (a trainer builds an env per rollout); an env no
        replica serves is a ValueError."""
        key = (self, env_id)
        with _LOCK:
            spec = _SPECS.get(key)
        if spec is None:
            try:
                spec = self.client().get_spec(env_id)
            except EnvNotFoundError as e:  # not served there
                raise ValueError(f"{env_id!r} at {self.where}: {e.message}") from None
            with _LOCK:
                _SPECS[key] = spec
        return spec


_LOCK = threading.Lock()
_CLIENTS: "dict[Endpoint, StreamingClient]" = {}
_SPECS: dict[tuple, Any] = {}
# Bumped by close_channels, so sessions holding a closed client take a new one.
_GENERATION = [0]
# Every Session with an open id, to close what the frameworks never close (GEM's vector envs) at exit.
_OPEN: "weakref.WeakSet[Session]" = weakref.WeakSet()


def close_channels() -> None:
    """Closes every shared client's streams and channels (a later call makes them again)."""
    with _LOCK:
        clients, _ = list(_CLIENTS.values()), _CLIENTS.clear()
        _SPECS.clear()
        _GENERATION[0] += 1
    for c in clients:
        c.close()


def _at_exit() -> None:
    """Closes the sessions still open (one Close per endpoint, short deadlines), then the clients."""
    by_endpoint: dict[Endpoint, list[str]] = {}
    for session in list(_OPEN):
        if session.id:
            by_endpoint.setdefault(session.endpoint, []).append(session.id)
    for endpoint, sids in by_endpoint.items():
        close_quietly(endpoint, sids)
    close_channels()


atexit.register(_at_exit)


def plain_dict(value: Any, what: str) -> dict:
    """A mapping as a plain dict: a dict, an omegaconf DictConfig (SkyRL's env_config) or a dataclass;
    None is empty. Anything else is a ValueError naming `what`."""
    if value is None:
        return {}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf
        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(value).__name__}")
    return {str(k): (plain_dict(v, what) if isinstance(v, Mapping) or type(v).__module__.startswith("omegaconf")
                     else v) for k, v in value.items()}


# -- sessions --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Outcome:
    """One Step of a Session: the StepResult, or the error that ended the episode instead (the call
    failed: replica down, draining; or the item failed: session lost, lease expired)."""
    result: Any = None
    error: EnvServeError | None = None

    @property
    def ended(self) -> bool:
        return self.error is not None or self.result.done or self.result.truncated

    @property
    def reward(self) -> float:
        return 0.0 if self.result is None else float(self.result.reward)

    def text(self) -> str:
        return error_text(self.error) if self.error is not None else step_text(self.result)


class Session:
    """One envserve session, opened lazily (or by `open()`), reopened by a reset when the server lost
    it; `step` never raises. `tracker`, where given, is a set holding the ids of open sessions (a pool
    closes them all in one call). A session that is garbage-collected is closed on the server."""

    def __init__(self, endpoint: Endpoint, env_id: str, config: Mapping[str, Any] | None = None,
                 action_format: str = "no_think", tracker: "set[str] | None" = None):
        self.endpoint = endpoint
        self.env_id = env_id
        self.config = dict(config or {})
        self.action_format = action_format
        self.tracker = tracker
        self.system_prompt = ""      # Open's: the env's rules with the format's answer instructions
        # The id lives in a list so the finalizer (which must not hold `self`) sees it change.
        self._sid: list[str] = []
        self._client, self._generation = endpoint.client(), _GENERATION[0]
        weakref.finalize(self, _close_ids, endpoint, self._sid, tracker).atexit = False

    @property
    def id(self) -> str:
        return self._sid[0] if self._sid else ""

    @property
    def real_id(self) -> str:
        """The id of the session on its replica now: the caller's id until the session is rebuilt
        elsewhere (what a judge reading the replica's ground truth must name)."""
        return self.client.sessions.current(self.id) if self._sid else ""

    @property
    def client(self) -> StreamingClient:
        if self._generation != _GENERATION[0]:  # close_channels() closed the one this client used
            self._client, self._generation = self.endpoint.client(), _GENERATION[0]
        return self._client

    def open(self) -> str:
        """Opens the session now (construction-time checks: an unknown config key, a bad value or an
        action format the env does not take is a ValueError)."""
        if not self._sid:
            try:
                reply = self.client.open_sessions(self.env_id, 1, self.config, self.action_format)
            except EnvServeError as e:
                if e.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                    raise ValueError(f"{self.env_id} at {self.endpoint.where}: {e.message}") from None
                raise
            self.system_prompt = reply.system_prompt
            self._adopt(reply.session_ids[0])
        return self._sid[0]

    def _adopt(self, sid: str) -> None:
        self._sid.append(sid)
        _OPEN.add(self)
        if self.tracker is not None:
            self.tracker.add(sid)

    def _forget(self) -> None:
        if self._sid:
            sid = self._sid.pop()
            if self.tracker is not None:
                self.tracker.discard(sid)

    def reset(self, seed: int | None = None, task_id: str = "", split: str = ""):
        """Reset to `seed` (or a task id or split); returns the StepResult. A session the server no
        longer has (lease expired, worker died) is opened again, once: same seed, same start."""
        self.open()
        try:
            return self._reset(seed, task_id, split)
        except (SessionNotFoundError, SessionLostError):
            self._forget()
            self.open()
            return self._reset(seed, task_id, split)

    def _reset(self, seed, task_id, split):
        result = self.client.reset([self._sid[0]], [seed], task_id=task_id, split=split)[0]
        err = item_error(result)
        if err is not None:
            raise err
        return result

    def step(self, text: str) -> Outcome:
        """One Step with the model's text, as is (the session's action format parses it)."""
        if not self._sid:
            return Outcome(error=EnvServeError(grpc.StatusCode.FAILED_PRECONDITION, "the session is not open"))
        try:
            result = self.client.step([(self._sid[0], text)])[0]
        except EnvServeError as e:
            return Outcome(error=e)
        err = item_error(result)
        return Outcome(error=err) if err is not None else Outcome(result=result)

    def state(self):
        """GetState of the current turn (the ground truth experts read)."""
        return self.client.get_state(self.id, -1)

    def fork(self) -> "Session":
        """A new session in this one's exact state (Fork), with the same settings."""
        twin = Session(self.endpoint, self.env_id, self.config, self.action_format, self.tracker)
        twin.system_prompt = self.system_prompt
        twin._adopt(self.client.fork(self.open(), 1)[0])
        return twin

    def close(self) -> None:
        """Closes the session on the server; never raises (the replica may be gone). A later reset
        opens a new one."""
        sid = list(self._sid)
        self._forget()
        _close_ids(self.endpoint, sid, None)

    def settings(self) -> dict[str, Any]:
        """Every config key of the session: the spec's defaults with the session's config over them."""
        return session_settings(self.endpoint.spec(self.env_id), self.config)

    def answer(self, actions: Sequence[str]) -> str:
        """A minimal valid answer in the session's action format carrying `actions`."""
        return plain_answer(self.action_format, list(actions), str(self.settings()["action_separator"]))


def _close_ids(endpoint: Endpoint, sids: list[str], tracker: "set[str] | None") -> None:
    if not sids:
        return
    if tracker is not None:
        for sid in sids:
            tracker.discard(sid)
    close_quietly(endpoint, sids)


def close_quietly(endpoint: Endpoint, sids: Sequence[str]) -> None:
    """Close sessions in one call, with a short deadline; never raises (a server that is gone has
    dropped them already, or its leases will)."""
    if not sids:
        return
    try:
        endpoint.client().close_sessions(list(sids), timeout=CLOSE_TIMEOUT)
    except Exception:
        pass


# -- text ------------------------------------------------------------------------------------------
def error_text(err: EnvServeError) -> str:
    return f"Error: the environment failed ({err.code.name}: {err.message}). The episode is over."


def feedback_and_observation(result) -> str:
    """The env's feedback (why an action was invalid, what happened), then the new observation."""
    parts = []
    if not result.action_valid:
        parts.append(result.feedback or "Invalid action.")
    elif result.feedback:
        parts.append(result.feedback)
    parts.append(result.observation.text)
    return "\n".join(p for p in parts if p)


def step_text(result) -> str:
    """What the model reads after a step: feedback (why an action was invalid), the observation, the
    reward and, at the end, how the episode ended."""
    parts = [feedback_and_observation(result), f"Reward: {result.reward:g}."]
    if result.done:
        parts.append("The episode is over: " + ("success." if result.success else "failure."))
    elif result.truncated:
        parts.append("The episode is over: turn limit reached.")
    return "\n".join(p for p in parts if p)


def pil_images(result) -> list:
    """The observation's images as PIL images (what the frameworks' processors take)."""
    if not result.observation.images:
        return []
    from PIL import Image
    return [Image.fromarray(decode_image(im)) for im in result.observation.images]


def content_blocks(text: str, images: list) -> "str | list[dict[str, Any]]":
    """Text alone, or chat content blocks (images first) when there are images."""
    if not images:
        return text
    return [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": text}]


def first_text(rules: str, result) -> str:
    """What the model reads first: the rules, then the first observation."""
    return f"{rules}\n\n{result.observation.text}" if rules else result.observation.text


def step_info(outcome: Outcome) -> dict[str, Any]:
    """A step's details for a framework's info/metadata dict (plain Python values only)."""
    if outcome.error is not None:
        return {"error": error_text(outcome.error), "error_code": outcome.error.code.name, "action_valid": False,
                "success": False, "truncated": False}
    r = outcome.result
    return {"turn": int(r.turn), "action_valid": bool(r.action_valid), "success": bool(r.success),
            "truncated": bool(r.truncated), "feedback": r.feedback, "parsed_actions": list(r.parsed_actions),
            "actions_executed": int(r.actions_executed), "reward_components": dict(r.reward_components),
            "episode": int(r.episode), "info": _struct(r.info)}


def _struct(struct) -> dict:
    """A protobuf Struct as plain Python (a few microseconds; json_format's is several times slower)."""
    return {k: _plain(v) for k, v in struct.items()} if struct.fields else {}


def _plain(v):
    if isinstance(v, (str, float, bool)) or v is None:
        return v
    if hasattr(v, "fields"):            # a nested Struct
        return _struct(v)
    return [_plain(x) for x in v]       # a ListValue


def row_reset_args(*rows: Mapping[str, Any] | None) -> tuple[int | None, str, str]:
    """(seed, task_id, split) from the first of `rows` that has them (a dataset row, then its nested
    extra_info...). A seed that is not a whole number is a ValueError."""
    seed, task_id, split = None, "", ""
    for row in rows:
        if not row:
            continue
        if seed is None and row.get("seed") is not None:
            try:
                seed = int(row["seed"])
            except (TypeError, ValueError):
                raise ValueError(f"seed must be a whole number, got {row['seed']!r}") from None
        task_id = task_id or str(row.get("task_id") or "")
        split = split or str(row.get("split") or "")
    return seed, task_id, split
