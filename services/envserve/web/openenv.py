"""OpenEnv's protocol over any envserve environment, so OpenEnv's own clients (openenv's
EnvClient and GenericEnvClient, and the trainers built on them: TRL, SkyRL, NeMo Gym, AgileRL)
drive envserve sessions unchanged.

Each environment is an OpenEnv "base URL" of its own: http://HOST:PORT/openenv/<env_id>.

- WebSocket <base>/ws: one connection is one envserve session, opened on connect through the
  facade's replica routing (the least-loaded replica serving the env) and closed when the socket
  closes. Messages are JSON objects with a `type`:
    {"type": "reset", "data": {"seed": 3, "episode_id": ..., "task_id": ..., "split": ...,
                               "config": {...}, "action_format": "no_think"}}
    {"type": "step", "data": {"message": "<answer>Left</answer>"}}   (the action text; `action`
                                                                      or `text` are read too)
    {"type": "state"}    {"type": "close"}
  and each is answered by one {"type": "observation" | "state" | "error", "data": {...}}. An
  observation's data is {"observation": {"text", "turn", "episode", ["images"], "metadata"},
  "reward", "done", "metadata"}, metadata holding the turn, whether the action was valid, the
  env's feedback and info. A `config` or `action_format` at reset that differs from the session's
  reopens the session with them (envserve fixes both when a session opens). Anything wrong with
  one message (invalid JSON, an unknown type, a missing action, an item the replica refused)
  comes back as an error message, {"message", "code"} with OpenEnv's codes, and the socket stays.
  `?session_id=ID` attaches the socket to a session opened over HTTP instead (closing that
  socket leaves the session open).
- A session belongs to the token that opened it, as over gRPC: every call on it, over HTTP or a
  socket, goes out with the caller's own credentials, and a caller with another token is refused
  (PERMISSION_DENIED; UNAUTHENTICATED without one) before anything happens to the session.
- HTTP <base>/reset, /step, /state: OpenEnv's own server makes a throwaway environment per HTTP
  request; here /reset opens a session (or resets the one named by `session_id` in the body) and
  says its id in metadata.session_id; /step and /state name it (`session_id` in the body, or the
  query for /state). Sessions opened over HTTP are closed after `idle_seconds` without a call
  (and by POST <base>/close). <base>/health, /schema and /metadata answer as OpenEnv's do.

The steps and resets of all sockets and HTTP sessions are batched per replica and token
(gateway.Batcher): those that arrive in one event-loop turn go out as one Step call, so sixty-four
sockets stepping at once cost a few batched calls rather than sixty-four.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import hmac
import json
import logging
import time
from typing import Any, Optional

import grpc
from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field

from envserve import __version__
from envserve.client import info_dict
from envserve.client._requests import open_request, reset_item
from envserve.directory import ReplicaInfo
from envserve.rpc.values import status_code
from envserve.v1 import envserve_pb2 as pb

from .gateway import ApiError, Gateway, forwarded
from .limits import HttpLimits, parse_json, read_json_body

log = logging.getLogger("envserve.web.openenv")

try:  # orjson encodes a step's reply in a fifth of json's time (the web extra installs it)
    import orjson

    def _dumps(obj) -> str:
        try:
            return orjson.dumps(obj).decode()
        except TypeError:  # what orjson refuses (ints past 64 bits, non-str keys), json writes
            return json.dumps(obj)
except ImportError:  # pragma: no cover - without the web extra's orjson
    _dumps = json.dumps

# OpenEnv's error codes (openenv.core.env_server.types.WSErrorCode).
INVALID_JSON, UNKNOWN_TYPE, VALIDATION_ERROR = "INVALID_JSON", "UNKNOWN_TYPE", "VALIDATION_ERROR"
EXECUTION_ERROR, CAPACITY_REACHED, FACTORY_ERROR, SESSION_ERROR = (
    "EXECUTION_ERROR", "CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR")
_SESSION_GONE = (grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.DATA_LOSS.value[0])
ACTION_KEYS = ("message", "action", "text")  # where a generic OpenEnv client puts the action text


class OpenEnvError(Exception):
    """One message's failure: an OpenEnv error reply on a socket, an HTTP error over HTTP."""

    def __init__(self, code: str, message: str, status: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status

    def data(self) -> dict:
        return {"message": self.message, "code": self.code, "status": self.status.name}


def _from_api(e: Exception, opening: bool = False) -> OpenEnvError:
    """An ApiError or gRPC error as OpenEnv reports it."""
    if isinstance(e, ApiError):
        status, message = e.code, e.message
    elif isinstance(e, grpc.RpcError):
        status, message = e.code(), e.details() or e.code().name
    else:
        return OpenEnvError(EXECUTION_ERROR, f"{type(e).__name__}: {e}", grpc.StatusCode.INTERNAL)
    if status == grpc.StatusCode.RESOURCE_EXHAUSTED:
        code = CAPACITY_REACHED
    elif opening:
        code = FACTORY_ERROR
    elif status in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DATA_LOSS):
        code = SESSION_ERROR
    else:
        code = EXECUTION_ERROR
    return OpenEnvError(code, message, status)


