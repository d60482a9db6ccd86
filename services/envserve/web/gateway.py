"""How the HTTP front ends reach sessions: where a new session opens, which replica a session id
names, a batch split by replica, and single steps of many callers batched per replica.

Both the /v1 JSON routes (app.py) and the OpenEnv endpoint (openenv.py) go through a Gateway, so
they open sessions on the same replicas by the same rule and fail the same way.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import grpc

from envserve.common.errors import ApiError  # noqa: F401 (the facade's callers import it from here)
from envserve.common.lru import IdleLRU
from envserve.directory import ReplicaInfo, replica_of
from envserve.rpc.auth import BEARER, owner_of
from envserve.v1 import envserve_pb2 as pb

from .limits import TOKEN_CACHE_ENTRIES
from .routing import ReplicaTable

log = logging.getLogger("envserve.web")


# Open failures that another replica may not have: full, draining, down, slow.
# CANCELLED: the facade cancelled nothing, so the replica did (a gRPC server stopping cancels the
# calls that reach it meanwhile).
_TRY_NEXT = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.CANCELLED)


def bearer_token(md) -> str | None:
    """The token of a caller's 'authorization: Bearer <token>' metadata, read as a replica reads it."""
    for key, value in md:
        if key == "authorization":
            return value[len(BEARER):].strip() if value.lower().startswith(BEARER) else None
    return None


def forwarded(headers) -> tuple:
    """The caller's credentials (its Authorization header), as the gRPC metadata every call on
    its behalf carries. gRPC carries printable ASCII only: another header is refused here, as a
    gRPC client could not have sent it."""
    auth = headers.get("authorization")
    if auth is None:
        return ()
    if not auth.isascii() or not auth.isprintable():
        raise ApiError(grpc.StatusCode.UNAUTHENTICATED,
                       "the Authorization header must be 'Bearer <token>' in printable ASCII")
    return (("authorization", auth),)


class Gateway:
    def __init__(self, table: ReplicaTable, timeout: float = 60.0, token_cache_entries: int = TOKEN_CACHE_ENTRIES):
        self.table = table
        self.timeout = timeout
        # One batcher per replica and caller token: tokens come and go, so the idle ones that
        # were used least recently make room (a busy one is never dropped with its callers).
        self._batchers: IdleLRU[Batcher] = IdleLRU(token_cache_entries, Batcher.idle)

    @staticmethod
    def owner(md) -> str:
        """Whose sessions a caller's calls may touch: the digest of its bearer token, as the
        replica keeps it ("" without a token). The replica checks the token itself on every call
        it gets; this is for what the facade answers alone (an OpenEnv session's state)."""
        token = bearer_token(md)
        return owner_of(token) if token is not None else ""

    async def close(self) -> None:
        self._batchers.clear()
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

    async def spec(self, env_id: str, md) -> pb.EnvSpec:
        serving = await self.serving(env_id, md)
        return await self.table.stubs(serving[0]).env.GetSpec(pb.GetSpecRequest(env_id=env_id),
                                                               timeout=self.timeout, metadata=md)

    async def session_replica(self, session_id: str, md) -> ReplicaInfo:
        rid = replica_of(session_id)
        r = await self.table.find(rid, md) if rid else None
        if r is None:
            code, message = self.missing(session_id, rid)
            raise ApiError(code, message)
        return r

    def missing(self, session_id: str, rid: str) -> tuple[grpc.StatusCode, str]:
        """Why no replica answers for a session id: a replica this facade knew and that is gone
        lost it (DATA_LOSS: a routed client rebuilds it elsewhere); any other id is unknown, as a
        replica says of an id it never gave (NOT_FOUND)."""
        if not rid:
            return grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r}: not an envserve session id"
        if self.table.was_known(rid):
            return grpc.StatusCode.DATA_LOSS, f"session lost: its replica {rid!r} is gone (not in the directory or replica list)"
        return grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r}: no replica {rid!r} is known here"

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
            reservation = self.table.reserve(r, max(1, req.count))
            try:
                resp = await self.table.stubs(r).env.Open(req, timeout=self.timeout, metadata=md)
            except grpc.RpcError as e:
                self.table.settle(r, reservation, 0)
                if e.code() not in _TRY_NEXT:
                    raise  # anything else is the request's fault
                last = e
                continue
            except BaseException:
                self.table.settle(r, reservation, 0)
                raise
            self.table.settle(r, reservation, len(resp.session_ids), resp)
            return r, resp
        raise last

    async def close_sessions(self, ids: list[str], md) -> list[pb.ItemStatus]:
        async def call(r, indices):
            sub = pb.CloseRequest(session_ids=[ids[i] for i in indices])
            return list((await self.table.stubs(r).env.CloseSessions(sub, timeout=self.timeout, metadata=md)).statuses)
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
                    results[i] = make_failure(ids[i], *self.missing(ids[i], rid))
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

    # -- single items, batched ---------------------------------------------------------------------
    def batcher(self, r: ReplicaInfo, md) -> "Batcher":
        """Where single steps and resets for replica r go, for callers with credentials md (a
        session belongs to the token that opened it, so each token has its own batches)."""
        key = (self.table.address_of(r), r.tls, tuple(md))
        return self._batchers.get(key, lambda: Batcher(self.table.stubs(r).env, md, self.timeout))


