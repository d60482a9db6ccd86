"""StreamingClient: a synchronous client whose steps travel on persistent Interact streams.

Frameworks call environments from plain threads, one blocking call at a time (a TRL tool, SkyRL's
and GEM's `step`). A unary Step per call pays a whole gRPC call each time; here every call of the
process runs on one background event loop (a daemon thread, made on first use), through one
AsyncRoutedClient with `stream_steps`: one Interact stream per replica, shared by every thread;
threads that overlap share its messages. A thread stepping alone skips the loop and its thread
hops: it writes and reads on the replica's lane (sync_lane.py) itself. Routing (a directory URL,
several addresses or one) and recovery are the routed client's.

Fork (PyTorch's DataLoader starts its workers so): gRPC's core cannot be forked while a thread is
inside it, and the loop's channels always are. So before a fork the process lets the calls in
flight finish (new ones wait), closes every client's streams and channels and every lane of the
process (cancelling their calls, and waiting for a blocking stream's gRPC threads) and stops the loop;
parent and child each start a loop again on their next call. Session histories survive the fork,
so sessions the parent opened can still be stepped, and rebuilt, from either side. Where gRPC's
asyncio poller still runs at the fork (an asyncio channel or server of the process's own, not this
client's, is open), the child inherits a poller that no thread runs: its calls would never be
answered, so they fail at once with FAILED_PRECONDITION instead.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import threading
import time
import weakref
from typing import Any, Iterable, Mapping, Sequence

import grpc

from envserve.directory import replica_of
from envserve.v1 import envserve_pb2 as pb

from . import seats
from .aio_routing import AsyncRoutedClient
from .errors import EnvServeError, make_error
from .recovery import RecoverySettings, SessionTable
from . import sync_lane
from .sync_lane import SyncLane

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_LOOP: list = [None, None, None]  # (pid, loop, thread) of this process's background loop
_CLIENTS: "weakref.WeakSet[StreamingClient]" = weakref.WeakSet()
# Calls in flight on the loop, and whether a fork is being prepared (new calls wait for it).
_FLIGHT = threading.Condition()
_STATE = {"in_flight": 0, "forking": False, "fork_thread": None,
          # set in a child forked while gRPC's asyncio poller ran: why its calls are refused
          "grpc_unusable": None}
# Sessions closed from inside the fork hook (a finalizer its collection ran): the parent closes them
# once the fork is done.
_DEFERRED_CLOSES: "list[tuple[StreamingClient, list[str]]]" = []
# Closes a collected env started on the loop's thread, held until done.
_BACKGROUND: "set[asyncio.Task]" = set()
# How long a fork waits for the calls in flight to finish before closing the streams under them.
FORK_WAIT = 30.0


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's background event loop, started on first use (again after a fork)."""
    with _LOCK:
        pid, loop, _ = _LOOP
        if pid != os.getpid() or loop is None or loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="envserve-client-loop", daemon=True)
            thread.start()
            _LOOP[:] = [os.getpid(), loop, thread]
        return loop


def _grpc_pollers() -> list[threading.Thread]:
    """gRPC asyncio's completion-queue poller threads: one runs inside gRPC's core while any aio
    channel object lives, and ends when the last one is collected."""
    return [t for t in threading.enumerate() if "_poll_wrapper" in t.name and t.is_alive()]


def _before_fork() -> None:
    deadline = time.monotonic() + FORK_WAIT
    with _FLIGHT:
        _STATE["forking"], _STATE["fork_thread"] = True, threading.get_ident()
        _FLIGHT.wait_for(lambda: _STATE["in_flight"] == 0, FORK_WAIT)
    pid, loop, thread = _LOOP
    loop_stuck = False
    if pid == os.getpid() and loop is not None and not loop.is_closed():
        # Every step waits for what it needs, not a few seconds: on a starved machine a fork taken
        # with a thread still inside gRPC aborts the child.
        for client in list(_CLIENTS):
            client._drop_connections(max(1.0, deadline - time.monotonic()))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(max(1.0, deadline - time.monotonic()))
        if not thread.is_alive():
            loop.close()
        _LOOP[:] = [None, None, None]
        loop_stuck = thread.is_alive()
    # Every lane of the process, its client's or one a client dropped unclosed left open: their
    # gRPC threads must be out of gRPC's core at the fork.
    lanes_stuck = sync_lane.close_all(max(1.0, deadline - time.monotonic()))
    gc.collect()  # the closed channels freed now, so gRPC's poller ends before the fork
    for poller in _grpc_pollers():
        poller.join(max(0.1, deadline - time.monotonic()))
    _STATE["grpc_running"] = bool(_grpc_pollers()) or bool(lanes_stuck)
    # One warning, naming the cause: a stuck call of this client's keeps the poller alive too.
    if loop_stuck or lanes_stuck:
        log.warning("forking with a call still inside gRPC after %.0f s: the child's calls will "
                    "fail", FORK_WAIT)
    elif _STATE["grpc_running"]:
        log.warning("forking while gRPC's asyncio poller runs (an asyncio channel or server other "
                    "than envserve's clients' is open): the child's calls will fail")