# -- the models /schema publishes (what a typed OpenEnv client would declare) -------------------------
class EnvServeAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str = Field(description="The agent's whole answer, parsed by the session's action format")
    metadata: dict[str, Any] = Field(default_factory=dict)


class EnvServeImage(BaseModel):
    png: str = Field(description="PNG, base64")
    height: int
    width: int
    channels: int
    name: str = ""


class EnvServeObservation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    done: bool = False
    reward: Optional[float] = None
    text: str = Field(description="The observation text (with the env's feedback after a step)")
    turn: int = 0
    episode: int = 0
    images: list[EnvServeImage] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict, description=(
        "session_id, env_id, turn, episode, trial, valid_action, actions_executed, parsed_actions, "
        "truncated, success, feedback, reward_components, reasoning, info (and system_prompt at reset)"))


class EnvServeState(BaseModel):
    model_config = ConfigDict(extra="allow")
    episode_id: Optional[str] = None
    step_count: int = 0
    session_id: str = ""
    env_id: str = ""
    turn: int = 0
    episode: int = 0
    done: bool = False
    episode_return: float = 0.0
    action_format: str = ""


_SCHEMA = {"action": EnvServeAction.model_json_schema(), "observation": EnvServeObservation.model_json_schema(),
           "state": EnvServeState.model_json_schema()}


# -- sessions ---------------------------------------------------------------------------------------
class Session:
    __slots__ = ("env_id", "session_id", "replica", "owner", "reap_md", "config", "action_format", "system_prompt",
                 "episode_id", "step_count", "turn", "episode", "done", "episode_return", "last_used",
                 "sockets", "http")

    def __init__(self, env_id: str, session_id: str, replica: ReplicaInfo, owner: str, reap_md: tuple,
                 config: dict, action_format: str, system_prompt: str, http: bool):
        # owner: the opener's token digest ("" without a token). reap_md: the opener's credentials,
        # kept only to close the session when it idles out or the endpoint stops; every call a
        # caller makes goes out with that caller's own.
        self.env_id, self.session_id, self.replica = env_id, session_id, replica
        self.owner, self.reap_md = owner, reap_md
        self.config, self.action_format, self.system_prompt = config, action_format, system_prompt
        self.episode_id: Optional[str] = None
        self.step_count = self.turn = self.episode = 0
        self.done = False
        self.episode_return = 0.0
        self.last_used = time.monotonic()
        self.sockets = 0     # sockets attached to an HTTP session: not reclaimed while any is
        self.http = http

    def state(self) -> dict:
        return {"episode_id": self.episode_id or f"{self.session_id}/{self.episode}",
                "step_count": self.step_count, "session_id": self.session_id, "env_id": self.env_id,
                "turn": self.turn, "episode": self.episode, "done": self.done,
                "episode_return": self.episode_return, "action_format": self.action_format,
                "config": self.config}


