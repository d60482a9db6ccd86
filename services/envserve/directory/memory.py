"""In-process directory: the embedded default of `envserve up` (one process, no Redis)."""
from __future__ import annotations

import threading
import time

from .base import Directory, ReplicaInfo, TaskOutcomes


# Stats scopes kept at most (the least recently recorded go first); Redis keeps them by TTL alone.
MAX_SCOPES = 10_000


class MemoryDirectory(Directory):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, tuple[ReplicaInfo, float]] = {}  # id -> (info, expires monotonic)
        self._moves: dict[str, tuple[str, float]] = {}  # old session id -> (new id, expires monotonic)
        # scope -> (ttl, task id -> sums); scopes and tasks in the order they were last recorded
        self._stats: dict[str, tuple[float, dict[str, TaskOutcomes]]] = {}

    def heartbeat(self, info: ReplicaInfo, ttl_seconds: float) -> None:
        info.heartbeat_unix = time.time()
        with self._lock:
            self._replicas[info.replica_id] = (info, time.monotonic() + ttl_seconds)

    def deregister(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)

    def replicas(self, env_id: str | None = None) -> list[ReplicaInfo]:
        now = time.monotonic()
        with self._lock:
            for rid in [rid for rid, (_, exp) in self._replicas.items() if exp <= now]:
                del self._replicas[rid]
            found = [info for info, _ in self._replicas.values()]
        return [r for r in found if env_id is None or env_id in r.envs]


    def record_moves(self, moves: dict[str, str], ttl_seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            for old, (_, exp) in list(self._moves.items()):
                if exp <= now:
                    del self._moves[old]
            self._moves.update((old, (new, now + ttl_seconds)) for old, new in moves.items())

    def moved_to(self, session_id: str) -> str | None:
        with self._lock:
            found = self._moves.get(session_id)
        return found[0] if found is not None and found[1] > time.monotonic() else None

    def record_outcomes(self, scope: str, outcomes: dict[str, TaskOutcomes], ttl_seconds: float,
                        max_tasks: int) -> None:
        with self._lock:
            _, tasks = self._stats.pop(scope, (ttl_seconds, {}))
            for task_id, o in outcomes.items():
                sums = tasks.pop(task_id, None) or TaskOutcomes()
                sums.add(o)
                tasks[task_id] = sums           # to the end: the most recently recorded
            while len(tasks) > max_tasks:
                del tasks[next(iter(tasks))]
            self._stats[scope] = (ttl_seconds, tasks)   # to the end too
            while len(self._stats) > MAX_SCOPES:
                del self._stats[next(iter(self._stats))]
            now = time.time()
            for name in list(self._stats):
                ttl, kept = self._stats[name]
                for task_id in [t for t, o in kept.items() if o.last_unix < now - ttl]:
                    del kept[task_id]
                if not kept:
                    del self._stats[name]

    def task_stats(self, scope: str) -> dict[str, TaskOutcomes]:
        with self._lock:
            ttl, tasks = self._stats.get(scope, (0.0, {}))
            oldest = time.time() - ttl
            return {t: TaskOutcomes(**vars(o)) for t, o in tasks.items() if o.last_unix >= oldest}


_shared: dict[str, MemoryDirectory] = {}
_shared_lock = threading.Lock()


def shared_memory_directory(name: str = "") -> MemoryDirectory:
    """One directory per name per process, so a server and clients in one process meet."""
    with _shared_lock:
        return _shared.setdefault(name, MemoryDirectory())
