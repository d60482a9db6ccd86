"""Minesweeper with LaMer's rules; see env.py."""
from .env import MinesweeperEnv

__all__ = ["MinesweeperEnv"]
