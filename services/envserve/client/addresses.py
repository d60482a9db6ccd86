"""Replicas at fixed addresses, for a client given no directory: each address is asked who it is
and how loaded (ListEnvs) whenever the router refreshes its listing.

`directory_for` turns whatever a caller names its replicas by into a Directory: a URL
(`redis://host:6379/0`, `memory://`) opens that directory; one address, several (a list, or one
string joined by commas) become an AddressDirectory. A replica that does not answer is left out
of the listing, as a directory drops a replica that stopped heartbeating; one restarted on its
address is listed again under its new id.
"""
from __future__ import annotations

import threading
from typing import Sequence

import grpc

from envserve.directory import Directory, DirectoryUnavailable, ReplicaInfo, open_directory
from envserve.v1 import envserve_pb2 as pb

from .client import EnvClient
from .errors import from_rpc_error

# How long asking one address may take: a replica that is gone must not hold up a listing.
PROBE_TIMEOUT = 2.0


def split_addresses(target: "str | Sequence[str]") -> list[str]:
    """The addresses a target names: a sequence as given, a string split at commas."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    addresses = [a.strip() for a in parts if a and a.strip()]
    if not addresses:
        raise ValueError(f"no replica address in {target!r}")
    return addresses


def is_directory_url(target: object) -> bool:
    return isinstance(target, str) and "://" in target


def directory_for(target: "Directory | str | Sequence[str]", token: str | None = None,
                  root_certificates: "bytes | str | None" = None, tls: bool = False) -> Directory:
    """A Directory for a directory URL, one address or several (see the module's doc)."""
    if isinstance(target, Directory):
        return target
    if is_directory_url(target) or target == "":
        return open_directory(target)
    return AddressDirectory(split_addresses(target), token=token, root_certificates=root_certificates, tls=tls)


class AddressDirectory(Directory):
    """The replicas at a fixed list of addresses. Nothing registers here: each listing asks every
    address (in parallel, PROBE_TIMEOUT each) for its id, environments and load."""

    gone_because = "it no longer answers at its address"

    def __init__(self, addresses: Sequence[str], token: str | None = None,
                 root_certificates: "bytes | str | None" = None, tls: bool = False):
        self.addresses = list(addresses)
        self._clients = {a: EnvClient(a, timeout=PROBE_TIMEOUT, token=token, root_certificates=root_certificates,
                                      tls=tls) for a in self.addresses}
        self._tls = bool(root_certificates is not None or tls)
        self._lock = threading.Lock()
        self.errors: dict[str, str] = {}  # address -> why it did not answer its last probe

    def replicas(self, env_id: str | None = None) -> list[ReplicaInfo]:
        futures = [(a, c.env.ListEnvs.future(pb.ListEnvsRequest(), timeout=PROBE_TIMEOUT, metadata=c.metadata))
                   for a, c in self._clients.items()]
        found: list[ReplicaInfo] = []
        refused: list[grpc.RpcError] = []
        for address, future in futures:
            try:
                resp = future.result()
            except grpc.RpcError as e:
                with self._lock:
                    self.errors[address] = f"{e.code().name}: {e.details()}"
                if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    refused.append(e)
                continue
            with self._lock:
                self.errors.pop(address, None)
            envs = [s.env_id for s in resp.envs]
            if env_id is not None and env_id not in envs:
                continue
            found.append(ReplicaInfo(replica_id=resp.replica_id, address=address, envs=envs,
                                     capacity=resp.capacity, live_sessions=resp.live_sessions,
                                     draining=resp.draining, tls=self._tls,
                                     max_open_per_call=resp.max_open_per_call,
                                     max_batch_items=resp.max_batch_items))
        if refused and len(refused) == len(futures):
            # Every replica refused the credentials: a configuration error, said now, not a wait.
            raise from_rpc_error(refused[0])
        return found

    def heartbeat(self, info: ReplicaInfo, ttl_seconds: float) -> None:
        raise DirectoryUnavailable("fixed replica addresses take no registrations: give replicas a directory URL")

    def deregister(self, replica_id: str) -> None:
        pass

    def record_moves(self, moves: "dict[str, str]", ttl_seconds: float) -> None:
        pass

    def record_outcomes(self, scope, outcomes, ttl_seconds, max_tasks) -> None:
        raise DirectoryUnavailable("fixed replica addresses keep no stats: give replicas a directory URL")

    def task_stats(self, scope):
        return {}   # each replica answers GetTaskStats from its own directory

    def moved_to(self, session_id: str) -> str | None:
        # No shared record of a drain's moves: a client rebuilds such a session from its history.
        return None

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