def _after_fork(child: bool) -> None:
    if child:
        for client in list(_CLIENTS):
            client._table._lock = threading.Lock()  # a parent's thread may have held it at the fork
        _STATE["in_flight"] = 0
        if _STATE.get("grpc_running") and not _STATE["grpc_unusable"]:
            _STATE["grpc_unusable"] = (
                "this process was forked while gRPC's asyncio poller ran in its parent (an asyncio "
                "gRPC channel or server other than envserve's clients' was open, or a call did not "
                "finish): no thread polls gRPC here, so no call would be answered. Close those "
                "before forking, or start the workers with the 'spawn' or 'forkserver' method")
    _STATE.pop("grpc_running", None)
    with _FLIGHT:
        _STATE["forking"], _STATE["fork_thread"] = False, None
        _FLIGHT.notify_all()
    deferred, _DEFERRED_CLOSES[:] = list(_DEFERRED_CLOSES), []
    if deferred and not child:
        threading.Thread(target=_close_deferred, args=(deferred,), name="envserve-deferred-close",
                         daemon=True).start()


def _close_deferred(deferred) -> None:
    for client, sids in deferred:
        try:
            client.close_sessions(sids)
        except Exception as e:  # noqa: BLE001 (their leases free them anyway)
            log.warning("closing %d sessions after a fork failed: %s", len(sids), e)


def _on_loop_thread() -> bool:
    """Whether this thread is the process's event loop thread (a finalizer that a collection ran
    in the middle of a loop callback): a call that waited for the loop would wait for itself."""
    pid, _, thread = _LOOP
    return pid == os.getpid() and thread is threading.current_thread()


def _in_fork_hook() -> bool:
    """Whether this thread is the one preparing a fork (a finalizer run by its collection)."""
    return _STATE["forking"] and _STATE["fork_thread"] == threading.get_ident()


_WATCHING = [False]


def _watch_forks() -> None:
    """Registers the fork hooks once, after this process's first call: gRPC registers its own fork
    handlers when it first makes a channel, and hooks run in reverse order of registration, so
    these must come later to quiesce the loop before gRPC checks for threads inside it."""
    with _LOCK:
        if _WATCHING[0] or not hasattr(os, "register_at_fork"):
            return
        _WATCHING[0] = True
    os.register_at_fork(before=_before_fork, after_in_parent=lambda: _after_fork(False),
                        after_in_child=lambda: _after_fork(True))


def _close_lanes(lanes: "dict[tuple[str, str], SyncLane]") -> None:
    """Closes a client's lanes (its close(), a fork, or its collection)."""
    for key in list(lanes):
        lane = lanes.pop(key, None)
        if lane is not None:
            lane.close()


_FULL_PATH = object()  # _step_handed_over: take step()'s whole path
# How long a step handed over while its replica's answers are due waits for one of them to carry it
# to the stream before it wakes the loop itself (a slow or stuck replica delays its steps no more).
HANDOVER_HOLD_S = 0.002


class _Waiter:
    """A blocking caller's one-shot result, set once on the loop (the stream's reader task) and
    waited for by the caller's thread: a bare lock, the cheapest wake-up a thread has. Once its
    step is on a stream, `replica` names where it went and `client` is told when it is answered
    (the hand-over's answer clock, StreamingClient._answered)."""
    __slots__ = ("_lock", "_set", "value", "error", "taken", "client", "replica")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = self.taken = False
        self.value = self.error = self.client = self.replica = None

    def done(self) -> bool:
        return self._set

    def set_result(self, value) -> None:
        if not self._set:
            self._set, self.value = True, value
            self._lock.release()
            if self.client is not None:
                self.client._answered(self.replica)

    def set_exception(self, error: BaseException) -> None:
        if not self._set:
            self._set, self.error = True, error
            self._lock.release()
            if self.client is not None:
                self.client._answered(self.replica)

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else timeout)


