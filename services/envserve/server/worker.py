"""A worker process: holds many sessions and runs the operations the front sends it.

Messages in: (request_id, op, payload, wait_s). Replies: (request_id, result) once per request,
except op "stream", which replies (request_id, [(index, result, seconds), ...]) as items
finish, so Interact can forward each result without waiting for the rest.
A failure of one item is that item's result, never the worker's. A wait_s above 0 says the
request is a lone caller's step: the worker then polls for that caller's next request for up
to wait_s after replying (NextRequestWait) rather than sleeping in its pipe's read.

Time limits and cancels (WorkGuard): the worker and its front share a small array of integers
(which request and item the worker is on; which requests the front cancelled). The front
watches it and times each item: an item (a step, reset, fork copy or replay) that runs past the time limit, or whose
call was cancelled, is interrupted by SIGUSR1 from the front; it answers alone and leaves its
session needing a reset. Items of a cancelled request that have not started are skipped. An
env that cannot be interrupted safely (spec.interruptible False) runs on, and the front kills a
worker that stays busy past the limit and its grace (pool.WorkerPool.kill_stuck).
"""
from __future__ import annotations

import collections
import ctypes
import gc
import os
import signal
import time
import traceback

from envserve.core.registry import get_env_class
from envserve.core.session import Session, SessionError
from envserve.server import convert, stats

# The array a worker shares with its front, one int64 a slot: the request the worker is on and the
# item of it, whether that item's env may be stopped part way; the item the front asks to stop and
# why (STOP_CANCELLED, or the time limit in milliseconds); and a ring of cancelled request ids with
# the count of cancels written so far.
CURRENT_REQUEST, CURRENT_INDEX, INTERRUPTIBLE, STOP_REQUEST, STOP_INDEX, STOP_REASON, CANCEL_SEQ = range(7)
STOP_CANCELLED = -1
FIRST_CANCEL = 7
CANCEL_RING = 64
SHARED_SLOTS = FIRST_CANCEL + CANCEL_RING

STREAM_COALESCE_SECONDS = 0.0005
# After a wait for the next request outlasts its window, this many hinted requests are answered
# without waiting before the worker tries again.
NEXT_REQUEST_WAIT_BACKOFF = 32
# Finished episodes a worker keeps for the front's next collection (GetTaskStats); older ones are
# dropped if the front falls this far behind.
OUTCOMES_KEPT = 10_000


def _malloc_trim() -> None:
    # Give freed heap pages back to the OS after closing sessions (glibc only).
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def freeze_startup_objects() -> None:
    """Moves every object alive now (modules, classes, the preloaded envs' packages) to the
    collector's permanent generation. A Close runs a full collection so that closed sessions'
    cycles are freed and their pages trimmed; after this it scans only what came since (about 0.1
    ms against 5 to 8 ms for a front's or worker's startup objects, and in an `--inline` front
    that pause stalls every session)."""
    gc.collect()
    gc.freeze()


class ItemInterrupted(BaseException):
    """Raised in an item's code by the worker's signal handlers. A BaseException, so that an
    env's own `except Exception` cannot swallow it."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class WorkGuard:
    """What the worker runs, told to the front through the shared array, and the signal that
    interrupts it. The worker writes which request and which item of it it is on (one write an
    item: no clock, no system call); the front, watching the array, times each item itself and
    asks for a stop by naming the item and a reason in the array and sending SIGUSR1
    (pool.WorkerHandle). Only an item's own code is interrupted (between begin and end, where
    `armed`); a signal anywhere else (the worker's loop, a reply being written) or naming another
    item is ignored, and a cancel is then seen by the next item's check."""

    def __init__(self, shared=None):
        self.shared = shared
        self.armed = False
        self.request = 0
        self.index = 0
        self._interruptible = -1
        self._seq = 0
        self._cancelled: frozenset[int] = frozenset()

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)

    def start_request(self, request_id: int) -> None:
        self.request, self.index = request_id, 0
        if self.shared is not None:
            self.shared[CURRENT_INDEX] = 0
            self.shared[CURRENT_REQUEST] = request_id

    def cancelled(self, request_id: int) -> bool:
        shared = self.shared
        if shared is None:
            return False
        seq = shared[CANCEL_SEQ]
        if seq != self._seq:
            self._seq = seq
            self._cancelled = frozenset(shared[FIRST_CANCEL:SHARED_SLOTS])
        return request_id in self._cancelled

    def begin(self, index: int, interruptible: bool) -> None:
        shared = self.shared
        if shared is None:
            return
        if interruptible != self._interruptible:
            shared[INTERRUPTIBLE] = self._interruptible = int(interruptible)
        self.index = index
        shared[CURRENT_INDEX] = index
        self.armed = interruptible

    def end(self) -> None:
        self.armed = False

    def _on_signal(self, signum, frame) -> None:
        shared = self.shared
        if not self.armed or shared[STOP_REQUEST] != self.request or shared[STOP_INDEX] != self.index:
            return
        self.armed = False
        if shared[STOP_REASON] == STOP_CANCELLED:
            raise ItemInterrupted("CANCELLED", "its call was cancelled (the caller's deadline passed, "
                                               "it cancelled, or its stream closed)")
        raise ItemInterrupted("DEADLINE_EXCEEDED", f"it ran past the replica's time limit of "
                                                   f"{shared[STOP_REASON] / 1000:g} s per item")


