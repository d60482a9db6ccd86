"""Rendering checked SVG with cairosvg, in a child process that can be killed.

cairosvg is C (cairo) underneath: a render that runs too long cannot be interrupted in a
thread, and a crash in cairo would take the worker with it. So renders run in a child
process (one per worker process, started on first use, shared by the worker's sessions) with
a memory cap; a render past its time limit kills the child, the call answers RenderError, and
the next render starts a fresh child. The pipe protocol follows the ALFWorld engine's
(envs/alfworld/engine.py): a socketpair and a fresh interpreter, not a fork.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np


class RenderError(Exception):
    """The SVG could not be rendered (cairosvg error, time limit, memory, crash)."""


def _refuse_fetch(url, resource_type):
    # Defense in depth: the sanitizer already refuses every external reference.
    raise ValueError(f"fetching {str(url)[:60]!r} is not allowed")


def render_rgb(svg_text: str, size: int) -> np.ndarray:
    """Renders in this process: an RGB uint8 array (size, size, 3) on a white background.
    The drawing is scaled to the square (its aspect ratio kept, as preserveAspectRatio says)."""
    from cairosvg.parser import Tree
    from cairosvg.surface import PNGSurface

    tree = Tree(bytestring=svg_text.encode("utf-8"), url_fetcher=_refuse_fetch, unsafe=False)
    # output=None: draw in memory only; the pixels are read from the cairo surface directly.
    surface = PNGSurface(tree, None, 96, output_width=size, output_height=size)
    cairo_surface = surface.cairo
    cairo_surface.flush()
    stride = cairo_surface.get_stride()
    h, w = cairo_surface.get_height(), cairo_surface.get_width()
    raw = np.frombuffer(cairo_surface.get_data(), np.uint8).reshape(h, stride // 4, 4)[:, :w]
    # cairo ARGB32 is premultiplied BGRA in memory (little-endian): over white, out = c + (255 - a).
    alpha = raw[..., 3:4].astype(np.uint16)
    rgb = raw[..., 2::-1].astype(np.uint16) + (255 - alpha)
    out = np.minimum(rgb, 255).astype(np.uint8)
    cairo_surface.finish()
    return np.ascontiguousarray(out)


def _serve(fd: int, memory_mb: int) -> None:
    """The child's loop: ("render", svg, size) in, ("ok", shape, bytes) or ("error", text) out."""
    import resource
    from multiprocessing.connection import Connection
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's Ctrl-C is for the server
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    conn = Connection(fd)
    import cairosvg.parser  # noqa: F401  - imported before the handshake so renders start warm
    conn.send(("ok", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg[0] == "exit":
            break
        _, svg, size = msg
        try:
            img = render_rgb(svg, size)
            conn.send(("ok", img.shape, img.tobytes()))
        except MemoryError:
            conn.send(("error", "the drawing needs more memory than allowed"))
        except RecursionError:
            conn.send(("error", "the drawing nests too deeply"))
        except Exception as e:  # noqa: BLE001 - any cairosvg failure is the SVG's fault
            conn.send(("error", f"{type(e).__name__}: {str(e)[:200]}"))
    os._exit(0)


class Renderer:
    """The worker side: render(svg, size, timeout) answered by a child process."""

    def __init__(self, memory_mb: int = 1024, start_timeout: float = 60.0) -> None:
        self.memory_mb = memory_mb
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._lock = threading.Lock()
        self.restarts = 0

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else -1

    def _start(self) -> None:
        from multiprocessing.connection import Connection
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from envserve.envs.svg.render import _serve; "
             "_serve(int(sys.argv[1]), int(sys.argv[2]))", str(theirs.fileno()), str(self.memory_mb)],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self._conn = Connection(ours.detach())
        if not self._conn.poll(self.start_timeout):
            self._kill()
            raise RenderError("the renderer process did not start")
        try:
            self._conn.recv()
        except (EOFError, OSError):
            self._kill()
            raise RenderError("the renderer process exited while starting") from None

    def _kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.wait(10)
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def render(self, svg_text: str, size: int, timeout: float) -> np.ndarray:
        """RGB uint8 (size, size, 3); RenderError on any failure. A render past `timeout`
        seconds kills the child; the next call starts another."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:
                    self.restarts += 1
                self._kill()
                self._start()
            try:
                self._conn.send(("render", svg_text, int(size)))
                ready = self._conn.poll(timeout)
                if not ready:
                    self._kill()
                    self.restarts += 1
                    raise RenderError(f"rendering took longer than the time limit ({timeout:g} s)")
                answer = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                code = self._proc.poll() if self._proc is not None else None
                self._kill()
                self.restarts += 1
                raise RenderError(f"the renderer crashed (exit code {code})") from None
        if answer[0] == "error":
            raise RenderError(answer[1])
        _, shape, data = answer
        return np.frombuffer(data, np.uint8).reshape(shape).copy()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    self._conn.send(("exit",))
                proc = self._proc
                if proc is not None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(2)
            self._kill()


_SHARED: dict[tuple[int, int], Renderer] = {}
_SHARED_LOCK = threading.Lock()


def shared_renderer(memory_mb: int) -> Renderer:
    """This process's renderer for a memory cap: one child serves every session of a worker."""
    key = (os.getpid(), int(memory_mb))
    with _SHARED_LOCK:
        r = _SHARED.get(key)
        if r is None:
            r = _SHARED[key] = Renderer(memory_mb)
        return r
