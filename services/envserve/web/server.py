"""Running the facade with uvicorn: on its own (`envserve web`) or beside a replica (`up --http-port`),
over plain HTTP or TLS, with an app's limits (limits.HttpLimits) on WebSocket messages too."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from dataclasses import dataclass

import uvicorn

from envserve.rpc.serving import listen_error

from .limits import MAX_BODY_BYTES


@dataclass(frozen=True)
class TlsFiles:
    """A server certificate and key (PEM files); with client_ca, clients must present a certificate
    signed by that CA (mutual TLS)."""
    cert: str
    key: str
    client_ca: str = ""

    @classmethod
    def of(cls, cert: str = "", key: str = "", client_ca: str = "") -> "TlsFiles | None":
        """TLS from the command line's files: None for neither, ValueError for one without the other."""
        if not (cert or key):
            if client_ca:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
            return None
        if not (cert and key):
            raise ValueError("TLS needs both a certificate and a key file (--tls-cert and --tls-key)")
        return cls(cert, key, client_ca)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket, bound before uvicorn starts so port 0 can be reported. Made with
    protocol IPPROTO_TCP, not 0 (socket.create_server's): asyncio sets TCP_NODELAY only on sockets
    that say TCP, and without it a response's body waited for the client's delayed ACK of its
    headers, 40 ms a request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise listen_error(host, port, e) from None
    return sock


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


def _config(app, lifespan: str = "on", tls: TlsFiles | None = None) -> uvicorn.Config:
    # WebSocket frames go uncompressed: observations are small text or PNG already, and
    # per-message deflate cost more CPU per step than the rest of a frame (OpenEnv endpoint).
    # A WebSocket message may be as large as a request body, no larger (its socket is closed, 1009).
    limits = getattr(getattr(app, "state", None), "limits", None)
    tls_options = {} if tls is None else dict(
        ssl_certfile=tls.cert, ssl_keyfile=tls.key, ssl_ca_certs=tls.client_ca or None,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls.client_ca else ssl.CERT_NONE)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan=lifespan,
                            ws_per_message_deflate=False, ws=WS_PROTOCOL,
                            ws_max_size=limits.max_body_bytes if limits is not None else MAX_BODY_BYTES,
                            **tls_options)
    try:
        config.load()  # now, so that unreadable TLS files fail the start, not the first connection
    except (OSError, ssl.SSLError) as e:
        if tls is None:
            raise
        raise ValueError(f"cannot use the TLS files {tls.cert}, {tls.key}"
                         f"{', ' + tls.client_ca if tls.client_ca else ''}: {e}") from None
    return config


def _server(app, tls: TlsFiles | None = None) -> uvicorn.Server:
    return uvicorn.Server(_config(app, tls=tls))


class _NoSignals(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the host process keeps its own signal handlers
        yield


def start_on_loop(app, sock: socket.socket, tls: TlsFiles | None = None,
                  lifespan: str = "off") -> tuple[uvicorn.Server, asyncio.Task]:
    """uvicorn serving app on sock from the running event loop, beside whatever else runs
    there (a replica's gRPC server), without taking over SIGINT/SIGTERM. Stop it by setting
    .should_exit and awaiting the task. lifespan "on": the app's lifespan runs (an MCP endpoint's
    session manager lives in it)."""
    server = _NoSignals(_config(app, lifespan=lifespan, tls=tls))
    return server, asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))


def display(host: str, port: int, tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def serve(app, host: str, port: int, announce: str = "", tls: TlsFiles | None = None, name: str = "web",
          path: str = "") -> None:
    """Blocks until SIGINT/SIGTERM (uvicorn's own handlers stop it gracefully). name and path: what
    the ready line calls the server, and the path its URL ends with."""
    server = _server(app, tls)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    print(f"envserve {name} on {display(host, port, tls is not None)}{path}{announce}", flush=True)
    asyncio.run(server.serve(sockets=[sock]))


def start_in_thread(app, host: str, port: int, tls: TlsFiles | None = None) -> tuple[uvicorn.Server, int]:
    """The facade on its own event loop in a daemon thread (the replica keeps the main loop and
    its signal handlers: uvicorn installs none outside the main thread). Returns the server
    (set .should_exit to stop it) and the bound port."""
    server = _server(app, tls)
    sock = bind(host, port)
    threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="envserve-web",
                     daemon=True).start()
    return server, sock.getsockname()[1]
