"""Running the facade with uvicorn: on its own (`envserve web`) or beside a replica (`up --http-port`)."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before uvicorn starts so port 0 can be reported."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


try:
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    class WebSocketProtocol(WebSocketsSansIOProtocol):
        """uvicorn's WebSocket protocol, except that it stops reading a socket only once
        MAX_QUEUED messages wait for the app, not after every message: an OpenEnv client sends
        one message and waits for its reply, and pausing and resuming the read cost two epoll
        calls a message (with 64 sockets stepping, 15-30% of the endpoint's CPU a step)."""
        MAX_QUEUED = 16

        @property
        def read_paused(self) -> bool:
            # Reads as paused while few messages wait, so the base class neither pauses the
            # transport nor (pausing it for real once MAX_QUEUED wait) forgets to resume it.
            return self._paused or self.queue.qsize() < self.MAX_QUEUED

        @read_paused.setter
        def read_paused(self, value: bool) -> None:
            self._paused = value

    WS_PROTOCOL = WebSocketProtocol
except ImportError:  # pragma: no cover - uvicorn before its sans-I/O websockets protocol
    WS_PROTOCOL = "auto"


def _config(app, lifespan: str = "on") -> uvicorn.Config:
    # WebSocket frames go uncompressed: observations are small text or PNG already, and
    # per-message deflate cost more CPU per step than the rest of a frame (OpenEnv endpoint).
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan,
                          ws_per_message_deflate=False, ws=WS_PROTOCOL)


def _server(app) -> uvicorn.Server:
    return uvicorn.Server(_config(app))


class _NoSignals(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host process keeps its own signal handlers
        yield


def start_on_loop(app, sock: socket.socket) -> tuple[uvicorn.Server, asyncio.Task]:
    """uvicorn serving app on sock from the running event loop, beside whatever else runs
    there (a replica's gRPC server), without taking over SIGINT/SIGTERM. Stop it by setting
    .should_exit and awaiting the task."""
    server = _NoSignals(_config(app, lifespan="off"))
    return server, asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))


def display(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(app, host: str, port: int, announce: str = "") -> None:
    """Blocks until SIGINT/SIGTERM (uvicorn's own handlers stop it gracefully)."""
    sock = bind(host, port)
    port = sock.getsockname()[1]
    print(f"envserve web on {display(host, port)}{announce}", flush=True)
    asyncio.run(_server(app).serve(sockets=[sock]))


def start_in_thread(app, host: str, port: int) -> tuple[uvicorn.Server, int]:
    """The facade on its own event loop in a daemon thread (the replica keeps the main loop and
    its signal handlers: uvicorn installs none outside the main thread). Returns the server
    (set .should_exit to stop it) and the bound port."""
    sock = bind(host, port)
    server = _server(app)
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="envserve-web",
                     daemon=True).start()
    return server, sock.getsockname()[1]
