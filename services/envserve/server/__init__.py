"""The gRPC server runtime: an asyncio front process and environment worker processes."""
from .config import ServerConfig

__all__ = ["ServerConfig"]