def step_failure(sid: str, code: grpc.StatusCode, message: str) -> pb.StepResult:
    return pb.StepResult(session_id=sid, status=pb.ItemStatus(code=code.value[0], message=message))


def status_failure(sid: str, code: grpc.StatusCode, message: str) -> pb.ItemStatus:
    return pb.ItemStatus(code=code.value[0], message=message)


class Batcher:
    """Many callers' single steps and resets to one replica, batched: each caller gets its own
    result back, and the replica splits a batch by worker and runs the parts in parallel. At most
    `in_flight` calls are out at once; items that come meanwhile wait and go together in the next
    call, so a lone caller is sent at once and sixty-four busy ones share a few calls. Measured
    against a replica with 64 concurrent callers, one batched call per loop turn cost the caller's
    process about 10 us a step, an Interact stream shared the same way about 33 us, a unary call
    per step about 200 us. A call that fails as a whole fails each of its items with its error."""

    def __init__(self, stub, md, timeout: float, in_flight: int = 2):
        self._stub, self._md, self.timeout = stub, tuple(md), timeout
        self.in_flight = in_flight
        self._busy = 0
        self._steps: list[tuple[pb.StepItem, asyncio.Future]] = []
        self._resets: list[tuple[pb.ResetItem, asyncio.Future]] = []
        self._scheduled = False

    def idle(self) -> bool:
        """Nothing waits to go and nothing is out: dropping it loses no caller's item."""
        return not (self._busy or self._steps or self._resets or self._scheduled)

    def _flush(self) -> None:
        self._scheduled = False
        loop = asyncio.get_running_loop()
        for box, method, request in ((self._steps, self._stub.Step, pb.StepRequest),
                                     (self._resets, self._stub.Reset, pb.ResetRequest)):
            if box and self._busy < self.in_flight:
                batch = box[:]
                box.clear()
                self._busy += 1
                loop.create_task(self._send(method, request(items=[b[0] for b in batch]), batch))

    async def _send(self, method, req, batch) -> None:
        try:
            resp = await method(req, timeout=self.timeout, metadata=self._md)
        except BaseException as e:  # noqa: BLE001 - each caller sees why its item failed
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        finally:
            self._busy -= 1
            if (self._steps or self._resets) and not self._scheduled:
                self._scheduled = True
                asyncio.get_running_loop().call_soon(self._flush)
        for (_, fut), r in zip(batch, resp.results):
            if not fut.done():
                fut.set_result(r)

    def _queue(self, box: list, item) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        box.append((item, fut))
        if not self._scheduled and self._busy < self.in_flight:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    async def step(self, session_id: str, action: str) -> pb.StepResult:
        return await self._queue(self._steps, pb.StepItem(session_id=session_id, action=action))

    async def reset(self, item: pb.ResetItem) -> pb.StepResult:
        return await self._queue(self._resets, item)
