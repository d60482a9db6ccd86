"""A Python child process that answers calls over a socket pair: how an env keeps state or C code
that must not share the worker's fate (ALFWorld's engine, the SVG renderer) out of the worker.

A fresh interpreter, not a fork: the worker may hold threads or locks a fork would copy, and
multiprocessing's fork server re-imports the caller's __main__, which scripts without a main guard
do not survive. The child runs `module.function(fd, *args)`; `serve` is the loop most children
want (a handshake, then (op, args) in and ("ok", value) or ("error", text) out).

Death: a call to a child that exited, crashed or did not answer within its deadline raises
ChildGone with the reason; the caller maps it to its sessions (DATA_LOSS for a session whose state
lived there) and starts a new child when it next needs one (`ChildProcess.start` again).

Copies: a child running `serve` can be copied by os.fork, its state included (a loaded game, warm
caches), for the price of a fork instead of a start and a replay: `fork()` gives the caller a copy
of its own, `copies(ttl_s)` leaves a frozen copy listening on an abstract Unix socket that hands
every process connecting to it (`ChildProcess.connect`, from any process on the machine) a copy of
its own, until it has been idle for ttl_s. A copy is not the caller's child: it is watched through
its socket and a pidfd (so a recycled pid is never signalled).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from typing import Any, Callable, Sequence

FORK_OP = "__fork__"        # serve's built-in ops: a copy for the caller,
COPIES_OP = "__copies__"    # a frozen copy that serves copies to whoever connects


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

    @classmethod
    def _copy(cls, conn, what: str) -> "ChildProcess":
        """The handle of a copy made by fork() or served by copies(): its handshake carries its pid."""
        self = cls.__new__(cls)
        self.what, self._proc, self._conn, self._pidfd = what, None, conn, None
        self._copy_pid = -1
        self.hello = self._receive()
        self._copy_pid = int(self.hello[1])
        with contextlib.suppress(OSError):
            self._pidfd = os.pidfd_open(self._copy_pid)
        return self

    @classmethod
    def connect(cls, address: str, what: str = "child process copy", timeout: float = 60.0) -> "ChildProcess":
        """A copy of its own from the frozen copy at `address` (what copies() returned)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            raise ChildGone(f"no {what} at that address any more ({type(e).__name__}: {e})") from None
        from multiprocessing.connection import Connection
        conn = Connection(sock.detach())
        if not conn.poll(timeout):
            conn.close()
            raise ChildGone(f"the {what} did not answer within {timeout:g} s", timed_out=True)
        return cls._copy(conn, what)

    def fork(self, what: str | None = None, timeout: float = 60.0) -> "ChildProcess":
        """A copy of this child (os.fork in the child: its whole state), answering on a socket
        pair of its own."""
        from multiprocessing.connection import Connection
        from multiprocessing.reduction import send_handle
        ours, theirs = socket.socketpair()
        with self._whole():
            try:
                self.request_nowait((FORK_OP, ()))
                send_handle(self._conn, theirs.fileno(), self.pid)
            finally:
                theirs.close()
            status, value = self._answer(timeout)
        if status != "ok":
            ours.close()
            raise RuntimeError(value)
        conn = Connection(ours.detach())
        return ChildProcess._copy(conn, what or f"copy of the {self.what}")

    def copies(self, ttl_s: float, timeout: float = 60.0) -> str:
        """The address of a frozen copy of this child that gives each connect() a copy of its own
        and ends once no one has connected for ttl_s seconds."""
        with self._whole():
            self.request_nowait((COPIES_OP, (float(ttl_s),)))
            status, value = self._answer(timeout)
        if status != "ok":
            raise RuntimeError(value)
        return value

    @property
    def pid(self) -> int:
        if self._proc is not None:
            return self._proc.pid
        return getattr(self, "_copy_pid", -1) if self._conn is not None else -1

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        return self._conn is not None and not self._copy_ended()

    def _copy_ended(self) -> bool:
        import select
        if getattr(self, "_pidfd", None) is None:
            return False
        return bool(select.select([self._pidfd], [], [], 0)[0])    # a pidfd reads ready once it exited

    def why(self) -> str:
        """After the connection broke: the exit code, once the process has ended (it may close its
        end a moment before the kernel reports it exited), else that it stopped answering. A copy is
        not our child: its exit code is its parent's to read."""
        code = None
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._proc.wait(1.0)
        elif getattr(self, "_pidfd", None) is not None:
            import select
            if select.select([self._pidfd], [], [], 1.0)[0]:
                return "exited"
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
        with self._whole():
            self.request_nowait(message)
            return self._answer(timeout)

    @contextlib.contextmanager
    def _whole(self):
        """A call stopped part way by something other than the child (a worker's time limit or a
        cancel raising in this thread) kills the child: its answer, sent or not, would be read as
        the next call's. The caller meets ChildGone on its next call and starts another."""
        try:
            yield
        except ChildGone:
            raise
        except BaseException:
            self.kill()
            raise

    def request_nowait(self, message: Any) -> None:
        if self._conn is None:
            raise ChildGone(f"the {self.what} was stopped")
        try:
            self._conn.send(message)
        except (OSError, BrokenPipeError):
            reason = self.why()
            self.kill()
            raise ChildGone(f"the {self.what} {reason}") from None

    def _answer(self, timeout: float | None) -> Any:
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
        pidfd, self._pidfd = getattr(self, "_pidfd", None), None
        self._proc = self._conn = None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.wait(10)
        if pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            os.close(pidfd)
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
            elif getattr(self, "_pidfd", None) is not None:
                import select
                select.select([self._pidfd], [], [], grace)
        self.kill()


