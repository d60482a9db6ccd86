"""Sokoban on gym-sokoban rooms; see env.py."""
from .env import SokobanEnv

__all__ = ["SokobanEnv"]
