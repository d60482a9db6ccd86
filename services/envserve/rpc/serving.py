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


class ListenError(OSError):
    """A port this process cannot listen on, said in one line: `cannot listen on HOST:PORT: REASON`
    (what the command line prints instead of a traceback)."""

    def __init__(self, host: str, port: int, reason: str, errno_: int | None = None):
        super().__init__(errno_, reason)
        self.host, self.port, self.reason = host, port, reason[:1].lower() + reason[1:]

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"cannot listen on {host}:{self.port}: {self.reason}"


def why_not_listening(host: str, port: int) -> tuple[str, int] | None:
    """Why a port cannot be listened on, asked of a plain socket (grpc logs its own reason, in a
    line of its own, and says only that it failed); None when it can be."""
    import os
    import socket
    bare = host.strip("[]") or "0.0.0.0"
    try:
        with socket.create_server((bare, port), family=socket.AF_INET6 if ":" in bare else socket.AF_INET):
            pass
    except OSError as e:
        return (os.strerror(e.errno) if e.errno else str(e)), e.errno
    return None


def listen_error(host: str, port: int, error: OSError) -> ListenError:
    import os
    return ListenError(host, port, os.strerror(error.errno) if error.errno else str(error), error.errno)


def add_port(server, host: str, port: int, credentials=None) -> int:
    """Adds host:port (TLS with credentials) to a grpc.aio server; the port it got, or ListenError.
    A port taken already (or an address not this machine's) is found out first, so that grpc
    does not log about it."""
    why = why_not_listening(host, port)
    if why is not None:
        raise ListenError(host, port, *why)
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise ListenError(host, port, *(why_not_listening(host, port) or ("the gRPC server could not bind it",)))
    return bound