def serve(fd: int, handler: Callable[[str, tuple], Any], hello: Any = None) -> None:
    """The child's loop over a `ChildProcess`: answers the handshake with ("ok", hello or its pid),
    then each (op, args) with ("ok", handler(op, args)) or ("error", "Type: text") (a Refusal's
    text alone), until "exit" or the parent's end closes; FORK_OP and COPIES_OP make copies of the
    whole process (ChildProcess.fork and .copies). Exits without interpreter teardown (os._exit): C
    extensions some children load (planners, cairo) crash in their exit handlers."""
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is for the server
    conn = Connection(fd)
    conn.send(("ok", os.getpid() if hello is None else hello))
    _loop(conn, handler)


def _loop(conn, handler: Callable[[str, tuple], Any]) -> None:
    while True:
        _reap_copies()
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "exit":
            break
        try:
            if op == FORK_OP:
                conn = _fork_copy(conn)   # the copy goes on serving its own connection
            elif op == COPIES_OP:
                conn.send(("ok", _start_copy_server(conn, handler, float(args[0]))))
            else:
                conn.send(("ok", handler(op, args)))
        except Refusal as e:
            conn.send(("error", str(e)))
        except BaseException as e:  # noqa: BLE001 - SystemExit from a library included: the child lives on
            conn.send(("error", f"{type(e).__name__}: {e}"))
    os._exit(0)


def _reap_copies() -> None:
    """Copies this process forked that have ended (no library call is running here between
    messages, so no other code is waiting for a child of its own)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _fork_copy(conn):
    """FORK_OP: the caller sent one end of a new socket pair after the message; the copy serves it."""
    from multiprocessing.connection import Connection
    from multiprocessing.reduction import recv_handle
    fd = recv_handle(conn)
    pid = os.fork()
    if pid == 0:
        conn.close()
        mine = Connection(fd)
        mine.send(("ok", os.getpid()))
        return mine
    os.close(fd)
    conn.send(("ok", pid))
    return conn


def _start_copy_server(conn, handler, ttl_s: float) -> str:
    """COPIES_OP: a frozen copy of this process (forked twice, so it is not this process's child
    to reap) listening on a fresh abstract Unix socket; its address."""
    address = f"\0envserve-copies-{os.getpid()}-{uuid.uuid4().hex}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            conn.close()
            _copy_server(listener, handler, ttl_s)
        os._exit(0)
    listener.close()
    os.waitpid(pid, 0)
    return address


def _copy_server(listener: socket.socket, handler, ttl_s: float) -> None:
    """Each connection gets a fork of this (frozen) process serving it; ends after ttl_s idle."""
    from multiprocessing.connection import Connection
    listener.settimeout(min(1.0, ttl_s))
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < ttl_s:
        _reap_copies()
        try:
            sock, _ = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            break
        idle_since = time.monotonic()
        if os.fork() == 0:
            listener.close()
            sock.settimeout(None)
            mine = Connection(sock.detach())
            mine.send(("ok", os.getpid()))
            _loop(mine, handler)
        sock.close()
    os._exit(0)
