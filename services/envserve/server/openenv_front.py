"""OpenEnv's protocol served by a replica itself (`envserve serve --openenv-port`): the same
routes as the facade's /openenv/<env_id>/ (envserve.web.openenv), on this replica's envs, in the
replica's front process and on its event loop. A socket's steps go straight to the worker pool,
with no facade process and no gRPC call between: for one replica, the cheapest way to serve
OpenEnv clients. (Behind `envserve web`, sessions are routed over many replicas instead.)

The steps and resets of all sockets that arrive in one event-loop turn go to each worker as one
message, as Interact sends them; results come back as the workers finish them.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from envserve.common.errors import ApiError
from envserve.common.lru import IdleLRU
from envserve.rpc.auth import Denied
from envserve.rpc.values import BadValue, config_of
from envserve.v1 import envserve_pb2 as pb

from . import convert
from .pool import WorkerHandle
from .quotas import QuotaExceeded
from .service import Refused, Replica, _cap, _reset_item

log = logging.getLogger("envserve.server.openenv")
IN_FLIGHT = 1  # measured: 2 cost more CPU a step (smaller batches), for no more steps/s
BATCHERS_KEPT = 1024  # callers' credentials whose batchers are kept between calls


class _Metadata:
    """The part of a gRPC context an Authenticator reads: the caller's metadata."""

    def __init__(self, md: tuple):
        self._md = md

    def invocation_metadata(self):
        return self._md


class LocalGateway:
    """What envserve.web.openenv needs of a Gateway (open, close, batched single steps and
    resets, spec, serving), answered by this replica's own sessions."""

    def __init__(self, replica: Replica, batchers_kept: int = BATCHERS_KEPT):
        self.r = replica
        # By the caller's metadata: tokens come and go, so the idle batchers used least recently
        # make room (one with items out or waiting is never dropped).
        self._batchers: IdleLRU[LocalBatcher] = IdleLRU(batchers_kept, LocalBatcher.idle)

    def owner(self, md) -> str:
        """The caller's owner id, as EnvService finds it ("" with auth off); ApiError
        UNAUTHENTICATED or PERMISSION_DENIED for a token this replica refuses."""
        try:
            return self.r.auth.env_owner(_Metadata(tuple(md)))
        except Denied as e:
            raise ApiError(e.code, e.message) from None

    async def open(self, req: pb.OpenRequest, md) -> tuple[None, pb.OpenResponse]:
        owner = self.owner(md)
        try:
            config = config_of(req)
            ids, prompt = await self.r.open(req.env_id, req.count, config, req.action_format, owner)
        except BadValue as e:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except Refused as e:
            raise ApiError(e.code, e.message) from None
        return None, pb.OpenResponse(session_ids=ids, lease_seconds=self.r.config.lease_seconds,
                                     system_prompt=prompt)

    async def read_state(self, req: pb.ReadStateRequest, md) -> pb.GetStateResponse:
        """ReadState for a caller's metadata, checked as StateService checks it."""
        try:
            reader = self.r.auth.reader(_Metadata(tuple(md)))
            return await self.r.read_state(req.session_id, reader, req.turn if req.HasField("turn") else -1,
                                           req.episode if req.HasField("episode") else None,
                                           req.trial if req.HasField("trial") else None)
        except (Denied, Refused) as e:
            raise ApiError(e.code, e.message) from None

    async def close_sessions(self, ids: list[str], md) -> list[pb.ItemStatus]:
        return await self.r.close_sessions(list(ids), self.owner(md))

    async def serving(self, env_id: str, md) -> list:
        self.owner(md)
        if env_id not in self.r.specs:
            raise ApiError(grpc.StatusCode.NOT_FOUND,
                           f"env {env_id!r} is not served here; served: {self.r.env_ids}")
        return [None]

    async def spec(self, env_id: str, md) -> pb.EnvSpec:
        await self.serving(env_id, md)
        return convert.spec_to_proto(self.r.specs[env_id])

    def batcher(self, _replica, md) -> "LocalBatcher":
        md = tuple(md)  # a token the replica refuses makes no batcher: owner() raises
        return self._batchers.get(md, lambda: LocalBatcher(self.r, self.owner(md)))

    async def close(self) -> None:
        self._batchers.clear()


