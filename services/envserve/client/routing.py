"""RoutedClient: many replicas behind one client, found through the directory, no proxy in between.

Open picks the least-loaded replicas serving the environment; every later call goes straight to
the replica a session id names (`<replica_id>/<token>`). Batches are split by replica and sent in
parallel; one replica's failure fails only its own items.

A session outlives its replica: the client keeps each session's reset arguments and actions
(recovery.py) and, when a call finds the session lost (its replica dead, drained or restarted, its
worker killed), rebuilds it on a live replica with Restore, which replays them and checks every
turn's anchor, then answers the call as if nothing had happened. The caller keeps its session id.
`recovery=False` turns this off.
"""
from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Any, Iterable, Mapping, Sequence

import grpc

from envserve.common.tables import count_problem, sessions_per_table
from envserve.directory import Directory, DirectoryUnavailable, ReplicaInfo, replica_of
from envserve.v1 import envserve_pb2 as pb

from . import _requests as rq
from . import seats
from .addresses import directory_for
from .call_limits import parts
from .client import EnvClient
from .errors import EnvNotFoundError, EnvServeError, UnavailableError, from_unary_error, make_error
from .recovery import RecoverySettings, SessionTable, lost_result, replica_gone

_TIE_RANDOM = random.SystemRandom()

# Failures of a whole Open that mean "try another replica".
_RETRY_ELSEWHERE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.DEADLINE_EXCEEDED}


# How long a recovery waits for a draining replica to move a session before rebuilding it itself.
DRAIN_MOVE_WAIT = 10.0

# Failures of a whole call that refuse the caller, or say the replica is slow, rather than that the
# call broke under it.
_REFUSALS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


def broken_call_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """The code a call's items get when the call failed as a whole: a replica killed mid-call ends it
    with whatever its transport gave (INTERNAL "Internal error from Core", CANCELLED, UNKNOWN), and
    all of them mean the replica did not answer: UNAVAILABLE, so the sessions are rebuilt."""
    return code if code in _REFUSALS else grpc.StatusCode.UNAVAILABLE


def _item_failure(sid: str, code: grpc.StatusCode, message: str) -> pb.StepResult:
    return pb.StepResult(session_id=sid, status=pb.ItemStatus(code=code.value[0], message=message))


def _on(item, session_id: str):
    """The item (StepItem, ResetItem) addressed to session_id."""
    if item.session_id == session_id:
        return item
    copy = type(item)()
    copy.CopyFrom(item)
    copy.session_id = session_id
    return copy


