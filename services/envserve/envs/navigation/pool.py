"""A per-process warm pool of simulator instances, keyed by the settings they were built with.

Creating a simulator is slow (an AI2-THOR Unity process takes seconds to start, a MiniWorld GL
context and its textures about as long), reusing one is cheap. A session takes an instance on
creation and gives it back on close; the pool keeps at most `cap` idle instances in all and stops
the rest, the oldest idle ones first, whatever their key: keys are settings callers choose (image
size, field of view...), and idle instances of every setting a caller tried would otherwise pile
up, each a GL context or a Unity process. An instance that died or failed is never given back: it
is stopped and dropped.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable


class WarmPool:
    def __init__(self, name: str):
        self.name = name
        self._idle: dict[Hashable, list[Any]] = {}
        self._order: list[tuple[Hashable, Any]] = []  # every idle instance, oldest first
        self._lock = threading.Lock()
        # Counters for tests and monitoring.
        self.created = 0
        self.reused = 0
        self.dropped = 0

    def acquire(self, key: Hashable, create: Callable[[], Any], alive: Callable[[Any], bool],
                stop: Callable[[Any], None]) -> Any:
        """An idle instance built for `key` that is still alive, else a new one from `create()`."""
        while True:
            with self._lock:
                idle = self._idle.get(key)
                item = idle.pop() if idle else None
                if item is not None:
                    self._order = [(k, i) for k, i in self._order if i is not item]
            if item is None:
                break
            if alive(item):
                self.reused += 1
                return item
            self.dropped += 1
            _quiet(stop, item)
        made = create()
        self.created += 1
        return made

    def release(self, key: Hashable, item: Any, cap: int, healthy: bool,
                stop: Callable[[Any], None]) -> None:
        """Keep `item` for the next session, unless it is unhealthy or `cap` instances of its key
        are idle already; then stop the oldest idle instances until at most `cap` are idle in all."""
        evicted: list[Any] = []
        if healthy and cap > 0:
            with self._lock:
                idle = self._idle.setdefault(key, [])
                if len(idle) < cap:
                    idle.append(item)
                    self._order.append((key, item))
                    while len(self._order) > cap:
                        old_key, old = self._order.pop(0)
                        self._idle[old_key].remove(old)
                        evicted.append(old)
                    item = None
        elif not healthy:
            self.dropped += 1
        for old in evicted:
            _quiet(stop, old)
        if item is not None:
            _quiet(stop, item)

    def idle_count(self, key: Hashable | None = None) -> int:
        with self._lock:
            if key is not None:
                return len(self._idle.get(key, []))
            return sum(len(v) for v in self._idle.values())

    def clear(self, stop: Callable[[Any], None]) -> None:
        with self._lock:
            items = [i for v in self._idle.values() for i in v]
            self._idle.clear()
            self._order.clear()
        for item in items:
            _quiet(stop, item)


def _quiet(stop: Callable[[Any], None], item: Any) -> None:
    # Stopping a simulator that is already gone must not fail the session that lets it go.
    try:
        stop(item)
    except Exception:
        pass
