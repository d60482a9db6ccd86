"""A replica's Interact stream driven by the thread that calls: the lone sync caller's fast path.

A blocking call handed to the background event loop pays two thread hops and the loop's wake-ups
(about half of a lone step's time on a 2-core machine). A lane is a second, synchronous Interact
stream to the same replica: the calling thread writes its one item and reads the answer itself.
One thread at a time holds a lane; a thread that finds it taken goes the loop's way, where
overlapping calls share messages. The lane never recovers anything: on a broken stream, a lost
session or a timeout the caller falls back to, or reports as, the loop's path would.

Two kinds, one interface (`open_lane` picks):
- `PolledLane` (the default): the stream's call has a completion queue of its own, and the
  calling thread starts each send and receive and takes their completions from that queue itself.
  No helper thread, so a step costs no thread hop at all. It is built on gRPC's single-threaded
  call (the one its blocking unary calls use), which the Python package keeps internal: where the
  installed grpcio lacks it, or `ENVSERVE_SYNC_LANE=blocking` is set, the lane is a
  `BlockingStreamLane`.
- `BlockingStreamLane`: gRPC's blocking stream API. It runs helper threads inside gRPC's core: a
  request consumer per stream, and a poller per channel while any stream on it lives; each step
  crosses both. `close` ends the first, and the second once no stream is left on its channel.

The module keeps every open lane of the process, whoever made it, so `close_all` (before a fork)
ends them all and waits for the threads their starts began: a lane left open by a client no one
closed would otherwise keep a call (and for a blocking stream, a thread) inside gRPC across the
fork.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time

import grpc

from envserve.v1 import envserve_pb2 as pb

log = logging.getLogger(__name__)

# Every lane of this process not closed yet (held here, so an unclosed one is never lost from view).
_OPEN: "set[SyncLane]" = set()
# gRPC's helper threads the lanes' starts began; a channel's poller outlives the lane that started it.
_STARTED: "list[threading.Thread]" = []
_WATCH_LOCK = threading.Lock()
_WATCHER: list = [None]  # the deadline watcher thread, started with the first lane
WATCH_EVERY = 0.25
# "polled" or "blocking": the kind of lane `open_lane` makes (ENVSERVE_SYNC_LANE).
KIND = os.environ.get("ENVSERVE_SYNC_LANE", "polled")


class SyncLane:
    """What both kinds share: the holder's lock, the deadline the watcher reads, the state."""
    threads: "list[threading.Thread]" = []

    def __init__(self) -> None:
        self.busy = threading.Lock()
        self.deadline: float | None = None
        self.closed = self.timed_out = False
        self._tags = itertools.count(1)

    def exchange(self, item: pb.StepItem, timeout: float | None) -> pb.StepResult:
        """One item out and its result back, by the caller holding `busy`. Raises grpc.RpcError
        or EOFError when the stream ends (`timed_out` says whether the deadline ended it)."""
        self.deadline = None if timeout is None else time.monotonic() + timeout
        tag = next(self._tags)
        try:
            self._send(pb.InteractRequest(items=[pb.InteractItem(tag=tag, step=item)]))
            while True:
                for result in self._receive().results:
                    if result.tag == tag:  # a tag of its own: an answer is never another step's
                        return result.result
        except (EOFError, grpc.RpcError):
            raise
        except BaseException:
            # Interrupted while waiting (Ctrl-C's KeyboardInterrupt, a signal handler's error): a
            # receive is left half done in gRPC, so the lane is dropped and the next call opens
            # another. The step itself may still run on the replica.
            self._drop()
            raise
        finally:
            self.deadline = None

    def _drop(self) -> None:
        self.close()

    def _send(self, request: pb.InteractRequest) -> None:
        raise NotImplementedError

    def _receive(self) -> pb.InteractResponse:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class PolledLane(SyncLane):
    """The Interact call on a completion queue of its own, polled by the thread holding the lane."""

    def __init__(self, stub, metadata: tuple = ()):
        from grpc._cython import cygrpc  # gRPC's core binding: internal, hence open_lane's fallback

        super().__init__()
        self._cygrpc = cygrpc
        method = stub.Interact
        self._serialize = method._request_serializer
        self._deserialize = method._response_deserializer
        metadata = tuple(metadata)
        operations = (
            ((cygrpc.SendInitialMetadataOperation(metadata, 0),
              cygrpc.ReceiveStatusOnClientOperation(0)), "status"),
            ((cygrpc.ReceiveInitialMetadataOperation(0),), "initial"),
        )
        self._call = method._channel.segregated_call(
            cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, method._method, None, None,
            metadata, None, operations, method._context, method._registered_call_handle)
        # The batches started and not completed yet: at most one send and one receive at a time.
        self._due = {"status", "initial"}
        self._message: bytes | None = None
        self._released = False
        _open(self)

    def _next_event(self) -> None:
        try:
            event = self._call.next_event()  # waits in gRPC's core, answering signals every 200 ms
        except BaseException:
            # gRPC releases the call and its queue when its wait ends with an error (a signal
            # handler's): nothing of it may be touched again.
            self._released = True
            raise
        self._due.discard(event.tag)
        if event.tag == "recv":
            self._message = event.batch_operations[0].message() if event.success else None

    def _send(self, request: pb.InteractRequest) -> None:
        while "send" in self._due:  # the last send's completion can come after its answer
            self._next_event()
        if self.closed:
            raise EOFError("lane closed")
        self._call.operate((self._cygrpc.SendMessageOperation(self._serialize(request), 0),), "send")
        self._due.add("send")

    def _receive(self) -> pb.InteractResponse:
        try:
            if "recv" not in self._due:  # else an interrupted caller's receive is still out: take it
                self._call.operate((self._cygrpc.ReceiveMessageOperation(0),), "recv")
                self._due.add("recv")
            while "recv" in self._due:
                self._next_event()
        except ValueError as e:  # gRPC refuses a batch on a call that has ended
            self._end()
            raise EOFError(f"Interact stream ended: {e}") from None
        if self._message is None:
            self._end()
            raise EOFError("Interact stream ended")
        return self._deserialize(self._message)

    def _end(self) -> None:
        """By the holder, as the stream ends: cancels it and takes every completion left, so the
        call and its queue are released."""
        self.close()
        while self._due:
            self._next_event()

    def _drop(self) -> None:
        if self._released:
            self._due.clear()
            self.closed = True
            with _WATCH_LOCK:
                _OPEN.discard(self)
        else:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._call.cancel(self._cygrpc.StatusCode.cancelled, "lane closed")
        with _WATCH_LOCK:
            _OPEN.discard(self)
        if self.busy.acquire(blocking=False):  # else its holder takes the completions (_end)
            try:
                while self._due:
                    self._next_event()
            finally:
                self.busy.release()


