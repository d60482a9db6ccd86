"""The Open Reward Standard (ORS) door of the facade: every env the replicas serve as an ORS
environment, at the facade's root (ORS clients join their paths to the server's root).

  GET  /list_environments, /{env}/splits, /{env}/tools      what is served, its splits, its one tool
  POST /{env}/tasks | num_tasks | task | task_range         a split's tasks (ListTasks underneath)
  POST /create_session (SSE), /create, /ping, /delete, /delete_session
  GET  /{env}/prompt, /{env}/task_tools;  POST /{env}/call (SSE)

A task is {task_id, seed, split, description, task_type, parameters}; /create takes one (its
task_id starts the session) or a split and index. The tool is `act(action)`: one Step with the
action as the session's answer; its ToolOutput carries the step's reward inline, `finished` when
the episode ended (done or out of turns), and success, turn and reward components as metadata.
Credentials: ORS clients send `X-API-Key`, taken as the bearer token every call forwards. An ORS
session is its opener's, checked on every call as the replicas check theirs; the sessions live in
the same bounded, idle-reclaimed store as OpenEnv's HTTP sessions (web/openenv.py).
"""
from __future__ import annotations

import base64
import hmac
import json
import secrets
import time
from typing import Any, AsyncIterator

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from envserve.client import json_field
from envserve.v1 import envserve_pb2 as pb

from .gateway import ApiError, Gateway, forwarded
from .limits import HTTP_STATUS, HttpLimits, read_json_body
from .openenv import OpenEnvError, OpenEnvSessions, Session

TOOL = "act"
# A whole split in one /tasks answer at most; larger splits page with num_tasks + task/task_range.
MAX_LISTED_TASKS = 10_000
# Tasks one /task_range answer holds at most.
MAX_RANGE = 1_000
# The action format ORS sessions are opened with: the tool's argument is the answer itself.
ACTION_FORMAT = "no_think"


class OrsError(Exception):
    """An ORS call's failure: ORS clients read `detail`; the facade's `code` and `message` come along
    where the failure has a gRPC code."""

    def __init__(self, status: int, detail: str, code: grpc.StatusCode | None = None):
        super().__init__(detail)
        self.status, self.detail, self.code = status, detail, code


def _http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def split_type(name: str) -> str:
    """ORS's split kinds: train, validation or test, read from an envserve split's name."""
    lowered = name.lower()
    if lowered.startswith("train"):
        return "train"
    if "valid" in lowered or lowered in ("dev", "val"):
        return "validation"
    return "test"


def _task(t: pb.Task) -> dict[str, Any]:
    return {"task_id": t.task_id, "seed": t.seed, "split": t.split, "description": t.description,
            "task_type": t.task_type, "parameters": json_field(t, "parameters")}


def _blocks(text: str, obs: pb.Observation) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
    blocks += [{"type": "image", "mimeType": "image/png", "data": base64.b64encode(im.png).decode("ascii")}
               for im in obs.images]
    return blocks


def _sse(events: list[tuple[str, str]]) -> StreamingResponse:
    async def stream() -> AsyncIterator[bytes]:
        for event, data in events:
            lines = "".join(f"data: {line}\n" for line in (data.split("\n") if data else [""]))
            yield f"event: {event}\n{lines}\n".encode()
    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class OrsSession:
    __slots__ = ("session", "prompt", "first", "last_call", "last_result")

    def __init__(self, session: Session, prompt: str, first: pb.StepResult):
        self.session, self.prompt, self.first = session, prompt, first
        self.last_call, self.last_result = "", ""   # a call's id and answer, for a client reconnecting


