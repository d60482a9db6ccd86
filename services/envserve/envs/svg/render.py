"""Rendering checked SVG with cairosvg, in a child process that can be killed.

cairosvg is C (cairo) underneath: a render that runs too long cannot be interrupted in a
thread, and a crash in cairo would take the worker with it. So renders run in a child
process (one per worker process, started on first use, shared by the worker's sessions) with
a memory cap; a render past its time limit kills the child, the call answers RenderError, and
the next render starts a fresh child. The child is core's ChildProcess (as ALFWorld's engine).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from envserve.core.child import ChildGone, ChildProcess, Refusal, serve


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


def _render_answer(op: str, args: tuple):
    svg, size = args
    try:
        img = render_rgb(svg, size)
    except MemoryError:
        raise Refusal("the drawing needs more memory than allowed") from None
    except RecursionError:
        raise Refusal("the drawing nests too deeply") from None
    except Exception as e:  # noqa: BLE001 - any cairosvg failure is the SVG's fault
        raise Refusal(f"{type(e).__name__}: {str(e)[:200]}") from None
    return img.shape, img.tobytes()


def _serve(fd: int, memory_mb: str) -> None:
    """The child: a memory cap, cairosvg imported before the handshake (so renders start warm), then
    ("render", (svg, size)) answered with (shape, bytes)."""
    import resource
    limit = int(memory_mb) * 1024 * 1024
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import cairosvg.parser  # noqa: F401
    serve(fd, _render_answer)


class Renderer:
    """The worker side: render(svg, size, timeout) answered by a child process."""

    def __init__(self, memory_mb: int = 1024, start_timeout: float = 60.0) -> None:
        self.memory_mb = memory_mb
        self.start_timeout = start_timeout
        self._child: ChildProcess | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    @property
    def pid(self) -> int:
        return self._child.pid if self._child is not None else -1

    def render(self, svg_text: str, size: int, timeout: float) -> np.ndarray:
        """RGB uint8 (size, size, 3); RenderError on any failure. A render past `timeout`
        seconds kills the child; the next call starts another."""
        with self._lock:
            if self._child is None or not self._child.alive():
                if self._child is not None:
                    self.restarts += 1
                    self._child.kill()
                try:
                    self._child = ChildProcess("envserve.envs.svg.render:_serve", (self.memory_mb,),
                                               self.start_timeout, "renderer process")
                except ChildGone as e:
                    self._child = None
                    raise RenderError(str(e)) from None
            try:
                shape, data = self._child.call("render", svg_text, int(size), timeout=timeout)
            except ChildGone as e:
                self._child = None
                self.restarts += 1
                if e.timed_out:
                    raise RenderError(f"rendering took longer than the time limit ({timeout:g} s)") from None
                raise RenderError(f"the renderer crashed ({e})") from None
            except RuntimeError as e:
                raise RenderError(str(e)) from None
        return np.frombuffer(data, np.uint8).reshape(shape).copy()

    def close(self) -> None:
        with self._lock:
            if self._child is not None:
                self._child.close()
                self._child = None


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