def _images(obs: pb.Observation) -> list[dict]:
    return [{"png": base64.b64encode(im.png).decode("ascii"), "height": im.height, "width": im.width,
             "channels": im.channels, "name": im.name} for im in obs.images]


def observation_payload(s: Session, r: pb.StepResult, reset: bool = False) -> dict:
    """A StepResult in OpenEnv's wire form (what its serialize_observation makes of an Observation)."""
    meta = {"session_id": s.session_id, "env_id": s.env_id, "turn": r.turn, "episode": r.episode,
            "trial": r.trial, "valid_action": r.action_valid, "actions_executed": r.actions_executed,
            "parsed_actions": list(r.parsed_actions), "truncated": r.truncated, "success": r.success,
            "feedback": r.feedback, "reward_components": dict(r.reward_components),
            "reasoning": dict(r.reasoning),
            "info": info_dict(r)}
    if reset:
        meta["system_prompt"] = s.system_prompt
    obs = r.observation
    observation = {"text": obs.text, "turn": obs.turn, "episode": obs.episode, "metadata": meta}
    if obs.images:
        observation["images"] = _images(obs)
    # OpenEnv has one `done`: an episode out of turns is over too (its metadata says truncated), so
    # a client that loops until done stops there instead of stepping into an error.
    return {"observation": observation, "reward": r.reward, "done": r.done or r.truncated, "metadata": meta}


def _action_text(data: Any) -> str:
    if isinstance(data, str):
        return data
    if isinstance(data, dict):
        for key in ACTION_KEYS:
            v = data.get(key)
            if isinstance(v, str):
                return v
    raise OpenEnvError(VALIDATION_ERROR, "a step's action is the answer text: {\"message\": \"...\"} "
                                         f"(or `action` / `text`), got {json.dumps(data)[:200]}")


def _reset_options(data: Any) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise OpenEnvError(VALIDATION_ERROR, f"reset data must be an object, got {type(data).__name__}")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise OpenEnvError(VALIDATION_ERROR, f"seed must be a whole number 0..2**63-1, got {seed!r}")
    for key in ("task_id", "split", "action_format", "episode_id"):
        v = data.get(key)
        if v is not None and not isinstance(v, str):
            raise OpenEnvError(VALIDATION_ERROR, f"{key} must be a string, got {v!r}")
    config = data.get("config")
    if config is not None and not isinstance(config, dict):
        raise OpenEnvError(VALIDATION_ERROR, f"config must be an object, got {config!r}")
    return data