class LocalBatcher:
    """Single steps and resets of many callers (one owner) to the workers: what arrives in one
    loop turn goes to each worker as one message, its results streamed back as they finish. At
    most `in_flight` messages are out per worker; items that come meanwhile wait and go together
    in the next, so a lone caller is sent at once and sixty-four busy ones share a few messages
    (each costs a pipe write and a wake-up on both sides)."""

    def __init__(self, replica: Replica, owner: str, in_flight: int = IN_FLIGHT):
        self.r, self.owner, self.in_flight = replica, owner, in_flight
        self._items: list[tuple[tuple, asyncio.Future]] = []
        self._waiting: dict[int, tuple[WorkerHandle, list, list, list]] = {}  # by id of the worker
        self._busy: dict[int, int] = {}  # messages out, by worker slot
        self._scheduled = False

    def idle(self) -> bool:
        """No item waits or is out: dropping it loses no caller's item."""
        return not (self._items or self._waiting or self._scheduled or any(self._busy.values()))

    def _queue(self, item: tuple) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._items.append((item, fut))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def step(self, session_id: str, action: str) -> asyncio.Future:
        return self._queue(("step", session_id, _cap(action)))

    def reset(self, item: pb.ResetItem) -> asyncio.Future:
        return self._queue(_reset_item(item))

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._items = self._items, []
        r = self.r
        waiting = self._waiting
        for item, fut in batch:
            rec, code, message = r.lookup(item[1], self.owner)
            if rec is None:
                r.metrics.errors.labels(code).inc()
                if not fut.done():
                    fut.set_result(convert.error_result(item[1], code, message))
                continue
            try:   # the caller's quota counts items from every door
                r.quotas.take_items(self.owner, 1)
            except QuotaExceeded as e:
                r.metrics.errors.labels("RESOURCE_EXHAUSTED").inc()
                if not fut.done():
                    fut.set_result(convert.error_result(item[1], "RESOURCE_EXHAUSTED", str(e)))
                continue
            w = rec.worker
            g = waiting.get(id(w))
            if g is None:
                g = waiting[id(w)] = (w, [], [], [])
            g[1].append(item)
            g[2].append(fut)
            g[3].append(rec.env_id)
        for key, (w, items, futs, env_ids) in list(waiting.items()):
            if self._busy.get(w.slot, 0) < self.in_flight or not w.alive:
                del waiting[key]
                self._send(w, items, futs, env_ids)

    def _done(self, slot: int) -> None:
        self._busy[slot] -= 1
        if self._waiting and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _send(self, w: WorkerHandle, items: list, futs: list, env_ids: list) -> None:
        r, slot = self.r, w.slot
        r.enter(len(items))
        self._busy[slot] = self._busy.get(slot, 0) + 1
        left = [len(items)]
        observe = r.metrics.observe_step

        def finish() -> None:
            r.leave(left[0])
            r.quotas.give_items(self.owner, left[0])
            left[0] = 0
            self._done(slot)

        def on_item(result) -> None:
            if left[0] <= 0:
                return
            if isinstance(result, BaseException):
                for item, fut in zip(items, futs):
                    if not fut.done():
                        fut.set_result(pb.StepResult.FromString(r.lost_result(item[1], result)))
                finish()
                return
            for index, data, seconds in result:
                observe(env_ids[index], seconds)
                fut = futs[index]
                if not fut.done():
                    fut.set_result(pb.StepResult.FromString(data))
            left[0] -= len(result)
            r.leave(len(result))
            r.quotas.give_items(self.owner, len(result))
            if left[0] <= 0:
                left[0] = 0
                finish()

        r.pool.stream(w, items, on_item)
