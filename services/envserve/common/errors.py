"""An error that fails a call as a whole, with the gRPC status code it carries: what the HTTP
fronts (the facade, a replica's own OpenEnv endpoint) turn into their responses, and what the
code answering them (a gateway to replicas, a replica's own sessions) raises."""
from __future__ import annotations

import grpc


class ApiError(Exception):
    """A call that fails as a whole, with the gRPC code it would have had. http_status: where
    HTTP says it more precisely than the code's usual status (413 for a body over the limit,
    415 for a body that is not JSON)."""

    def __init__(self, code: grpc.StatusCode, message: str, http_status: int | None = None):
        super().__init__(message)
        self.code, self.message, self.http_status = code, message, http_status
