"""Python SDK for envserve: sync, async (streaming) and gymnasium clients."""
from .aio import AsyncEnvClient, InteractStream
from .client import EnvClient, decode_image, state_dict
from .errors import (EnvServeError, ReplicaFullError, SessionLostError, SessionNotFoundError,
                     UnavailableError, check, item_error)

__all__ = [
    "EnvClient", "AsyncEnvClient", "InteractStream", "decode_image", "state_dict", "EnvServeError",
    "SessionLostError", "SessionNotFoundError", "ReplicaFullError", "UnavailableError", "check", "item_error",
]
