"""Requests that do not parse as their protobuf message answer INVALID_ARGUMENT.

grpc's own servers answer such bytes with UNKNOWN ("Unexpected <class 'DecodeError'>") for a
unary call, and a bidirectional stream can end as if nothing had been sent. Every service of a
replica and of the judge is added through `add_service` or `add_handlers`, which give each method a
request deserializer that cannot raise (it returns a `Malformed` marker) and a behaviour that aborts
with INVALID_ARGUMENT, naming the method and the message type, when it meets one. A unary method
that meets a value it cannot take while reading a request (rpc/values.py's BadValue: a NaN in a
config Struct) answers INVALID_ARGUMENT with that message the same way. The wrapping is done once,
when the service is added, so a well-formed call pays one type check per message.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import grpc

from .values import BadValue


class Malformed:
    """What a request deserializer returns for bytes that are not its message."""
    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _message_name(deserializer: Callable) -> str:
    cls = getattr(deserializer, "__self__", None)
    descriptor = getattr(cls, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "") or "its request message"


def _parser(method: str, deserializer: Callable) -> Callable[[bytes], Any]:
    expected = _message_name(deserializer)

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - DecodeError, or whatever a custom parser raises
            return Malformed(f"{method}: the request is not a valid {expected} ({type(e).__name__}: {e})")
    return parse


async def _refuse(context, request: Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _until_malformed(requests, bad: list):
    """A stream's requests up to the first that does not parse, which is kept in bad. To the
    servicer the stream just ends there; the wrapper aborts once the servicer has finished, from
    the handler itself: an abort raised inside whatever task reads the requests (Interact reads
    them in a task of its own) could race the servicer's own writes and leave the call hanging."""
    async for request in requests:
        if type(request) is Malformed:
            bad.append(request)
            return
        yield request


async def _result(value):
    return await value if inspect.isawaitable(value) else value


def checked_handler(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """handler, answering a request that does not parse with INVALID_ARGUMENT."""
    if handler.request_deserializer is None:
        return handler  # raw bytes in: nothing to parse
    parse = _parser(method, handler.request_deserializer)
    out = handler.response_serializer
    if handler.unary_unary is not None:
        behaviour = handler.unary_unary

        async def unary_unary(request, context):
            if type(request) is Malformed:
                await _refuse(context, request)
            try:
                return await _result(behaviour(request, context))
            except BadValue as e:  # a value in the request the server cannot take (rpc/values.py)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=parse, response_serializer=out)
    if handler.unary_stream is not None:
        behaviour = handler.unary_stream

        async def unary_stream(request, context):
            if type(request) is Malformed:
                await _refuse(context, request)
            replies = behaviour(request, context)
            if hasattr(replies, "__aiter__"):
                async for reply in replies:
                    yield reply
            else:
                await _result(replies)  # a behaviour that writes through context.write
        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=parse, response_serializer=out)
    if handler.stream_unary is not None:
        behaviour = handler.stream_unary

        async def stream_unary(requests, context):
            bad: list[Malformed] = []
            reply = await _result(behaviour(_until_malformed(requests, bad), context))
            if bad:
                await _refuse(context, bad[0])
            return reply
        return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=parse, response_serializer=out)
    behaviour = handler.stream_stream

    async def stream_stream(requests, context):
        bad: list[Malformed] = []
        replies = behaviour(_until_malformed(requests, bad), context)
        if hasattr(replies, "__aiter__"):
            async for reply in replies:
                yield reply
        else:
            await _result(replies)
        if bad:
            await _refuse(context, bad[0])  # after the items sent before it were answered
    return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=parse, response_serializer=out)


def add_handlers(server: grpc.aio.Server, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
    """Adds one service's method handlers (name -> handler), each checked."""
    checked = {name: checked_handler(f"/{service}/{name}", h) for name, h in handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, checked),))
    server.add_registered_method_handlers(service, checked)


class _Registrar:
    """Given to a generated add_*_to_server function in place of the server. Generated code hands
    each service's handler table to add_registered_method_handlers (taken and checked here) and
    the same table wrapped as a generic handler to add_generic_rpc_handlers (noted, then checked
    to have come with a table, so a service can never be added unchecked)."""

    def __init__(self, server: grpc.aio.Server):
        self.server = server
        self.generic: set[str] = set()
        self.tables: set[str] = set()

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        add_handlers(self.server, service, handlers)
        self.tables.add(service)

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        for g in generic_handlers:
            self.generic.add(g.service_name())


def add_service(add_to_server: Callable, servicer: Any, server: grpc.aio.Server) -> None:
    """add_to_server(servicer, server), a generated function, with every method checked."""
    registrar = _Registrar(server)
    add_to_server(servicer, registrar)
    unchecked = registrar.generic - registrar.tables
    if unchecked:
        raise RuntimeError(f"{add_to_server.__name__} added {sorted(unchecked)} without a method table")


def add_health_and_reflection(server: grpc.aio.Server, health: Any, service_names: tuple[str, ...]) -> None:
    """grpc's health service (the servicer `health`) and server reflection naming service_names,
    both checked like the rest."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

    add_service(health_pb2_grpc.add_HealthServicer_to_server, health, server)
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    # reflection.enable_server_reflection picks this servicer for an aio server; added here directly
    # so that it goes through add_service too.
    add_service(reflection_pb2_grpc.add_ServerReflectionServicer_to_server, reflection.aio.ReflectionServicer(names),
                server)
