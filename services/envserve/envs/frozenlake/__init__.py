"""FrozenLake on gymnasium's FrozenLakeEnv; see env.py."""
from .env import FrozenLakeEnv

__all__ = ["FrozenLakeEnv"]
