"""Walk a 5x5 grid from a seeded start to a seeded goal around seeded walls."""
import random
from typing import Any, Literal, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

SIZE, WALLS, MAX_STEPS = 5, 4, 30
MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


class MoveAction(Action):
    direction: Literal["up", "down", "left", "right"]
    steps: int = 1


class GridObservation(Observation):
    board: str
    position: list[int]
    goal: list[int]


class GridState(State):
    position: list[int] = [0, 0]
    goal: list[int] = [0, 0]
    walls: list[list[int]] = []


class GridEnvironment(Environment):
    """Reach the goal G from P on a 5x5 grid; # are walls. Each move costs a little."""

    def __init__(self):
        super().__init__()
        self._state = GridState()

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
              **kwargs: Any) -> GridObservation:
        rng = random.Random(seed)
        cells = [[r, c] for r in range(SIZE) for c in range(SIZE)]
        rng.shuffle(cells)
        self._state = GridState(episode_id=episode_id, position=cells[0], goal=cells[1], walls=cells[2:2 + WALLS])
        return self._observe(0.0, False)

    def step(self, action: MoveAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GridObservation:
        if not 1 <= action.steps <= SIZE:
            raise ValueError(f"steps must be 1..{SIZE}")
        s = self._state
        s.step_count += 1
        dr, dc = MOVES[action.direction]
        for _ in range(action.steps):
            nxt = [s.position[0] + dr, s.position[1] + dc]
            if not (0 <= nxt[0] < SIZE and 0 <= nxt[1] < SIZE) or nxt in s.walls:
                break
            s.position = nxt
        if s.position == s.goal:
            return self._observe(1.0, True, success=True)
        return self._observe(-0.01, s.step_count >= MAX_STEPS)

    def _observe(self, reward, done, success=False):
        s = self._state
        rows = []
        for r in range(SIZE):
            row = ""
            for c in range(SIZE):
                cell = [r, c]
                row += "P" if cell == s.position else "G" if cell == s.goal else "#" if cell in s.walls else "."
            rows.append(row)
        return GridObservation(board="\n".join(rows), position=list(s.position), goal=list(s.goal),
                               reward=reward, done=done, metadata={"success": success} if success else {})

    def web_actions(self, observation):
        return [(d, {"direction": d}) for d in MOVES]

    @property
    def state(self) -> GridState:
        return self._state
