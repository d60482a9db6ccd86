"""A replica's Interact stream driven by the thread that calls: the lone sync caller's fast path.

A blocking call handed to the background event loop pays two thread hops and the loop's wake-ups
(about half of a lone step's time on a 2-core machine). A lane is a second, synchronous Interact
stream to the same replica (gRPC's blocking API): the calling thread writes its one item and reads
the answer itself. One thread at a time holds a lane; a thread that finds it taken goes the loop's
way, where overlapping calls share messages. The lane never recovers anything: on a broken stream,
a lost session or a timeout the caller falls back to, or reports as, the loop's path would.

gRPC's blocking streams run helper threads inside its core: a request consumer per stream, and a
poller per channel while any stream on it lives. `close` ends the first; `threads` names those the
lane's start began, so a fork can wait for them once every lane is closed.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref

from envserve.v1 import envserve_pb2 as pb

_WATCHED: "weakref.WeakSet[SyncLane]" = weakref.WeakSet()
_WATCH_LOCK = threading.Lock()
_WATCHER: list = [None]  # the deadline watcher thread, started with the first lane
WATCH_EVERY = 0.25


class SyncLane:
    def __init__(self, stub, metadata: tuple = ()):
        self._requests: "queue.SimpleQueue[pb.InteractRequest | None]" = queue.SimpleQueue()
        self._tags = itertools.count(1)
        self.busy = threading.Lock()
        self.deadline: float | None = None
        self.closed = self.timed_out = False
        before = set(threading.enumerate())
        self._responses = stub.Interact(self._request_iterator(), metadata=metadata)
        self.threads = [t for t in threading.enumerate() if t not in before]
        _watch(self)

    def _request_iterator(self):
        while True:
            request = self._requests.get()
            if request is None:
                return
            yield request

    def exchange(self, item: pb.StepItem, timeout: float | None) -> pb.StepResult:
        """One item out and its result back, by the caller holding `busy`. Raises grpc.RpcError
        when the stream ends (`timed_out` says whether the deadline ended it) and EOFError when
        the server closed it."""
        self.deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._requests.put(pb.InteractRequest(items=[pb.InteractItem(tag=next(self._tags), step=item)]))
            response = next(self._responses)
        except StopIteration:
            raise EOFError("Interact stream ended") from None
        finally:
            self.deadline = None
        return response.results[0].result

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._responses.cancel()
        self._requests.put(None)  # ends the request consumer thread


def _watch(lane: SyncLane) -> None:
    with _WATCH_LOCK:
        _WATCHED.add(lane)
        thread = _WATCHER[0]
        if thread is None or not thread.is_alive():
            # Python only (no gRPC inside), so a fork may happen at any point of its loop.
            thread = threading.Thread(target=_expire_deadlines, name="envserve-lane-deadlines", daemon=True)
            thread.start()
            _WATCHER[0] = thread


def _expire_deadlines() -> None:
    """Cancels a lane whose caller waited past its deadline: its `next()` then raises."""
    while True:
        time.sleep(WATCH_EVERY)
        now = time.monotonic()
        for lane in list(_WATCHED):
            deadline = lane.deadline
            if deadline is not None and now > deadline and not lane.closed:
                lane.timed_out = True
                lane.close()
