"""Python SDK for envserve: sync, async (streaming) and gymnasium clients."""
# The wire messages the clients take and return (StepResult, Observation...), for code that builds
# or types them without reaching into the generated package.
from envserve.v1 import envserve_pb2 as messages
from envserve.common.tables import sessions_per_table
from .aio import AsyncEnvClient, InteractStream
from .client import EnvClient, decode_image, info_dict, json_field, state_dict
from .errors import (EnvNotFoundError, EnvServeError, PermissionDeniedError, ReplicaFullError, SessionLostError,
                     SessionNotFoundError, UnauthenticatedError, UnavailableError, check, item_error)
from .aio_routing import AsyncRoutedClient, RoutedStream
from .routing import RoutedClient
from .streaming import StreamingClient
from .recovery import RecoverySettings
from .judge import AsyncJudgeClient, JudgeClient, JudgeTask
from .tasks import iter_tasks

__all__ = [
    "EnvClient", "AsyncEnvClient", "iter_tasks", "JudgeClient", "AsyncJudgeClient", "JudgeTask", "RoutedClient", "AsyncRoutedClient", "StreamingClient", "RoutedStream", "RecoverySettings", "InteractStream", "decode_image", "state_dict", "info_dict", "json_field",
    "EnvServeError", "EnvNotFoundError", "SessionLostError", "SessionNotFoundError", "ReplicaFullError", "UnavailableError",
    "PermissionDeniedError", "UnauthenticatedError", "check", "item_error", "messages", "sessions_per_table",
]
