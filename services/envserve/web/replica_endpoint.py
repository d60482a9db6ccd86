"""A replica's own OpenEnv endpoint (`envserve serve --openenv-port`): envserve.web.openenv's routes
under /openenv, on host:port, answered by a gateway over the replica's own sessions (the server's
LocalGateway, handed in by the command line, so this module needs nothing of the server's)."""
from __future__ import annotations

import asyncio
import contextlib


class OpenEnvEndpoint:
    """An app with the OpenEnv routes over `gateway`, served on host:port in the running loop."""

    def __init__(self, gateway, host: str, port: int, idle_seconds: float = 300.0):
        from fastapi import FastAPI

        from .app import add_error_handlers
        from .openenv import mount_openenv
        from .server import bind
        self.gateway = gateway
        self.app = FastAPI(title="envserve OpenEnv endpoint")
        add_error_handlers(self.app)
        self.sessions = mount_openenv(self.app, gateway, idle_seconds=idle_seconds)
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._server = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        from .server import start_on_loop
        self._server, self._task = start_on_loop(self.app, self.sock)

    @property
    def url(self) -> str:
        from .server import display
        return display(self.host, self.port) + "/openenv"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5.0)
        await self.sessions.close_all()
