"""A replica's own OpenEnv endpoint (`envserve serve --openenv-port`): envserve.web.openenv's routes
under /openenv, on host:port, answered by a gateway over the replica's own sessions (the server's
LocalGateway, handed in by the command line, so this module needs nothing of the server's). It
takes the replica's limits and TLS files from the replica's config."""
from __future__ import annotations

import asyncio
import contextlib


def limits_of(config):
    """The HTTP limits a replica's config sets (a ServerConfig, or anything with those names)."""
    from .limits import HttpLimits
    defaults = HttpLimits()
    return HttpLimits(max_body_bytes=getattr(config, "max_body_bytes", defaults.max_body_bytes),
                      openenv_max_http_sessions=getattr(config, "openenv_max_http_sessions",
                                                        defaults.openenv_max_http_sessions),
                      allow_plain_http_tokens=getattr(config, "allow_plain_http_tokens", False))


def tls_of(config):
    """The replica's TLS files, which its HTTP fronts serve as its gRPC port does (None: plain)."""
    from .server import TlsFiles
    return TlsFiles.of(getattr(config, "tls_cert_file", ""), getattr(config, "tls_key_file", ""),
                       getattr(config, "tls_client_ca_file", ""))


class _Endpoint:
    """An app served on host:port in the running loop, beside the replica's gRPC server, with the
    replica's limits and TLS files. Subclasses build `app` and name their `path`."""
    path = ""
    lifespan = "off"   # "on": the app's lifespan runs (where a session manager lives)

    def _bind(self, app, host: str, port: int) -> None:
        from .server import bind
        self.app = app
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._server = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        from .server import start_on_loop
        try:
            self._server, self._task = start_on_loop(self.app, self.sock, self.tls, lifespan=self.lifespan)
        except BaseException:
            self.sock.close()
            raise

    @property
    def url(self) -> str:
        from .server import display
        return display(self.host, self.port, self.tls is not None) + self.path

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5.0)


class OpenEnvEndpoint(_Endpoint):
    """An app with the OpenEnv routes over `gateway`, served on host:port in the running loop."""
    path = "/openenv"

    def __init__(self, gateway, host: str, port: int, idle_seconds: float = 300.0, config=None):
        from fastapi import FastAPI

        from .app import add_error_handlers
        from .limits import HttpGuard
        from .openenv import mount_openenv
        self.gateway = gateway
        self.limits = limits_of(config)
        self.tls = tls_of(config)
        app = FastAPI(title="envserve OpenEnv endpoint")
        app.state.limits = self.limits
        add_error_handlers(app)
        app.add_middleware(HttpGuard, limits=self.limits)
        self.sessions = mount_openenv(app, gateway, idle_seconds=idle_seconds, limits=self.limits)
        self._bind(app, host, port)

    async def stop(self) -> None:
        await super().stop()
        await self.sessions.close_all()


class McpEndpoint(_Endpoint):
    """An app with the MCP door (envserve.web.mcp) over `gateway`, at /mcp/<env_id> on host:port,
    served in the running loop; its session manager lives in the app's lifespan, so stopping the
    app ends the MCP sessions, which close their envserve sessions."""
    path = "/mcp"
    lifespan = "on"

    def __init__(self, gateway, host: str, port: int, idle_seconds: float = 300.0, config=None,
                 max_sessions: int | None = None, ground_truth: bool | None = None):
        from .mcp import McpSettings, create_mcp_app
        from envserve.common.http import MCP_MAX_SESSIONS
        self.gateway = gateway
        self.limits = limits_of(config)
        self.tls = tls_of(config)
        if ground_truth is None:
            ground_truth = getattr(config, "mcp_ground_truth", False)
        settings = McpSettings(idle_seconds=idle_seconds, ground_truth=ground_truth,
                               max_sessions=max_sessions or getattr(config, "mcp_max_sessions", MCP_MAX_SESSIONS))
        self._bind(create_mcp_app(gateway, settings, self.limits), host, port)