def indices_by_replica(items: list, sid_of) -> dict[str, list[int]]:
    """The positions of `items` grouped by the replica their session lives on (its id's prefix)."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(replica_of(sid_of(item)), []).append(i)
    return groups


class Router:
    """What the sync and async routed clients share: the cached replica list, where to open,
    and which replica a session lives on. directory: a Directory, its URL, or the replicas'
    addresses (one, a list, or a string joined by commas; see addresses.py). use_external:
    connect to the replicas' external addresses (published container ports). recovery: rebuild lost
    sessions on live replicas (True, the default), not (False), or RecoverySettings.
    retire_after_seconds: a replica missing from every successful listing for this long is gone
    (killed, drained, replaced under a new id): its connections are closed, so a long run over
    replicas that come and go holds connections to the live ones only. The same holds for an
    address: a replica restarted under its id elsewhere (a new port, a new pod IP) leaves its old
    address's connection behind, closed once that address has been unlisted for as long.
    max_open_per_call: the most sessions one Open asks of a replica (0: as many as it takes, which
    its heartbeat or replies say); a replica's share of a larger count goes in several Opens."""

    client_class = EnvClient

    def __init__(self, directory: "Directory | str | Sequence[str]", token: str | None = None, state_token: str | None = None,
                 root_certificates: "bytes | str | None" = None, tls: bool = False, use_external: bool = False,
                 timeout: float | None = 60.0, refresh_seconds: float = 1.0, max_open_per_call: int = 0,
                 retire_after_seconds: float = 120.0,
                 recovery: "RecoverySettings | bool" = True, state_readers: Sequence[str] = (),
                 stats_scope: str = ""):
        self.directory = directory_for(directory, token, root_certificates, tls)
        self._owns_directory = self.directory is not directory
        self.state_readers = tuple(state_readers)
        self.stats_scope = stats_scope
        self.client_kw = dict(token=token, state_token=state_token, root_certificates=root_certificates,
                              tls=tls, timeout=timeout, state_readers=self.state_readers, stats_scope=stats_scope,
                              max_open_per_call=max_open_per_call)
        self.use_external = use_external
        self.refresh_seconds = refresh_seconds
        self.max_open_per_call = max_open_per_call
        self._lock = threading.Lock()
        self._known: dict[str, ReplicaInfo] = {}
        self._seen: dict[str, ReplicaInfo] = {}  # every replica listed so far, as last listed
        self.retire_after_seconds = retire_after_seconds
        self._missing_since: dict[str, float] = {}  # seen replicas absent from the last listings
        self._unlisted_since: dict[tuple[str, str], float] = {}  # client keys whose address is not listed
        self._fetched = 0.0
        self._opened: dict[str, list[tuple[float, int]]] = {}  # replica -> (when, n) not yet in its count
        # How this client breaks ties between equally loaded replicas: its own random order, so
        # clients opening at once from a listing they all read pick different replicas first.
        self._tie_rank: dict[str, float] = {}
        self._clients: dict[tuple[str, str], EnvClient] = {}
        self._blocking: dict[tuple[str, str], EnvClient] = {}
        if not isinstance(recovery, RecoverySettings):
            recovery = RecoverySettings(enabled=bool(recovery))
        self.sessions = SessionTable(recovery)

    # -- the directory, cached for refresh_seconds ---------------------------------------------
    def replicas(self, env_id: str | None = None, refresh: bool = False) -> list[ReplicaInfo]:
        """Live replicas. While the directory is unreachable the last list is used as it was."""
        if refresh or time.monotonic() - self._fetched >= self.refresh_seconds:
            try:
                found = self.directory.replicas()
            except DirectoryUnavailable:
                if not self._known:
                    raise
            else:
                with self._lock:
                    self._known = {r.replica_id: self._fresher(r) for r in found}
                    self._seen.update(self._known)
                    self._fetched = now = time.monotonic()
                    self._forget_counted()
                    gone = self._gone_since(now)
                if gone:
                    self._retire(gone)
        return [r for r in self._known.values() if env_id is None or env_id in r.envs]

    def _fresher(self, listed: ReplicaInfo) -> ReplicaInfo:
        """(Under the lock.) A listed replica, with the count an Open's answer gave where that is
        newer than the listing's heartbeat (the same run of the replica: counts of another are moot)."""
        known = self._known.get(listed.replica_id)
        counted = listed.counted_unix or listed.heartbeat_unix
        if (known is None or not counted or known.started_unix != listed.started_unix
                or known.counted_unix <= counted):
            return listed
        return dataclasses.replace(listed, live_sessions=known.live_sessions, counted_unix=known.counted_unix)

    def _forget_counted(self) -> None:
        """(Under the lock, after a listing.) Drop the openings each replica's listed count already
        holds: those before it counted its sessions. A heartbeat can be older than this client's
        last openings; forgetting those would send the next ones all to the same replica."""
        for rid in list(self._opened):
            r = self._known.get(rid)
            counted = (r.counted_unix or r.heartbeat_unix) if r is not None else 0.0
            kept = [e for e in self._opened[rid] if counted and e[0] > counted]
            if kept:
                self._opened[rid] = kept
            else:
                del self._opened[rid]

    def _opened_since_count(self, replica_id: str) -> int:
        return sum(n for _, n in self._opened.get(replica_id, ()))

    def _gone_since(self, now: float) -> list:
        """(Under the lock, after a listing.) The clients of replicas absent from every listing for
        retire_after_seconds, and of addresses no replica has been listed at for as long, forgotten.
        Absent from one listing is not gone: Redis restarted empty lists no one until the replicas'
        next heartbeats."""
        for rid in self._seen:
            if rid in self._known:
                self._missing_since.pop(rid, None)
            else:
                self._missing_since.setdefault(rid, now)
        gone = {rid for rid, t in self._missing_since.items() if now - t >= self.retire_after_seconds}
        for rid in gone:
            del self._missing_since[rid]
            del self._seen[rid]
        # A client is kept per (replica, address): a replica listed again under its id at another
        # address (restarted, rescheduled) leaves the old address's client unused for good.
        listed = {(rid, self.address(r)) for rid, r in self._known.items()}
        keys = {k for table in (self._clients, self._blocking) for k in table}
        for key in list(self._unlisted_since):
            if key in listed or key not in keys:
                del self._unlisted_since[key]
        for key in keys - listed:
            self._unlisted_since.setdefault(key, now)
        stale = {k for k, t in self._unlisted_since.items() if now - t >= self.retire_after_seconds}
        if not gone and not stale:
            return []
        clients = []
        for table in (self._clients, self._blocking):
            for key in [k for k in table if k[0] in gone or k in stale]:
                self._unlisted_since.pop(key, None)
                c = table.pop(key)
                if all(c is not other for other in clients):
                    clients.append(c)
        return clients

    def _retire(self, clients: list) -> None:
        """Close the clients of replicas that are gone (the async router closes them on its loop)."""
        for c in clients:
            c.close()

    def address(self, r: ReplicaInfo) -> str:
        """Where to reach a replica: its external address (published port) with use_external."""
        return (r.external_address or r.address) if self.use_external else r.address

    def load(self, r: ReplicaInfo) -> int:
        """Its live sessions as last heard, plus what this client opened there since (-1: unknown)."""
        if r.live_sessions < 0:
            return -1
        return r.live_sessions + self._opened_since_count(r.replica_id)

    def client_for(self, r: ReplicaInfo):
        """The replica's client, knowing its limits per call as listed (its heartbeat)."""
        key = (r.replica_id, self.address(r))
        with self._lock:
            c = self._clients.get(key)
            if c is None:
                c = self._clients[key] = self.client_class(key[1], **self.client_kw)
        c.limits.note(r)
        return c

    def blocking_client(self, r: ReplicaInfo) -> EnvClient:
        """A blocking EnvClient for a replica (the async client's recovery runs in a thread)."""
        if self.client_class is EnvClient:
            return self.client_for(r)
        key = (r.replica_id, self.address(r))
        with self._lock:
            c = self._blocking.get(key)
            if c is None:
                c = self._blocking[key] = EnvClient(key[1], **self.client_kw)
        c.limits.note(r)
        return c

    def _replica_for(self, session_id: str) -> ReplicaInfo | None:
        """Where a session's replica is: as listed now, else as last listed. A replica missing from
        the listing may be alive (Redis restarted empty, its next heartbeat not yet written): calls
        still go there, and one that fails finds it gone (still_listed)."""
        rid = replica_of(session_id)
        r = self._known.get(rid)
        if r is None:
            try:
                self.replicas(refresh=True)
            except DirectoryUnavailable:
                pass
            r = self._known.get(rid) or self._seen.get(rid)
        return r

    # -- opening: least loaded first ------------------------------------------------------------
    def plan(self, env_id: str, count: int, exclude: set[str] = frozenset()) -> dict[str, int]:
        """How many of count new sessions each replica gets: always the one with the lowest
        (live + planned) / capacity, counting what this client opened since the last heartbeat."""
        candidates = [r for r in self.replicas(env_id) if not r.draining and r.replica_id not in exclude]
        load = {r.replica_id: r.live_sessions + self._opened_since_count(r.replica_id) for r in candidates}
        caps = {r.replica_id: max(1, r.capacity) for r in candidates}
        shares: dict[str, int] = {}
        for _ in range(count):
            open_ones = [rid for rid in load if load[rid] < caps[rid]]
            if not open_ones:
                break
            rid = min(open_ones, key=lambda i: (load[i] / caps[i], load[i], self._tie(i)))
            load[rid] += 1
            shares[rid] = shares.get(rid, 0) + 1
        return shares

    def _tie(self, replica_id: str) -> float:
        rank = self._tie_rank.get(replica_id)
        if rank is None:
            # Not the global generator: trainers seed it alike in every process.
            rank = self._tie_rank[replica_id] = _TIE_RANDOM.random()
        return rank

    def open_deadline(self) -> float:
        """Until when Open waits for a replica to appear while none can take its sessions: as long as
        a recovery would (a Redis restarted empty lists no replica until their next heartbeats);
        not at all with recovery off."""
        return time.monotonic() + (self.sessions.settings.timeout_seconds if self.sessions.enabled else 0.0)

    def check_served(self, env_id: str) -> None:
        """NOT_FOUND at once for an env no replica listed so far serves (while replicas are listed):
        waiting would not make it appear. One whose replicas are all restarting is waited for."""
        try:
            self.replicas()
        except DirectoryUnavailable:
            return
        if self._seen and not any(env_id in r.envs for r in self._seen.values()):
            served = sorted({e for r in self._seen.values() for e in r.envs})
            raise EnvNotFoundError(grpc.StatusCode.NOT_FOUND, f"{env_id!r} is not served by any replica; served: {served}")

    def listed(self, env_id: str) -> bool:
        """Whether any replica not draining is listed for env_id (in the cached listing)."""
        return any(not r.draining for r in self.replicas(env_id))

    def _refresh_quietly(self) -> None:
        try:
            self.replicas(refresh=True)
        except DirectoryUnavailable:
            pass

    def note_opened(self, replica_id: str, n: int) -> None:
        """Count n sessions opened on a replica until its next heartbeat reports them."""
        self.reserve(replica_id, n)

    def reserve(self, replica_id: str, n: int) -> list:
        """Count n sessions as opening on a replica from now, before its Open answers, so openers
        running at the same time see them and go elsewhere; settle() it once the Open answered."""
        entry = [time.time(), n]
        with self._lock:
            self._opened.setdefault(replica_id, []).append(entry)
        return entry

    def settle(self, replica_id: str, entry: list, opened: int, reply: "pb.OpenResponse | None" = None) -> None:
        """A reservation's Open answered with `opened` sessions (0: it failed): they count from now
        until a heartbeat has counted them. The reply's own count of the replica's sessions (newer
        than its heartbeat) replaces the listed one, with this client's openings it already holds:
        other processes' openings there count at once, not a heartbeat later."""
        with self._lock:
            entries = self._opened.setdefault(replica_id, [])
            kept = next((i for i, e in enumerate(entries) if e is entry), None)
            if kept is not None:
                del entries[kept]
            r = self._known.get(replica_id)
            if (reply is not None and reply.counted_unix and r is not None
                    and reply.counted_unix > (r.counted_unix or r.heartbeat_unix)):
                self._known[replica_id] = dataclasses.replace(
                    r, live_sessions=reply.live_sessions, counted_unix=reply.counted_unix)
                entries[:] = [e for e in entries if e[0] > reply.counted_unix]
            elif opened:
                entries.append([time.time(), opened])
            if not entries:
                del self._opened[replica_id]

    def claim(self, env_id: str, count: int, exclude: set[str] = frozenset(),
              unit: int = 1) -> dict[str, tuple[int, list]]:
        """plan(), each share reserved at once: replica -> (sessions, reservation to settle). Shares
        come in whole units (a table's seats stay on one replica)."""
        return {rid: (n * unit, self.reserve(rid, n * unit))
                for rid, n in self.plan(env_id, count // unit, exclude).items()}

    def still_listed(self, replica_id: str) -> bool:
        """After a replica stopped answering: is it still registered? (No: it is gone.)"""
        try:
            self.replicas(refresh=True)
        except DirectoryUnavailable:
            return True  # cannot tell: report it unavailable, not lost
        return replica_id in self._known

    # -- recovery: rebuild lost sessions elsewhere (blocking; the async client calls it in a thread) --
    def restore(self, session_ids: Sequence[str], avoid: "set[str] | frozenset" = frozenset()
                ) -> "dict[str, str | pb.StepResult]":
        """Rebuilds each caller session from its history on a live replica, least loaded first and
        never on one in `avoid` (unreachable) until none other is left. Returns, per session, the id
        that holds it now, or the DATA_LOSS item the caller gets when it cannot be rebuilt: no
        history kept, a replay that diverged (the turn is named), or no replica within the timeout."""
        table = self.sessions
        out: dict[str, "str | pb.StepResult"] = {}
        pending = []
        for sid in self._follow_moves(dict.fromkeys(session_ids), out):
            why = table.why_not(sid)
            if why:
                out[sid] = lost_result(sid, why)
            else:
                pending.append(sid)
        avoid = set(avoid)
        deadline = time.monotonic() + table.settings.timeout_seconds
        last = "no live replica serves its environment"
        while pending:
            tried = False
            by_env: dict[str, list[str]] = {}
            for sid in pending:
                by_env.setdefault(table.log(sid).env_id, []).append(sid)
            for env_id, group in by_env.items():
                try:
                    shares = self.plan(env_id, len(group), avoid)
                except DirectoryUnavailable:
                    shares = {}
                rest = iter(group)
                for rid, n in shares.items():
                    batch = [next(rest) for _ in range(n)]
                    tried = True
                    try:
                        reply = self.blocking_client(self._known[rid]).restore([table.history(s) for s in batch])
                    except EnvServeError as e:
                        if e.code not in _RETRY_ELSEWHERE:
                            out.update((s, lost_result(s, f"replica {rid} refused it: {e.message}")) for s in batch)
                        avoid.add(rid)
                        last = f"replica {rid}: {e.message}"
                        continue
                    for s, got in zip(batch, reply.sessions):
                        if got.status.code == 0:
                            table.moved(s, got.session_id)
                            self.note_opened(rid, 1)
                            out[s] = got.session_id
                        elif grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] == got.status.code:
                            avoid.add(rid)
                        else:
                            out[s] = lost_result(s, got.status.message)
            pending = [s for s in pending if s not in out]
            if not pending:
                break
            if time.monotonic() >= deadline:
                out.update((s, lost_result(s, f"no replica took it within {table.settings.timeout_seconds:g} s "
                                              f"({last})")) for s in pending)
                break
            if not tried:
                # Nothing left to try: wait for a replica to come (back), then try every one again.
                time.sleep(0.2)
                avoid.clear()
            self._refresh_quietly()
        return out

    def _follow_moves(self, session_ids, out: dict) -> list[str]:
        """Sessions a draining replica moved (recorded in the directory) now answer under their new
        ids: noted in `out`. Those of a replica still draining are waited for while it moves them
        (up to DRAIN_MOVE_WAIT s). Returns the sessions left to rebuild from their histories."""
        self._refresh_quietly()
        left = []
        deadline = time.monotonic() + DRAIN_MOVE_WAIT
        waiting = list(session_ids)
        while waiting:
            still = []
            for sid in waiting:
                real = self.sessions.current(sid)
                try:
                    new = self.directory.moved_to(real)
                except DirectoryUnavailable:
                    new = None
                if new:
                    self.sessions.moved(sid, new)
                    out[sid] = new
                elif (r := self._known.get(replica_of(real))) is not None and r.draining:
                    still.append(sid)
                else:
                    left.append(sid)
            if not still or time.monotonic() >= deadline:
                return left + still
            time.sleep(0.1)
            self._refresh_quietly()
            waiting = still
        return left

    def moved_address(self, session_id: str) -> bool:
        """After a call to a session's replica failed UNAVAILABLE: whether the directory now lists
        that replica at another address (restarted under its id elsewhere), so the call may go again."""
        rid = replica_of(session_id)
        before = self._known.get(rid) or self._seen.get(rid)
        self._refresh_quietly()
        after = self._known.get(rid)
        return before is not None and after is not None and self.address(after) != self.address(before)

    def _lost_items(self, items: list, results: list, given_up: set) -> list[int]:
        """Positions of the items whose session was lost and may be rebuilt."""
        table = self.sessions
        return [i for i, r in enumerate(results)
                if i not in given_up and table.recoverable(items[i].session_id, r.status.code)]

    def _avoid(self, items: list, results: list, lost: list[int]) -> set[str]:
        """Replicas that did not answer at all: rebuild elsewhere first."""
        return {replica_of(self.sessions.current(items[i].session_id)) for i in lost if replica_gone(results[i])}

    def _lost(self, sid: str, rid: str) -> pb.StepResult:
        return _item_failure(sid, grpc.StatusCode.DATA_LOSS,
                             f"session lost: its replica {rid!r} is gone ({self.directory.gone_because})")

    def _unreachable(self, sid: str, r: ReplicaInfo, code: grpc.StatusCode, details: str, gone: bool):
        return self._lost(sid, r.replica_id) if gone else _item_failure(
            sid, code, f"replica {r.replica_id} at {self.address(r)}: {details}")


class RoutedClient(Router):
    """Synchronous: Open spreads over replicas; batches are split by replica and sent at once
    (gRPC futures), results in request order."""

    def open_sessions(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                      action_format: str = "") -> pb.OpenResponse:
        """Opens count sessions, spread over replicas; returns ids (in no particular replica order),
        the smallest lease and the system prompt."""
        opened: list[str] = []
        lease, prompt = 0.0, ""
        tried: set[str] = set()
        last_error: EnvServeError | None = None
        remaining = count
        unit = sessions_per_table(config)
        if unit > 1 and count_problem(count):
            raise make_error(grpc.StatusCode.INVALID_ARGUMENT, count_problem(count))
        self.check_served(env_id)
        deadline = self.open_deadline()
        while remaining > 0:
            claims = self.claim(env_id, remaining, tried, unit)
            if not claims:
                if time.monotonic() >= deadline or self.listed(env_id):
                    break  # full or refusing replicas answer at once; only an empty listing is waited out
                time.sleep(0.2)  # no replica now (all restarting, Redis restarted empty): wait for one
                self._refresh_quietly()
                tried.clear()
                continue
            calls, got, replies = [], {rid: 0 for rid in claims}, {}
            refused: EnvServeError | None = None
            for rid, (n, _) in claims.items():
                stub = self.client_for(self._known[rid])
                # Each replica's share in Opens it takes (its limit, within this client's own).
                per_call = stub.limits.open_size(self.max_open_per_call, unit)
                for start in range(0, n, per_call):
                    k = min(per_call, n - start)
                    req = rq.open_request(env_id, k, config, action_format, self.state_readers, self.stats_scope)
                    calls.append((stub, rid, stub.env.Open.future(req, timeout=stub.timeout, metadata=stub.metadata)))
            try:
                for stub, rid, fut in calls:
                    try:
                        resp = fut.result()
                    except grpc.RpcError as e:
                        err = from_unary_error(e)
                        if err.code not in _RETRY_ELSEWHERE:
                            # The calls still running are waited for, so what they open is closed too.
                            refused = refused or err
                            continue
                        last_error = err
                        tried.add(rid)
                        continue
                    stub.limits.note(resp)
                    opened.extend(resp.session_ids)
                    remaining -= len(resp.session_ids)
                    lease = min(lease, resp.lease_seconds) if lease else resp.lease_seconds
                    prompt = prompt or resp.system_prompt
                    got[rid] += len(resp.session_ids)
                    if rid not in replies or resp.counted_unix > replies[rid].counted_unix:
                        replies[rid] = resp
            finally:
                for rid, (_, entry) in claims.items():
                    self.settle(rid, entry, got[rid], replies.get(rid))
            if refused is not None:
                self.close_sessions(opened)  # all or nothing, as one replica's Open is
                raise refused
        if remaining > 0:
            self.close_sessions(opened)
            if last_error is not None:
                raise last_error
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE,
                                   f"no live replica serving {env_id!r} has room for {count} sessions")
        self.sessions.opened(opened, env_id, config, action_format, self.state_readers, self.stats_scope)
        seats.note_opened(opened, config)
        return pb.OpenResponse(session_ids=opened, lease_seconds=lease, system_prompt=prompt)

    def open(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
             action_format: str = "") -> list[str]:
        return list(self.open_sessions(env_id, count, config, action_format).session_ids)

    # -- batches: split by replica, sent in parallel ----------------------------------------------
    def _fan_out(self, items: list, sid_of, method: str, build, field: str = "results") -> list:
        results: list = [None] * len(items)
        calls = []
        for rid, indices in indices_by_replica(items, sid_of).items():
            r = self._replica_for(sid_of(items[indices[0]]))
            if r is None:
                for i in indices:
                    results[i] = self._lost(sid_of(items[i]), rid)
                continue
            c = self.client_for(r)
            for part in parts(indices, c.limits.batch_size()):  # what the replica takes in one call
                fut = getattr(c.env, method).future(build([items[i] for i in part]), timeout=c.timeout,
                                                    metadata=c.metadata)
                calls.append((r, part, fut))
        for r, indices, fut in calls:
            try:
                batch = getattr(fut.result(), field)
            except grpc.RpcError as e:
                # The replica as a whole failed (down, or refusing the token): its items only.
                # Unreachable and gone from the directory means dead: its sessions are lost.
                code = broken_call_code(e.code())
                gone = code == grpc.StatusCode.UNAVAILABLE and not self.still_listed(r.replica_id)
                details = e.details() if code == e.code() else f"{e.code().name}: {e.details()}"
                for i in indices:
                    results[i] = self._unreachable(sid_of(items[i]), r, code, details, gone)
                continue
            for i, res in zip(indices, batch):
                results[i] = res
        return results

    def reset(self, session_ids: Sequence[str], seeds=None, task_id: str = "", split: str = "",
              same_task: bool = False) -> list[pb.StepResult]:
        items = list(rq.reset_request(session_ids, seeds, task_id, split, same_task).items)
        return self._items(items, "Reset", lambda its: pb.ResetRequest(items=its))

    def step(self, actions: "Mapping[str, str] | Iterable[tuple]") -> list[pb.StepResult]:
        items = list(rq.step_request(actions).items)
        return self._items(items, "Step", lambda its: pb.StepRequest(items=its))

    def _items(self, items: list, method: str, build) -> list[pb.StepResult]:
        """A batch of StepItems or ResetItems under the caller's ids: sent to where each session
        is now; lost ones are rebuilt and sent again; results recorded and shown under the caller's ids."""
        table = self.sessions

        def send(positions):
            return self._fan_out([_on(items[i], table.current(items[i].session_id)) for i in positions],
                                 lambda it: it.session_id, method, build)
        results = send(range(len(items)))
        given_up: set[int] = set()
        for _ in range(table.settings.attempts):
            lost = self._lost_items(items, results, given_up)
            if not lost:
                break
            moved = self.restore([items[i].session_id for i in lost], self._avoid(items, results, lost))
            again = []
            for i in lost:
                got = moved[items[i].session_id]
                if isinstance(got, str):
                    again.append(i)
                else:
                    results[i] = got
                    given_up.add(i)
            for i, r in zip(again, send(again)):
                results[i] = r
        return [table.answer(it.session_id, r, it.action if method == "Step" else None)
                for it, r in zip(items, results)]

    def _with_recovery(self, session_id: str, call):
        """call(id of the session now) for one caller session, rebuilt once if it was lost."""
        table = self.sessions
        real = table.current(session_id)
        try:
            return call(real)
        except EnvServeError as e:
            if e.code == grpc.StatusCode.UNAVAILABLE and self.moved_address(real):
                return self._with_recovery(session_id, call)
            if not table.recoverable(session_id, e.code.value[0]):
                raise
            avoid = {replica_of(real)} if e.code == grpc.StatusCode.UNAVAILABLE else set()
            got = self.restore([session_id], avoid)[session_id]
            if not isinstance(got, str):
                raise make_error(grpc.StatusCode.DATA_LOSS, got.status.message, session_id) from None
            return call(got)

    def _session_client(self, session_id: str) -> EnvClient:
        r = self._replica_for(session_id)
        if r is None:
            raise make_error(grpc.StatusCode.DATA_LOSS,
                             f"session lost: its replica {replica_of(session_id)!r} is gone", session_id)
        return self.client_for(r)

    def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                  trial: int | None = None) -> pb.GetStateResponse:
        state = self._with_recovery(
            session_id, lambda real: self._session_client(real).get_state(real, turn, episode, trial))
        state.session_id = session_id
        return state

    def fork(self, session_id: str, count: int = 1) -> list[str]:
        children = self._with_recovery(session_id, lambda real: self._session_client(real).fork(real, count))
        self.sessions.forked(session_id, children)
        return children

    def close_sessions(self, session_ids: Sequence[str]) -> list[pb.ItemStatus]:
        ids = list(session_ids)
        if not ids:
            return []
        real = [self.sessions.current(s) for s in ids]
        self.sessions.closed(ids)
        seats.note_closed(ids)
        results = self._fan_out(real, lambda s: s, "CloseSessions", lambda sids: pb.CloseRequest(session_ids=sids),
                                "statuses")
        # CloseSessions answers statuses, not StepResults; _fan_out placed either kind.
        return [r if isinstance(r, pb.ItemStatus) else r.status for r in results]

    def list_envs(self) -> list[pb.EnvSpec]:
        """Every environment some live replica serves (one spec per env)."""
        specs: dict[str, pb.EnvSpec] = {}
        for r in self.replicas():
            if all(e in specs for e in r.envs):
                continue
            for s in self.client_for(r).list_envs():
                specs.setdefault(s.env_id, s)
        return list(specs.values())

    def get_spec(self, env_id: str) -> pb.EnvSpec:
        candidates = self.replicas(env_id)
        if not candidates:
            raise make_error(grpc.StatusCode.NOT_FOUND, f"no live replica serves {env_id!r}")
        return self.client_for(candidates[0]).get_spec(env_id)

    def _any_replica(self, env_id: str, call):
        """call(client) on the first replica serving env_id that answers: one the directory still
        lists for a moment after it died is passed over."""
        candidates = self.replicas(env_id)
        if not candidates:
            raise make_error(grpc.StatusCode.NOT_FOUND, f"no live replica serves {env_id!r}")
        for r in candidates[:-1]:
            try:
                return call(self.client_for(r))
            except UnavailableError:
                continue
        return call(self.client_for(candidates[-1]))

    def list_tasks(self, env_id: str, split: str = "", page_size: int = 0, page_token: str = "") -> pb.ListTasksResponse:
        """A page of a split's tasks, from any replica serving the env (they list the same tasks)."""
        return self._any_replica(env_id, lambda c: c.list_tasks(env_id, split, page_size, page_token))

    def task_stats(self, env_id: str, scope: str | None = None) -> list[pb.TaskStat]:
        """A stats scope's finished episodes per task, from any replica serving the env (with a
        shared directory, they all read the same table)."""
        return self._any_replica(env_id, lambda c: c.task_stats(env_id, scope))

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()
        self._blocking.clear()  # the sync client's blocking clients are its own clients
        if self._owns_directory:
            self.directory.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
