"""gRPC server options the replica and the judge service share."""
from __future__ import annotations

# grpc core cancels calls that wait for the application beyond 1,000 (at random) and 3,000 (all):
# a trainer with a thousand sessions each awaiting its own unary Step crosses that, and about 2%
# of its calls came back CANCELLED with nothing logged. Ours: queue them, as a gRPC client expects.
MAX_PENDING_CALLS = 65_536


def server_options(max_message_bytes: int | None = None, max_pending_calls: int = MAX_PENDING_CALLS) -> list:
    opts = [("grpc.server.max_pending_requests", max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", max_pending_calls)]
    if max_message_bytes is not None:
        opts += [("grpc.max_receive_message_length", max_message_bytes),
                 ("grpc.max_send_message_length", max_message_bytes)]
    return opts
