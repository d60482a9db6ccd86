"""The replica: EnvService and StateService over a pool of worker processes."""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import dataclass

import grpc

from envserve.common.tables import sessions_per_table
from envserve.core import tasks
from envserve.core.env import resolve_config
from envserve.core.registry import get_env_class
from envserve.core.session import full_spec
from envserve.directory import DirectoryUnavailable
from envserve.rpc.auth import Authenticator, Denied, Reader
from envserve.rpc.values import code_number
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

from . import convert, stats
from .config import ServerConfig
from .metrics import Metrics
from .pool import WorkerHandle, WorkerLost, WorkerPool
from .quotas import Quotas, QuotaExceeded
from .tables import Tables

log = logging.getLogger("envserve.server")
OK = 0
LOST = "DATA_LOSS"


class Refused(Exception):
    """A call refused as a whole, with the gRPC status it answers."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class SessionRecord:
    env_id: str
    worker: WorkerHandle
    deadline: float
    owner: str = ""  # digest of the token that opened it ("" without auth)
    # Names of the state tokens its owner let read it (at Open, or in the owner's token entry).
    readers: frozenset = frozenset()


class Replica:
    """Session bookkeeping shared by both services."""

    def __init__(self, config: ServerConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.replica_id = ""
        self.env_ids = list(config.env_ids)
        self.specs = {e: get_env_class(e).spec for e in self.env_ids}
        self.auth = Authenticator(config.tokens, config.state_tokens)
        self.quotas = Quotas(self.auth, config.max_sessions, config.max_open_per_call)
        self.sessions: dict[str, SessionRecord] = {}
        # Ids a worker may hold before the front records them (an Open, Fork or Restore under way,
        # or one whose caller left and whose sessions are being closed): the orphan sweep skips them.
        self.building: set[str] = set()
        self._cleanups: set[asyncio.Task] = set()
        self.lost: dict[str, tuple[str, float]] = {}
        # Sessions a drain moved to other replicas: old id -> new id. While they move, their calls
        # answer UNAVAILABLE (a step now would be lost in the copy); after, NOT_FOUND naming the new id.
        self.moved: dict[str, str] = {}
        self.moving = False
        self.pool = WorkerPool(config.resolved_workers(), self.env_ids, self._on_worker_death, inline=config.inline,
                                lone_reply_wait_s=config.lone_reply_wait_seconds,
                                lone_request_wait_s=config.lone_request_wait_seconds,
                                time_limit_s=config.item_time_limit_seconds,
                                stuck_grace_s=config.stuck_grace_seconds, limits=config.config_limits or None)
        self.draining = False
        # Calls and stream items being worked on: a drain waits for these, not for open streams.
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._reaper: asyncio.Task | None = None
        self._last_sweep = time.monotonic()
        # Wake-ups of the open Interact streams, so a drain can end the idle ones at once.
        self.streams: set[asyncio.Event] = set()
        self.tables = Tables(self)
        # Where finished episodes' statistics go and GetTaskStats reads them (the replica's
        # directory, set by the server once it is open).
        self.directory = None

    async def start(self, replica_id: str) -> None:
        self.replica_id = replica_id
        await self.pool.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        await self.pool.close()

    # -- in-flight accounting, for drain --------------------------------------------------
    def enter(self, n: int = 1) -> None:
        self.in_flight += n
        self._idle.clear()

    def leave(self, n: int = 1) -> None:
        self.in_flight -= n
        if self.in_flight <= 0:
            self._idle.set()

    def begin_drain(self) -> None:
        """Refuses new sessions from now on, and wakes every stream so that the idle ones end."""
        self.draining = True
        for wake in list(self.streams):
            wake.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # -- sessions -------------------------------------------------------------------------
    def new_session_id(self) -> str:
        return f"{self.replica_id}/{secrets.token_hex(8)}"

    def lookup(self, sid: str, owner: str | None = "", reader: Reader | None = None
               ) -> tuple[SessionRecord | None, str, str]:
        """The session's record, or an error (code, message). Any lookup renews the lease.
        owner None may see every session; otherwise it must match the opener. A reader (the
        ground-truth services) sees the sessions it may read instead."""
        rec = self.sessions.get(sid)
        if rec is not None and self.moving:
            return None, "UNAVAILABLE", "replica is draining: the session is moving to another replica"
        if rec is not None:
            if reader is not None:
                if not reader.may_read(rec.owner, rec.readers):
                    return None, "PERMISSION_DENIED", (
                        f"session {sid!r} belongs to another token" if reader.owner is not None else
                        f"session {sid!r} belongs to another token than the judge's caller"
                        if reader.on_behalf is not None and reader.on_behalf != rec.owner else
                        f"session {sid!r} does not let state token {reader.name!r} read it: its owner grants "
                        f"that at Open (state_readers) or the operator in its token entry (grants=)")
            elif owner is not None and rec.owner != owner:
                return None, "PERMISSION_DENIED", f"session {sid!r} belongs to another token"
            rec.deadline = time.monotonic() + self.config.lease_seconds
            return rec, "", ""
        if sid in self.moved:
            return None, "NOT_FOUND", f"session moved to {self.moved[sid]} (this replica drained)"
        if sid in self.lost:
            return None, LOST, f"session lost: {self.lost[sid][0]}"
        return None, "NOT_FOUND", f"unknown session {sid!r} (closed, expired or never opened)"

    def add_sessions(self, ids: list[str], env_id: str, worker: WorkerHandle, owner: str = "",
                     readers: frozenset = frozenset()) -> None:
        deadline = time.monotonic() + self.config.lease_seconds
        for sid in ids:
            self.sessions[sid] = SessionRecord(env_id, worker, deadline, owner, readers)
            worker.sessions.add(sid)
        self.quotas.opened(owner, len(ids))
        self.metrics.live_sessions.labels(env_id).inc(len(ids))
        self.metrics.replica_live_sessions.set(len(self.sessions))

    def drop_session(self, sid: str) -> SessionRecord | None:
        if sid in self.tables.by_host:
            self.tables.host_ended(sid, "ABORTED", "the table's game ended (its session closed or expired)")
        rec = self.sessions.pop(sid, None)
        if rec is not None:
            rec.worker.sessions.discard(sid)
            self.quotas.closed(rec.owner)
            self.metrics.live_sessions.labels(rec.env_id).dec()
            self.metrics.replica_live_sessions.set(len(self.sessions))
        return rec

    def _on_worker_death(self, h: WorkerHandle) -> None:
        until = time.monotonic() + self.config.lost_memory_seconds
        reason = (f"its worker process (pid {h.pid}) was replaced: one of its items ran past the replica's time "
                  f"limit and did not stop" if getattr(h, "stuck", None) else f"its worker process (pid {h.pid}) died")
        for sid in list(h.sessions):
            for seat in self.tables.host_ended(sid, LOST, f"session lost: {reason}"):
                self.lost[seat] = (reason, until)
            self.drop_session(sid)
            self.lost[sid] = (reason, until)
        self.metrics.sessions_lost.inc(len(h.sessions))
        self.metrics.worker_restarts.inc()

    def pick_workers(self, n: int) -> list[WorkerHandle]:
        """Spread n new sessions over the live workers, least loaded first."""
        workers = self.pool.alive_workers()
        if not workers:
            return []
        load = {w.slot: len(w.sessions) for w in workers}
        chosen = []
        for _ in range(n):
            w = min(workers, key=lambda w: load[w.slot])
            load[w.slot] += 1
            chosen.append(w)
        return chosen

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval())
            try:
                self.pool.check_processes()
                await self.reap()
                if time.monotonic() - self._last_sweep >= self.config.orphan_sweep_seconds:
                    self._last_sweep = time.monotonic()
                    await self.sweep_orphans()
            except Exception:
                log.exception("reaper failed")

    async def collect_outcomes(self) -> dict:
        """The episodes the workers finished since the last collection, summed per stats key and
        task (server/stats.py)."""
        workers = self.pool.alive_workers()
        replies = await asyncio.gather(*[self.pool.call(w, "outcomes", None) for w in workers],
                                       return_exceptions=True)
        return stats.aggregate(r for reply in replies if isinstance(reply, list) for r in reply)

    async def sweep_orphans(self) -> int:
        """Closes the sessions a worker holds that the front does not know (their Open's caller
        left before they were recorded, and their closing failed), and records how many sessions
        each worker holds. Returns how many it closed."""
        workers = self.pool.alive_workers()
        replies = await asyncio.gather(*[self.pool.call(w, "held", None) for w in workers], return_exceptions=True)
        closed = 0
        for w, held in zip(workers, replies):
            if isinstance(held, BaseException) or not isinstance(held, list):
                continue
            orphans = [sid for sid in held if sid not in self.sessions and sid not in self.building]
            self.metrics.worker_sessions.labels(str(w.slot)).set(len(held) - len(orphans))
            if orphans:
                log.warning("worker %d held %d sessions the front does not know: closing them", w.slot, len(orphans))
                self.metrics.orphans_closed.inc(len(orphans))
                closed += len(orphans)
                try:
                    await self.pool.call(w, "close", orphans)
                except WorkerLost:
                    pass
        return closed

    async def build(self, plan: list[tuple[WorkerHandle, list[str], str, object]]) -> list:
        """Sends each (worker, ids, op, payload) that makes sessions and returns the replies (an
        exception where a worker failed). If the caller leaves first (its deadline, a cancel), the
        workers are told to stop, and whatever they made anyway is closed once they answer: a
        session is never left in a worker without its record in the front."""
        ids = [sid for _, sids, _, _ in plan for sid in sids]
        self.building.update(ids)
        sent = [(w, *self.pool.request(w, op, payload)) for w, _, op, payload in plan]
        calls = asyncio.gather(*[fut for _, fut, _ in sent], return_exceptions=True)
        try:
            return await asyncio.shield(calls)
        except asyncio.CancelledError:
            for w, _, rid in sent:
                if rid:
                    w.cancel([rid])

            made = list(ids)

            async def close_what_was_made():
                try:
                    await calls
                    await asyncio.gather(*[self.pool.call(w, "close", sids) for w, sids, _, _ in plan],
                                         return_exceptions=True)
                finally:
                    self.building.difference_update(made)
            task = asyncio.get_running_loop().create_task(close_what_was_made())
            self._cleanups.add(task)   # the loop keeps only a weak reference to a task
            task.add_done_callback(self._cleanups.discard)
            ids = []  # they leave `building` once closed
            raise
        finally:
            self.building.difference_update(ids)

    async def reap(self) -> int:
        now = time.monotonic()
        expired = [sid for sid, rec in self.sessions.items() if rec.deadline <= now]
        for sid, (_, until) in list(self.lost.items()):
            if until <= now:
                del self.lost[sid]
        if expired:
            # Counted before the close: the live-sessions gauge drops inside close_sessions, and a
            # scrape between the two would see them gone but not reaped.
            self.metrics.sessions_reaped.inc(len(expired))
            await self.close_sessions(expired)
            log.info("reaped %d idle sessions", len(expired))
        return len(expired)

    async def close_sessions(self, ids: list[str], owner: str | None = None) -> list[pb.ItemStatus]:
        statuses: list[pb.ItemStatus] = []
        by_worker: dict[int, tuple[WorkerHandle, list[str]]] = {}
        hosts: list[str] = []
        for sid in ids:
            if sid in self.tables.by_seat:
                status, host = self.tables.leave(sid, owner)
                statuses.append(status)
                if host is not None:
                    hosts.append(host)
                continue
            rec, code, message = self.lookup(sid, owner)
            if rec is None:
                statuses.append(pb.ItemStatus(code=code_number(code), message=message))
                if code == LOST:
                    self.lost.pop(sid, None)
                continue
            self.drop_session(sid)
            statuses.append(pb.ItemStatus(code=OK))
            by_worker.setdefault(rec.worker.slot, (rec.worker, []))[1].append(sid)
        calls = [self.pool.call(w, "close", sids) for w, sids in by_worker.values()]
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, Exception) and not isinstance(r, WorkerLost):
                log.warning("close failed: %s", r)
        if hosts:  # every seat of these tables has left
            await self.close_sessions(hosts)
        return statuses

    # -- drain: move the live sessions to other replicas ---------------------------------------
    async def migrate(self, targets: list, timeout: float, metadata: tuple = ()) -> tuple[dict[str, str], int]:
        """Rebuilds every live session on the other replicas in `targets` (ReplicaInfo, not
        draining, serving its env; least loaded first) with Restore, from the history each worker
        keeps. Returns (old id -> new id, sessions not moved); the moved ones leave this replica."""
        deadline = time.monotonic() + timeout
        self.moving = True
        by_worker: dict[int, tuple[WorkerHandle, list[str]]] = {}
        for sid, rec in self.sessions.items():
            if sid not in self.tables.by_host:  # a table's seats live in this front: they end here
                by_worker.setdefault(rec.worker.slot, (rec.worker, []))[1].append(sid)
        replies = await asyncio.gather(*[asyncio.wait_for(self.pool.call(w, "histories", sids),
                                                          max(0.1, deadline - time.monotonic()))
                                         for w, sids in by_worker.values()], return_exceptions=True)
        by_env: dict[str, list[tuple[str, pb.SessionHistory]]] = {}
        for reply in replies:
            if isinstance(reply, BaseException):
                continue  # that worker died or is stuck: its sessions end with this replica
            for sid, h in reply:
                if h is not None and sid in self.sessions:
                    by_env.setdefault(h["env_id"], []).append((sid, convert.history_to_proto(h)))
        moves: dict[str, str] = {}
        for env_id, items in by_env.items():
            load = {t.replica_id: t.live_sessions for t in targets
                    if env_id in t.envs and not t.draining and t.replica_id != self.replica_id}
            info = {t.replica_id: t for t in targets}
            while items and load and time.monotonic() < deadline:
                rid = min(load, key=lambda i: load[i] / max(1, info[i].capacity))
                room = max(0, info[rid].capacity - load[rid])
                batch, items = items[:max(1, min(room, 256))], items[max(1, min(room, 256)):]
                try:
                    async with grpc.aio.insecure_channel(info[rid].address) as channel:
                        reply = await pb_grpc.EnvServiceStub(channel).Restore(
                            pb.RestoreRequest(sessions=[h for _, h in batch]), metadata=metadata,
                            timeout=max(0.1, deadline - time.monotonic()))
                except grpc.RpcError as e:
                    log.warning("moving sessions to %s failed: %s", rid, e.details())
                    del load[rid]
                    items = batch + items
                    continue
                for (sid, _), got in zip(batch, reply.sessions):
                    if got.status.code == OK:
                        moves[sid] = got.session_id
                load[rid] += len(batch)
        return moves, len(self.sessions) - len(moves)

    async def finish_moves(self, moves: dict[str, str]) -> None:
        """After the moves are recorded in the directory: the moved sessions leave this replica
        (their calls answer NOT_FOUND naming the new id), the rest answer again until the stop."""
        self.moved.update(moves)
        by_worker: dict[int, tuple[WorkerHandle, list[str]]] = {}
        for sid in moves:
            rec = self.drop_session(sid)
            if rec is not None:
                by_worker.setdefault(rec.worker.slot, (rec.worker, []))[1].append(sid)
        self.moving = False
        await asyncio.gather(*[self.pool.call(w, "close", sids) for w, sids in by_worker.values()],
                             return_exceptions=True)

    # -- opening sessions -----------------------------------------------------------------
    def admit(self, owner: str, count: int) -> None:
        """Raises Refused (RESOURCE_EXHAUSTED) when count more sessions do not fit the replica or
        the owner's quotas."""
        if len(self.sessions) + len(self.building) + count > self.config.max_sessions:
            self.metrics.errors.labels("RESOURCE_EXHAUSTED").inc()
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"replica is full: {len(self.sessions)} of {self.config.max_sessions} sessions open")
        try:
            self.quotas.admit_sessions(owner, count)
        except QuotaExceeded as e:
            self.metrics.errors.labels("RESOURCE_EXHAUSTED").inc()
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None

    def readers_for(self, owner: str, requested=()) -> frozenset:
        try:
            return self.auth.readers_for(owner, requested) if self.auth.state_policies else frozenset()
        except Denied as e:
            raise Refused(e.code, e.message) from None

    async def open(self, env_id: str, count: int, config: dict, action_format: str,
                   owner: str = "", state_readers=(), stats_scope: str = "") -> tuple[list[str], str]:
        """Opens count sessions of env_id (0: one) spread over the workers: (ids, system prompt).
        Raises Refused with the gRPC status the Open call answers."""
        if self.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "replica is draining; open sessions elsewhere")
        if sessions_per_table(config) > 1 and env_id in self.specs:
            return await self.tables.open(env_id, count, config, action_format, owner,
                                          lambda code, message: Refused(getattr(grpc.StatusCode, code), message))
        spec = self.specs.get(env_id)
        if spec is None:
            # Only the ids the replica was started with: building a class for any other (an
            # `openenv:<module>:<Class>` imports the module) would run the caller's choice of code
            # here. Why a family cannot serve an id is told to the operator, at `envserve serve`.
            raise Refused(grpc.StatusCode.NOT_FOUND, f"env {env_id!r} is not served here; served: {self.env_ids}")
        count = count or 1
        if count < 0 or count > self.config.max_open_per_call:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"count must be 1..{self.config.max_open_per_call} (--max-open-per-call), got {count}: "
                          f"split the Open into calls of at most {self.config.max_open_per_call}")
        try:
            resolve_config(full_spec(spec), config)
        except ValueError as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        readers = self.readers_for(owner, state_readers)
        try:
            key = stats.stats_key(owner, env_id, stats_scope)
        except stats.BadScope as e:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self.admit(owner, count)
        workers = self.pick_workers(count)
        if not workers:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "no worker is running; try again shortly")
        self.enter()
        try:
            ids = [self.new_session_id() for _ in range(count)]
            plan: dict[int, tuple[WorkerHandle, list[str]]] = {}
            for sid, w in zip(ids, workers):
                plan.setdefault(w.slot, (w, []))[1].append(sid)
            replies = await self.build([(w, sids, "open", (env_id, config, action_format, sids, key))
                                        for w, sids in plan.values()])
            failure, prompt = None, ""
            for (w, sids), reply in zip(plan.values(), replies):
                if isinstance(reply, BaseException) or reply[0] != "ok":
                    failure = failure or reply
                else:
                    self.add_sessions(sids, env_id, w, owner, readers)
                    prompt = reply[1]
            if failure is not None:
                await self.close_sessions([sid for sid in ids if sid in self.sessions])
                if isinstance(failure, BaseException):
                    raise Refused(grpc.StatusCode.UNAVAILABLE, f"open failed: {failure}")
                raise Refused(getattr(grpc.StatusCode, failure[1]), failure[2])
            return ids, prompt
        finally:
            self.leave()

    # -- batches --------------------------------------------------------------------------
    def route(self, items: list[tuple], owner: str = "") -> tuple[list, dict]:
        """Split items ((kind, sid, ...)) by worker. Returns per-index errors (BatchResponse
        elements) and worker groups (worker, indices, items, env ids)."""
        results: list = [None] * len(items)
        groups: dict[int, tuple[WorkerHandle, list[int], list[tuple], list[str]]] = {}
        for i, item in enumerate(items):
            sid = item[1]
            rec, code, message = self.lookup(sid, owner)
            if rec is None:
                results[i] = convert.batch_element(convert.error_result(sid, code, message).SerializeToString())
                self.metrics.errors.labels(code).inc()
                continue
            g = groups.setdefault(rec.worker.slot, (rec.worker, [], [], []))
            g[1].append(i)
            g[2].append(item)
            g[3].append(rec.env_id)
        return results, groups

    async def run_batch(self, items: list[tuple], owner: str = "") -> bytes:
        """The serialized BatchResponse: the workers' framed elements joined in request order. An
        element that would take the reply past the message limit is replaced by its error (the
        step ran; ReadState reads what it saw), so the caller is never answered with nothing."""
        elements = await self.run_elements(items, owner)
        limit = self.config.max_message_bytes
        if sum(map(len, elements)) > limit:
            # Each result that does not fit becomes its (small) error; the errors of the results
            # after it are counted before it is kept, so the reply as a whole stays under the limit.
            errors = [convert.batch_element(convert.error_result(
                item[1], "RESOURCE_EXHAUSTED", f"this result ({len(element)} bytes) did not fit the reply's "
                f"limit of {limit} bytes with the others; it ran: read its observation with ReadState, "
                "and step fewer sessions per call").SerializeToString()) for item, element in zip(items, elements)]
            after = sum(map(len, errors))
            kept = 0
            for i, element in enumerate(elements):
                after -= len(errors[i])
                if kept + len(element) + after > limit:
                    elements[i] = errors[i]
                kept += len(elements[i])
        return b"".join(elements)

    async def run_elements(self, items: list[tuple], owner: "str | None" = "") -> list[bytes]:
        """Each item's StepResult framed as an element of BatchResponse.results, in request order.
        A table's seats take their turns (and may wait for them) beside the workers' items."""
        if self.tables.by_seat and any(it[1] in self.tables.by_seat for it in items):
            seated = [i for i, it in enumerate(items) if it[1] in self.tables.by_seat]
            rest = [i for i, it in enumerate(items) if it[1] not in self.tables.by_seat]
            turns = [self.tables.run(items[i], owner) if alone else self.tables.refuse_shared_batch(items[i][1])
                     for i, alone in zip(seated, self.tables.alone_at_table([items[i][1] for i in seated]))]
            got = await asyncio.gather(self.run_elements([items[i] for i in rest], owner), *turns)
            out: list = [None] * len(items)
            for i, element in zip(rest, got[0]):
                out[i] = element
            for i, data in zip(seated, got[1:]):
                out[i] = convert.batch_element(data)
            return out
        results, groups = self.route(items, owner)
        sent = [(w, *self.pool.request(w, "batch", group_items)) for w, _, group_items, _ in groups.values()]
        try:
            replies = await asyncio.gather(*[fut for _, fut, _ in sent], return_exceptions=True)
        except asyncio.CancelledError:  # the caller left: its items not yet run are skipped
            for w, _, rid in sent:
                if rid:
                    w.cancel([rid])
            raise
        observe = self.metrics.observe_step
        for (w, indices, group_items, env_ids), reply in zip(groups.values(), replies):
            if isinstance(reply, BaseException):
                stuck = getattr(reply, "stuck_index", None)
                for k, (i, item) in enumerate(zip(indices, group_items)):
                    results[i] = convert.batch_element(
                        convert.error_result(item[1], "DEADLINE_EXCEEDED", reply.stuck_message).SerializeToString()
                        if k == stuck else self.lost_result(item[1], reply))
                continue
            for i, env_id, (data, seconds) in zip(indices, env_ids, reply):
                results[i] = data
                observe(env_id, seconds)
        return results

    async def read_state(self, session_id: str, reader: Reader, turn: int = -1, episode: int | None = None,
                         trial: int | None = None) -> pb.GetStateResponse:
        """The ground truth of a session at a turn (StateService, and the HTTP fronts' own gateway),
        for a reader the Authenticator let in; Refused with the status otherwise."""
        sid = session_id
        if sid in self.tables.by_seat:  # a seat reads its table's game
            table, _, code, message = self.tables.find(sid, reader.owner)
            if table is None:
                raise Refused(getattr(grpc.StatusCode, code), message)
            sid = table.host
        rec, code, message = self.lookup(sid, reader=reader)
        if rec is None:
            raise Refused(getattr(grpc.StatusCode, code), message)
        try:
            reply = await self.pool.call(rec.worker, "get_state", (sid, turn, episode, trial))
        except WorkerLost as e:
            raise Refused(grpc.StatusCode.DATA_LOSS, f"session lost: {e}") from None
        if reply[0] != "ok":
            raise Refused(getattr(grpc.StatusCode, reply[1]), reply[2])
        state = pb.GetStateResponse.FromString(reply[1])
        state.session_id = session_id
        return state

    def lost_result(self, sid: str, exc: BaseException) -> bytes:
        self.metrics.errors.labels(LOST).inc()
        _, code, message = self.lookup(sid, None)
        if code != LOST:
            code, message = LOST, f"session lost: {exc}"
        return convert.error_result(sid, code, message).SerializeToString()


