"""Environments as MCP tools: the Model Context Protocol's streamable-HTTP transport (the official
`mcp` SDK's), so agent runtimes that speak MCP (OpenAI Agents SDK, LangGraph, Claude, ...) play
envserve sessions as tool calls.

Each environment is an MCP endpoint of its own: http(s)://HOST:PORT/mcp/<env_id>.

- One MCP session is one envserve session: opened on the first tool call (or `reset`), closed
  when the MCP session ends (the client's DELETE, or the transport closing), and reclaimed with
  it after `idle_seconds` without a request. At most `max_sessions` MCP sessions live at once;
  opening one more is refused (HTTP 503 with a JSON-RPC error saying so).
- Tools, from the env's spec: `step(action)` (one turn: the action text, what the env's prompt
  puts inside <answer>...</answer>), `reset(seed?, task_id?, split?, config?)` (a config unlike
  the session's opens a new envserve session with it, as envserve fixes a config at Open), and,
  where the operator turns ground truth on, `state(turn?)` (ReadState). A step's result is its
  observation as text (and PNG images, as MCP image content), its reward, done, truncated,
  success, turn, action_valid and feedback in `structuredContent`. A malformed action is the
  env's invalid action with feedback; a failed call is a tool error (isError) naming its gRPC code.
- Credentials: `Authorization: Bearer <token>` is forwarded as the envserve token on every call.
  An MCP session belongs to the token that opened it: the SDK's session manager answers any other
  token (or none) as if the session did not exist (404), so no token uses another's session id.
- Cancelling an MCP request (notifications/cancelled) cancels its handler, and with it the gRPC
  call it is waiting on (behind the facade the call is the session's own, so the replica stops
  the item; a replica's own endpoint has no call between, and the step it sent runs to its end).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
import grpc

import mcp.types as types
from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
from mcp.server.auth.provider import AccessToken
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import McpError

from envserve import __version__
from envserve.client import state_dict
from envserve.client._requests import reset_item
from envserve.common.http import MCP_MAX_SESSIONS
from envserve.rpc.auth import owner_of
from envserve.rpc.values import status_code
from envserve.v1 import envserve_pb2 as pb

from .gateway import ApiError, bearer_token, forwarded
from .limits import HTTP_STATUS, HttpLimits
from .openenv import OpenEnvError, OpenEnvSessions, Session

log = logging.getLogger("envserve.web.mcp")
# The SDK's server logs two INFO lines per request ("Processing request of type ..."): under a
# replica's INFO logging that was a quarter of the endpoint's CPU at 64 sessions (py-spy).
logging.getLogger("mcp.server.lowlevel.server").setLevel(logging.WARNING)

PREFIX = "/mcp"
# Tool arguments are the answer itself: the session's format wraps it in <answer> tags.
ACTION_FORMAT = "no_think"
# Closing an ended MCP session's envserve session may wait this long at most (a replica gone away).
CLOSE_SECONDS = 10.0
_SESSION_GONE = (grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.DATA_LOSS.value[0])

STEP_OUTPUT_SCHEMA = {
    "type": "object",
    "properties": {
        "reward": {"type": "number"}, "done": {"type": "boolean"}, "truncated": {"type": "boolean"},
        "success": {"type": "boolean"}, "turn": {"type": "integer"}, "episode": {"type": "integer"},
        "action_valid": {"type": "boolean"}, "feedback": {"type": "string"},
        "reward_components": {"type": "object", "additionalProperties": {"type": "number"}},
        "session_id": {"type": "string"},
    },
    "required": ["reward", "done", "truncated", "success", "turn", "action_valid", "feedback"],
}
STATE_OUTPUT_SCHEMA = {
    "type": "object",
    "properties": {"turn": {"type": "integer"}, "episode": {"type": "integer"}, "state": {"type": "object"},
                   "relations": {"type": "array", "items": {"type": "string"}}},
    "required": ["turn", "episode", "state", "relations"],
}


@dataclass(frozen=True)
class McpSettings:
    """idle_seconds: an MCP session without a request for this long ends, and its envserve
    session closes. max_sessions: MCP sessions held at once. ground_truth: offer the `state` tool
    (the replica still decides per call whether the caller's token may read the session)."""
    idle_seconds: float = 300.0
    max_sessions: int = MCP_MAX_SESSIONS
    ground_truth: bool = False

    def __post_init__(self):
        if not self.idle_seconds > 0:
            raise ValueError(f"idle_seconds must be > 0, got {self.idle_seconds}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")


class McpSessionState:
    """What one MCP session holds: its env, and its envserve session once a tool call opened it."""
    __slots__ = ("env_id", "session", "lock")

    def __init__(self):
        self.env_id: str | None = None
        self.session: Session | None = None
        self.lock = asyncio.Lock()   # one open at a time, when a client sends calls concurrently


class ToolFailure(Exception):
    """A tool call's failure, answered as an MCP tool error: `CODE: message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _failure(e: Exception) -> ToolFailure:
    if isinstance(e, ToolFailure):
        return e
    if isinstance(e, OpenEnvError):
        return ToolFailure(e.status, e.message)
    if isinstance(e, ApiError):
        return ToolFailure(e.code, e.message)
    if isinstance(e, grpc.RpcError):
        return ToolFailure(e.code(), e.details() or e.code().name)
    raise e


def _error_result(f: ToolFailure) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=f"{f.code.name}: {f.message}")],
                                isError=True)


def _result(s: Session, r: pb.StepResult, prefix: str = "") -> types.CallToolResult:
    obs = r.observation
    text = f"{r.feedback}\n\n{obs.text}" if r.feedback and r.feedback not in obs.text else obs.text
    content: list[Any] = [types.TextContent(type="text", text=prefix + text)]
    content += [types.ImageContent(type="image", mimeType="image/png", data=base64.b64encode(im.png).decode("ascii"))
                for im in obs.images]
    structured = {"reward": r.reward, "done": r.done, "truncated": r.truncated, "success": r.success,
                  "turn": r.turn, "episode": r.episode, "action_valid": r.action_valid, "feedback": r.feedback,
                  "reward_components": dict(r.reward_components), "session_id": s.session_id}
    return types.CallToolResult(content=content, structuredContent=structured, isError=False)


def _tools(spec: pb.EnvSpec, ground_truth: bool) -> list[types.Tool]:
    per_turn = (f" Up to {spec.max_actions_per_turn} actions in one turn, separated by commas."
                if spec.max_actions_per_turn > 1 else "")
    tools = [
        types.Tool(
            name="step",
            description=(f"Take one turn in {spec.env_id}. {spec.description}\nActions: {spec.action_space}."
                         f"{per_turn} Returns the next observation; reward, done, success and whether the action "
                         "was valid (with the env's feedback) are in the structured result.").strip(),
            inputSchema={"type": "object", "required": ["action"], "additionalProperties": False,
                         "properties": {"action": {"type": "string", "description": (
                             f"the turn's action, e.g. one of: {spec.action_space}")}}},
            outputSchema=STEP_OUTPUT_SCHEMA),
        types.Tool(
            name="reset",
            description=(f"Start a new {spec.env_id} episode and return its first observation and the rules. "
                         "Optional: a seed, a task_id or split of the env's tasks, and config overrides "
                         "(a JSON object, e.g. {\"render_image\": true} for image observations)."),
            inputSchema={"type": "object", "additionalProperties": False, "properties": {
                "seed": {"type": "integer", "minimum": 0, "maximum": 2 ** 63 - 1},
                "task_id": {"type": "string"}, "split": {"type": "string"},
                "config": {"type": "object", "description": "config overrides; their JSON Schema is the "
                                                            "env's config_schema (GetSpec)"}}},
            outputSchema=STEP_OUTPUT_SCHEMA),
    ]
    if ground_truth:
        tools.append(types.Tool(
            name="state",
            description=f"The ground truth of this {spec.env_id} session (positions, relations) at a turn "
                        "(default: the latest). Where the replica lets this token read it.",
            inputSchema={"type": "object", "additionalProperties": False,
                         "properties": {"turn": {"type": "integer", "description": "negative counts back "
                                                                                  "from the latest"}}},
            outputSchema=STATE_OUTPUT_SCHEMA))
    return tools


def _action_text(action: str) -> str:
    # The spec's system prompt asks for <answer> tags; an agent that follows it is taken as it is.
    return action if "<answer>" in action else f"<answer>{action}</answer>"


def _reset_args(args: dict) -> dict:
    seed = args.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63):
        raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT, f"seed must be a whole number 0..2**63-1, got {seed!r}")
    for key in ("task_id", "split"):
        if args.get(key) is not None and not isinstance(args[key], str):
            raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT, f"{key} must be a string, got {args[key]!r}")
    config = args.get("config")
    if config is not None and not isinstance(config, dict):
        raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT, f"config must be a JSON object, got {config!r}")
    unknown = sorted(set(args) - {"seed", "task_id", "split", "config"})
    if unknown:
        raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT, f"reset takes seed, task_id, split and config; "
                                                            f"not {unknown}")
    return args


class McpDoor:
    """The MCP endpoint over a gateway (the facade's Gateway over replicas, or a replica's own
    LocalGateway): an ASGI app for PREFIX/{env_id}, run inside `async with door.run()`."""

    def __init__(self, gateway, settings: McpSettings | None = None, limits: HttpLimits | None = None):
        self.gateway = gateway
        self.settings = settings or McpSettings()
        self.limits = limits or HttpLimits()
        self.store = OpenEnvSessions(gateway, self.settings.idle_seconds, self.limits)
        self.live: set[McpSessionState] = set()
        self.server = Server("envserve", version=__version__, lifespan=self._session_life,
                             instructions="Each tool call plays this endpoint's environment: reset starts an "
                                          "episode, step takes a turn.")
        self.server.list_tools()(self._list_tools)
        self.server.call_tool(validate_input=False)(self._call_tool)
        # Replies as plain JSON, not an SSE stream per POST: a tool sends no progress to stream,
        # and a one-event stream cost a quarter of a step's time (bench/mcp_tools.py).
        self.manager = StreamableHTTPSessionManager(
            self.server, json_response=True, session_idle_timeout=self.settings.idle_seconds,
            max_sessions=self.settings.max_sessions,
            max_request_body_size=self.limits.max_body_bytes)

    def run(self):
        """The session manager's life: sessions are served inside it, and end with it."""
        return self.manager.run()

    # -- HTTP ---------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import Request
        request = Request(scope, receive)
        env_id = scope.get("path_params", {}).get("env_id", "")
        try:
            md = forwarded(request.headers)
            token = bearer_token(md)
            if token is not None:
                # The manager keeps each session's opener and answers anyone else 404: the opener
                # is the token's digest, as the replicas keep it.
                scope["user"] = AuthenticatedUser(AccessToken(token="", client_id=owner_of(token), scopes=[]))
            if request.method == "POST" and "mcp-session-id" not in request.headers:
                # A new MCP session: room for it, and an env this token may play, first.
                if len(self.live) >= self.settings.max_sessions:
                    raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"this endpoint holds {self.settings.max_sessions} MCP sessions, its limit "
                                   "(--mcp-max-sessions): end one (DELETE) or wait for an idle one to be reclaimed",
                                   http_status=503)
                await self.gateway.serving(env_id, md)
        except (ApiError, grpc.RpcError) as e:
            f = _failure(e)
            status = e.http_status if isinstance(e, ApiError) and e.http_status else HTTP_STATUS.get(f.code, 500)
            return await _jsonrpc_error(f, status)(scope, receive, send)
        await self.manager.handle_request(scope, receive, send)

    # -- one MCP session's life -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _session_life(self, _server):
        state = McpSessionState()
        self.live.add(state)
        try:
            yield state
        finally:
            self.live.discard(state)
            s = state.session
            state.session = None
            if s is not None:
                # The session ends however its MCP session did (DELETE, idle, the endpoint stopping):
                # shielded, so a cancelled server task still closes it on the replica.
                with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_SECONDS):
                    await self.store.close(s, s.reap_md)

    def _context(self) -> tuple[McpSessionState, str, tuple]:
        ctx = self.server.request_context
        request = ctx.request
        env_id = request.path_params.get("env_id", "") if request is not None else ""
        md = forwarded(request.headers) if request is not None else ()
        return ctx.lifespan_context, env_id, md

    async def _list_tools(self) -> list[types.Tool]:
        _, env_id, md = self._context()
        try:
            spec = await self.gateway.spec(env_id, md)
        except (ApiError, grpc.RpcError) as e:
            f = _failure(e)
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS, message=f"{f.code.name}: {f.message}")) from None
        return _tools(spec, self.settings.ground_truth and self._reads_state())

    def _reads_state(self) -> bool:
        return hasattr(self.gateway, "table") or hasattr(self.gateway, "read_state")

    async def _call_tool(self, name: str, args: dict) -> types.CallToolResult:
        try:
            state, env_id, md = self._context()
            if state.env_id is None:
                state.env_id = env_id
            elif state.env_id != env_id:
                raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"this MCP session plays {state.env_id!r}, not {env_id!r}: open a session at "
                                  f"{PREFIX}/{env_id}")
            if name == "step":
                action = args.get("action")
                if not isinstance(action, str) or set(args) - {"action"}:
                    raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT,
                                      f'step takes {{"action": "<text>"}}, got {json.dumps(args)[:200]}')
                prefix = ""
                if state.session is None:
                    prefix, _ = await self._open(state, env_id, md, {}, only_if_none=True)
                s = state.session
                r = await self._one(s, md, pb.StepRequest, pb.StepItem(session_id=s.session_id,
                                                                       action=_action_text(action)))
                return _result(s, r, prefix)
            if name == "reset":
                opts = _reset_args(args)
                if state.session is None or (opts.get("config") is not None and opts["config"] != state.session.config):
                    prefix, r = await self._open(state, env_id, md, opts)
                    return _result(state.session, r, prefix)
                s = state.session
                r = await self._one(s, md, pb.ResetRequest, _reset(s, opts))
                return _result(s, r)
            if name == "state" and self.settings.ground_truth and self._reads_state():
                return await self._state(state, env_id, md, args)
            raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT, f"unknown tool {str(name)[:64]!r}; this endpoint's "
                                                                f"tools: step, reset"
                                                                f"{', state' if self.settings.ground_truth else ''}")
        except Exception as e:  # noqa: BLE001 - a caller's failure is its tool error, anything else is raised
            return _error_result(_failure(e))

    async def _open(self, state: McpSessionState, env_id: str, md: tuple, opts: dict,
                    only_if_none: bool = False) -> tuple[str, pb.StepResult | None]:
        """Opens the MCP session's envserve session (again, with another config) and resets it;
        returns the rules to show ahead of the first observation, and the reset's result.
        only_if_none: a step's implicit open, skipped when a concurrent call opened it meanwhile."""
        async with state.lock:
            old = state.session
            if only_if_none and old is not None:
                return "", None
            config = opts.get("config") if opts.get("config") is not None else (old.config if old else None)
            s = await self.store.open(env_id, md, config, ACTION_FORMAT)
            try:
                r = await self._one(s, md, pb.ResetRequest, _reset(s, opts))
            except BaseException:
                await self.store.close(s, md)
                raise
            state.session = s
            if old is not None:
                await self.store.close(old, md)
        return (f"{s.system_prompt}\n\n" if s.system_prompt else ""), r

    async def _one(self, s: Session, md: tuple, request, item) -> pb.StepResult:
        """One step or reset of s. Behind the facade it is a call of its own, which a cancelled MCP
        request cancels; on a replica's own endpoint it goes through the replica's batcher."""
        s.last_used = time.monotonic()
        try:
            table = getattr(self.gateway, "table", None)
            if table is not None:
                stub = table.stubs(s.replica).env
                method = stub.Step if request is pb.StepRequest else stub.Reset
                resp = await method(request(items=[item]), timeout=self.gateway.timeout, metadata=md)
                r = resp.results[0]
            else:
                batcher = self.gateway.batcher(s.replica, md)
                r = await (batcher.step(item.session_id, item.action) if request is pb.StepRequest
                           else batcher.reset(item))
        except (ApiError, grpc.RpcError) as e:
            raise _failure(e) from None
        if r.status.code:
            raise ToolFailure(status_code(r.status.code), r.status.message or status_code(r.status.code).name)
        return r

    async def _state(self, state: McpSessionState, env_id: str, md: tuple, args: dict) -> types.CallToolResult:
        turn = args.get("turn")
        if (turn is not None and (isinstance(turn, bool) or not isinstance(turn, int) or not -2 ** 31 <= turn < 2 ** 31)) \
                or set(args) - {"turn"}:
            raise ToolFailure(grpc.StatusCode.INVALID_ARGUMENT, f'state takes {{"turn": <int>}} or nothing, '
                                                                f"got {json.dumps(args)[:200]}")
        s = state.session
        if s is None:
            raise ToolFailure(grpc.StatusCode.FAILED_PRECONDITION, "no episode yet: call reset (or step) first")
        req = pb.ReadStateRequest(session_id=s.session_id)
        if turn is not None:
            req.turn = turn
        try:
            table = getattr(self.gateway, "table", None)
            if table is not None:
                r = await self.gateway.session_replica(s.session_id, md)
                got = await table.stubs(r).state.ReadState(req, timeout=self.gateway.timeout, metadata=md)
            else:
                got = await self.gateway.read_state(req, md)
        except (ApiError, grpc.RpcError) as e:
            raise _failure(e) from None
        truth = state_dict(got)
        structured = {"turn": got.turn, "episode": got.episode, "state": truth, "relations": list(got.relations)}
        text = "\n".join(got.relations) or json.dumps(truth)
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)],
                                    structuredContent=structured, isError=False)


