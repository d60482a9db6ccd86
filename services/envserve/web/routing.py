"""The replicas behind the HTTP facade: from a directory and/or fixed addresses, one grpc.aio
channel per replica, and which replica opens the next sessions.

The directory's replicas come through the client's Router (its cached list, liveness, address
choice and the count of sessions opened since the last heartbeat), as every routed client reads
them; this table adds what only the facade has: fixed addresses asked who they are, per-caller
credentials, and MonitorService targets."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict

import grpc

from envserve.client.client import make_channel
from envserve.client.routing import Router
from envserve.directory import DirectoryUnavailable, ReplicaInfo, open_directory
from envserve.v1 import envserve_pb2 as pb
from envserve.v1 import envserve_pb2_grpc as pb_grpc

log = logging.getLogger("envserve.web")
REMEMBERED_REPLICAS = 4096  # ids of replicas seen, to tell a lost session from an unknown one


@dataclasses.dataclass
class Stubs:
    channel: grpc.aio.Channel
    env: pb_grpc.EnvServiceStub
    state: pb_grpc.StateServiceStub
    monitor: pb_grpc.MonitorServiceStub


class ReplicaTable:
    """directory_url: replicas registered there (their `address`, or `external_address` with
    use_external). addresses: fixed HOST:PORT replicas, asked for their id and envs (ListEnvs).
    Fixed replicas use TLS when root_certificates is given; directory ones when they say so."""

    def __init__(self, directory_url: str = "", addresses=(), root_certificates: bytes | None = None,
                 use_external: bool = False, refresh_seconds: float = 1.0, timeout: float = 60.0):
        if not directory_url and not addresses:
            raise ValueError("the facade needs a directory URL or replica addresses")
        self.directory = open_directory(directory_url) if directory_url else None
        self.router = Router(self.directory, use_external=use_external, refresh_seconds=refresh_seconds) \
            if self.directory is not None else None
        self.addresses = list(dict.fromkeys(addresses))
        self.root_certificates = root_certificates
        self.refresh_seconds = refresh_seconds
        self.timeout = timeout
        self._fixed: dict[str, ReplicaInfo] = {}  # address -> what its ListEnvs said
        self._probed_at: dict[str, float] = {}
        # address -> why a fixed replica could not be asked (down, or a token it refuses)
        self.probe_errors: dict[str, grpc.RpcError] = {}
        self._lock = asyncio.Lock()
        self._stubs: dict[tuple[str, bool], Stubs] = {}
        self._turn = 0
        # Every replica id listed or asked so far, the latest REMEMBERED_REPLICAS of them: a session
        # naming one of these that is gone was lost with it; one naming any other is unknown.
        self._seen: OrderedDict[str, None] = OrderedDict()

    # -- the table -----------------------------------------------------------------------------
    async def replicas(self, metadata=(), refresh: bool = False) -> list[ReplicaInfo]:
        """Live replicas: the directory's (re-read at most every refresh_seconds, or now with
        refresh=True) and the fixed ones that said who they are (unknown ones are asked again
        at most every refresh_seconds; all of them with refresh=True)."""
        listed = await self.listed(refresh)
        now = time.monotonic()
        due = [a for a in self.addresses
               if refresh or (a not in self._fixed and now - self._probed_at.get(a, -1e9) >= self.refresh_seconds)]
        if due:
            await self._probe_all(due, metadata)
        known = {r.replica_id: r for r in listed}
        for info in self._fixed.values():
            known.setdefault(info.replica_id, info)
        for rid in known:
            self._remember(rid)
        return list(known.values())

    def _remember(self, replica_id: str) -> None:
        self._seen[replica_id] = None
        self._seen.move_to_end(replica_id)
        while len(self._seen) > REMEMBERED_REPLICAS:
            self._seen.popitem(last=False)

    def was_known(self, replica_id: str) -> bool:
        """Whether this table has listed the replica (it may be gone now)."""
        return replica_id in self._seen

    async def listed(self, refresh: bool = False) -> list[ReplicaInfo]:
        """The directory's replicas; while it is unreachable the last list stands (none before the first)."""
        if self.router is None:
            return []
        try:
            return await asyncio.to_thread(self.router.replicas, None, refresh)
        except DirectoryUnavailable as e:
            log.warning("directory unreachable and no replica list yet: %s", e)
            return []

    async def _probe_all(self, addresses, metadata) -> None:
        for address, info in zip(addresses, await asyncio.gather(*[self._probe(a, metadata) for a in addresses])):
            self._probed_at[address] = time.monotonic()
            if info is not None:
                self._fixed[address] = info

    async def _probe(self, address: str, metadata) -> ReplicaInfo | None:
        """A fixed replica's id and envs; None while it cannot say (down, or refusing the token)."""
        try:
            resp = await self.stubs_at(address, self.fixed_tls).env.ListEnvs(
                pb.ListEnvsRequest(), timeout=min(self.timeout, 5.0), metadata=metadata)
        except grpc.RpcError as e:
            log.info("replica %s did not answer ListEnvs: %s %s", address, e.code().name, e.details())
            self.probe_errors[address] = e
            return None
        self.probe_errors.pop(address, None)
        return ReplicaInfo(replica_id=resp.replica_id, address=address, envs=[s.env_id for s in resp.envs],
                           capacity=0, live_sessions=-1, tls=self.fixed_tls,
                           max_open_per_call=resp.max_open_per_call, max_batch_items=resp.max_batch_items)

    @property
    def fixed_tls(self) -> bool:
        return self.root_certificates is not None

    def unasked(self) -> list[grpc.RpcError]:
        """Why fixed replicas whose id and envs are still unknown could not be asked."""
        return [e for a, e in self.probe_errors.items() if a not in self._fixed]

    async def ask_again(self, metadata) -> None:
        """Ask fixed replicas that refused an earlier caller's credentials with this caller's."""
        refused = [a for a, e in self.probe_errors.items() if a not in self._fixed and e.code() in (
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)]
        if refused:
            await self._probe_all(refused, metadata)

    def watch_targets(self, listed: list[ReplicaInfo]) -> list[tuple[str, bool, ReplicaInfo | None]]:
        """(address, tls, what is known) of every replica to ask MonitorService: the directory's,
        and each fixed address, asked directly (a monitor token may not call ListEnvs, so a fixed
        replica's id may be unknown here)."""
        targets = [(self.address_of(r), r.tls, r) for r in listed]
        ids = {r.replica_id for r in listed}
        for a in self.addresses:
            info = self._fixed.get(a)
            if info is None or info.replica_id not in ids:
                targets.append((a, self.fixed_tls, info))
        return targets

    def is_fixed(self, r: ReplicaInfo) -> bool:
        return any(r is f for f in self._fixed.values())

    async def find(self, replica_id: str, metadata=()) -> ReplicaInfo | None:
        """The replica a session id names; one forced refresh when it is not known (yet)."""
        if not replica_id:
            return None
        for refresh in (False, True):
            for r in await self.replicas(metadata, refresh=refresh):
                if r.replica_id == replica_id:
                    return r
        return None

    async def still_listed(self, replica_id: str) -> bool:
        """After a directory replica stopped answering: is it still registered? (No: it is gone.)"""
        return self.router is not None and await asyncio.to_thread(self.router.still_listed, replica_id)

    # -- channels --------------------------------------------------------------------------------
    def address_of(self, r: ReplicaInfo) -> str:
        return r.address if self.is_fixed(r) or self.router is None else self.router.address(r)

    def stubs(self, r: ReplicaInfo) -> Stubs:
        return self.stubs_at(self.address_of(r), r.tls)

    def stubs_at(self, address: str, tls: bool) -> Stubs:
        key = (address, tls)
        s = self._stubs.get(key)
        if s is None:
            ch = make_channel(address, self.root_certificates, tls, aio=True)
            s = self._stubs[key] = Stubs(ch, pb_grpc.EnvServiceStub(ch), pb_grpc.StateServiceStub(ch),
                                         pb_grpc.MonitorServiceStub(ch))
        return s

    async def close(self) -> None:
        for s in self._stubs.values():
            await s.channel.close()
        self._stubs.clear()
        if self.directory is not None:
            self.directory.close()

    # -- where new sessions go ---------------------------------------------------------------------
    async def open_order(self, env_id: str, metadata=()) -> list[ReplicaInfo]:
        """Replicas serving env_id that accept sessions, least loaded first. Directory replicas
        report their load in heartbeats; fixed ones are asked (MonitorService); replicas whose
        load is unknown come last, taking turns."""
        await self.ask_again(metadata)
        candidates = [r for r in await self.replicas(metadata) if env_id in r.envs and not r.draining]
        fixed = [r for r in candidates if self.is_fixed(r)]
        totals = await asyncio.gather(*[self._live_sessions(r, metadata) for r in fixed])
        live = {r.replica_id: n for r, n in zip(fixed, totals)}
        self._turn += 1
        n = len(candidates) or 1

        def key(item):
            i, r = item
            count = live[r.replica_id] if r.replica_id in live else self.router.load(r)
            if count is None or count < 0:
                return (1, 0.0, (i + self._turn) % n)
            return (0, count / r.capacity if r.capacity > 0 else float(count), (i + self._turn) % n)
        return [r for _, r in sorted(enumerate(candidates), key=key)]

    async def _live_sessions(self, r: ReplicaInfo, metadata) -> int | None:
        try:
            resp = await self.stubs(r).monitor.ListSessions(pb.ListSessionsRequest(limit=1),
                                                            timeout=min(self.timeout, 5.0), metadata=metadata)
        except grpc.RpcError:
            return None  # e.g. the caller's token may not watch sessions: load unknown
        return resp.total

    def reserve(self, r: ReplicaInfo, count: int):
        """Count sessions as opening on a directory replica from now (before its Open answers, so
        the Opens running beside this one go elsewhere); settle() once the Open answered."""
        if self.router is None or self.is_fixed(r):
            return None
        return self.router.reserve(r.replica_id, count)

    def settle(self, r: ReplicaInfo, reservation, opened: int, reply: "pb.OpenResponse | None" = None) -> None:
        """The Open answered with `opened` sessions (0: it failed); reply: its answer, with the load."""
        if reservation is not None:
            self.router.settle(r.replica_id, reservation, opened, reply)
