"""What environment authors and the server share: the interface, formats, sessions, registry."""
from .env import ActionOutcome, Environment, EnvSpec, GroundTruth, Split, seeded_splits
from .formats import ActionFormat, ParsedTurn, get_format, format_names, register_format
from .registry import env_ids, get_env_class, register
from .session import Session, SessionError, TurnResult

__all__ = [
    "ActionOutcome", "Environment", "EnvSpec", "GroundTruth", "Split", "seeded_splits", "ActionFormat", "ParsedTurn",
    "get_format", "format_names", "register_format", "env_ids", "get_env_class", "register",
    "Session", "SessionError", "TurnResult",
]
