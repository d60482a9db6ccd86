"""TextArena's games, served as `textarena:<game id>`; see env.py."""
from .env import TextArenaEnv, examples, make_env_class

__all__ = ["TextArenaEnv", "examples", "make_env_class"]