class BlockingStreamLane(SyncLane):
    """gRPC's blocking stream: a request queue its consumer thread sends from."""

    def __init__(self, stub, metadata: tuple = ()):
        super().__init__()
        self._requests: "queue.SimpleQueue[pb.InteractRequest | None]" = queue.SimpleQueue()
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

    def _send(self, request: pb.InteractRequest) -> None:
        self._requests.put(request)

    def _receive(self) -> pb.InteractResponse:
        try:
            return next(self._responses)
        except StopIteration:
            raise EOFError("Interact stream ended") from None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._responses.cancel()
        self._requests.put(None)  # ends the request consumer thread
        with _WATCH_LOCK:
            _OPEN.discard(self)


def open_lane(stub, metadata: tuple = ()) -> SyncLane:
    """A lane on stub's channel: polled by the caller where gRPC allows it (KIND), else gRPC's
    blocking stream."""
    if KIND != "blocking":
        try:
            return PolledLane(stub, metadata)
        except (ImportError, AttributeError, TypeError) as e:  # another grpcio's internals
            log.warning("a blocking-stream lane instead of a polled one (this grpcio: %s)", e)
    return BlockingStreamLane(stub, metadata)


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
    """Cancels a lane whose caller waited past its deadline: its wait then ends with an error."""
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
