"""How the HTTP front ends reach sessions: where a new session opens, which replica a session id
names, a batch split by replica, and one shared Interact stream per replica for single steps.

Both the /v1 JSON routes (app.py) and the OpenEnv endpoint (openenv.py) go through a Gateway, so
they open sessions on the same replicas by the same rule and fail the same way.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable

import grpc

from envserve.directory import ReplicaInfo, replica_of
from envserve.v1 import envserve_pb2 as pb

from .routing import ReplicaTable

log = logging.getLogger("envserve.web")


class ApiError(Exception):
    """A call that fails as a whole, with the gRPC code it would have had."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


# Open failures that another replica may not have: full, draining, down, slow.
_TRY_NEXT = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class Gateway:
    def __init__(self, table: ReplicaTable, timeout: float = 60.0):
        self.table = table
        self.timeout = timeout
        self._streams: dict[tuple, InteractMux] = {}

    async def close(self) -> None:
        for mux in list(self._streams.values()):
            mux.shut()
        self._streams.clear()
        await self.table.close()

    # -- where sessions are ---------------------------------------------------------------------
    async def not_served(self, env_id: str, md) -> ApiError | grpc.RpcError:
        """No known replica serves env_id. When a fixed replica could not be asked, its answer
        (e.g. UNAUTHENTICATED without a token) says more than NOT_FOUND could."""
        served = sorted({e for r in await self.table.replicas(md) for e in r.envs})
        unasked = self.table.unasked()
        if unasked:
            return unasked[0]
        return ApiError(grpc.StatusCode.NOT_FOUND, f"env {env_id!r} is not served by any replica; served: {served}")

    async def serving(self, env_id: str, md) -> list[ReplicaInfo]:
        """Replicas that serve env_id (draining ones too); raises what not_served says when none."""
        await self.table.ask_again(md)
        found = [r for r in await self.table.replicas(md) if env_id in r.envs]
        if not found:
            raise await self.not_served(env_id, md)
        return found

    async def session_replica(self, session_id: str, md) -> ReplicaInfo:
        rid = replica_of(session_id)
        if not rid:
            raise ApiError(grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r}: not an envserve session id")
        r = await self.table.find(rid, md)
        if r is None:
            raise ApiError(grpc.StatusCode.DATA_LOSS,
                           f"session lost: its replica {rid!r} is gone (not in the directory or replica list)")
        return r

    async def open(self, req: pb.OpenRequest, md) -> tuple[ReplicaInfo, pb.OpenResponse]:
        """OpenRequest on the least-loaded replica serving the env (all sessions of one call on one
        replica, as a gRPC Open); a full, draining or unreachable replica passes it to the next."""
        order = await self.table.open_order(req.env_id, md)
        if not order:
            if any(req.env_id in r.envs for r in await self.table.replicas(md)):
                raise ApiError(grpc.StatusCode.UNAVAILABLE, f"every replica serving {req.env_id!r} is draining")
            raise await self.not_served(req.env_id, md)
        last: grpc.RpcError | None = None
        for r in order:
            try:
                resp = await self.table.stubs(r).env.Open(req, timeout=self.timeout, metadata=md)
            except grpc.RpcError as e:
                if e.code() not in _TRY_NEXT:
                    raise  # anything else is the request's fault
                last = e
                continue
            self.table.opened(r, len(resp.session_ids))
            return r, resp
        raise last

    async def close_sessions(self, ids: list[str], md) -> list[pb.ItemStatus]:
        async def call(r, indices):
            sub = pb.CloseRequest(session_ids=[ids[i] for i in indices])
            return list((await self.table.stubs(r).env.Close(sub, timeout=self.timeout, metadata=md)).statuses)
        return await self.fan_out(ids, md, call, status_failure)

    async def fan_out(self, ids: list[str], md, call, make_failure: Callable) -> list:
        """Items split by the replica their session names, sent in parallel, answered in request
        order. One replica's failure fails its own items; when every part failed as a whole with
        the same code, the call fails with it, as one replica's gRPC call would."""
        table = self.table
        results: list[Any] = [None] * len(ids)
        groups: dict[str, list[int]] = {}
        for i, sid in enumerate(ids):
            groups.setdefault(replica_of(sid), []).append(i)
        parts = []
        for rid, indices in groups.items():
            r = await table.find(rid, md) if rid else None
            if r is None:
                for i in indices:
                    if rid:
                        results[i] = make_failure(ids[i], grpc.StatusCode.DATA_LOSS,
                                                  f"session lost: its replica {rid!r} is gone")
                    else:
                        results[i] = make_failure(ids[i], grpc.StatusCode.NOT_FOUND,
                                                  f"unknown session {ids[i]!r}: not an envserve session id")
                continue
            parts.append((r, indices))
        replies = await asyncio.gather(*[call(r, indices) for r, indices in parts], return_exceptions=True)
        refused = []  # parts refused as a whole, as gRPC said
        for (r, indices), rep in zip(parts, replies):
            if isinstance(rep, grpc.RpcError):
                code = rep.code()
                if code == grpc.StatusCode.UNAVAILABLE and not table.is_fixed(r) \
                        and not await table.still_listed(r.replica_id):
                    # Unreachable and gone from the directory: dead, with its sessions.
                    code, msg = grpc.StatusCode.DATA_LOSS, f"session lost: its replica {r.replica_id!r} is gone"
                else:
                    refused.append(rep)
                    msg = f"replica {r.replica_id} at {table.address_of(r)}: {rep.details()}"
                for i in indices:
                    results[i] = make_failure(ids[i], code, msg)
            elif isinstance(rep, BaseException):
                raise rep
            else:
                for i, item in zip(indices, rep):
                    results[i] = item
        # Every item went to a replica and each refused the whole call with one code (e.g. no
        # token): the call fails with it, as a single replica's gRPC call would.
        if parts and len(parts) == len(groups) and len(refused) == len(parts) \
                and len({e.code() for e in refused}) == 1:
            raise refused[0]
        return results

    # -- single items over a shared stream --------------------------------------------------------
    def stream(self, r: ReplicaInfo, md) -> "InteractMux":
        """The Interact stream this facade keeps open to replica r for callers with credentials md
        (a session belongs to the token that opened it, so each token has its own stream)."""
        key = (self.table.address_of(r), r.tls, tuple(md))
        mux = self._streams.get(key)
        if mux is None or mux.broken:
            mux = self._streams[key] = InteractMux(self.table.stubs(r).env, md, self.timeout)
        return mux


