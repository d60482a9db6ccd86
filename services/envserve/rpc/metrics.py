"""A Prometheus registry of its own with the HTTP endpoint that serves it, so several services can
share a process."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from .serving import listen_error


class MetricsEndpoint:
    """A registry of its own and the HTTP endpoint Prometheus scrapes it on."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.server = None

    def serve_http(self, host: str, port: int) -> int:
        try:
            self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise listen_error(host, port, e) from None
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
