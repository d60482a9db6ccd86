"""The directory on a Ray cluster: `ray://`, with no Redis to run.

The records live in one detached, named actor (default `envserve-directory` in the Ray namespace
`envserve`) holding the in-process directory, so heartbeats, moves after a drain and the task
statistics behave exactly as with `memory://`, shared by every process of the cluster. The actor is
placed on the head node (whose loss ends the cluster anyway) and Ray restarts it if it dies; a
restarted actor starts empty and is whole again after one heartbeat period, as a restarted Redis is
(a lost move record leaves its client to rebuild the session from its own history).

URL forms:
  ray://                    from inside the cluster (a Ray task or actor, a driver on a node, or a
                            process with RAY_ADDRESS set): the cluster this process belongs to
  ray://HOST:PORT           from outside, through Ray Client (`ray.init("ray://HOST:PORT")`)
  ...?name=N&namespace=S    another directory on the same cluster (several fleets side by side)
"""
from __future__ import annotations

import os
import threading
from urllib.parse import parse_qs, urlsplit

from .base import Directory, DirectoryUnavailable, ReplicaInfo, TaskOutcomes
from .memory import MemoryDirectory

DEFAULT_NAME = "envserve-directory"
DEFAULT_NAMESPACE = "envserve"
# Seconds one directory call waits for the actor: past it the call fails as Redis's do when
# Redis is unreachable, and the caller retries on its next period.
CALL_TIMEOUT = 10.0
# Seconds a new directory waits for its actor to answer: creating it starts a worker process,
# which on a busy machine takes far longer than a call.
START_TIMEOUT = 120.0
# Threads the actor serves calls on (each call is a dict lookup under a lock).
ACTOR_CONCURRENCY = 64

_connect_lock = threading.Lock()


class DirectoryActor:
    """The records, in the actor's process (made a Ray actor by `directory_actor`)."""

    def __init__(self) -> None:
        self.records = MemoryDirectory()

    def call(self, method: str, *args):
        return getattr(self.records, method)(*args)

    def ping(self) -> bool:
        return True


def connect(address: str = "") -> None:
    """Joins the Ray cluster this process is meant to use, once: Ray Client for a `ray://HOST:PORT`
    address, else RAY_ADDRESS or the cluster running on this machine."""
    import ray
    with _connect_lock:
        if ray.is_initialized():
            return
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False,
                 configure_logging=False, ignore_reinit_error=True)


def head_node_strategy():
    """Prefer the head node (soft: a cluster whose head is elsewhere still gets the actor)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)
    return "DEFAULT"


def directory_actor(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE):
    """The directory actor's handle, created (detached, restarted when it dies) where none exists."""
    import ray
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    cls = ray.remote(DirectoryActor)
    return cls.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True,
                       max_restarts=-1, max_task_retries=-1, num_cpus=0,
                       max_concurrency=ACTOR_CONCURRENCY, scheduling_strategy=head_node_strategy()).remote()


class RayDirectory(Directory):
    gone_because = "no heartbeat in the Ray directory"

    def __init__(self, name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE, address: str = "",
                 timeout: float = CALL_TIMEOUT, start_timeout: float = START_TIMEOUT):
        import ray
        try:
            connect(address)
            self._actor = directory_actor(name, namespace)
            ray.get(self._actor.ping.remote(), timeout=start_timeout)
        except Exception as e:  # no cluster to join, or no actor within start_timeout
            raise DirectoryUnavailable(f"ray: {e}") from e
        self.timeout = timeout
        self.name, self.namespace = name, namespace

    @classmethod
    def from_url(cls, url: str) -> "RayDirectory":
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        address = f"ray://{parts.netloc}" if parts.netloc else ""
        return cls(query.get("name", [DEFAULT_NAME])[0], query.get("namespace", [DEFAULT_NAMESPACE])[0], address)

    def _call(self, method: str, *args):
        import ray
        from ray.exceptions import GetTimeoutError, RayError
        try:
            return ray.get(self._actor.call.remote(method, *args), timeout=self.timeout)
        except (GetTimeoutError, RayError) as e:
            raise DirectoryUnavailable(f"ray: {e}") from e

    def heartbeat(self, info: ReplicaInfo, ttl_seconds: float) -> None:
        self._call("heartbeat", info, ttl_seconds)

    def deregister(self, replica_id: str) -> None:
        self._call("deregister", replica_id)

    def replicas(self, env_id: str | None = None) -> list[ReplicaInfo]:
        return self._call("replicas", env_id)

    def record_moves(self, moves: dict[str, str], ttl_seconds: float) -> None:
        self._call("record_moves", moves, ttl_seconds)

    def moved_to(self, session_id: str) -> str | None:
        return self._call("moved_to", session_id)

    def record_outcomes(self, scope: str, outcomes: dict[str, TaskOutcomes], ttl_seconds: float,
                        max_tasks: int) -> None:
        self._call("record_outcomes", scope, outcomes, ttl_seconds, max_tasks)

    def task_stats(self, scope: str) -> dict[str, TaskOutcomes]:
        return self._call("task_stats", scope)