class OpenEnvSessions:
    """The endpoint's sessions: those of the sockets, and those opened over HTTP (kept in
    `http_sessions`, at most limits.openenv_max_http_sessions of them, reclaimed after
    idle_seconds without a call)."""

    def __init__(self, gateway: Gateway, idle_seconds: float = 300.0, limits: HttpLimits | None = None):
        self.gateway = gateway
        self.idle_seconds = idle_seconds
        self.limits = limits or HttpLimits()
        self.http_sessions: dict[str, Session] = {}
        self._opening = 0  # HTTP sessions being opened: counted against the limit already
        self._reaper: asyncio.Task | None = None

    # -- envserve calls -----------------------------------------------------------------------------
    async def open(self, env_id: str, md: tuple, config: dict | None = None, action_format: str = "",
                   http: bool = False, replacing: bool = False) -> Session:
        """replacing: the new HTTP session takes the place of one about to close (a reset with
        another config), so it needs no room of its own."""
        try:
            owner = self.gateway.owner(md)
        except ApiError as e:
            raise _from_api(e, opening=True) from None
        counted = http and not replacing
        if counted:
            limit = self.limits.openenv_max_http_sessions
            if len(self.http_sessions) + self._opening >= limit:
                raise OpenEnvError(CAPACITY_REACHED, f"this endpoint holds {limit} sessions opened over HTTP, "
                                                     "its limit: close some (POST /close) or use the WebSocket",
                                   grpc.StatusCode.RESOURCE_EXHAUSTED)
            self._opening += 1
        try:
            replica, resp = await self.gateway.open(open_request(env_id, 1, config, action_format or ""), md)
        except (ApiError, grpc.RpcError) as e:
            raise _from_api(e, opening=True) from None
        finally:
            if counted:
                self._opening -= 1
        s = Session(env_id, resp.session_ids[0], replica, owner, md, dict(config or {}), action_format or "",
                    resp.system_prompt, http)
        if http:
            self.http_sessions[s.session_id] = s
            self._start_reaper()
        return s

    async def close(self, s: Session, md: tuple) -> None:
        """Closes s with the credentials md (its owner's: a caller's, checked, or the opener's
        when the endpoint reclaims it)."""
        self.http_sessions.pop(s.session_id, None)
        try:
            await self.gateway.close_sessions([s.session_id], md)
        except (ApiError, grpc.RpcError) as e:
            log.info("closing %s: %s", s.session_id, e)

    # One step or reset of a session through its replica's batcher (the ORS door calls it too).
    async def call(self, s: Session, md: tuple, step: str | None = None,
                   reset: pb.ResetItem | None = None) -> pb.StepResult:
        s.last_used = time.monotonic()
        try:
            batcher = self.gateway.batcher(s.replica, md)
            r = await (batcher.step(s.session_id, step) if reset is None else batcher.reset(reset))
        except (ApiError, grpc.RpcError) as e:
            raise _from_api(e) from None
        s.last_used = time.monotonic()
        if r.status.code:
            status = status_code(r.status.code)
            raise OpenEnvError(SESSION_ERROR if r.status.code in _SESSION_GONE else EXECUTION_ERROR,
                               r.status.message or status.name, status)
        return r

    async def reset(self, s: Session, md: tuple, data: Any) -> tuple[Session, dict]:
        """Returns the session (a new one when config or action_format changed) and the payload."""
        opts = _reset_options(data)
        config, fmt = opts.get("config"), opts.get("action_format")
        if (config is not None and config != s.config) or (fmt is not None and fmt != s.action_format):
            new = await self.open(s.env_id, md, config if config is not None else s.config,
                                  fmt if fmt is not None else s.action_format, http=s.http, replacing=True)
            new.sockets = s.sockets  # a socket attached to the old HTTP session holds the new one
            await self.close(s, md)
            s = new
        item = reset_item(s.session_id, opts.get("seed"), opts.get("task_id") or "", opts.get("split") or "",
                          bool(opts.get("same_task", False)))
        r = await self.call(s, md, reset=item)
        s.episode_id = opts.get("episode_id")
        s.step_count, s.turn, s.episode, s.done, s.episode_return = 0, r.turn, r.episode, r.done or r.truncated, 0.0
        return s, observation_payload(s, r, reset=True)

    async def step(self, s: Session, md: tuple, action: Any) -> dict:
        text = _action_text(action)
        r = await self.call(s, md, step=text)
        s.step_count += 1
        s.turn, s.episode, s.done = r.turn, r.episode, r.done or r.truncated
        s.episode_return += r.reward
        return observation_payload(s, r)

    # -- HTTP sessions ------------------------------------------------------------------------------
    def http_session(self, env_id: str, session_id: Any, md: tuple) -> Session:
        """The HTTP session a call names, for a caller with credentials md: checked as a replica
        checks a gRPC call (the caller's token first, then the session, then that the session
        is the caller's), before anything happens to it."""
        caller = self.gateway.owner(md)  # a replica's own endpoint refuses a missing or unknown token here
        if not isinstance(session_id, str) or not session_id:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                           "name the session: `session_id`, as /reset returned it in metadata.session_id "
                           "(or use the WebSocket at /ws, one session per connection)")
        s = self.http_sessions.get(session_id)
        if s is None:
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"unknown session {session_id!r}: not opened here over HTTP, closed, or reclaimed "
                           f"after {self.idle_seconds:g} s without a call")
        # Opened without a token: no token guards it (the replica took an Open without one).
        if s.owner and not hmac.compare_digest(s.owner, caller):
            if not caller:
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED,
                               "missing bearer token: send 'Authorization: Bearer <token>'")
            raise ApiError(grpc.StatusCode.PERMISSION_DENIED, f"session {session_id!r} belongs to another token")
        if s.env_id != env_id:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"session {session_id!r} is a {s.env_id!r} session, "
                                                             f"not {env_id!r}")
        return s

    def _start_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        interval = max(0.05, min(self.idle_seconds / 4, 5.0))
        while self.http_sessions:
            await asyncio.sleep(interval)
            now = time.monotonic()
            idle = [s for s in self.http_sessions.values()
                    if not s.sockets and now - s.last_used > self.idle_seconds]
            for s in idle:
                if self.http_sessions.get(s.session_id) is s:
                    log.info("reclaiming idle OpenEnv session %s (%s)", s.session_id, s.env_id)
                    await self.close(s, s.reap_md)

    async def close_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        sessions = list(self.http_sessions.values())
        self.http_sessions.clear()
        for s in sessions:
            await self.close(s, s.reap_md)