def _reset_item(it: pb.ResetItem) -> tuple:
    return ("reset", it.session_id, it.seed if it.HasField("seed") else None, it.task_id, it.split, it.same_task)


async def caller(context, check) -> str | None:
    """Runs an Authenticator check; a refusal ends the call with its status."""
    try:
        return check(context)
    except Denied as e:
        await context.abort(e.code, e.message)


class EnvService(pb_grpc.EnvServiceServicer):
    def __init__(self, replica: Replica):
        self.r = replica

    async def ListEnvs(self, request, context):
        await caller(context, self.r.auth.env_owner)
        return pb.ListEnvsResponse(envs=[convert.spec_to_proto(s) for s in self.r.specs.values()],
                                   replica_id=self.r.replica_id, live_sessions=len(self.r.sessions),
                                   capacity=self.r.config.max_sessions, draining=self.r.draining,
                                   max_open_per_call=self.r.config.max_open_per_call,
                                   max_batch_items=self.r.config.max_batch_items)

    async def served_spec(self, env_id: str, context):
        """The spec of an env this replica serves; NOT_FOUND for another."""
        spec = self.r.specs.get(env_id)
        if spec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"env {env_id!r} is not served here; served: {self.r.env_ids}")
        return spec

    async def GetSpec(self, request, context):
        await caller(context, self.r.auth.env_owner)
        return convert.spec_to_proto(await self.served_spec(request.env_id, context))

    async def ListTasks(self, request, context):
        await caller(context, self.r.auth.env_owner)
        spec = await self.served_spec(request.env_id, context)
        if request.page_size < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_size must be >= 0, got {request.page_size}")
        size = min(request.page_size or self.r.config.default_tasks_page, self.r.config.max_tasks_page)
        try:
            total = (spec.split(request.split) if request.split else spec.splits[0]).num_tasks
            start = tasks.parse_page_token(request.page_token, total)
        except (KeyError, tasks.TaskListError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e.args[0]))
        # An env may read a file or two to describe its tasks: off the event loop.
        page, total, next_start = await asyncio.to_thread(
            tasks.list_tasks, get_env_class(request.env_id), spec, request.split, start, size)
        return pb.ListTasksResponse(tasks=[convert.task_to_proto(t) for t in page], total=total,
                                    next_page_token="" if next_start is None else str(next_start))

    async def GetTaskStats(self, request, context):
        owner = await caller(context, self.r.auth.env_owner)
        await self.served_spec(request.env_id, context)
        try:
            key = stats.stats_key(owner, request.env_id, request.scope)
        except stats.BadScope as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name the stats scope the sessions were opened with")
        if self.r.directory is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's directory is not open yet")
        try:
            found = await asyncio.to_thread(self.r.directory.task_stats, key)
        except DirectoryUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the directory cannot be read: {e}")
        return pb.TaskStatsResponse(stats=[
            pb.TaskStat(task_id=t, episodes=o.episodes, successes=o.successes, return_sum=o.return_sum,
                        turns_sum=o.turns_sum, last_unix=o.last_unix, tokens_sum=o.tokens_sum)
        for t, o in sorted(found.items())])

    async def Open(self, request, context):
        owner = await caller(context, self.r.auth.env_owner)
        config = convert.config_from_proto(request)
        try:
            ids, prompt = await self.r.open(request.env_id, request.count, config, request.action_format, owner,
                                            request.state_readers, request.stats_scope)
        except Refused as e:
            await context.abort(e.code, e.message)
        return pb.OpenResponse(session_ids=ids, lease_seconds=self.r.config.lease_seconds, system_prompt=prompt,
                               live_sessions=len(self.r.sessions), counted_unix=time.time(),
                               max_open_per_call=self.r.config.max_open_per_call,
                               max_batch_items=self.r.config.max_batch_items)

    async def Reset(self, request, context):
        return await self._batch(request.items, _reset_item, context)

    async def Step(self, request, context):
        return await self._batch(request.items, _step_item, context)

    async def _batch(self, request_items, make_item, context) -> bytes:
        # Returns the serialized BatchResponse: worker-made results are framed, not re-encoded.
        r = self.r
        owner = await caller(context, r.auth.env_owner)
        n = len(request_items)
        if n > r.config.max_batch_items:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{n} items in one call; at most "
                                f"{r.config.max_batch_items} (--max-batch-items): split the batch")
        try:
            r.quotas.take_items(owner, n)
        except QuotaExceeded as e:
            r.metrics.errors.labels("RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        r.enter(n)
        try:
            return await r.run_batch([make_item(it) for it in request_items], owner)
        finally:
            r.leave(n)
            r.quotas.give_items(owner, n)

    async def Interact(self, request_iterator, context):
        """Results stream back as workers finish them; whatever is ready when the writer wakes
        travels in one response. Returns serialized InteractResponses (see app.py).

        Bounded: at most max_stream_items items of one stream are in flight or written but not
        yet read by the client; past that the stream's requests are not read (the client's sends
        wait, as gRPC's flow control makes them), so a client that never reads holds no more than
        that. A stream that ends (the client left, or its call was cancelled) cancels the work it
        started. A drain ends streams with nothing in flight at once, with UNAVAILABLE."""
        r = self.r
        owner = await caller(context, r.auth.env_owner)
        loop = asyncio.get_running_loop()
        ready: list[bytes] = []
        wake = asyncio.Event()
        room = asyncio.Event()
        room.set()
        cap = r.config.max_stream_items
        # Items arriving together are sent to each worker as one message, flushed on the next loop turn.
        outgoing: dict[int, tuple[WorkerHandle, list]] = {}
        out: dict[int, WorkerHandle] = {}  # worker requests still answering, by request id
        # pending: items accepted and not answered (each counted in flight for drain); quota:
        # those of them counted against the owner's max_in_flight.
        state = {"pending": 0, "quota": 0, "reading": True, "flush_scheduled": False, "closed": False,
                 "refused": "", "writing": 0}
        seated: set[asyncio.Task] = set()  # seats' turns still waiting

        def emit(tag: int, data: bytes, counted: bool = True) -> None:
            if state["closed"]:
                return
            state["pending"] -= 1
            r.leave()
            if counted:
                state["quota"] -= 1
                r.quotas.give_items(owner, 1)
            ready.append(convert.interact_result(tag, data))
            wake.set()

        def flush() -> None:
            state["flush_scheduled"] = False
            batches = list(outgoing.values())
            outgoing.clear()
            for w, entries in batches:
                tags = [e[0] for e in entries]
                sids = [e[1][1] for e in entries]
                done = [False] * len(entries)
                rid_box = [0]

                def on_item(result, tags=tags, sids=sids, done=done, rid_box=rid_box):
                    if isinstance(result, BaseException):
                        out.pop(rid_box[0], None)
                        for i, finished in enumerate(done):
                            if not finished:
                                done[i] = True
                                emit(tags[i], r.lost_result(sids[i], result))
                        return
                    for index, data, seconds in result:
                        done[index] = True
                        rec = r.sessions.get(sids[index])
                        if rec is not None:
                            r.metrics.observe_step(rec.env_id, seconds)
                        emit(tags[index], data)
                    if all(done):
                        out.pop(rid_box[0], None)

                rid = r.pool.stream(w, [e[1] for e in entries], on_item)
                if rid and not all(done):
                    rid_box[0] = rid
                    out[rid] = w

        def seat_answered(turn: asyncio.Task, tag: int, sid: str) -> None:
            seated.discard(turn)
            if turn.cancelled():
                return
            if turn.exception() is not None:
                log.error("a seat's turn failed", exc_info=turn.exception())
                emit(tag, convert.error_result(sid, "INTERNAL", f"{type(turn.exception()).__name__}: "
                                                               f"{turn.exception()}").SerializeToString())
                return
            emit(tag, turn.result())

        def accept(it: pb.InteractItem) -> None:
            state["pending"] += 1
            r.enter()
            kind = it.WhichOneof("request")
            if kind == "step":
                item = _step_item(it.step)
            elif kind == "reset":
                item = _reset_item(it.reset)
            else:
                emit(it.tag, convert.error_result("", "INVALID_ARGUMENT",
                                                  "item holds neither step nor reset").SerializeToString(), False)
                return
            try:
                r.quotas.take_items(owner, 1)
            except QuotaExceeded as e:
                r.metrics.errors.labels("RESOURCE_EXHAUSTED").inc()
                emit(it.tag, convert.error_result(item[1], "RESOURCE_EXHAUSTED", str(e)).SerializeToString(), False)
                return
            state["quota"] += 1
            if item[1] in r.tables.by_seat:  # answered at the seat's turn, maybe after later items
                turn = loop.create_task(r.tables.run(item, owner))
                seated.add(turn)
                turn.add_done_callback(lambda t, tag=it.tag, sid=item[1]: seat_answered(t, tag, sid))
                return
            rec, code, message = r.lookup(item[1], owner)
            if rec is None:
                r.metrics.errors.labels(code).inc()
                emit(it.tag, convert.error_result(item[1], code, message).SerializeToString())
                return
            outgoing.setdefault(rec.worker.slot, (rec.worker, []))[1].append((it.tag, item))

        def too_many(req) -> bool:
            if len(req.items) <= r.config.max_batch_items:
                return False
            state["refused"] = (f"{len(req.items)} items in one InteractRequest; at most "
                                f"{r.config.max_batch_items} (--max-batch-items)")
            return True

        async def read_requests():
            try:
                async for req in request_iterator:
                    if too_many(req):
                        break
                    for it in req.items:
                        accept(it)
                    if outgoing and not state["flush_scheduled"]:
                        state["flush_scheduled"] = True
                        loop.call_soon(flush)
                    while state["pending"] + len(ready) + state["writing"] >= cap:
                        room.clear()
                        await room.wait()
            finally:
                state["reading"] = False
                wake.set()

        def finish() -> None:
            state["closed"] = True
            for rid, w in list(out.items()):
                w.cancel([rid])   # its caller is gone: skip what has not run
            out.clear()
            r.leave(state["pending"])
            r.quotas.give_items(owner, state["quota"])

        if r.pool.inline and not r.tables.possible:
            # Items step as they are read, so each request's results are written before the next
            # is read: no reader task and no wake-up between reading and writing (~0.03 ms of a
            # one-session step).
            try:
                async for req in request_iterator:
                    if too_many(req):
                        break
                    for it in req.items:
                        accept(it)
                    flush()
                    if ready:
                        batch = ready[:]
                        ready.clear()
                        for data in self._frames(batch):
                            yield data
            finally:
                finish()
            if state["refused"]:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, state["refused"])
            return
        r.streams.add(wake)
        reader = loop.create_task(read_requests())
        try:
            while True:
                await wake.wait()
                wake.clear()
                if ready:
                    # Taken before the writes: results that finish while they wait join the next.
                    batch = ready[:]
                    ready.clear()
                    state["writing"] = len(batch)
                    for data in self._frames(batch):
                        yield data
                    state["writing"] = 0
                    room.set()
                if state["pending"] <= 0 and not ready:
                    if not state["reading"]:
                        break
                    if r.draining:
                        await context.abort(grpc.StatusCode.UNAVAILABLE,
                                            "replica is draining: this stream had nothing in flight; open "
                                            "sessions elsewhere (their calls answer where they moved)")
        finally:
            r.streams.discard(wake)
            reader.cancel()
            for turn in list(seated):
                turn.cancel()
            finish()
        if state["refused"]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, state["refused"])

    def _frames(self, ready: list[bytes]):
        """ready's results as InteractResponses, each under half the message limit."""
        limit = self.r.config.max_message_bytes // 2
        start, size = 0, 0
        for i, data in enumerate(ready):
            if size and size + len(data) > limit:
                yield convert.frame_repeated(1, ready[start:i])
                start, size = i, 0
            size += len(data)
        yield convert.frame_repeated(1, ready[start:] if start else ready)

    async def Fork(self, request, context):
        r = self.r
        owner = await caller(context, r.auth.env_owner)
        if r.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is draining; fork elsewhere")
        if request.session_id in r.tables.by_seat:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "a seat at a table cannot be forked: its game is shared with the other seat")
        rec, code, message = r.lookup(request.session_id, owner)
        if rec is None:
            await context.abort(getattr(grpc.StatusCode, code), message)
        count = request.count or 1
        if count < 0 or count > r.config.max_open_per_call:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"count must be 1..{r.config.max_open_per_call}")
        try:
            r.admit(owner, count)
        except Refused as e:
            await context.abort(e.code, e.message)
        r.enter()
        try:
            try:
                reply = await r.pool.call(rec.worker, "export", request.session_id)
            except WorkerLost as e:
                await context.abort(grpc.StatusCode.DATA_LOSS, f"session lost: {e}")
            if reply[0] != "ok":
                await context.abort(getattr(grpc.StatusCode, reply[1]), reply[2])
            blob = reply[1]
            ids = [r.new_session_id() for _ in range(count)]
            plan: dict[int, tuple[WorkerHandle, list[str]]] = {}
            for sid, w in zip(ids, r.pick_workers(count)):
                plan.setdefault(w.slot, (w, []))[1].append(sid)
            replies = await r.build([(w, sids, "adopt", (blob, sids)) for w, sids in plan.values()])
            failure = None
            for (w, sids), rep in zip(plan.values(), replies):
                if isinstance(rep, BaseException) or rep[0] != "ok":
                    failure = failure or rep
                else:
                    r.add_sessions(sids, rec.env_id, w, owner, rec.readers)
            if failure is not None:
                await r.close_sessions([sid for sid in ids if sid in r.sessions])
                if isinstance(failure, BaseException):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"fork failed: {failure}")
                await context.abort(getattr(grpc.StatusCode, failure[1]), failure[2])
            return pb.ForkResponse(session_ids=ids)
        finally:
            r.leave()

    async def Restore(self, request, context):
        """Rebuilds each history as a new session here (see Session.restore); one that cannot be
        replayed fails alone, with its status."""
        r = self.r
        owner = await caller(context, r.auth.env_owner)
        if r.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "replica is draining; restore elsewhere")
        count = len(request.sessions)
        if count > r.config.max_open_per_call:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {r.config.max_open_per_call} per call")
        try:
            r.admit(owner, count)
        except Refused as e:
            await context.abort(e.code, e.message)
        out = [pb.RestoredSession() for _ in range(count)]
        plan: dict[int, tuple[WorkerHandle, list[int], list]] = {}
        workers = iter(r.pick_workers(count))
        readers: dict[int, frozenset] = {}

        def refuse(i: int, code: str, message: str) -> None:
            out[i].status.CopyFrom(pb.ItemStatus(code=code_number(code), message=message))
            r.metrics.errors.labels(code).inc()

        for i, h in enumerate(request.sessions):
            spec = r.specs.get(h.env_id)
            if spec is None:
                refuse(i, "NOT_FOUND", f"env {h.env_id!r} is not served here")
                continue
            # A history longer than an episode can be is refused before it is copied anywhere:
            # replaying it could only diverge, after the front and a worker paid for its size.
            most = _most_turns(spec, h)
            if len(h.turns) > most:
                refuse(i, "INVALID_ARGUMENT", f"history of {len(h.turns)} turns; an episode of {h.env_id} "
                                              f"with this config has at most {most}")
                continue
            try:
                readers[i] = r.readers_for(owner, h.state_readers)
                history = convert.history_from_proto(h)
                history["stats_key"] = stats.stats_key(owner, h.env_id, h.stats_scope)
            except Refused as e:
                refuse(i, e.code.name, e.message)
                continue
            except ValueError as e:
                refuse(i, "INVALID_ARGUMENT", str(e))
                continue
            w = next(workers, None)
            if w is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is running; try again shortly")
            sid = r.new_session_id()
            out[i].session_id = sid
            plan.setdefault(w.slot, (w, [], []))[1].append(i)
            plan[w.slot][2].append((sid, history))
        r.enter()
        try:
            replies = await r.build([(w, [sid for sid, _ in items], "restore", items)
                                     for w, _, items in plan.values()])
            for (w, indices, items), reply in zip(plan.values(), replies):
                for k, (i, (sid, h)) in enumerate(zip(indices, items)):
                    got = ("error", "UNAVAILABLE", f"restore failed: {reply}") \
                        if isinstance(reply, BaseException) else reply[k]
                    if got[0] == "ok":
                        r.add_sessions([sid], h["env_id"], w, owner, readers.get(i, frozenset()))
                        out[i].anchor = got[1]
                    else:
                        out[i].session_id = ""
                        out[i].status.CopyFrom(pb.ItemStatus(code=code_number(got[1]), message=got[2]))
                        r.metrics.errors.labels(got[1]).inc()
            return pb.RestoreResponse(sessions=out, lease_seconds=r.config.lease_seconds)
        finally:
            r.leave()

    async def CloseSessions(self, request, context):
        owner = await caller(context, self.r.auth.env_owner)
        if len(request.session_ids) > self.r.config.max_batch_items:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.session_ids)} sessions in one "
                                f"CloseSessions; at most {self.r.config.max_batch_items} (--max-batch-items)")
        return pb.CloseResponse(statuses=await self.r.close_sessions(list(request.session_ids), owner))


