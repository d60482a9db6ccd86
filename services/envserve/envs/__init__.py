"""Built-in environment families: one folder each, one registration line each."""
from envserve.core.registry import register

register("sokoban", "envserve.envs.sokoban:SokobanEnv")
register("frozenlake", "envserve.envs.frozenlake:FrozenLakeEnv")
register("minesweeper", "envserve.envs.minesweeper:MinesweeperEnv")
