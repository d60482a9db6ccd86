"""The HTTP/JSON facade over EnvService, StateService and MonitorService, and the live page.

Bodies and replies are the protocol messages in protobuf's JSON mapping (lowerCamelCase names;
snake_case is accepted too; bytes such as PNG images are base64), sent as application/json. A
session opened here is an ordinary gRPC session on its replica, so both APIs can drive it, with
the caller's own token (the replica checks it). A call that fails as a whole answers the HTTP
status of its gRPC code with {"code": "NOT_FOUND", "message": ...}; inside batches (reset, step,
close) each item keeps its own status, as over gRPC. What a request may be (its size, its
Content-Type, its JSON) is limits.py's.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from contextlib import asynccontextmanager
from typing import Any

import grpc
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from google.protobuf import json_format
from starlette.exceptions import HTTPException as StarletteHTTPException

from envserve.client._requests import get_state_request
from envserve.directory import ReplicaInfo
from envserve.rpc.auth import owner_of
from envserve.v1 import envserve_pb2 as pb

from .gateway import ApiError, Gateway, bearer_token, forwarded, step_failure
from .limits import HttpGuard, HttpLimits, error_json, error_response, read_json_body
from .page import PAGE
from .routing import ReplicaTable

INT32 = 2 ** 31  # the protocol's int32 fields (turn, episode, trial, limit)
# For errors that start on the HTTP side (unknown route, wrong method).
_CODE_OF_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                 403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                 405: grpc.StatusCode.UNIMPLEMENTED, 409: grpc.StatusCode.ABORTED,
                 413: grpc.StatusCode.RESOURCE_EXHAUSTED, 415: grpc.StatusCode.INVALID_ARGUMENT,
                 429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def to_json(message) -> dict:
    # Every field, defaults included: a JSON client should read done=false, not a missing key.
    try:
        return json_format.MessageToDict(message, always_print_fields_with_no_presence=True)
    except TypeError:  # protobuf < 5.26
        return json_format.MessageToDict(message, including_default_value_fields=True)


async def parse_body(request: Request, message, limits: HttpLimits):
    data = await read_json_body(request, limits)
    if not isinstance(data, dict):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"body must be a JSON object ({message.DESCRIPTOR.name}), got {type(data).__name__}")
    try:
        return json_format.ParseDict(data, message)
    except (json_format.ParseError, ValueError, TypeError, OverflowError) as e:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"not a {message.DESCRIPTOR.name}: {e}") from None


def _forwarded(request: Request) -> tuple:
    """The caller's credentials, passed on as gRPC metadata."""
    return forwarded(request.headers)


