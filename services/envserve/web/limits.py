"""What the HTTP fronts (the facade and a replica's own OpenEnv endpoint) accept from a caller
before anything reaches a session, in one place: bodies read up to a limit while they arrive,
JSON only under a JSON Content-Type, finite numbers and a bounded nesting depth, and bearer
tokens over plain HTTP only from this machine.

Every refusal is the facade's {"code", "message"} JSON (an OpenEnv error message on a socket),
with the HTTP status of its gRPC code, or 413 and 415 where HTTP has a closer word.
"""
from __future__ import annotations

import ipaddress
import json
import math
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.responses import JSONResponse

from envserve.common.errors import ApiError
# Defaults of the operator's flags (envserve web, and a replica's --openenv-port).
from envserve.common.http import MAX_BODY_BYTES, MAX_JSON_DEPTH, OPENENV_MAX_HTTP_SESSIONS, TOKEN_CACHE_ENTRIES

try:  # several times faster than json on a step's message; refuses NaN, Infinity and 1e400 itself
    import orjson
    _loads = orjson.loads
except ImportError:  # pragma: no cover - without the web extra's orjson
    orjson = None
    _loads = None

CROSS_SITE_SOCKET = ("a WebSocket from a page of another site (its Origin is not this server): refused, so "
                     "that no web page can drive sessions through a browser that reaches this server")
PLAIN_HTTP_TOKEN = ("a bearer token over plain HTTP from another machine travels in clear: use https:// "
                    "(serve with --tls-cert and --tls-key), or, with TLS ended by a proxy in front, start "
                    "the server with --allow-plain-http-tokens")


@dataclass(frozen=True)
class HttpLimits:
    """max_body_bytes: a request body (and a WebSocket message) larger than this is refused (413),
    while it is read. max_json_depth: JSON nested deeper is refused (400).
    openenv_max_http_sessions: OpenEnv sessions opened over plain HTTP that the endpoint holds at
    once (RESOURCE_EXHAUSTED beyond). token_cache_entries: callers' tokens whose batchers are kept
    (the least recently used idle ones make room). allow_plain_http_tokens: accept an
    Authorization header over plain HTTP from a peer that is not this machine (TLS ended by a
    proxy in front)."""
    max_body_bytes: int = MAX_BODY_BYTES
    max_json_depth: int = MAX_JSON_DEPTH
    openenv_max_http_sessions: int = OPENENV_MAX_HTTP_SESSIONS
    token_cache_entries: int = TOKEN_CACHE_ENTRIES
    allow_plain_http_tokens: bool = False

    def __post_init__(self):
        for name in ("max_body_bytes", "max_json_depth", "openenv_max_http_sessions", "token_cache_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def too_large(limit: int) -> ApiError:
    return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"body over {limit} bytes (the server's --max-body-bytes)",
                    http_status=413)


def is_json_type(content_type: str | None) -> bool:
    """application/json or any +json type, with or without parameters (charset)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    kind, _, sub = media.partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


async def read_json_body(request, limits: HttpLimits) -> Any:
    """A JSON route's body, parsed: refused when its Content-Type is not JSON (415: a page of
    another site can POST text/plain or a form to a server on this machine, but not JSON without
    asking it first), when it grows past the limit (413, while it arrives: no more is read), and
    when it is not JSON, holds a non-finite number or nests too deep (400). An empty body is {}."""
    if not is_json_type(request.headers.get("content-type")):
        got = request.headers.get("content-type")
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"send the body as JSON with 'Content-Type: application/json' (got {got!r})"
                       if got else "send the body as JSON with 'Content-Type: application/json' (none given)",
                       http_status=415)
    body = await read_body(request, limits.max_body_bytes)
    if not body.strip():
        return {}
    return parse_json(body, limits.max_json_depth, what="body")


async def read_body(request, limit: int) -> bytearray:
    """The body, read chunk by chunk as it arrives, and refused (413) as soon as it passes limit;
    a declared Content-Length over it is refused before anything is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise too_large(limit)
        body += chunk
    return body


def parse_json(data, max_depth: int, what: str = "message") -> Any:
    """JSON text or bytes -> its value; ApiError INVALID_ARGUMENT naming the problem otherwise."""
    try:
        value = _loads(data) if _loads is not None else _strict_loads(data)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, _why_not(data, e, max_depth, what)) from None
    if _depth(value, max_depth) > max_depth:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is JSON nested deeper than {max_depth} levels")
    return value


class _NonFinite(ValueError):
    pass


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _NonFinite(text)
    return x


