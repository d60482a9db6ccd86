"""Navigation (VAGEN): reach an instructed target object from a first-person view; see env.py."""
from .env import NavigationEnv

__all__ = ["NavigationEnv"]
