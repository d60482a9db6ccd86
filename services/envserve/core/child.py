"""A Python child process that answers calls over a socket pair: how an env keeps state or C code
that must not share the worker's fate (ALFWorld's engine, the SVG renderer) out of the worker.

A fresh interpreter, not a fork: the worker may hold threads or locks a fork would copy, and
multiprocessing's fork server re-imports the caller's __main__, which scripts without a main guard
do not survive. The child runs `module.function(fd, *args)`; `serve` is the loop most children
want (a handshake, then (op, args) in and ("ok", value) or ("error", text) out).

Death: a call to a child that exited, crashed or did not answer within its deadline raises
ChildGone with the reason; the caller maps it to its sessions (DATA_LOSS for a session whose state
lived there) and starts a new child when it next needs one (`ChildProcess.start` again).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from typing import Any, Callable, Sequence


class ChildGone(Exception):
    """The child process died or stopped answering (timed_out: no answer within the call's deadline)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class Refusal(Exception):
    """Raised by a `serve` handler: its text is the whole error answer (no exception type prefixed)."""


class ChildProcess:
    """The parent's side. target: "module:function", called in the child as function(fd, *args)
    with the child's end of the socket pair; it must answer one message first (the handshake)."""

    def __init__(self, target: str, args: Sequence[Any] = (), start_timeout: float = 300.0,
                 what: str = "child process") -> None:
        from multiprocessing.connection import Connection
        module, _, function = target.partition(":")
        self.what = what
        ours, theirs = socket.socketpair()
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-c", f"import sys; from {module} import {function} as run; "
             f"run(int(sys.argv[1]), *sys.argv[2:])", str(theirs.fileno()), *[str(a) for a in args]],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self._conn = Connection(ours.detach())
        if not self._conn.poll(start_timeout):
            self.kill()
            raise ChildGone(f"the {what} did not start within {start_timeout:g} s")
        self.hello = self._receive()

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def why(self) -> str:
        """After the connection broke: the exit code, once the process has ended (it may close its
        end a moment before the kernel reports it exited), else that it stopped answering."""
        code = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(1.0)
        return f"exited with code {code}" if code is not None else "stopped answering"

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            reason = self.why()
            self.kill()
            raise ChildGone(f"the {self.what} {reason}") from None

    def request(self, message: Any, timeout: float | None) -> Any:
        """Sends one message and returns the answer; ChildGone if the child is gone, or when it gives
        none within `timeout` seconds (the child is then killed: a late answer would be read as the
        next call's)."""
        if self._conn is None:
            raise ChildGone(f"the {self.what} was stopped")
        try:
            self._conn.send(message)
        except (OSError, BrokenPipeError):
            reason = self.why()
            self.kill()
            raise ChildGone(f"the {self.what} {reason}") from None
        if not self._conn.poll(timeout):
            self.kill()
            raise ChildGone(f"the {self.what} gave no answer within {timeout:g} s", timed_out=True)
        return self._receive()

    def call(self, op: str, *args, timeout: float | None = None) -> Any:
        """request((op, args)) to a child running `serve`: its value, RuntimeError for its error text."""
        status, value = self.request((op, args), timeout)
        if status == "error":
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def close(self, goodbye: Any = ("exit", ()), grace: float = 2.0) -> None:
        """Asks the child to exit (the goodbye message), waits `grace` seconds, then kills it."""
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.send(goodbye)
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(grace)
        self.kill()


def serve(fd: int, handler: Callable[[str, tuple], Any], hello: Any = None) -> None:
    """The child's loop over a `ChildProcess`: answers the handshake with ("ok", hello or its pid),
    then each (op, args) with ("ok", handler(op, args)) or ("error", "Type: text") (a Refusal's
    text alone), until "exit" or
    the parent's end closes. Exits without interpreter teardown (os._exit): C extensions some
    children load (planners, cairo) crash in their exit handlers."""
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is for the server
    conn = Connection(fd)
    conn.send(("ok", os.getpid() if hello is None else hello))
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "exit":
            break
        try:
            conn.send(("ok", handler(op, args)))
        except Refusal as e:
            conn.send(("error", str(e)))
        except BaseException as e:  # noqa: BLE001 - SystemExit from a library included: the child lives on
            conn.send(("error", f"{type(e).__name__}: {e}"))
    os._exit(0)