def mount_ors(app: FastAPI, gateway: Gateway, idle_seconds: float = 300.0,
              limits: HttpLimits | None = None) -> OpenEnvSessions:
    limits = limits or HttpLimits()
    store = OpenEnvSessions(gateway, idle_seconds, limits)
    ors: dict[str, OrsSession] = {}     # ORS session id -> its envserve session

    def credentials(request: Request) -> tuple:
        key = request.headers.get("x-api-key")
        if key and "authorization" not in request.headers:
            if not key.isascii() or not key.isprintable():
                raise OrsError(401, "X-API-Key must be printable ASCII")
            return (("authorization", f"Bearer {key}"),)
        return forwarded(request.headers)

    def sid_of(request: Request) -> str:
        sid = (request.headers.get("x-session-id") or "").strip()
        if not sid:
            raise OrsError(400, "X-Session-ID header is required")
        return sid

    def held(request: Request, md: tuple, env_id: str | None = None) -> OrsSession:
        """The caller's ORS session the request names: unknown, reclaimed or another token's are refused."""
        sid = sid_of(request)
        o = ors.get(sid)
        if o is not None and store.http_sessions.get(o.session.session_id) is not o.session:
            del ors[sid]    # reclaimed after idling, or closed
            o = None
        if o is None:
            raise OrsError(404, f"no ORS session {sid[:64]!r} here: never created, deleted, or reclaimed "
                                f"after {idle_seconds:g} s without a call")
        caller = gateway.owner(md)
        if o.session.owner and not hmac.compare_digest(o.session.owner, caller):
            raise OrsError(401 if not caller else 403, "this ORS session belongs to another token")
        if env_id is not None and o.session.env_id != env_id:
            raise OrsError(400, f"this session plays {o.session.env_id!r}, not {env_id!r}")
        o.session.last_used = time.monotonic()
        return o

    async def body(request: Request) -> dict:
        data = await read_json_body(request, limits)
        if not isinstance(data, dict):
            raise OrsError(400, "the body must be a JSON object")
        return data

    async def split_of(env_id: str, md: tuple, data: dict) -> pb.Split:
        name = data.get("split")
        spec = await gateway.spec(env_id, md)
        for s in spec.splits:
            if s.name == name:
                return s
        raise OrsError(400, f"Invalid split {str(name)[:64]!r}; {env_id} has {[s.name for s in spec.splits]}")

    async def tasks(env_id: str, md: tuple, split: str, start: int, stop: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        token = str(start) if start else ""
        r = await gateway.serving(env_id, md)
        stub = gateway.table.stubs(r[0]).env
        while len(out) < stop - start:
            page = await stub.ListTasks(pb.ListTasksRequest(env_id=env_id, split=split, page_size=min(
                MAX_RANGE, stop - start - len(out)), page_token=token), timeout=gateway.timeout, metadata=md)
            out += [_task(t) for t in page.tasks]
            token = page.next_page_token
            if not token or not page.tasks:
                break
        return out

    def index(value: Any, what: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OrsError(400, f"{what} must be a whole number >= 0, got {value!r}")
        return value

    @app.exception_handler(OrsError)
    async def _ors_error(request, e: OrsError):
        extra = {"code": e.code.name, "message": e.detail} if e.code is not None else {}
        return JSONResponse({"detail": e.detail, **extra}, status_code=e.status)

    def guarded(fn):
        """ORS clients read an error's `detail`: envserve's own errors are given that shape here."""
        import functools

        @functools.wraps(fn)
        async def run(*args, **kwargs):
            try:
                return await fn(*args, **kwargs)
            except ApiError as e:
                raise OrsError(e.http_status or _http_status(e.code), e.message, e.code) from None
            except OpenEnvError as e:
                raise OrsError(_http_status(e.status), e.message, e.status) from None
            except grpc.RpcError as e:
                raise OrsError(_http_status(e.code()), e.details() or e.code().name, e.code()) from None
        return run

    async def served(md: tuple) -> list[str]:
        return sorted({e for r in await gateway.table.replicas(md) for e in r.envs})

    async def task_at(env_id: str, md: tuple, data: dict) -> dict[str, Any]:
        split = await split_of(env_id, md, data)
        i = index(data.get("index"), "index")
        if i >= split.num_tasks:
            raise OrsError(400, f"Invalid index {i}: split {split.name} holds {split.num_tasks} tasks")
        return (await tasks(env_id, md, split.name, i, i + 1))[0]

    # -- what is served -------------------------------------------------------------------------------
    @app.get("/list_environments")
    @guarded
    async def list_environments(request: Request):
        return await served(credentials(request))

    @app.get("/{env_id}/splits")
    @guarded
    async def splits(env_id: str, request: Request):
        spec = await gateway.spec(env_id, credentials(request))
        return [{"name": s.name, "type": split_type(s.name)} for s in spec.splits]

    def tool_specs(spec: pb.EnvSpec) -> dict:
        return {"tools": [{"name": TOOL, "description": f"Take one action in {spec.env_id}: {spec.action_space}",
                           "input_schema": {"type": "object", "required": ["action"], "additionalProperties": False,
                                            "properties": {"action": {"type": "string", "description": (
                                                f"the action, e.g. one of: {spec.action_space}")}}}}]}

    @app.get("/{env_id}/tools")
    @guarded
    async def tools(env_id: str, request: Request):
        return tool_specs(await gateway.spec(env_id, credentials(request)))

    # -- tasks ---------------------------------------------------------------------------------------
    @app.post("/{env_id}/tasks")
    @guarded
    async def list_all(env_id: str, request: Request):
        md = credentials(request)
        split = await split_of(env_id, md, await body(request))
        if split.num_tasks > MAX_LISTED_TASKS:
            raise OrsError(400, f"split {split.name} holds {split.num_tasks} tasks, more than one list answers "
                                f"({MAX_LISTED_TASKS}): use the index-based API (num_tasks + task / task_range)")
        return {"tasks": await tasks(env_id, md, split.name, 0, split.num_tasks), "env_name": env_id}

    @app.post("/{env_id}/num_tasks")
    @guarded
    async def num_tasks(env_id: str, request: Request):
        split = await split_of(env_id, credentials(request), await body(request))
        return {"num_tasks": split.num_tasks}

    @app.post("/{env_id}/task")
    @guarded
    async def one_task(env_id: str, request: Request):
        md = credentials(request)
        return {"task": await task_at(env_id, md, await body(request))}

    @app.post("/{env_id}/task_range")
    @guarded
    async def task_range(env_id: str, request: Request):
        md = credentials(request)
        data = await body(request)
        split = await split_of(env_id, md, data)
        start = index(data.get("start") or 0, "start")
        stop = split.num_tasks if data.get("stop") is None else min(index(data["stop"], "stop"), split.num_tasks)
        if stop - start > MAX_RANGE:
            raise OrsError(400, f"at most {MAX_RANGE} tasks a range; asked for {stop - start}")
        return {"tasks": await tasks(env_id, md, split.name, start, stop) if stop > start else []}

    # -- sessions ------------------------------------------------------------------------------------
    @app.post("/create_session")
    async def create_session():
        return _sse([("task_id", secrets.token_urlsafe(24)), ("end", "")])

    @app.post("/delete_session")
    async def delete_session(request: Request):
        return {"sid": sid_of(request)}

    @app.post("/create")
    @guarded
    async def create(request: Request):
        md = credentials(request)
        data = await body(request)     # first: a body over the limit is refused as such
        sid = sid_of(request)
        if sid in ors and store.http_sessions.get(ors[sid].session.session_id) is ors[sid].session:
            raise OrsError(400, "Session already exists")
        env_id = data.get("env_name")
        if env_id is None:
            envs = await served(md)
            if not envs:
                raise OrsError(503, "no replica serves any environment")
            env_id = envs[0]
        if not isinstance(env_id, str):
            raise OrsError(400, f"env_name must be a string, got {env_id!r}")
        spec_ = data.get("task_spec")
        if (spec_ is None) == (data.get("split") is None or data.get("index") is None):
            raise OrsError(400, "Provide either task_spec or both split and index, not both/neither")
        if spec_ is not None:
            if not isinstance(spec_, dict) or not isinstance(spec_.get("task_id"), str):
                raise OrsError(400, "task_spec must be a task of this environment's list: it names its task_id")
            task_id = spec_["task_id"]
        else:
            task_id = (await task_at(env_id, md, data))["task_id"]
        for gone in [k for k, o in ors.items() if store.http_sessions.get(o.session.session_id) is not o.session]:
            del ors[gone]
        s = await store.open(env_id, md, None, ACTION_FORMAT, http=True)
        try:
            first = await store.call(s, md, reset=pb.ResetItem(session_id=s.session_id, task_id=task_id))
        except BaseException:
            await store.close(s, md)
            raise
        ors[sid] = OrsSession(s, s.system_prompt, first)
        return {"sid": sid}

    @app.post("/ping")
    @guarded
    async def ping(request: Request):
        held(request, credentials(request))
        return {"status": "ok"}

    @app.post("/delete")
    @guarded
    async def delete(request: Request):
        md = credentials(request)
        o = held(request, md)
        ors.pop(sid_of(request), None)
        await store.close(o.session, md)
        return {"sid": sid_of(request)}

    @app.get("/{env_id}/prompt")
    @guarded
    async def prompt(env_id: str, request: Request):
        o = held(request, credentials(request), env_id)
        return _blocks(f"{o.prompt}\n\n{o.first.observation.text}", o.first.observation)

    @app.get("/{env_id}/task_tools")
    @guarded
    async def task_tools(env_id: str, request: Request):
        md = credentials(request)
        held(request, md, env_id)
        return tool_specs(await gateway.spec(env_id, md))

    @app.post("/{env_id}/call")
    @guarded
    async def call(env_id: str, request: Request):
        md = credentials(request)
        data = await body(request)
        o = held(request, md, env_id)
        call_id = data.get("task_id")
        if call_id is not None:
            # A client reconnecting to a call it started: its answer again, never a second step.
            if isinstance(call_id, str) and call_id and hmac.compare_digest(call_id, o.last_call):
                return _sse([("task_id", call_id), ("end", o.last_result)])
            return _sse([("error", "unknown task_id")])
        name, args = data.get("name"), data.get("input")
        if name != TOOL:
            result = {"ok": False, "error": f"unknown tool {str(name)[:64]!r}; this environment's tool is {TOOL!r}"}
        elif not isinstance(args, dict) or not isinstance(args.get("action"), str):
            result = {"ok": False, "error": f"{TOOL} takes {{\"action\": \"...\"}}, got {json.dumps(args)[:200]}"}
        else:
            try:
                r = await store.call(o.session, md, step=f"<answer>{args['action']}</answer>")
            except OpenEnvError as e:
                result = {"ok": False, "error": e.message}
            else:
                text = f"{r.feedback}\n\n{r.observation.text}" if r.feedback else r.observation.text
                result = {"ok": True, "output": {
                    "blocks": _blocks(text, r.observation), "reward": r.reward, "finished": r.done or r.truncated,
                    "metadata": {"success": r.success, "truncated": r.truncated, "turn": r.turn,
                                 "valid_action": r.action_valid, "reward_components": dict(r.reward_components)}}}
        o.last_call, o.last_result = secrets.token_urlsafe(12), json.dumps(result)
        return _sse([("task_id", o.last_call), ("end", o.last_result)])

    return store