def _finite_int(text: str) -> int:
    x = int(text)
    if abs(x) > 1.7976931348623157e308:  # the largest double: beyond it, no JSON reader agrees on a value
        raise _NonFinite(text if len(text) <= 24 else text[:20] + "...")
    return x


def _no_constant(name: str):
    raise _NonFinite(name)


def _strict_loads(data):
    return json.loads(data, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_finite_int)


def _why_not(data, error: Exception, max_depth: int, what: str) -> str:
    """Why data is refused, in words: orjson's messages say where, the standard reader what."""
    if isinstance(error, RecursionError) or "depth" in str(error).lower():
        return f"{what} is JSON nested deeper than {max_depth} levels"
    try:
        _strict_loads(data)
    except _NonFinite as e:
        return (f"{what} holds the number {e}, which is not finite: JSON numbers must be finite "
                "(no NaN, Infinity, or values beyond +-1.8e308)")
    except RecursionError:
        return f"{what} is JSON nested deeper than {max_depth} levels"
    except (ValueError, UnicodeDecodeError):
        pass
    return f"{what} is not valid JSON: {error}"


def _depth(value: Any, limit: int) -> int:
    """How deep value's lists and objects nest (a scalar: 0), counted up to limit + 1."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest = 1
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > limit:
            return d
        for child in (v.values() if isinstance(v, dict) else v):
            if isinstance(child, (dict, list)):
                stack.append((child, d + 1))
    return deepest


# -- before the app: plain-HTTP tokens and declared body sizes ----------------------------------------
def is_local(client) -> bool:
    """Whether a peer (ASGI's scope["client"]) is this machine: a loopback address, or a Unix socket."""
    if client is None:
        return True
    host = str(client[0]).split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def same_origin(headers) -> bool:
    """No Origin (a program, not a browser), or one naming the Host the request came to. Browsers
    open WebSockets to any address without asking it first (no CORS preflight), with their Origin."""
    origin = host = None
    for k, v in headers:
        if k == b"origin":
            origin = v.decode("latin-1").strip()
        elif k == b"host":
            host = v.decode("latin-1").strip()
    if origin is None:
        return True
    netloc = origin.split("://", 1)[1] if "://" in origin else ""
    return bool(netloc) and host is not None and netloc.lower() == host.lower()


class HttpGuard:
    """ASGI middleware in front of every route of an HTTP front: a request carrying Authorization
    over plain HTTP from another machine is refused (403) unless the operator allows it (TLS ended
    by a proxy; uvicorn takes the client and scheme from X-Forwarded-For/-Proto of a proxy on this
    machine), a WebSocket a page of another site opens is refused (403), and a declared
    Content-Length over the limit is refused (413) before the body is read."""

    def __init__(self, app, limits: HttpLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or ()
        if not self.limits.allow_plain_http_tokens and scope.get("scheme") in ("http", "ws") \
                and any(k == b"authorization" for k, _ in headers) and not is_local(scope.get("client")):
            error = ApiError(grpc.StatusCode.PERMISSION_DENIED, PLAIN_HTTP_TOKEN)
            if kind == "websocket":
                return await refuse_socket(receive, send, error)
            return await error_json(error)(scope, receive, send)
        if kind == "websocket" and not same_origin(headers):
            return await refuse_socket(receive, send, ApiError(grpc.StatusCode.PERMISSION_DENIED, CROSS_SITE_SOCKET))
        if kind == "http":
            for k, v in headers:
                if k == b"content-length" and v.isdigit() and int(v) > self.limits.max_body_bytes:
                    return await error_json(too_large(self.limits.max_body_bytes))(scope, receive, send)
        return await self.app(scope, receive, send)


# gRPC code -> HTTP status, as grpc-gateway and Google's API guidelines map them.
HTTP_STATUS = {
    grpc.StatusCode.OK: 200, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DATA_LOSS: 500,
}


def error_response(code: grpc.StatusCode, message: str, http_status: int | None = None) -> JSONResponse:
    return JSONResponse({"code": code.name, "message": message},
                        status_code=http_status or HTTP_STATUS.get(code, 500))


def error_json(e: ApiError) -> JSONResponse:
    return error_response(e.code, e.message, e.http_status)


async def refuse_socket(receive, send, e: ApiError) -> None:
    """A WebSocket refused before the app sees it: accepted, told why in an OpenEnv error message
    (what its clients read), and closed as a policy violation."""
    message = await receive()
    if message.get("type") != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps(
        {"type": "error", "data": {"message": e.message, "code": "SESSION_ERROR", "status": e.code.name}})})
    await send({"type": "websocket.close", "code": 1008})
