"""A replica's Interact stream driven by the thread that calls: the lone sync caller's fast path.

A blocking call handed to the background event loop pays two thread hops and the loop's wake-ups
(about half of a lone step's time on a 2-core machine). A lane is a second, synchronous Interact
stream to the same replica (gRPC's blocking API): the calling thread writes its one item and reads
the answer itself. One thread at a time holds a lane; a thread that finds it taken goes the loop's
way, where overlapping calls share messages. The lane never recovers anything: on a broken stream,
a lost session or a timeout the caller falls back to, or reports as, the loop's path would.

gRPC's blocking streams run helper threads inside its core: a request consumer per stream, and a
poller per channel while any stream on it lives. `close` ends the first, and the second once no
stream is left on its channel. The module keeps every open lane of the process, whoever made it,
so `close_all` (before a fork) ends them all and waits for the threads their starts began: a lane
left open by a client no one closed would otherwise keep a thread inside gRPC across the fork.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time

from envserve.v1 import envserve_pb2 as pb

# Every lane of this process not closed yet (held here, so an unclosed one is never lost from view).
_OPEN: "set[SyncLane]" = set()
# gRPC's helper threads the lanes' starts began; a channel's poller outlives the lane that started it.
_STARTED: "list[threading.Thread]" = []
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
        # gRPC's helpers (another thread's pools, started meanwhile, are not ours to wait for)
        self.threads = [t for t in threading.enumerate() if t not in before
                        and not t.name.startswith(("envserve-", "asyncio_", "ThreadPoolExecutor"))]
        _open(self)

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
        tag = next(self._tags)
        try:
            self._requests.put(pb.InteractRequest(items=[pb.InteractItem(tag=tag, step=item)]))
            while True:
                # An earlier caller interrupted while waiting (KeyboardInterrupt) may have left its
                # answer behind, alone or in one message with this one's: only this tag's is ours.
                for result in next(self._responses).results:
                    if result.tag == tag:
                        return result.result
        except StopIteration:
            raise EOFError("Interact stream ended") from None
        finally:
            self.deadline = None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._responses.cancel()
        self._requests.put(None)  # ends the request consumer thread
        with _WATCH_LOCK:
            _OPEN.discard(self)


def close_all(wait: float) -> list[threading.Thread]:
    """Closes every open lane of this process and waits up to `wait` seconds for the gRPC threads
    their starts began; returns those still running (inside gRPC's core)."""
    deadline = time.monotonic() + wait
    with _WATCH_LOCK:
        lanes = list(_OPEN)
    for lane in lanes:
        lane.close()
    for t in list(_STARTED):
        t.join(max(0.0, deadline - time.monotonic()))
    with _WATCH_LOCK:
        _STARTED[:] = [t for t in _STARTED if t.is_alive()]
        return list(_STARTED)


def _open(lane: SyncLane) -> None:
    with _WATCH_LOCK:
        _OPEN.add(lane)
        _STARTED[:] = [t for t in _STARTED if t.is_alive()] + lane.threads
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
        with _WATCH_LOCK:
            lanes = list(_OPEN)
        for lane in lanes:
            deadline = lane.deadline
            if deadline is not None and now > deadline and not lane.closed:
                lane.timed_out = True
                lane.close()
        with _WATCH_LOCK:
            if not _OPEN:  # no open lane left: the next one starts another watcher
                _WATCHER[0] = None
                return