class Worker:
    def __init__(self, guard: WorkGuard | None = None) -> None:
        self.sessions: dict[str, Session] = {}
        # Each session's latest image as a serialized PNG Image, for MonitorService: kept encoded
        # (a 128 px grid PNG is about 0.7 KB against 49 KB raw).
        self.images: dict[str, bytes] = {}
        self.guard = guard or WorkGuard()
        # Sessions whose finished episodes are recorded: id -> stats key (server/stats.py), and the
        # episodes finished since the front last collected them.
        self.stats_keys: dict[str, str] = {}
        self.outcomes: collections.deque = collections.deque(maxlen=OUTCOMES_KEPT)
        # Tokens the caller reported for each recorded session's episode so far (StepItem.generated_tokens).
        self.episode_tokens: dict[str, int] = {}

    # Each op returns what the front receives; per-item ops return serialized StepResults.
    def op_open(self, payload):
        env_id, config, action_format, ids, stats_key = payload
        made = {}
        guard = self.guard
        try:
            for i, sid in enumerate(ids):
                if guard.cancelled(guard.request):
                    raise SessionError("CANCELLED", "the open was cancelled while its sessions were built")
                guard.begin(i, False)  # a constructor is not interrupted: it may be starting processes
                try:
                    made[sid] = Session(env_id, config, action_format)
                finally:
                    guard.end()
        except SessionError as e:
            for s in made.values():
                s.close()
            return ("error", e.code, e.message)
        self.sessions.update(made)
        if stats_key:
            self.stats_keys.update(dict.fromkeys(made, stats_key))
        return ("ok", next(iter(made.values())).system_prompt() if made else "")

    def run_item(self, item, index: int = 0) -> bytes:
        """("step", sid, action[, generated tokens]) or ("reset", sid, seed, task_id, split, same_task)
        -> a serialized StepResult."""
        sid = item[1]
        session = self.sessions.get(sid)
        if session is None:
            return convert.error_result(sid, "NOT_FOUND", f"unknown session {sid}").SerializeToString()
        guard = self.guard
        if guard.cancelled(guard.request):
            return convert.error_result(sid, "CANCELLED", "not run: its call was cancelled").SerializeToString()
        guard.begin(index, session.spec.interruptible)
        try:
            result = session.step(item[2]) if item[0] == "step" else session.reset(*item[2:])
            guard.end()
            if sid in self.stats_keys:
                self._count(sid, session, item)
            image = convert.image_of(result)
            if image is not None:
                self.images[sid] = image
            return convert.encode_turn(sid, result, image)
        except ItemInterrupted as e:
            guard.end()
            session.interrupted(f"its last {item[0]} was stopped: {e.message}")
            return convert.error_result(sid, e.code, f"{item[0]} stopped: {e.message}; the session must be "
                                                     "reset before its next step").SerializeToString()
        except SessionError as e:
            guard.end()
            return convert.error_result(sid, e.code, e.message).SerializeToString()
        except Exception as e:  # an env bug fails its item, not the batch
            guard.end()
            traceback.print_exc()
            return convert.error_result(sid, "INTERNAL", f"{type(e).__name__}: {e}").SerializeToString()

    def op_stream(self, items):
        """[(index, StepResult, seconds)] of every item at once (worker_main sends a process
        worker's as they finish instead)."""
        out = []
        for index, item in enumerate(items):
            t0 = time.perf_counter()
            data = self.run_item(item, index)
            out.append((index, data, time.perf_counter() - t0))
        return out

    def op_batch(self, items):
        """[(item's StepResult framed as an element of BatchResponse.results, seconds)]: framed
        here, in parallel workers, so the front only joins them in request order."""
        return [(convert.batch_element(data), seconds) for _, data, seconds in self.op_stream(items)]

    def _count(self, sid: str, session: Session, item: tuple) -> None:
        """A recorded session's episode: its tokens so far, and its outcome once it is over."""
        if item[0] != "step":
            self.episode_tokens.pop(sid, None)
            return
        tokens = self.episode_tokens.get(sid, 0) + (int(item[3]) if len(item) > 3 else 0)
        if not session.done:
            self.episode_tokens[sid] = tokens
            return
        self.episode_tokens.pop(sid, None)
        self.outcomes.append((self.stats_keys[sid], str(session.seed), session.success,
                              session.episode_return, session.turn, time.time(), tokens))

    def op_close(self, ids):
        found = []
        for sid in ids:
            s = self.sessions.pop(sid, None)
            self.images.pop(sid, None)
            self.stats_keys.pop(sid, None)
            self.episode_tokens.pop(sid, None)
            found.append(s is not None)
            if s is not None:
                try:
                    s.close()
                except Exception:
                    traceback.print_exc()
        s = None  # else the last session closed would outlive the collection
        gc.collect()
        _malloc_trim()
        return found

    def op_export(self, sid):
        s = self.sessions.get(sid)
        if s is None:
            return ("error", "NOT_FOUND", f"unknown session {sid}")
        if s.broken:
            return ("error", "FAILED_PRECONDITION", f"session {sid} cannot be forked: {s.broken}; reset it first")
        try:
            blob = s.to_blob()
        except SessionError as e:
            return ("error", e.code, e.message)
        blob["monitor_image"] = self.images.get(sid)  # a fork shows its image before its first step
        return ("ok", blob)

    def op_adopt(self, payload):
        blob, ids = payload
        guard = self.guard
        made = []
        try:
            for i, sid in enumerate(ids):
                if guard.cancelled(guard.request):
                    raise SessionError("CANCELLED", "the fork was cancelled while its copies were made")
                guard.begin(i, get_env_class(blob["env_id"]).spec.interruptible)
                try:
                    self.sessions[sid] = Session.from_blob(blob)
                finally:
                    guard.end()
                made.append(sid)
                if blob.get("monitor_image") is not None:
                    self.images[sid] = blob["monitor_image"]
        except ItemInterrupted as e:
            self.op_close(made)
            return ("error", e.code, f"fork stopped: {e.message}")
        except SessionError as e:
            self.op_close(made)
            return ("error", e.code, e.message)
        except Exception as e:
            self.op_close(made)
            traceback.print_exc()
            return ("error", "INTERNAL", f"fork failed: {type(e).__name__}: {e}")
        return ("ok",)

    def op_histories(self, sids):
        """[(sid, Session.replay_record() or None when the session is not here)]."""
        out = []
        for sid in sids:
            s = self.sessions.get(sid)
            record = s.replay_record() if s is not None and not s.broken else None
            if record is not None and sid in self.stats_keys:
                record["stats_scope"] = stats.scope_of_key(self.stats_keys[sid])
            out.append((sid, record))
        return out

    def op_restore(self, items):
        """[(sid, history)] -> [("ok", anchor) or ("error", code, message)], one per item: each
        session rebuilt by replaying its history (Session.restore); one failing fails alone."""
        out = []
        guard = self.guard
        for i, (sid, h) in enumerate(items):
            if guard.cancelled(guard.request):
                out.append(("error", "CANCELLED", "not rebuilt: the restore was cancelled"))
                continue
            try:
                guard.begin(i, get_env_class(h["env_id"]).spec.interruptible)
                try:
                    s = Session.restore(h["env_id"], h["config"], h["action_format"], h["seed"], h["trial"],
                                        h["episode"], h["actions"], h["anchors"], h["reset_anchor"])
                finally:
                    guard.end()
            except ItemInterrupted as e:
                out.append(("error", e.code, f"restore stopped: {e.message}"))
                continue
            except SessionError as e:
                out.append(("error", e.code, e.message))
                continue
            except Exception as e:  # an env bug fails its item
                traceback.print_exc()
                out.append(("error", "INTERNAL", f"restore failed: {type(e).__name__}: {e}"))
                continue
            self.sessions[sid] = s
            if h.get("stats_key"):
                self.stats_keys[sid] = h["stats_key"]
            out.append(("ok", s.anchor))
        return out

    def op_get_state(self, payload):
        sid, turn, episode, trial = payload
        s = self.sessions.get(sid)
        if s is None:
            return ("error", "NOT_FOUND", f"unknown session {sid}")
        try:
            return ("ok", convert.state_to_proto(sid, s.get_state(turn, episode, trial), s.env_id).SerializeToString())
        except SessionError as e:
            return ("error", e.code, e.message)

    def op_summaries(self, payload):
        """The latest turn of each of `sids` held here, most recently updated first, at most
        `limit`: [(updated_unix, serialized SessionSummary)]. Reads only; renews nothing."""
        sids, limit, include_images = payload
        found = [(s.updated_unix, sid, s) for sid in sids if (s := self.sessions.get(sid)) is not None]
        found.sort(key=lambda t: t[0], reverse=True)
        return [(updated, convert.summary_bytes(sid, s.summary(), self.images.get(sid) if include_images else None))
                for updated, sid, s in found[:limit]]

    def op_ping(self, payload):
        return os.getpid()

    def op_outcomes(self, payload):
        """The episodes finished since the last call: [(stats key, task id, success, return, turns,
        unix)]."""
        out = list(self.outcomes)
        self.outcomes.clear()
        return out

    def op_held(self, payload):
        """The ids of every session held here (the front closes those it does not know)."""
        return list(self.sessions)