def step_failure(sid: str, code: grpc.StatusCode, message: str) -> pb.StepResult:
    return pb.StepResult(session_id=sid, status=pb.ItemStatus(code=code.value[0], message=message))


def status_failure(sid: str, code: grpc.StatusCode, message: str) -> pb.ItemStatus:
    return pb.ItemStatus(code=code.value[0], message=message)


class InteractMux:
    """Many callers' single steps and resets over one Interact call: items submitted in the same
    event-loop turn travel in one InteractRequest (the replica hands each worker its share as one
    message), and each result goes back to its caller by tag. A stream that fails fails the items
    it holds with the stream's error; the next submit opens a new one."""

    def __init__(self, stub, md, timeout: float):
        self._stub, self._md, self.timeout = stub, tuple(md), timeout
        self._tags = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._outbox: list[pb.InteractItem] = []
        self._wake: asyncio.Event | None = None
        self._call = None
        self._tasks: list[asyncio.Task] = []
        self.broken = False

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._call = self._stub.Interact(metadata=self._md)
        self._tasks = [loop.create_task(self._read()), loop.create_task(self._write())]

    async def _read(self) -> None:
        call = self._call
        error: BaseException | None = None
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    error = ApiError(grpc.StatusCode.UNAVAILABLE, "the replica ended the Interact stream")
                    break
                waiting = self._waiting
                for r in resp.results:
                    fut = waiting.pop(r.tag, None)
                    if fut is not None and not fut.done():
                        fut.set_result(r.result)
        except grpc.RpcError as e:
            error = e
        except asyncio.CancelledError:
            error = ApiError(grpc.StatusCode.CANCELLED, "the facade is shutting down")
        except Exception as e:  # noqa: BLE001 - whatever broke the stream fails its items
            error = e
        self._fail(error)

    async def _write(self) -> None:
        """One writer: whatever was submitted while the last write was on its way goes next, in one
        request."""
        try:
            while not self.broken:
                await self._wake.wait()
                self._wake.clear()
                items, self._outbox = self._outbox, []
                if items:
                    await self._call.write(pb.InteractRequest(items=items))
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the reader sees the stream fail and fails the items
            log.info("Interact stream write failed: %s", e)
            self._call.cancel()

    def _fail(self, error: BaseException) -> None:
        self.broken = True
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        waiting, self._waiting = self._waiting, {}
        for fut in waiting.values():
            if not fut.done():
                fut.set_exception(error)

    async def submit(self, item: pb.InteractItem) -> pb.StepResult:
        """item: an InteractItem with its step or reset set (the tag is filled in here)."""
        if self.broken:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the Interact stream to the replica failed")
        if self._call is None:
            self._start()
        tag = next(self._tags)
        item.tag = tag
        fut = asyncio.get_running_loop().create_future()
        self._waiting[tag] = fut
        self._outbox.append(item)
        self._wake.set()
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except asyncio.TimeoutError:
            self._waiting.pop(tag, None)
            raise ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no result within {self.timeout:g} s") from None

    async def step(self, session_id: str, action: str) -> pb.StepResult:
        return await self.submit(pb.InteractItem(step=pb.StepItem(session_id=session_id, action=action)))

    async def reset(self, item: pb.ResetItem) -> pb.StepResult:
        return await self.submit(pb.InteractItem(reset=item))

    def shut(self) -> None:
        if self._call is not None:
            self._call.cancel()
        for t in self._tasks:
            t.cancel()
        self.broken = True
