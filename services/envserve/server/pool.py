"""Worker processes as seen from the asyncio front.

Each worker has a request pipe written without blocking and a reply pipe read on the event
loop (add_reader). While one caller steps alone, each step the only request out, the front
polls the pipe for its reply for a fraction of a millisecond (WorkerPool.lone_reply_wait_s)
instead of sleeping in the loop, and the step's request tells its worker to poll for the
caller's next one (lone_request_wait_s, worker.NextRequestWait): a serial caller pays no
wake-up of either process.
When a worker dies, its pending requests fail with WorkerLost, its sessions are reported lost,
and a new worker takes its slot. A worker busy with one item past the time limit and its grace
(an env that cannot be interrupted, or code that never returns to Python) is killed the same way,
its item answering DEADLINE_EXCEEDED (kill_stuck). A cancelled request (its caller gone) is told
to its worker through the array they share (worker.WorkGuard): its items not yet started are
skipped, the running one is interrupted where its env allows.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import struct
import time
from typing import Callable

from . import convert
from .worker import (CANCEL_RING, CANCEL_SEQ, CURRENT_INDEX, CURRENT_REQUEST, FIRST_CANCEL, INTERRUPTIBLE,
                     SHARED_SLOTS, STOP_CANCELLED, STOP_INDEX, STOP_REASON, STOP_REQUEST, Worker, worker_main)

log = logging.getLogger("envserve.pool")


# After a lone reply outlasts the wait, this many lone replies go to the loop before polling again.
LONE_WAIT_BACKOFF = 32
# A cancelled request's running item is interrupted once it has run this long: a shorter one ends
# sooner than the interruption would help, and would only leave its session to be reset.
INTERRUPT_AFTER_S = 0.1
# How often the front looks for items to interrupt (cancelled and past INTERRUPT_AFTER_S, or past
# the time limit) and for workers stuck past the time limit and its grace: an item is stopped at
# most this long after its limit.
WATCH_PERIOD_S = 0.1
# Polling starts after this many steps in a row went out alone: one caller stepping serially.
# Where callers overlap, a step is alone now and then only, and the loop is better left to
# gather the others' steps than held for its reply.
LONE_STREAK = 8


class WorkerLost(Exception):
    """The worker died (or was killed) with the request out. stuck_index: the item it was running
    when it was killed for passing the time limit, which answers DEADLINE_EXCEEDED."""

    def __init__(self, message: str, stuck_index: int | None = None, stuck_message: str = ""):
        super().__init__(message)
        self.stuck_index, self.stuck_message = stuck_index, stuck_message


class WorkerHandle:
    """One worker process and its two one-way pipes.

    Requests are written from the event loop to a non-blocking pipe (the rest of a frame that
    does not fit waits for add_writer), so the loop never blocks and no thread waits on the GIL;
    the worker reads them with an ordinary Connection, whose framing we write by hand."""

    def __init__(self, slot: int, ctx, preload: list[str], limits=None):
        self.slot = slot
        req_r, req_w = ctx.Pipe(duplex=False)
        rep_r, rep_w = ctx.Pipe(duplex=False)
        # Which item the worker is on, which to stop, which requests were cancelled (worker.WorkGuard).
        self.shared = ctx.RawArray("q", SHARED_SLOTS)
        self._cancels = 0
        # Cancelled requests still out: their running item is interrupted once it has run a while.
        self.to_interrupt: set[int] = set()
        # The item (request id, index) the front last saw the worker on, and since when; the one it
        # last asked to stop at the time limit (asked once).
        self._seen: tuple[int, int] | None = None
        self._seen_at = 0.0
        self._overdue: tuple[int, int] | None = None
        # Set when the front killed it for running one item too long: (request id, index, message).
        self.stuck: tuple[int, int, str] | None = None
        self.process = ctx.Process(target=worker_main, args=(req_r, rep_w, preload, self.shared, limits),
                                   daemon=True, name=f"envserve-worker-{slot}")
        self.process.start()
        req_r.close()
        rep_w.close()
        self.conn = rep_r  # replies, read on the event loop
        self.reply_poller = select.poll()
        self.reply_poller.register(rep_r.fileno(), select.POLLIN)
        self._req = req_w
        self._wfd = req_w.fileno()
        os.set_blocking(self._wfd, False)
        self._wbuf = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.alive = True
        self.sessions: set[str] = set()
        # request id -> (future or per-item callback, items expected)
        self.pending: dict[int, tuple] = {}

    @property
    def pid(self) -> int:
        return self.process.pid

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def cancel(self, request_ids) -> None:
        """Tells the worker these requests' callers are gone: items not started are skipped, and
        the one running is interrupted (SIGUSR1) where its env allows, once it has run
        INTERRUPT_AFTER_S (interrupt_cancelled)."""
        shared = self.shared
        for rid in request_ids:
            if rid in self.pending:
                shared[FIRST_CANCEL + self._cancels % CANCEL_RING] = rid
                self._cancels += 1
                self.to_interrupt.add(rid)
        shared[CANCEL_SEQ] = self._cancels
        self.interrupt_cancelled()

    def interrupt_cancelled(self) -> None:
        if not self.to_interrupt:
            return
        self.to_interrupt.intersection_update(self.pending)   # those answered need nothing more
        busy = self.busy_seconds()
        if self._seen is not None and self._seen[0] in self.to_interrupt and busy >= INTERRUPT_AFTER_S:
            self.to_interrupt.discard(self._seen[0])
            self._stop(STOP_CANCELLED)

    def interrupt_overdue(self, time_limit_s: float) -> None:
        """Asks the worker to stop an item that has run past the time limit (once an item), where
        its env may be stopped part way."""
        if self.busy_seconds() >= time_limit_s and self._seen != self._overdue and self.shared[INTERRUPTIBLE]:
            self._overdue = self._seen
            self._stop(max(1, round(time_limit_s * 1000)))

    def _stop(self, reason: int) -> None:
        """Names the item seen running and why it must stop (worker.STOP_*), and signals."""
        shared = self.shared
        shared[STOP_REQUEST], shared[STOP_INDEX] = self._seen
        shared[STOP_REASON] = reason
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGUSR1)
            except OSError:
                pass

    def busy_seconds(self) -> float:
        """How long the worker has been on its current item, as the front has watched it (0 when
        idle). Timed here, from when the front first saw the item, so that the worker pays no clock
        for it: at most one watch period (WATCH_PERIOD_S) short."""
        shared = self.shared
        rid = shared[CURRENT_REQUEST]
        if rid not in self.pending:
            self._seen = None
            return 0.0
        item = (rid, shared[CURRENT_INDEX])
        now = time.monotonic()
        if item != self._seen:
            self._seen, self._seen_at = item, now
        return now - self._seen_at

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        # multiprocessing.Connection framing: a signed 4-byte length, or -1 and an 8-byte one.
        header = struct.pack("!i", len(data)) if len(data) < 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
        if self._wbuf:
            self._wbuf += header + data
            return
        frame = header + data
        try:
            n = os.write(self._wfd, frame)
        except BlockingIOError:
            n = 0
        except OSError:
            return  # the worker is gone; the reader reports it
        if n < len(frame):
            self._wbuf += frame[n:]
            self._loop.add_writer(self._wfd, self._flush)

    def _flush(self) -> None:
        try:
            n = os.write(self._wfd, self._wbuf)
        except BlockingIOError:
            return
        except OSError:
            self._wbuf.clear()
            self._loop.remove_writer(self._wfd)
            return
        del self._wbuf[:n]
        if not self._wbuf:
            self._loop.remove_writer(self._wfd)

    def close_pipes(self) -> None:
        if self._loop is not None and self._wbuf:
            self._loop.remove_writer(self._wfd)
        self._wbuf.clear()
        for c in (self.conn, self._req):
            try:
                c.close()
            except OSError:
                pass


class InlineWorker:
    """A Worker run inside the front's own process, for envs whose step costs microseconds:
    no pipe, no pickling, no process switch per batch. The price is isolation: an env that
    crashes the interpreter takes the replica with it (an exception still fails only its item)."""

    def __init__(self, slot: int, preload: list[str]):
        from envserve.core.registry import get_env_class
        for env_id in preload:
            get_env_class(env_id)
        self.slot = slot
        self.worker = Worker()
        self.ops = {name[3:]: getattr(self.worker, name) for name in dir(self.worker) if name.startswith("op_")}
        self.alive = True
        self.sessions: set[str] = set()
        self.pid = os.getpid()

    def cancel(self, request_ids) -> None:
        pass  # an inline call runs to its end before the loop sees its cancel

    def interrupt_cancelled(self) -> None:
        pass

    def interrupt_overdue(self, time_limit_s: float) -> None:
        pass

    def busy_seconds(self) -> float:
        return 0.0

    def run(self, op: str, payload):
        try:
            result = self.ops[op](payload)
        except Exception as e:
            log.exception("inline %s failed", op)
            return ("error", "INTERNAL", f"{type(e).__name__}: {e}")
        if op == "export":
            # A worker's export crosses a pipe, so forks never share objects with their
            # parent; the same copy here.
            result = pickle.loads(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        return result


class WorkerPool:
    """`size` worker processes, or with `inline` one InlineWorker in this process."""

    def __init__(self, size: int, preload: list[str], on_death: Callable[[WorkerHandle], None],
                 inline: bool = False, lone_reply_wait_s: float = 0.0, lone_request_wait_s: float = 0.0,
                 time_limit_s: float = 0.0, stuck_grace_s: float = 0.0, limits=None):
        # forkserver: workers start from a clean process, not a fork of the gRPC front
        # (forking a process with gRPC threads or a GL context can hang).
        try:
            self._ctx = mp.get_context("forkserver")
            self._ctx.set_forkserver_preload(["envserve.server.worker"])
        except ValueError:
            self._ctx = mp.get_context("spawn")
        self._preload = preload
        self._on_death = on_death
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.size = size
        self.workers: list[WorkerHandle] = []
        self.restarts = 0
        self.closing = False
        self.inline = inline
        self.lone_reply_wait_s = lone_reply_wait_s
        self.lone_request_wait_s = lone_request_wait_s
        # Lone replies still to come before polling is tried again after one outlasted the wait.
        self._lone_wait_skips = 0
        self._lone_streak = 0  # steps in a row sent with no other request out
        self._lone_wait_scheduled = False
        # Per item (0: none): past time_limit_s an item is interrupted in its worker; past
        # time_limit_s + stuck_grace_s its worker is killed.
        self.time_limit_s = time_limit_s
        self.stuck_grace_s = stuck_grace_s
        self._limits = limits
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.inline:
            self.workers = [InlineWorker(0, self._preload)]
            return
        handles = await asyncio.gather(*[self._loop.run_in_executor(None, self._spawn, i) for i in range(self.size)])
        for h in handles:
            self._attach(h)
        self.workers = list(handles)
        # A first round trip proves every worker imported its envs.
        await asyncio.gather(*[self.call(w, "ping", None) for w in self.workers])
        self._watchdog = self._loop.create_task(self._watch())

    def _spawn(self, slot: int) -> WorkerHandle:
        return WorkerHandle(slot, self._ctx, self._preload, self._limits)

    async def _watch(self) -> None:
        while not self.closing:
            await asyncio.sleep(WATCH_PERIOD_S)
            try:
                for h in self.workers:
                    if h.alive:
                        h.interrupt_cancelled()
                        if self.time_limit_s > 0:
                            h.interrupt_overdue(self.time_limit_s)
                if self.time_limit_s > 0:
                    self.kill_stuck()
            except Exception:
                log.exception("the watch over the workers failed")

    def kill_stuck(self) -> list[WorkerHandle]:
        """Kills each worker busy with one item for longer than the time limit and its grace: an
        env that cannot be interrupted, or code that never returned to Python. Its death is then
        handled as any other (its sessions lost, a new worker in its slot), except that the item
        it was running answers DEADLINE_EXCEEDED."""
        limit = self.time_limit_s + self.stuck_grace_s
        killed = []
        for h in self.workers:
            if self.inline or not h.alive or h.stuck is not None:
                continue
            busy = h.busy_seconds()
            if busy > limit:
                h.stuck = (*h._seen,
                           f"it ran past the replica's time limit of {self.time_limit_s:g} s per item and did not "
                           f"stop within {self.stuck_grace_s:g} s more; its worker was replaced")
                log.warning("worker %d (pid %s) busy with one item for %.1f s: killed", h.slot, h.pid, busy)
                h.process.kill()
                killed.append(h)
        return killed

    def _attach(self, h: WorkerHandle) -> None:
        h.attach(self._loop)
        self._loop.add_reader(h.conn.fileno(), self._on_readable, h)

    def _on_readable(self, h: WorkerHandle) -> None:
        try:
            while h.conn.poll():
                request_id, result = h.conn.recv()
                entry = h.pending.get(request_id)
                if entry is None:
                    continue
                target, expected = entry
                if expected is None:  # a single reply
                    del h.pending[request_id]
                    if not target.done():
                        target.set_result(result)
                else:  # replies carry a list of finished items
                    target(result)
                    expected[0] -= len(result)
                    if expected[0] <= 0:
                        del h.pending[request_id]
        except (EOFError, OSError, ConnectionResetError):
            self._handle_death(h)

    def _handle_death(self, h: WorkerHandle) -> None:
        if not h.alive:
            return
        h.alive = False
        self._loop.remove_reader(h.conn.fileno())
        h.close_pipes()
        pending, h.pending = h.pending, {}
        stuck_rid, stuck_index, stuck_message = h.stuck or (None, None, "")
        why = f"worker {h.slot} was replaced: an item ran past the time limit" if h.stuck else f"worker {h.slot} died"
        for rid, (target, expected) in pending.items():
            index = stuck_index if rid == stuck_rid else None
            if expected is None:
                if not target.done():
                    target.set_exception(WorkerLost(why, index, stuck_message))
            else:
                if index is not None and index < len(expected[1]):
                    sid = expected[1][index][1]
                    target([(index, convert.error_result(sid, "DEADLINE_EXCEEDED", stuck_message).SerializeToString(),
                             0.0)])
                target(WorkerLost(why))
        if self.closing:
            return
        log.warning("worker %d (pid %s) died; %d sessions lost", h.slot, h.pid, len(h.sessions))
        self._on_death(h)
        self.restarts += 1
        self._loop.create_task(self._replace(h))

    async def _replace(self, dead: WorkerHandle) -> None:
        await self._loop.run_in_executor(None, dead.process.join, 1.0)
        new = await self._loop.run_in_executor(None, self._spawn, dead.slot)
        if self.closing:
            new.process.kill()
            return
        self._attach(new)
        self.workers[dead.slot] = new

    def alive_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers if w.alive]

    def call(self, h: WorkerHandle, op: str, payload) -> asyncio.Future:
        """One request, one reply."""
        return self.request(h, op, payload)[0]

    def request(self, h: WorkerHandle, op: str, payload) -> tuple[asyncio.Future, int]:
        """call(), and the request's id (for cancel; 0 where nothing can be cancelled)."""
        fut = self._loop.create_future()
        if not h.alive:
            fut.set_exception(WorkerLost(f"worker {h.slot} is not running"))
            return fut, 0
        if self.inline:
            fut.set_result(h.run(op, payload))
            return fut, 0
        request_id = next(self._ids)
        wait_s = self._next_request_wait() if op == "batch" else 0.0
        h.pending[request_id] = (fut, None)
        h.send((request_id, op, payload, wait_s))
        if op == "batch":
            self._schedule_lone_wait()
        return fut, request_id

    def stream(self, h: WorkerHandle, items: list, on_item: Callable) -> int:
        """Items answered as they finish: on_item([(index, bytes, seconds), ...]) per reply, or
        on_item(WorkerLost) once for all that are still out. Returns the request's id (0 where
        nothing can be cancelled). The item a worker was killed for (past the time limit) comes
        as its DEADLINE_EXCEEDED result before the WorkerLost of the rest."""
        if not h.alive:
            on_item(WorkerLost(f"worker {h.slot} is not running"))
            return 0
        if self.inline:
            on_item(h.run("stream", items))
            return 0
        request_id = next(self._ids)
        wait_s = self._next_request_wait()
        h.pending[request_id] = (on_item, [len(items), items])
        h.send((request_id, "stream", items, wait_s))
        self._schedule_lone_wait()
        return request_id

    def _next_request_wait(self) -> float:
        """How long the worker of a step about to go out should poll for the next request after
        answering it: lone_request_wait_s while one caller steps serially (the LONE_STREAK steps
        before this one went out alone, and no request is out now), else 0 (it sleeps in its read)."""
        if self._lone_streak < LONE_STREAK or self.lone_request_wait_s <= 0:
            return 0.0
        return 0.0 if any(w.pending for w in self.workers) else self.lone_request_wait_s

    def _schedule_lone_wait(self) -> None:
        # On the loop's next turn: every caller that was ready on this one has sent its steps
        # by then, so a step that is still alone there is one caller's.
        if self.lone_reply_wait_s > 0 and not self._lone_wait_scheduled:
            self._lone_wait_scheduled = True
            self._loop.call_soon(self.await_lone_reply)

    def await_lone_reply(self) -> None:
        """Run on the loop's turn after steps were sent: poll the reply pipe for up to
        lone_reply_wait_s when one request is the only one out (and the LONE_STREAK before it
        were too), and take the reply here if it comes (its future set, its callback run, as the
        loop would). The loop sleeping in epoll would pay a wake-up for it (tens of microseconds,
        as much as the worker's step). Holds the loop no longer than the wait; between polls it
        yields the CPU, so a worker sharing this core runs. A wait that outlasts its reply (a
        slow env, a busy machine) turns polling off for the next LONE_WAIT_BACKOFF lone replies."""
        self._lone_wait_scheduled = False
        if self.lone_reply_wait_s <= 0 or self.inline:
            return
        out = [w for w in self.workers if w.pending]
        if not out:
            return
        if len(out) != 1 or len(out[0].pending) != 1 or not out[0].alive or out[0]._wbuf:
            self._lone_streak = 0
            return
        self._lone_streak += 1
        if self._lone_streak <= LONE_STREAK:
            return
        if self._lone_wait_skips:
            self._lone_wait_skips -= 1
            return
        h = out[0]
        poll, deadline = h.reply_poller.poll, time.perf_counter() + self.lone_reply_wait_s
        while not poll(0):
            if time.perf_counter() > deadline:
                self._lone_wait_skips = LONE_WAIT_BACKOFF
                return
            os.sched_yield()
        self._on_readable(h)

    def check_processes(self) -> None:
        """Catch a death the pipe has not reported yet."""
        for h in list(self.workers):
            if not self.inline and h.alive and not h.process.is_alive():
                self._handle_death(h)

    async def close(self) -> None:
        self.closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.inline:
            h = self.workers[0]
            h.alive = False
            h.run("close", list(h.worker.sessions))
            return
        for h in self.workers:
            if h.alive:
                self._loop.remove_reader(h.conn.fileno())
                h.alive = False
            h.close_pipes()
        for h in self.workers:
            await self._loop.run_in_executor(None, h.process.join, 2.0)
            if h.process.is_alive():
                h.process.kill()
