"""MonitorService: this replica's live sessions with their latest turn (what the web page shows)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from .pool import WorkerHandle
from .service import Replica, caller

log = logging.getLogger("envserve.monitor")
DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000


class MonitorService(pb_grpc.MonitorServiceServicer):
    def __init__(self, replica: Replica):
        self.r = replica

    async def ListSessions(self, request, context):
        # Authorised like StateService: a session token sees its own sessions, a state token those
        # that grant it (every one where the operator lets it read all).
        reader = await caller(context, self.r.auth.reader)
        r = self.r
        if request.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"limit must be >= 0, got {request.limit}")
        limit = min(request.limit or DEFAULT_LIMIT, MAX_LIMIT)
        # The records are read directly, not through lookup(): watching a session must not renew
        # its lease, or an open page would keep abandoned sessions alive forever.
        by_worker: dict[int, tuple[WorkerHandle, list[str]]] = {}
        total = 0
        for sid, rec in list(r.sessions.items()):
            if request.env_id and rec.env_id != request.env_id:
                continue
            if not reader.may_read(rec.owner, rec.readers):
                continue
            total += 1
            by_worker.setdefault(rec.worker.slot, (rec.worker, []))[1].append(sid)
        calls = [r.pool.call(w, "summaries", (sids, limit, request.include_images)) for w, sids in by_worker.values()]
        found: list[tuple[float, bytes]] = []
        for reply in await asyncio.gather(*calls, return_exceptions=True):
            # A worker that died meanwhile lost its sessions; the rest are still worth showing.
            if isinstance(reply, BaseException) or (isinstance(reply, tuple) and reply[0] == "error"):
                log.warning("session summaries from a worker failed: %s", reply)
                continue
            found.extend(reply)
        found.sort(key=lambda t: t[0], reverse=True)
        return pb.ListSessionsResponse(
            replica_id=r.replica_id, total=total,
            sessions=[pb.SessionSummary.FromString(data) for _, data in found[:limit]])
