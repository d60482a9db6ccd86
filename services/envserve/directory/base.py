"""The directory interface and the replica record both implementations store."""
from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field


class DirectoryUnavailable(RuntimeError):
    """The directory's backing store cannot be reached (e.g. Redis restarting)."""


@dataclass
class ReplicaInfo:
    replica_id: str
    address: str  # host:port other services reach it on (pod IP, compose service name)
    envs: list[str]
    capacity: int  # max sessions
    live_sessions: int = 0
    draining: bool = False
    external_address: str = ""  # host:port reachable from outside the network (published port)
    http_address: str = ""  # the replica's metrics/HTTP port, if any
    tls: bool = False
    started_unix: float = field(default_factory=time.time)
    heartbeat_unix: float = 0.0
    counted_unix: float = 0.0  # when live_sessions was counted (0: at listing time, e.g. probed)
    # The most sessions one Open may ask of it (--max-open-per-call) and items one batch may carry
    # (--max-batch-items): clients split larger ones by them. 0: unknown (a replica older than these).
    max_open_per_call: int = 0
    max_batch_items: int = 0

    @property
    def load(self) -> float:
        return self.live_sessions / self.capacity if self.capacity > 0 else 1.0

    def free(self) -> int:
        return max(0, self.capacity - self.live_sessions)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, data: str | bytes) -> "ReplicaInfo":
        raw = json.loads(data)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}  # newer writers may add fields
        return cls(**known)


@dataclass
class TaskOutcomes:
    """The finished episodes of one task in one stats scope, summed."""
    episodes: int = 0
    successes: int = 0
    return_sum: float = 0.0
    turns_sum: int = 0
    last_unix: float = 0.0
    tokens_sum: int = 0        # what the callers reported generating (StepItem.generated_tokens)

    def add(self, other: "TaskOutcomes") -> None:
        self.episodes += other.episodes
        self.successes += other.successes
        self.return_sum += other.return_sum
        self.turns_sum += other.turns_sum
        self.last_unix = max(self.last_unix, other.last_unix)
        self.tokens_sum += other.tokens_sum


def replica_of(session_id: str) -> str:
    """The replica id a session id names (`<replica_id>/<token>`)."""
    replica_id, sep, _ = session_id.rpartition("/")
    return replica_id if sep else ""


class Directory(ABC):
    """Thread-safe; calls are blocking (servers call them off the event loop)."""

    # Why a replica missing from the listing is taken for gone (in the errors clients report).
    gone_because = "no heartbeat in the directory"

    @abstractmethod
    def heartbeat(self, info: ReplicaInfo, ttl_seconds: float) -> None:
        """Register or refresh a replica; it disappears ttl_seconds after its last heartbeat."""

    @abstractmethod
    def deregister(self, replica_id: str) -> None:
        """Remove a replica at once (clean shutdown)."""

    @abstractmethod
    def replicas(self, env_id: str | None = None) -> list[ReplicaInfo]:
        """Live replicas, those serving env_id if given."""

    def get(self, replica_id: str) -> ReplicaInfo | None:
        for r in self.replicas():
            if r.replica_id == replica_id:
                return r
        return None

    def locate(self, session_id: str) -> ReplicaInfo | None:
        """The live replica holding a session, or None when that replica is gone."""
        return self.get(replica_of(session_id))

    @abstractmethod
    def record_moves(self, moves: "dict[str, str]", ttl_seconds: float) -> None:
        """A draining replica moved these sessions (old id -> new id); kept ttl_seconds."""

    @abstractmethod
    def moved_to(self, session_id: str) -> str | None:
        """The id a session was moved to by a draining replica, or None."""

    @abstractmethod
    def record_outcomes(self, scope: str, outcomes: "dict[str, TaskOutcomes]", ttl_seconds: float,
                        max_tasks: int) -> None:
        """Adds finished episodes to a scope's per-task sums. A task not recorded for ttl_seconds is
        forgotten, and a scope keeps its max_tasks most recently recorded tasks."""

    @abstractmethod
    def task_stats(self, scope: str) -> "dict[str, TaskOutcomes]":
        """A scope's per-task sums (task id -> outcomes), without the forgotten ones."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_directory(url: str) -> Directory:
    """`memory://` (or empty): in this process. `redis://host:port/db` (or rediss://): Redis.
    A `prefix` query parameter namespaces the keys (several stacks on one Redis). `ray://`: an
    actor on the Ray cluster this process belongs to (ray_directory.py)."""
    if not url or url.startswith("memory:"):
        from .memory import shared_memory_directory
        name = url.split("://", 1)[1] if "://" in url else ""
        return shared_memory_directory(name)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis_directory import RedisDirectory
        return RedisDirectory.from_url(url)
    if url.startswith("ray://"):
        from .ray_directory import RayDirectory
        return RayDirectory.from_url(url)
    raise ValueError(f"unknown directory URL {url!r}: use memory://, redis://host:port/db or ray://")