def _reset(s: Session, opts: dict) -> pb.ResetItem:
    return reset_item(s.session_id, opts.get("seed"), opts.get("task_id") or "", opts.get("split") or "")


def _jsonrpc_error(f: ToolFailure, status: int):
    from starlette.responses import Response
    body = types.JSONRPCError(jsonrpc="2.0", id="server-error",
                              error=types.ErrorData(code=types.INVALID_REQUEST, message=f"{f.code.name}: {f.message}"))
    return Response(body.model_dump_json(by_alias=True, exclude_none=True), status_code=status,
                    media_type="application/json")


def mount_mcp(routes: list, door: McpDoor) -> None:
    """Adds the door's route, PREFIX/{env_id}, to a Starlette route list (a plain ASGI endpoint:
    no redirect to a trailing slash, which MCP clients do not follow with their POST body)."""
    from starlette.routing import Route
    routes.append(Route(PREFIX + "/{env_id}", endpoint=door, methods=["GET", "POST", "DELETE"]))


def create_mcp_app(gateway, settings: McpSettings | None = None, limits: HttpLimits | None = None):
    """A Starlette app serving the MCP door (and /healthz), its session manager run by the app's
    lifespan; on stop, the gateway closes too."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from .limits import HttpGuard
    limits = limits or HttpLimits()
    door = McpDoor(gateway, settings, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with door.run():
            yield
        await gateway.close()

    async def healthz(request):
        return JSONResponse({"status": "ok"})

    routes: list = [Route("/healthz", healthz)]
    mount_mcp(routes, door)
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[Middleware(HttpGuard, limits=limits)])
    app.state.limits = limits
    app.state.mcp = door
    return app
