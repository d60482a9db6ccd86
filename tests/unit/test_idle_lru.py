"""IdleLRU (envserve.common.lru): the per-token batcher caches of the HTTP fronts stay bounded as
tokens come and go, and never drop an entry that still holds a caller's work."""
import pytest

from envserve.common.lru import IdleLRU


class Entry:
    def __init__(self, name):
        self.name, self.busy = name, False


def test_least_recently_used_idle_entries_make_room():
    cache = IdleLRU(3, lambda e: not e.busy)
    made = {k: cache.get(k, lambda k=k: Entry(k)) for k in "abc"}
    assert cache.get("a", lambda: Entry("again")) is made["a"]  # a is now the most recent
    cache.get("d", lambda: Entry("d"))
    assert len(cache) == 3 and "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}


def test_busy_entries_stay_until_they_are_idle():
    cache = IdleLRU(2, lambda e: not e.busy)
    a = cache.get("a", lambda: Entry("a"))
    b = cache.get("b", lambda: Entry("b"))
    a.busy = b.busy = True
    cache.get("c", lambda: Entry("c"))  # nothing idle to drop: the map holds one more for a while
    assert len(cache) == 3 and "a" in cache and "b" in cache
    a.busy = b.busy = False
    for i in range(100):  # many callers later it is back within its bound
        cache.get(f"t{i}", lambda: Entry("t"))
    assert len(cache) == 2


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        IdleLRU(0, lambda e: True)
