"""A bounded map whose least recently used idle entries make room for new ones: per-caller
objects (a token's batcher) that must not pile up as callers come and go, and must not be
dropped while they hold work."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class IdleLRU(Generic[V]):
    """get(key, make) returns the entry for key, made by make() when missing. Past `capacity`
    entries the least recently used ones for which idle(entry) holds are dropped; busy ones stay
    (the map then holds more than capacity until they finish: at most one per call in flight)."""

    def __init__(self, capacity: int, idle: Callable[[V], bool]):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self._idle = capacity, idle
        self._entries: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        if len(self._entries) >= self.capacity:
            self._evict(len(self._entries) - self.capacity + 1)
        entry = self._entries[key] = make()
        return entry

    def _evict(self, count: int) -> None:
        victims = []
        for key, entry in self._entries.items():  # oldest first
            if self._idle(entry):
                victims.append(key)
                if len(victims) >= count:
                    break
        for key in victims:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def clear(self) -> None:
        self._entries.clear()