class NextRequestWait:
    """A worker that has just answered a lone caller's step polls its request pipe for that
    caller's next step instead of sleeping in the pipe's read: waking a sleeping process costs
    about as much as a small env's step (0.1 ms on a 2-core virtual machine), paid once a step.
    Between polls it yields the CPU, so the front and the caller sharing its core run. A wait that
    outlasts its window (a caller that thinks between steps, as a model does) turns waiting off for
    the next NEXT_REQUEST_WAIT_BACKOFF hinted requests, so such a caller costs a window of polling
    every few dozen steps."""

    def __init__(self) -> None:
        self.skips = 0

    def wait(self, requests, wait_s: float) -> str:
        """Returns "ready" (a request or the pipe's end came within wait_s), "missed" (none came)
        or "skipped" (no wait: none hinted, or backing off after a miss)."""
        if wait_s <= 0:
            return "skipped"
        if self.skips:
            self.skips -= 1
            return "skipped"
        deadline = time.perf_counter() + wait_s
        poll = requests.poll
        while not poll(0):
            if time.perf_counter() > deadline:
                self.skips = NEXT_REQUEST_WAIT_BACKOFF
                return "missed"
            os.sched_yield()
        return "ready"


def worker_main(requests, replies, preload: list[str], shared=None, limits=None) -> None:
    # The front handles signals; a worker only dies with it or when killed.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if limits is not None:
        from envserve.core import limits as config_limits
        config_limits.install(limits)
    for env_id in preload:
        get_env_class(env_id)  # import heavy packages before the first session
    guard = WorkGuard(shared)
    guard.install()
    worker = Worker(guard)
    ops = {name[3:]: getattr(worker, name) for name in dir(worker) if name.startswith("op_")}
    freeze_startup_objects()
    next_request = NextRequestWait()
    wait_s = 0.0
    while True:
        try:
            next_request.wait(requests, wait_s)
            request_id, op, payload, wait_s = requests.recv()
        except (EOFError, OSError):
            return  # the front is gone
        guard.start_request(request_id)
        if op == "stream":
            # Results go back as they finish; those finished within STREAM_COALESCE_SECONDS of
            # the last send share one message (a pipe message costs about as much as a step).
            ready, last_send = [], time.perf_counter()
            for index, item in enumerate(payload):
                t0 = time.perf_counter()
                data = worker.run_item(item, index)
                now = time.perf_counter()
                ready.append((index, data, now - t0))
                if now - last_send >= STREAM_COALESCE_SECONDS:
                    replies.send((request_id, ready))
                    ready, last_send = [], now
            if ready:
                replies.send((request_id, ready))
            continue
        try:
            result = ops[op](payload)
        except Exception as e:
            traceback.print_exc()
            result = ("error", "INTERNAL", f"{type(e).__name__}: {e}")
        replies.send((request_id, result))
