"""Exceptions carrying the gRPC status code and message, for calls and for batch items."""
from __future__ import annotations

import grpc

_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


class EnvServeError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, session_id: str = ""):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.session_id = session_id


class SessionLostError(EnvServeError):
    """The session's worker or replica died; open a new session."""


class SessionNotFoundError(EnvServeError):
    """Closed, expired or never opened."""


class EnvNotFoundError(EnvServeError):
    """No replica serves an environment of that id (Open, GetSpec)."""


class ReplicaFullError(EnvServeError):
    """The replica has max_sessions open; try another replica or later."""


class UnavailableError(EnvServeError):
    """The replica is draining or down."""


class PermissionDeniedError(EnvServeError):
    """The session belongs to another token, or the call needs a different kind of token."""


class UnauthenticatedError(EnvServeError):
    """No bearer token, or one the replica does not know."""


_CLASSES = {
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.DATA_LOSS: SessionLostError,
    grpc.StatusCode.NOT_FOUND: SessionNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ReplicaFullError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}


def make_error(code: grpc.StatusCode, message: str, session_id: str = "") -> EnvServeError:
    return _CLASSES.get(code, EnvServeError)(code, message, session_id)


def from_rpc_error(e: grpc.RpcError) -> EnvServeError:
    return make_error(e.code(), e.details() or "", "")


def env_error(err: EnvServeError) -> EnvServeError:
    """An Open's or GetSpec's error: NOT_FOUND there names the environment, not a session."""
    if err.code == grpc.StatusCode.NOT_FOUND and not isinstance(err, EnvNotFoundError):
        return EnvNotFoundError(err.code, err.message, err.session_id)
    return err


def from_unary_error(e: grpc.RpcError) -> EnvServeError:
    """from_rpc_error for a unary call, where CANCELLED becomes UNAVAILABLE. Its caller cannot have
    cancelled it (a blocking call has no handle to cancel; an awaited one raises CancelledError in
    the caller's task instead), so the other end did: a gRPC server shutting down cancels the calls
    that reach it meanwhile. UNAVAILABLE sends the caller, and the routed clients, elsewhere."""
    if e.code() == grpc.StatusCode.CANCELLED:
        return UnavailableError(grpc.StatusCode.UNAVAILABLE,
                                f"the call was cancelled under its caller (a stopping replica does that): {e.details()}")
    return from_rpc_error(e)


def item_error(result) -> EnvServeError | None:
    """The error of one batch item (a StepResult), or None when it succeeded."""
    if result.status.code == 0:
        return None
    code = _BY_NUMBER.get(result.status.code, grpc.StatusCode.UNKNOWN)
    return make_error(code, result.status.message, result.session_id)


def check(result):
    """Return the result, or raise its item error."""
    err = item_error(result)
    if err is not None:
        raise err
    return result