class StreamingClient:
    """The sync surface of RoutedClient (open_sessions, reset, step, fork, get_state, close_sessions,
    get_spec, list_envs), run on the process's background loop. target: a directory URL, the
    replicas' addresses (a list or a string joined by commas) or one address. timeout: how long
    one call may wait (a step over the stream included), in seconds; None waits as long as it
    takes (a lost session's rebuild adds up to its recovery timeout). stream_steps=False sends a unary Step per call instead (the same results)."""

    def __init__(self, target: "str | Sequence[str]", token: str | None = None, state_token: str | None = None,
                 root_certificates: "bytes | str | None" = None, tls: bool = False, timeout: float | None = 60.0,
                 recovery: "RecoverySettings | bool" = True, stream_steps: bool = True,
                 use_external: bool = False, state_readers: Sequence[str] = (), stats_scope: str = ""):
        self.target = target
        self.timeout = timeout
        self.stream_steps = stream_steps
        self._kw = dict(token=token, state_token=state_token, root_certificates=root_certificates, tls=tls,
                        timeout=timeout, recovery=recovery, use_external=use_external, state_readers=state_readers,
                        stats_scope=stats_scope)
        self._lock = threading.Lock()
        self._pid = -1
        self._client: AsyncRoutedClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The histories outlive the routed clients made over time (after a fork, after close()).
        self._table = SessionTable(recovery if isinstance(recovery, RecoverySettings)
                                   else RecoverySettings(enabled=bool(recovery)))
        # This process's lanes (sync_lane.py) by (replica id, address): a lone thread's steps. A
        # client dropped without close() closes them when collected (each holds a gRPC thread).
        self._lanes: dict[tuple[str, str], SyncLane] = {}
        weakref.finalize(self, _close_lanes, self._lanes)
        self._blocking_seen = -1  # how many channels the routed client had when lanes were last checked
        # Steps handed to the loop by threads (_step_handed_over), whether a drain is scheduled, and
        # by replica how many handed-over steps on its stream are not answered yet.
        self._queue: list = []
        self._queue_lock = threading.Lock()
        self._drain_due = False
        self._due: dict[str, int] = {}
        _CLIENTS.add(self)

    @property
    def routed(self) -> AsyncRoutedClient:
        """The AsyncRoutedClient behind this one in this process, on the process's loop (made again
        after a fork or close())."""
        client = self._client
        if client is None or self._pid != os.getpid():
            with self._lock:
                if self._client is None or self._pid != os.getpid():
                    self._loop = process_loop()
                    self._client = AsyncRoutedClient(self.target, stream_steps=self.stream_steps, **self._kw)
                    self._client.sessions = self._table
                    if self._pid != os.getpid():  # a forked child: a drain due in the parent is not its own
                        with self._queue_lock:
                            self._queue, self._drain_due, self._due = [], False, {}
                    self._pid = os.getpid()
                client = self._client
        return client

    def _drop_connections(self, wait: float = 5.0) -> None:
        """Closes this process's streams and channels (a fork is coming); the next call makes them."""
        with self._lock:
            client, self._client = self._client, None
        _close_lanes(self._lanes)
        if client is None or self._pid != os.getpid():
            return
        try:
            asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(wait)
        except Exception:  # noqa: BLE001 (closing what may be broken already)
            pass

    @property
    def sessions(self) -> SessionTable:
        """The session table (caller ids, histories) recovery keeps."""
        return self._table

    @contextlib.contextmanager
    def _in_flight(self):
        """Counts a blocking call as in flight on the loop (a fork waits for it), after any fork
        being prepared; refuses one that could only wait for itself."""
        if _STATE["grpc_unusable"]:
            raise make_error(grpc.StatusCode.FAILED_PRECONDITION, _STATE["grpc_unusable"])
        if _on_loop_thread():
            raise make_error(grpc.StatusCode.FAILED_PRECONDITION, "a blocking call made on the client's own "
                             "event loop thread would wait for itself; make it from another thread")
        with _FLIGHT:
            if _in_fork_hook():  # waiting for the fork to end would wait for ourselves
                raise make_error(grpc.StatusCode.UNAVAILABLE, "called while this thread prepares a fork; "
                                 "the client's connections are closed until the fork is done")
            if _STATE["forking"]:
                _FLIGHT.wait_for(lambda: not _STATE["forking"])
            _STATE["in_flight"] += 1
        try:
            yield
        finally:
            with _FLIGHT:
                _STATE["in_flight"] -= 1
                if _STATE["forking"]:
                    _FLIGHT.notify_all()

    def _run(self, coro_fn, *args, timeout: "float | None | object" = ...):
        with self._in_flight():
            client = self.routed
            # Deadlines are the routed client's own (a call's, a stream item's), so a recovery may
            # take its time; `timeout` here bounds only what has none of its own (a close).
            wait = None if timeout is ... else timeout
            future = asyncio.run_coroutine_threadsafe(coro_fn(client, *args), self._loop)
            try:
                result = future.result(wait)
                if not _WATCHING[0]:
                    _watch_forks()
                return result
            except concurrent.futures.TimeoutError:
                future.cancel()  # the item's result, when it comes, goes nowhere; the stream stays usable
                raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {wait:g} s") from None

    # -- the calls ------------------------------------------------------------------------------------
    def open_sessions(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
                      action_format: str = "") -> pb.OpenResponse:
        """Opens count sessions on the least-loaded replicas; the reply carries the ids and the
        system prompt (as EnvClient.open_sessions)."""
        ids, prompt = self._run(AsyncRoutedClient.open_with_prompt, env_id, count, config, action_format)
        return pb.OpenResponse(session_ids=ids, system_prompt=prompt)

    def open(self, env_id: str, count: int = 1, config: Mapping[str, Any] | None = None,
             action_format: str = "") -> list[str]:
        return list(self.open_sessions(env_id, count, config, action_format).session_ids)

    def reset(self, session_ids: Sequence[str], seeds=None, task_id: str = "", split: str = "",
              same_task: bool = False) -> list[pb.StepResult]:
        return self._run(AsyncRoutedClient.reset, list(session_ids), seeds, task_id, split, same_task)

    def step(self, actions: "Mapping[str, str] | Iterable[tuple]") -> list[pb.StepResult]:
        pairs = list(actions.items()) if isinstance(actions, Mapping) else list(actions)
        # one caller's step (reporting no generated tokens): a lane if free, else its replica's shared stream
        if len(pairs) == 1 and not any(pairs[0][2:]):
            pairs = [tuple(pairs[0][:2])]
            if self.stream_steps:
                result = self._step_on_lane(*pairs[0])
                if result is None:
                    result = self._step_handed_over(*pairs[0])
                if isinstance(result, pb.StepResult):
                    return [result]
                if result is _FULL_PATH:  # the stream broke under it, or its session needs recovery
                    return self._run(AsyncRoutedClient.step, pairs)
            return [self._run(AsyncRoutedClient.step_one, *pairs[0], timeout=self._one_call_wait())]
        return self._run(AsyncRoutedClient.step, pairs)

    def _step_handed_over(self, session_id: str, action: str) -> "pb.StepResult | object | None":
        """The step as an item of its replica's shared stream, handed to the loop in a queue and
        answered straight to this thread: no task per step. The queue is drained by the loop on
        its next answer from the replica while some are due (that answer wakes the loop anyway,
        and every step queued meanwhile goes in one message), else, or after HANDOVER_HOLD_S, by
        one wake-up of the loop for all queued. None when the session's stream is not up (a first
        call, a seat): step_one's path opens it; _FULL_PATH when the stream broke or the session
        needs recovery: step()'s path rebuilds."""
        client = self._client
        if client is None or self._pid != os.getpid() or not _WATCHING[0]:
            return None
        try:
            replica = replica_of(self._table.current(session_id))
        except Exception:  # noqa: BLE001 (the drain meets it again and sends the step step_one's way)
            replica = ""
        waiter = _Waiter()
        wait = self._one_call_wait()
        with self._in_flight():
            with self._queue_lock:
                self._queue.append((client, session_id, action, waiter))
                wake = not self._drain_due and not self._due.get(replica)
                self._drain_due = self._drain_due or wake
            if wake:
                self._loop.call_soon_threadsafe(self._drain)
            elif not waiter.wait(HANDOVER_HOLD_S):
                with self._queue_lock:  # no answer carried it yet: wake the loop, unless a wake-up is due
                    wake = not waiter.taken and not self._drain_due
                    self._drain_due = self._drain_due or wake
                if wake:
                    self._loop.call_soon_threadsafe(self._drain)
                if wait is not None:
                    wait = max(0.0, wait - HANDOVER_HOLD_S)
            if not waiter.done() and not waiter.wait(wait):
                # The result, when it comes, goes nowhere; the stream stays usable.
                raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {self._one_call_wait():g} s")
        if waiter.error is not None:
            if isinstance(waiter.error, (EOFError, EnvServeError)):
                return _FULL_PATH
            raise waiter.error
        result = waiter.value
        if result is None:
            return None
        if result.status.code and self._table.recoverable(session_id, result.status.code):
            return _FULL_PATH
        return self._table.answer(session_id, result, action)

    def _answered(self, replica: str) -> None:
        """On the loop, as a handed-over step's answer (or its stream's end) reaches its waiter:
        one fewer due from `replica`; steps queued meanwhile go on the loop's next turn, after the
        rest of this answer's results."""
        with self._queue_lock:
            left = self._due.get(replica, 0) - 1
            if left > 0:
                self._due[replica] = left
            else:
                self._due.pop(replica, None)
            drain = bool(self._queue) and not self._drain_due
            self._drain_due = self._drain_due or drain
        if drain:
            try:
                asyncio.get_running_loop().call_soon(self._drain)
            except RuntimeError:  # no loop runs it (a stream ended as its loop shut down): a thread wakes one
                with self._queue_lock:
                    self._drain_due = False

    def _drain(self) -> None:
        """On the loop: every handed-over step onto its replica's stream, one send per stream."""
        with self._queue_lock:
            queued, self._queue = self._queue, []
            self._drain_due = False
            for entry in queued:
                entry[3].taken = True
        by_stream: dict = {}
        for client, session_id, action, waiter in queued:
            try:
                real = client.sessions.current(session_id)
                r = client._known.get(replica_of(real))
                s = client._streams.get(client.client_for(r)) if r is not None and client is self._client else None
            except Exception:  # noqa: BLE001 (step_one's path meets it again and reports it)
                s = None
            if s is None or seats.is_seat(real):
                waiter.set_result(None)  # step_one's path: it opens the stream, or answers the seat
            else:
                waiter.client, waiter.replica = self, replica_of(real)
                by_stream.setdefault(s, []).append((pb.StepItem(session_id=real, action=action), waiter))
        with self._queue_lock:
            for pairs in by_stream.values():
                for _, waiter in pairs:
                    self._due[waiter.replica] = self._due.get(waiter.replica, 0) + 1
        for s, pairs in by_stream.items():
            try:
                s.send_to_waiters(pairs)
            except EOFError as e:
                for _, waiter in pairs:
                    waiter.set_exception(e)

    def _step_on_lane(self, session_id: str, action: str) -> pb.StepResult | None:
        """The step on its replica's lane, by this thread, when no other call of the process is in
        flight and the session is where the routed client last saw it; None sends it the loop's way
        (a first call, overlapping calls, a seat, a broken stream, a lost session: the loop's path
        recovers)."""
        client = self._client
        if client is None or self._pid != os.getpid() or not _WATCHING[0]:
            return None
        with _FLIGHT:
            # Only a call alone in the process: where calls overlap, the loop's stream carries them
            # together in fewer messages (and a lane's polling would take the loop's CPU).
            if _STATE["forking"] or _STATE["in_flight"]:
                return None  # (when forking, _run waits for the fork, or refuses in the fork hook)
            _STATE["in_flight"] += 1
        try:
            real = self._table.current(session_id)
            if seats.is_seat(real):
                return None  # answered at the seat's next turn: the loop's stream shares the wait
            r = client._known.get(replica_of(real))
            if r is None:
                return None
            lane = self._lane(client, r)
            if not lane.busy.acquire(blocking=False):
                return None
            try:
                result = lane.exchange(pb.StepItem(session_id=real, action=action), self.timeout)
            except (grpc.RpcError, EOFError):
                self._forget_lane(lane)
                if lane.timed_out:
                    raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"no answer within {self.timeout:g} s") from None
                return None
            finally:
                lane.busy.release()
            if result.status.code and self._table.recoverable(session_id, result.status.code):
                return None
            return self._table.answer(session_id, result, action)
        finally:
            with _FLIGHT:
                _STATE["in_flight"] -= 1
                if _STATE["forking"]:
                    _FLIGHT.notify_all()

    def _lane(self, client: AsyncRoutedClient, r) -> SyncLane:
        if len(client._blocking) != self._blocking_seen:
            self._close_retired_lanes(client)
        key = (r.replica_id, client.address(r))
        lane = self._lanes.get(key)
        if lane is not None and not lane.closed:
            return lane
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None or lane.closed:
                blocking = client.blocking_client(r)  # the routed client's channel to that replica
                lane = self._lanes[key] = sync_lane.open_lane(blocking.env, blocking.metadata)
            return lane

    def _close_retired_lanes(self, client: AsyncRoutedClient) -> None:
        """Closes the lanes whose channel the routed client retired (a replica gone, or restarted at
        another address): each would hold a blocked gRPC thread for good."""
        with client._lock:
            live = set(client._blocking)
        with self._lock:
            self._blocking_seen = len(live)
            retired = [self._lanes.pop(k, None) for k in [k for k in list(self._lanes) if k not in live]]
        for lane in retired:
            if lane is not None:
                lane.close()

    def _forget_lane(self, lane: SyncLane) -> None:
        lane.close()
        with self._lock:
            for key in [k for k, v in list(self._lanes.items()) if v is lane]:
                self._lanes.pop(key, None)

    def _one_call_wait(self) -> float | None:
        """How long one step may take in all: its deadline, plus a recovery's where one may run."""
        if self.timeout is None:
            return None
        return self.timeout + (self._table.settings.timeout_seconds if self._table.enabled else 0.0)

    def fork(self, session_id: str, count: int = 1) -> list[str]:
        return self._run(AsyncRoutedClient.fork, session_id, count)

    def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                  trial: int | None = None) -> pb.GetStateResponse:
        return self._run(AsyncRoutedClient.get_state, session_id, turn, episode, trial)

    def close_sessions(self, session_ids: Sequence[str], timeout: "float | None | object" = ...
                       ) -> list[pb.ItemStatus]:
        if _in_fork_hook():
            # An env collected while the fork hook frees the channels: close its sessions after.
            _DEFERRED_CLOSES.append((self, list(session_ids)))
            return [pb.ItemStatus() for _ in session_ids]
        if _on_loop_thread():
            # An env collected on the loop's thread (a collection inside a loop callback): blocking
            # here would stall every call of the process for the close's timeout, so the close
            # runs as a task of the loop instead.
            self._close_later(list(session_ids))
            return [pb.ItemStatus() for _ in session_ids]
        return self._run(AsyncRoutedClient.close_sessions, list(session_ids), timeout=timeout)

    def _close_later(self, sids: list[str]) -> None:
        client, loop = self._client, self._loop
        if client is None or self._pid != os.getpid() or loop is None:
            return  # no connection to close them on: their leases free them

        async def close():
            try:
                await client.close_sessions(sids)
            except Exception as e:  # noqa: BLE001 (their leases free them anyway)
                log.warning("closing %d sessions of a collected env failed: %s", len(sids), e)
        def start():
            task = loop.create_task(close())
            _BACKGROUND.add(task)  # the loop holds tasks weakly
            task.add_done_callback(_BACKGROUND.discard)
        loop.call_soon_threadsafe(start)

    def get_spec(self, env_id: str) -> pb.EnvSpec:
        return self._run(AsyncRoutedClient.get_spec, env_id)

    def list_envs(self) -> list[pb.EnvSpec]:
        return self._run(AsyncRoutedClient.list_envs)

    def list_tasks(self, env_id: str, split: str = "", page_size: int = 0, page_token: str = "") -> pb.ListTasksResponse:
        return self._run(AsyncRoutedClient.list_tasks, env_id, split, page_size, page_token)

    def task_stats(self, env_id: str, scope: str | None = None) -> list[pb.TaskStat]:
        return self._run(AsyncRoutedClient.task_stats, env_id, scope)

    def replica_of(self, session_id: str) -> str:
        """The replica id holding a caller's session now (it changes when the session is rebuilt)."""
        return replica_of(self.routed.sessions.current(session_id))

    def close(self) -> None:
        """Closes this process's streams and channels (a later call opens them again)."""
        self._drop_connections()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
