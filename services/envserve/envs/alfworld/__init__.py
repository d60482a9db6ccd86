"""ALFWorld (text): the alfworld package's PDDL games, official or generated."""
from .env import AlfWorldEnv

__all__ = ["AlfWorldEnv"]