def _cap(action: str) -> str:
    # Sessions reject texts over their own limit; never ship megabytes to a worker for that.
    return action if len(action) <= 1_048_576 else action[:1_048_577]


def _step_item(it: pb.StepItem) -> tuple:
    return ("step", it.session_id, _cap(it.action), it.generated_tokens)


def _most_turns(spec, h: pb.SessionHistory) -> int:
    """The most turns an episode of this history's session can have: its config's max_turns where
    it sets a number, else the highest the replica allows (the schema's maximum), else the env's."""
    if h.config_json:
        try:   # a config that cannot be read is refused when the history is read, naming why
            value = json.loads(h.config_json).get("max_turns")
        except (ValueError, AttributeError, RecursionError):
            value = None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
            return int(min(value, 2 ** 31))
    elif h.HasField("config") and "max_turns" in h.config.fields:
        value = h.config.fields["max_turns"]
        if value.WhichOneof("kind") == "number_value" and value.number_value == value.number_value:
            return int(min(value.number_value, 2 ** 31))
    bound = full_spec(spec).config_schema().get("properties", {}).get("max_turns", {}).get("maximum")
    return int(bound) if bound is not None else spec.max_turns


class StateService(pb_grpc.StateServiceServicer):
    def __init__(self, replica: Replica):
        self.r = replica

    async def GetState(self, request, context):
        """Deprecated: its turn has no presence, so an unset turn is turn 0."""
        return await self._state(request.session_id, request.turn, request, context)

    async def ReadState(self, request, context):
        return await self._state(request.session_id, request.turn if request.HasField("turn") else -1,
                                 request, context)

    async def _state(self, sid: str, turn: int, request, context):
        reader = await caller(context, self.r.auth.reader)
        try:
            return await self.r.read_state(sid, reader, turn, request.episode if request.HasField("episode") else None,
                                           request.trial if request.HasField("trial") else None)
        except Refused as e:
            await context.abort(e.code, e.message)