async def _json_body(request: Request, limits: HttpLimits) -> dict:
    data = await read_json_body(request, limits)
    if not isinstance(data, dict):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "body must be a JSON object")
    return data


def _as_api(e: OpenEnvError) -> ApiError:
    return ApiError(e.status, f"{e.code}: {e.message}")


def mount_openenv(app: FastAPI, gateway: Gateway, idle_seconds: float = 300.0,
                  prefix: str = "/openenv", limits: HttpLimits | None = None) -> OpenEnvSessions:
    """Adds OpenEnv's routes for every env under prefix/<env_id>/ to app: the facade's, over its
    replicas, or a replica's own (envserve.server.openenv_front.LocalGateway, no gRPC hop)."""
    limits = limits or HttpLimits()
    sessions = OpenEnvSessions(gateway, idle_seconds, limits)
    base = prefix + "/{env_id}"
    depth = limits.max_json_depth

    spec = gateway.spec

    # -- WebSocket ------------------------------------------------------------------------------
    @app.websocket(base + "/ws")
    async def openenv_ws(websocket: WebSocket, env_id: str):
        await websocket.accept()
        s: Session | None = None
        owned = False

        async def send(kind: str, data: dict) -> None:
            await websocket.send_text(_dumps({"type": kind, "data": data}))

        try:
            try:
                md = forwarded(websocket.headers)
                attach = websocket.query_params.get("session_id")
                if attach:
                    s = sessions.http_session(env_id, attach, md)
                    s.sockets += 1
                else:
                    q = websocket.query_params
                    try:
                        config = parse_json(q["config"], depth, "config") if q.get("config") else None
                    except ApiError as e:
                        raise OpenEnvError(VALIDATION_ERROR, e.message) from None
                    if config is not None and not isinstance(config, dict):
                        raise OpenEnvError(VALIDATION_ERROR, f"config must be a JSON object, got {q['config'][:200]}")
                    s = await sessions.open(env_id, md, config, q.get("action_format", ""))
                    owned = True
            except ApiError as e:
                await send("error", {"message": e.message, "code": SESSION_ERROR, "status": e.code.name})
                return
            except OpenEnvError as e:
                await send("error", e.data())
                return
            while True:
                msg = await websocket.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text")
                if raw is None:
                    raw = msg.get("bytes") or b""
                try:
                    try:
                        message = parse_json(raw, depth)
                    except ApiError as e:
                        raise OpenEnvError(INVALID_JSON, f"Invalid JSON: {e.message}") from None
                    if not isinstance(message, dict):
                        raise OpenEnvError(VALIDATION_ERROR, "a message is a JSON object with a `type`")
                    kind = message.get("type", "")
                    if kind == "step":
                        if "data" not in message:
                            raise OpenEnvError(VALIDATION_ERROR, "a step message carries the action in `data`")
                        await send("observation", await sessions.step(s, md, message["data"]))
                    elif kind == "reset":
                        s, payload = await sessions.reset(s, md, message.get("data") or {})
                        await send("observation", payload)
                    elif kind == "state":
                        await send("state", s.state())
                    elif kind == "close":
                        break
                    else:
                        raise OpenEnvError(UNKNOWN_TYPE, f"Unknown message type: {kind}")
                except OpenEnvError as e:
                    await send("error", e.data())
        except WebSocketDisconnect:
            pass
        except Exception as e:  # noqa: BLE001 - say why before the socket goes
            log.exception("OpenEnv socket for %s failed", env_id)
            try:
                await send("error", {"message": f"{type(e).__name__}: {e}", "code": EXECUTION_ERROR,
                                     "status": grpc.StatusCode.INTERNAL.name})
            except Exception:  # noqa: BLE001
                pass
        finally:
            if s is not None:
                if owned:
                    await sessions.close(s, md)
                else:
                    s.sockets -= 1
                    s.last_used = time.monotonic()
            try:
                await websocket.close()
            except Exception:  # noqa: BLE001 - already closed by the client
                pass

    # -- HTTP -----------------------------------------------------------------------------------
    @app.post(base + "/reset")
    async def openenv_reset(env_id: str, request: Request):
        body = await _json_body(request, limits)
        md = forwarded(request.headers)
        try:
            opts = _reset_options(body)
            if body.get("session_id"):
                s = sessions.http_session(env_id, body["session_id"], md)
            else:
                s = await sessions.open(env_id, md, opts.get("config"), opts.get("action_format") or "", http=True)
            _, payload = await sessions.reset(s, md, body)
        except OpenEnvError as e:
            raise _as_api(e) from None
        return payload

    @app.post(base + "/step")
    async def openenv_step(env_id: str, request: Request):
        body = await _json_body(request, limits)
        md = forwarded(request.headers)
        s = sessions.http_session(env_id, body.get("session_id"), md)
        if "action" not in body:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, 'a step is {"action": {"message": "..."}, "session_id": ...}')
        try:
            return await sessions.step(s, md, body["action"])
        except OpenEnvError as e:
            raise _as_api(e) from None

    @app.get(base + "/state")
    async def openenv_state(env_id: str, request: Request, session_id: str = ""):
        s = sessions.http_session(env_id, session_id, forwarded(request.headers))
        s.last_used = time.monotonic()
        return s.state()

    @app.post(base + "/close")
    async def openenv_close(env_id: str, request: Request):
        body = await _json_body(request, limits)
        md = forwarded(request.headers)
        s = sessions.http_session(env_id, body.get("session_id"), md)
        await sessions.close(s, md)
        return {"session_id": s.session_id, "closed": True}

    @app.get(base + "/health")
    async def openenv_health(env_id: str, request: Request):
        await gateway.serving(env_id, forwarded(request.headers))
        return {"status": "healthy"}

    @app.get(base + "/schema")
    async def openenv_schema(env_id: str, request: Request):
        sp = await spec(env_id, forwarded(request.headers))
        schema = copy.deepcopy(_SCHEMA)
        schema["action"]["properties"]["message"]["description"] = (
            f"The agent's whole answer in the session's action format (default {sp.default_action_format}; "
            f"also {', '.join(sp.action_formats)}). {sp.action_space}").strip()
        return schema

    @app.get(base + "/metadata")
    async def openenv_metadata(env_id: str, request: Request):
        sp = await spec(env_id, forwarded(request.headers))
        return {"name": sp.env_id, "description": sp.description, "readme_content": sp.system_prompt,
                "version": __version__, "author": "envserve", "documentation_url": None}

    return sessions
