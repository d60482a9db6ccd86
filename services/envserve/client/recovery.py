"""Sessions that outlive their replica: what the routed clients keep to rebuild a lost session.

Every environment is deterministic given its reset arguments and its actions, so a client that
keeps both can rebuild a session on any replica (the `Restore` call replays them and checks each
turn's anchor) and answer the call that found it lost as if nothing had happened. The caller keeps
its session id: this table maps it to the session that currently holds its state.

Only the bookkeeping lives here (no I/O), shared by the sync and async routed clients.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Mapping

import grpc

from envserve.common.tables import sessions_per_table
from envserve.v1 import envserve_pb2 as pb

from . import _requests as rq

# Item codes that say "this session's state is gone from where it was": its worker died
# (DATA_LOSS), its replica is unreachable or unlisted (UNAVAILABLE, DATA_LOSS), or a replica that
# restarted no longer knows it (NOT_FOUND). Recovered only for sessions this client has a history of.
LOSS_CODES = frozenset({grpc.StatusCode.DATA_LOSS.value[0], grpc.StatusCode.UNAVAILABLE.value[0],
                        grpc.StatusCode.NOT_FOUND.value[0]})


@dataclasses.dataclass(frozen=True)
class RecoverySettings:
    """enabled: rebuild lost sessions (on by default). max_turns: the longest episode kept for
    replay; a session stepped further is lost with its replica as before. timeout_seconds: how long
    a recovery waits for a live replica (one coming back on its address counts). forget_seconds:
    the history of a session not called for this long is dropped (a session left open, as the
    replica's lease reclaims it; the replica's default lease is 300 s)."""
    enabled: bool = True
    max_turns: int = 4096
    timeout_seconds: float = 60.0
    attempts: int = 3
    forget_seconds: float = 3600.0


@dataclasses.dataclass
class SessionLog:
    """How a session was opened, the reset that began its current episode, and the turns since."""
    env_id: str
    config: Mapping[str, Any] | None
    action_format: str
    seed: int | None = None
    state_readers: tuple = ()
    stats_scope: str = ""
    trial: int = -1
    episode: int = -1
    reset_anchor: str = ""
    actions: list = dataclasses.field(default_factory=list)
    anchors: list = dataclasses.field(default_factory=list)
    # Set when the episode grew past max_turns: the turns are dropped and recovery refused.
    too_long: bool = False
    used: float = dataclasses.field(default_factory=time.monotonic)

    def copy(self) -> "SessionLog":
        return dataclasses.replace(self, actions=list(self.actions), anchors=list(self.anchors))

    def to_proto(self) -> pb.SessionHistory:
        h = pb.SessionHistory(env_id=self.env_id, action_format=self.action_format, trial=self.trial,
                              episode=self.episode, reset_anchor=self.reset_anchor,
                              turns=[pb.ReplayTurn(action=a, anchor=n) for a, n in zip(self.actions, self.anchors)],
                              state_readers=list(self.state_readers), stats_scope=self.stats_scope)
        if self.config:
            h.config.CopyFrom(rq.open_request("", 1, self.config, "").config)
        if self.seed is not None:
            h.seed = self.seed
        return h


class SessionTable:
    """Per caller-visible session id: its history, and the session id that holds it now."""

    def __init__(self, settings: RecoverySettings | None = None):
        self.settings = settings or RecoverySettings()
        self._lock = threading.Lock()
        self._logs: dict[str, SessionLog] = {}
        self._current: dict[str, str] = {}   # caller's id -> the id on a replica now (when moved)
        self._caller: dict[str, str] = {}    # the id on a replica -> caller's id (when moved)
        self.recovered = 0
        self._opened = 0  # opens since the last sweep of idle histories

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    # -- ids ------------------------------------------------------------------------------------
    def current(self, sid: str) -> str:
        return self._current.get(sid, sid)

    def caller_id(self, real: str) -> str:
        return self._caller.get(real, real)

    def moved(self, sid: str, real: str) -> None:
        with self._lock:
            old = self._current.get(sid)
            if old is not None:
                self._caller.pop(old, None)
            if real == sid:
                self._current.pop(sid, None)
            else:
                self._current[sid] = real
                self._caller[real] = sid
        self.recovered += 1

    def log(self, sid: str) -> SessionLog | None:
        return self._logs.get(sid)

    def __len__(self) -> int:
        """Sessions whose histories are kept."""
        return len(self._logs)

    # -- what the clients report -------------------------------------------------------------------
    def opened(self, ids, env_id: str, config: Mapping[str, Any] | None, action_format: str,
               state_readers=(), stats_scope: str = "") -> None:
        if not self.enabled or sessions_per_table(config) > 1:
            return  # a seat at a table shares its game with another session: replaying one alone cannot rebuild it
        cfg = dict(config) if config else None
        with self._lock:
            for sid in ids:
                self._logs[sid] = SessionLog(env_id, cfg, action_format, state_readers=tuple(state_readers),
                                             stats_scope=stats_scope)
            self._opened += len(ids)
            if self._opened >= 1024:
                self._opened = 0
                self._forget_idle()

    def _forget_idle(self) -> None:
        # Sessions left open (never closed) would keep their histories forever.
        cutoff = time.monotonic() - self.settings.forget_seconds
        for sid in [sid for sid, log in self._logs.items() if log.used < cutoff]:
            del self._logs[sid]
            real = self._current.pop(sid, None)
            if real is not None:
                self._caller.pop(real, None)

    def forked(self, parent: str, children) -> None:
        log = self._logs.get(parent)
        if log is None:
            return
        with self._lock:
            for c in children:
                self._logs[c] = log.copy()

    def closed(self, ids) -> None:
        with self._lock:
            for sid in ids:
                self._logs.pop(sid, None)
                real = self._current.pop(sid, None)
                if real is not None:
                    self._caller.pop(real, None)

    def record_reset(self, sid: str, result: pb.StepResult) -> None:
        log = self._logs.get(sid)
        if log is None or result.status.code:
            return
        seed = result.info.fields.get("seed")
        if seed is not None and seed.WhichOneof("kind") == "number_value":
            log.seed = int(seed.number_value)
        log.trial, log.episode, log.reset_anchor = result.trial, result.episode, result.anchor
        log.actions, log.anchors, log.too_long = [], [], False
        log.used = time.monotonic()

    def record_step(self, sid: str, action: str, result: pb.StepResult) -> None:
        log = self._logs.get(sid)
        if log is None or result.status.code or log.too_long:
            return
        if len(log.actions) >= self.settings.max_turns:
            log.actions, log.anchors, log.too_long = [], [], True
            return
        log.actions.append(action)
        log.anchors.append(result.anchor)
        log.used = time.monotonic()

    def answer(self, sid: str, result: pb.StepResult, action: str | None) -> pb.StepResult:
        """Record a result of caller's session `sid` (action None: a reset) and show it under sid."""
        if action is None:
            self.record_reset(sid, result)
        else:
            self.record_step(sid, action, result)
        if result.session_id and result.session_id != sid:
            result.session_id = sid
        return result

    # -- recovery ---------------------------------------------------------------------------------
    def recoverable(self, sid: str, code: int) -> bool:
        return self.enabled and code in LOSS_CODES and sid in self._logs

    def why_not(self, sid: str) -> str:
        """Why the session cannot be rebuilt, or "" when it can."""
        log = self._logs.get(sid)
        if log is None:
            return "no history of it is kept"
        if log.too_long:
            return f"its episode is longer than the {self.settings.max_turns} turns kept for replay"
        return ""

    def history(self, sid: str) -> pb.SessionHistory:
        return self._logs[sid].to_proto()


def lost_result(sid: str, why: str, cause: str = "") -> pb.StepResult:
    """The item a caller gets when its session could not be rebuilt."""
    message = f"session lost and not recovered: {why}" + (f" (it was lost: {cause})" if cause else "")
    return pb.StepResult(session_id=sid, status=pb.ItemStatus(code=grpc.StatusCode.DATA_LOSS.value[0],
                                                              message=message))


def replica_gone(result: pb.StepResult) -> bool:
    """Whether the failure says the replica itself is unreachable (so restore elsewhere)."""
    return result.status.code == grpc.StatusCode.UNAVAILABLE.value[0]


