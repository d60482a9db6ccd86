"""StreamingClient: a synchronous client whose steps travel on persistent Interact streams.

Frameworks call environments from plain threads, one blocking call at a time (a TRL tool, SkyRL's
and GEM's `step`). A unary Step per call pays a whole gRPC call each time; here every call of the
process runs on one background event loop (a daemon thread, made on first use and again in a
forked child, whose parent's loop and channels do not survive the fork), through one
AsyncRoutedClient with `stream_steps`: one Interact stream per replica, shared by every thread. A
thread stepping alone writes and reads on the stream itself; threads that overlap share its
messages. Routing (a directory URL, several addresses or one) and recovery are the routed
client's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Iterable, Mapping, Sequence

import grpc

from envserve.v1 import envserve_pb2 as pb

from .aio_routing import AsyncRoutedClient
from .errors import make_error
from .recovery import RecoverySettings

_LOCK = threading.Lock()
_LOOP: list = [None, None]  # (pid, loop) of this process's background loop


def process_loop() -> asyncio.AbstractEventLoop:
    """This process's background event loop, started on first use (again after a fork)."""
    with _LOCK:
        pid, loop = _LOOP
        if pid != os.getpid() or loop is None or loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="envserve-client-loop", daemon=True).start()
            _LOOP[:] = [os.getpid(), loop]
        return loop


class StreamingClient:
    """The sync surface of RoutedClient (open_sessions, reset, step, fork, get_state, close_sessions,
    get_spec, list_envs), run on the process's background loop. target: a directory URL, the
    replicas' addresses (a list or a string joined by commas) or one address. timeout: how long
    one call may wait (a step over the stream included), in seconds; None waits as long as it
    takes (a lost session's rebuild adds up to its recovery timeout). stream_steps=False sends a unary Step per call instead (the same results)."""

    def __init__(self, target: "str | Sequence[str]", token: str | None = None, state_token: str | None = None,
                 root_certificates: "bytes | str | None" = None, tls: bool = False, timeout: float | None = 60.0,
                 recovery: "RecoverySettings | bool" = True, stream_steps: bool = True,
                 use_external: bool = False):
        self.target = target
        self.timeout = timeout
        self.stream_steps = stream_steps
        self._kw = dict(token=token, state_token=state_token, root_certificates=root_certificates, tls=tls,
                        timeout=timeout, recovery=recovery, use_external=use_external)
        self._lock = threading.Lock()
        self._pid = -1
        self._client: AsyncRoutedClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def routed(self) -> AsyncRoutedClient:
        """The AsyncRoutedClient behind this one, for this process (a forked child makes its own;
        the sessions its parent opened keep their histories, so they can be rebuilt here too)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    inherited = self._client.sessions if self._client is not None else None
                    self._loop = process_loop()
                    self._client = AsyncRoutedClient(self.target, stream_steps=self.stream_steps, **self._kw)
                    if inherited is not None:
                        inherited._lock = threading.Lock()  # a parent's thread may have held it at the fork
                        self._client.sessions = inherited
                    self._pid = os.getpid()
        return self._client

    @property
    def sessions(self):
        """The session table (caller ids, histories) recovery keeps."""
        return self.routed.sessions

    def _run(self, coro_fn, *args, timeout: "float | None | object" = ...):
        client = self.routed
        # Deadlines are the routed client's own (a call's, a stream item's), so a recovery may take
        # its time; `timeout` here bounds only what has none of its own (a close).
        wait = None if timeout is ... else timeout
        future = asyncio.run_coroutine_threadsafe(coro_fn(client, *args), self._loop)
        try:
            return future.result(wait)
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

    def step(self, actions: "Mapping[str, str] | Iterable[tuple[str, str]]") -> list[pb.StepResult]:
        return self._run(AsyncRoutedClient.step, list(actions.items()) if isinstance(actions, Mapping)
                         else list(actions))

    def fork(self, session_id: str, count: int = 1) -> list[str]:
        return self._run(AsyncRoutedClient.fork, session_id, count)

    def get_state(self, session_id: str, turn: int = -1, episode: int | None = None,
                  trial: int | None = None) -> pb.GetStateResponse:
        return self._run(AsyncRoutedClient.get_state, session_id, turn, episode, trial)

    def close_sessions(self, session_ids: Sequence[str], timeout: "float | None | object" = ...
                       ) -> list[pb.ItemStatus]:
        return self._run(AsyncRoutedClient.close_sessions, list(session_ids), timeout=timeout)

    def get_spec(self, env_id: str) -> pb.EnvSpec:
        return self._run(AsyncRoutedClient.get_spec, env_id)

    def list_envs(self) -> list[pb.EnvSpec]:
        return self._run(AsyncRoutedClient.list_envs)

    def replica_of(self, session_id: str) -> str:
        """The replica id holding a caller's session now (it changes when the session is rebuilt)."""
        from envserve.directory import replica_of
        return replica_of(self.routed.sessions.current(session_id))

    def close(self) -> None:
        """Closes this process's streams and channels (a later call opens them again)."""
        if self._pid == os.getpid() and self._client is not None:
            client, self._client, self._pid = self._client, None, -1
            try:
                asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(10)
            except Exception:  # noqa: BLE001 (closing what may be gone already)
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