def add_error_handlers(app: FastAPI) -> None:
    """Errors as {"code", "message"} JSON with the HTTP status of their gRPC code."""
    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return error_json(e)

    @app.exception_handler(grpc.RpcError)
    async def _rpc_error(request, e: grpc.RpcError):
        return error_response(e.code(), e.details() or e.code().name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in e.errors())
        return error_response(grpc.StatusCode.INVALID_ARGUMENT, problems or "invalid request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = _CODE_OF_HTTP.get(e.status_code, grpc.StatusCode.UNKNOWN)
        return JSONResponse({"code": code.name, "message": str(e.detail)}, status_code=e.status_code)


def create_app(directory_url: str = "", replicas=(), root_certificates: bytes | None = None,
               use_external: bool = False, monitor_token: str | None = None, timeout: float = 60.0,
               refresh_seconds: float = 1.0, openenv: bool = True, openenv_idle_seconds: float = 300.0,
               limits: HttpLimits | None = None, ors: bool = True) -> FastAPI:
    """monitor_token: the token that shows every replica's sessions on the live page: /v1/live
    then needs a bearer token, and a caller who presents this one is shown every session (the
    facade asks MonitorService with it), one who presents another token is shown what the
    replicas show that token, and a request without a token is refused (401). Without it,
    /v1/live passes on whatever the caller sends, as every route does.
    openenv: also serve OpenEnv's protocol under /openenv/<env_id>/ (openenv.py); sessions opened
    there over plain HTTP (no WebSocket) are closed after openenv_idle_seconds without a call.
    ors: also serve the Open Reward Standard's routes at the root (ors.py), its sessions held and
    reclaimed like OpenEnv's HTTP ones.
    limits: what a request may be (limits.HttpLimits: body size, JSON depth, ...)."""
    limits = limits or HttpLimits()
    table = ReplicaTable(directory_url, replicas, root_certificates, use_external, refresh_seconds, timeout)
    gateway = Gateway(table, timeout, limits.token_cache_entries)

    @asynccontextmanager
    async def lifespan(app):
        yield
        if app.state.openenv is not None:
            await app.state.openenv.close_all()
        if app.state.ors is not None:
            await app.state.ors.close_all()
        await gateway.close()

    app = FastAPI(title="envserve", summary="HTTP/JSON facade over the envserve.v1 gRPC services",
                  lifespan=lifespan)
    app.state.replicas = table
    app.state.gateway = gateway
    app.state.limits = limits
    app.state.openenv = None
    if openenv:
        from .openenv import mount_openenv
        app.state.openenv = mount_openenv(app, gateway, idle_seconds=openenv_idle_seconds, limits=limits)
    app.state.ors = None
    if ors:
        from .ors import mount_ors
        app.state.ors = mount_ors(app, gateway, idle_seconds=openenv_idle_seconds, limits=limits)

    add_error_handlers(app)
    app.add_middleware(HttpGuard, limits=limits)

    # -- helpers ------------------------------------------------------------------------------------
    fan_out, session_replica = gateway.fan_out, gateway.session_replica

    async def batch(request: Request, message, method: str) -> dict:
        req = await parse_body(request, message, limits)
        md = _forwarded(request)
        items = list(req.items)

        async def call(r, indices):
            sub = type(req)(items=[items[i] for i in indices])
            resp = await getattr(table.stubs(r).env, method)(sub, timeout=timeout, metadata=md)
            return list(resp.results)
        results = await fan_out([it.session_id for it in items], md, call, step_failure)
        for r in results:
            r.status.SetInParent()  # JSON clients always find status.code (0 when the item succeeded)
        return to_json(pb.BatchResponse(results=results))

    # -- EnvService ---------------------------------------------------------------------------------
    @app.get("/v1/envs")
    async def list_envs(request: Request):
        """Every environment some replica serves (one spec each) and the replicas themselves."""
        md = _forwarded(request)
        await table.ask_again(md)
        replicas = await table.replicas(md)
        if not replicas and table.unasked():
            raise table.unasked()[0]
        replies = await asyncio.gather(*[table.stubs(r).env.ListEnvs(pb.ListEnvsRequest(), timeout=timeout,
                                                                     metadata=md) for r in replicas],
                                       return_exceptions=True)
        specs: dict[str, Any] = {}
        listed = []
        for r, rep in zip(replicas, replies):
            entry = _replica_json(table, r)
            if isinstance(rep, grpc.RpcError):
                entry["error"] = {"code": rep.code().name, "message": rep.details()}
            elif isinstance(rep, BaseException):
                raise rep
            else:
                for s in rep.envs:
                    specs.setdefault(s.env_id, to_json(s))
            listed.append(entry)
        errors = [rep for rep in replies if isinstance(rep, grpc.RpcError)]
        if errors and len(errors) == len(replies):
            raise errors[0]
        return {"envs": list(specs.values()), "replicas": listed}

    @app.get("/v1/envs/{env_id}")
    async def get_spec(env_id: str, request: Request):
        md = _forwarded(request)
        serving = await gateway.serving(env_id, md)
        return to_json(await table.stubs(serving[0]).env.GetSpec(pb.GetSpecRequest(env_id=env_id),
                                                                  timeout=timeout, metadata=md))

    @app.get("/v1/envs/{env_id}/tasks")
    async def list_tasks(env_id: str, request: Request, split: str = Query("", max_length=256),
                         page_size: int = Query(0, ge=0, lt=INT32), page_token: str = Query("", max_length=64)):
        """ListTasksRequest's fields as query parameters -> ListTasksResponse, from a replica serving
        the env (every replica of an env lists the same tasks)."""
        md = _forwarded(request)
        serving = await gateway.serving(env_id, md)
        req = pb.ListTasksRequest(env_id=env_id, split=split, page_size=page_size, page_token=page_token)
        return to_json(await table.stubs(serving[0]).env.ListTasks(req, timeout=timeout, metadata=md))

    @app.get("/v1/envs/{env_id}/task-stats")
    async def task_stats(env_id: str, request: Request, scope: str = Query("", max_length=256)):
        """GetTaskStats for the caller's token: a stats scope's finished episodes per task."""
        md = _forwarded(request)
        serving = await gateway.serving(env_id, md)
        return to_json(await table.stubs(serving[0]).env.GetTaskStats(
            pb.GetTaskStatsRequest(env_id=env_id, scope=scope), timeout=timeout, metadata=md))

    @app.post("/v1/sessions")
    async def open_sessions(request: Request):
        """OpenRequest -> OpenResponse, on the least-loaded replica serving the env (all sessions of
        one call on one replica, as a gRPC Open)."""
        req = await parse_body(request, pb.OpenRequest(), limits)
        _, resp = await gateway.open(req, _forwarded(request))
        return to_json(resp)

    @app.post("/v1/reset")
    async def reset(request: Request):
        return await batch(request, pb.ResetRequest(), "Reset")

    @app.post("/v1/step")
    async def step(request: Request):
        return await batch(request, pb.StepRequest(), "Step")

    @app.post("/v1/fork")
    async def fork(request: Request):
        req = await parse_body(request, pb.ForkRequest(), limits)
        md = _forwarded(request)
        r = await session_replica(req.session_id, md)
        return to_json(await table.stubs(r).env.Fork(req, timeout=timeout, metadata=md))

    @app.post("/v1/close")
    async def close(request: Request):
        req = await parse_body(request, pb.CloseRequest(), limits)
        statuses = await gateway.close_sessions(list(req.session_ids), _forwarded(request))
        return to_json(pb.CloseResponse(statuses=statuses))

    # -- StateService ---------------------------------------------------------------------------------
    @app.get("/v1/sessions/{session_id:path}/state")
    async def get_state(session_id: str, request: Request, turn: int = Query(-1, ge=-INT32, lt=INT32),
                        episode: int | None = Query(None, ge=-INT32, lt=INT32),
                        trial: int | None = Query(None, ge=-INT32, lt=INT32)):
        md = _forwarded(request)
        r = await session_replica(session_id, md)
        req = get_state_request(session_id, turn, episode, trial)
        return to_json(await table.stubs(r).state.ReadState(req, timeout=timeout, metadata=md))

    # -- MonitorService and the page ----------------------------------------------------------------
    @app.get("/v1/live")
    async def live(request: Request, env_id: str = "", limit: int = Query(100, lt=INT32), images: bool = True):
        """Each replica's live sessions with their latest turn (MonitorService.ListSessions)."""
        md = _forwarded(request)
        if monitor_token:
            presented = bearer_token(md)
            if presented is None:
                raise ApiError(grpc.StatusCode.UNAUTHENTICATED,
                               "the live sessions need a token: send 'Authorization: Bearer <token>' (the monitor "
                               "token shows every session, a session token its own)")
            # The monitor's own token goes out, however its header was spelled; any other as sent.
            if hmac.compare_digest(owner_of(presented), owner_of(monitor_token)):
                md = (("authorization", f"Bearer {monitor_token}"),)
        if limit < 0:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be >= 0, got {limit}")
        targets = table.watch_targets(await table.listed())
        req = pb.ListSessionsRequest(env_id=env_id, limit=limit, include_images=images)
        replies = await asyncio.gather(*[table.stubs_at(a, tls).monitor.ListSessions(req, timeout=timeout, metadata=md)
                                         for a, tls, _ in targets], return_exceptions=True)
        refused = {rep.code() for rep in replies if isinstance(rep, grpc.RpcError)}
        if replies and len(refused) == 1 and all(isinstance(rep, grpc.RpcError) for rep in replies) \
                and refused & {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}:
            raise replies[0]  # every replica refused the caller's token alike: the call's answer
        out = []
        for (address, _, info), rep in zip(targets, replies):
            entry = _replica_json(table, info) if info is not None else {
                "replicaId": "", "address": address, "envs": [], "draining": False, "capacity": 0, "liveSessions": None}
            if isinstance(rep, grpc.RpcError):
                entry.update(total=0, sessions=[], error={"code": rep.code().name, "message": rep.details()})
            elif isinstance(rep, BaseException):
                raise rep
            else:
                entry.update(replicaId=rep.replica_id, total=rep.total, sessions=[to_json(s) for s in rep.sessions])
            entry["replicaId"] = entry["replicaId"] or address  # unknown and unreachable: named by address
            out.append(entry)
        out.sort(key=lambda e: e["replicaId"])
        return {"replicas": out, "updatedUnix": time.time()}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE, headers={
            # The page runs only its own inline script and shows data: images; nothing else loads.
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'",
            "Cache-Control": "no-store"})

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    return app


def _replica_json(table: ReplicaTable, r: ReplicaInfo) -> dict:
    return {"replicaId": r.replica_id, "address": table.address_of(r), "envs": list(r.envs),
            "draining": r.draining, "capacity": r.capacity,
            "liveSessions": r.live_sessions if r.live_sessions >= 0 else None}
