"""An error that fails a call as a whole, with the gRPC status code it carries: what the HTTP
fronts (the facade, a replica's own OpenEnv endpoint) turn into their responses, and what the
code answering them (a gateway to replicas, a replica's own sessions) raises."""
from __future__ import annotations

import grpc


class ApiError(Exception):
    """A call that fails as a whole, with the gRPC code it would have had."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message
