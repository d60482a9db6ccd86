"""ScienceWorld from the PyPI package `scienceworld` (a JVM simulator); see env.py."""
from .env import ScienceWorldEnv

__all__ = ["ScienceWorldEnv"]
