"""Minesweeper with LaMer's rules, implemented here.

Mines are placed from the task seed at reset, so the ground truth is fixed from turn 0.
The first reveal is always safe: if it hits a mine, that mine moves to the first free cell
in row-major order (deterministic, so replays agree). Revealing a 0 opens its connected
region of zeros and the numbers bordering it.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from envserve.core.env import REWARD_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits

from ..grid_render import Mark, Tile, render_grid

HIDDEN, MINE = "?", "*"
# numpy Generators take non-negative seeds: negative task seeds wrap around.
_SEED_MOD = 2 ** 64

# "(r, c)", "r, c", "r c", "reveal(r, c)", "reveal r c", "[r, c]"
_ACTION_RE = re.compile(
    r"^(?:reveal\s*)?(?:\(\s*(-?\d+)\s*(?:,\s*|\s+)(-?\d+)\s*\)|\[\s*(-?\d+)\s*(?:,\s*|\s+)(-?\d+)\s*\]"
    r"|(-?\d+)\s*(?:,\s*|\s+)(-?\d+))$",
    re.IGNORECASE)

SYSTEM_PROMPT = """You are playing Minesweeper.
The board is a grid of cells; some hide mines. In the text observation the first line lists the column numbers and every other line starts with its row number, both counted from 0 (row 0 at the top, column 0 at the left). Cells are separated by spaces:
? hidden cell
0 revealed cell with no mine among its 8 neighbours
1-8 revealed cell with that many mines among its 8 neighbours (including diagonals)
* a mine (shown only after the game is lost)
In the image observation hidden cells are grey, revealed cells are white with their number written in them (blank for 0) and mines are red.
Goal: reveal every cell that has no mine. Revealing a mine loses the game. Your first reveal is always safe. Revealing a 0 also reveals its whole connected area of 0 cells and the numbers around it.
Action: reveal one hidden cell per turn, written as (row, col), e.g. (2, 3).
Rewards (defaults): -0.1 per reveal, +10 for revealing every safe cell, -1 for hitting a mine."""

_HIDDEN_FILL = (150, 150, 150)
_OPEN_FILL = (235, 235, 235)
_NUMBER_COLORS = {1: (20, 60, 220), 2: (20, 130, 30), 3: (210, 30, 30), 4: (20, 20, 120),
                  5: (120, 20, 20), 6: (20, 130, 130), 7: (0, 0, 0), 8: (90, 90, 90)}
_TILES = {
    HIDDEN: Tile(_HIDDEN_FILL, (Mark("ring", (190, 190, 190), 0.08),)),
    "0": Tile(_OPEN_FILL),
    MINE: Tile((220, 40, 40), (Mark("circle", (20, 20, 20), 0.25),)),
    **{str(n): Tile(_OPEN_FILL, label=str(n), label_color=color) for n, color in _NUMBER_COLORS.items()},
}


@lru_cache(maxsize=64)
def _neighbours(rows: int, cols: int) -> tuple[tuple[int, ...], ...]:
    out = []
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        out.append(tuple((r + dr) * cols + c + dc for dr in (-1, 0, 1) for dc in (-1, 0, 1)
                         if (dr or dc) and 0 <= r + dr < rows and 0 <= c + dc < cols))
    return tuple(out)


class MinesweeperEnv(Environment):
    spec = EnvSpec(
        env_id="minesweeper",
        description="Minesweeper with LaMer's rules: seeded mines, safe first reveal, flood fill of zeros.",
        system_prompt=SYSTEM_PROMPT,
        action_space="(row, col), 0-based; also 'row, col', 'row col', 'reveal(row, col)'",
        # LaMer: one reveal per turn; 20 turns cover the 33 safe cells of a 6x6 board with
        # 3 mines because zeros open whole areas.
        max_turns=20,
        max_actions_per_turn=1,
        modalities=("text", "image"),
        difficulty_keys=("rows", "cols", "num_mines"),
        config_defaults={
            "rows": 6,
            "cols": 6,
            "num_mines": 3,
            "safe_first_reveal": True,
            "reward_win": 10.0,
            "penalty_mine": -1.0,
            "reward_reveal": 0.0,
            "penalty_for_step": -0.1,
            # An action "(r, c)" holds a comma, so several actions would be split on ';'.
            "action_separator": ";",
        },
        config_docs={
            "rows": "board rows",
            "cols": "board columns",
            "num_mines": "mines on the board (fewer than rows * cols)",
            "safe_first_reveal": "a mine under the first reveal moves to the first free cell in row-major order",
            "reward_win": "reward when every safe cell is revealed (episode ends, success)",
            "penalty_mine": "reward when a mine is revealed (episode ends, failure)",
            "reward_reveal": "reward per newly revealed safe cell",
            "penalty_for_step": "reward of every valid reveal",
            "action_separator": "separator between several actions in one answer (';' because actions hold commas)",
        },
        config_bounds={
            # The classic expert board is 16x30. A 30x30 board opens and resets in about a
            # millisecond on a 2-core machine; its text observation is about 2 KB.
            "rows": {"minimum": 1, "maximum": 30},
            "cols": {"minimum": 1, "maximum": 30},
            # Fewer than rows * cols as well (the env's own check).
            "num_mines": {"minimum": 0, "maximum": 899},
            "reward_win": REWARD_BOUNDS,
            "penalty_mine": REWARD_BOUNDS,
            "reward_reveal": REWARD_BOUNDS,
            "penalty_for_step": REWARD_BOUNDS,
        },
        splits=seeded_splits("seeded boards"),
        default_action_format="free_think",
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        self._R, self._C, self._n = int(c["rows"]), int(c["cols"]), int(c["num_mines"])
        if self._n >= self._R * self._C:
            raise ValueError(f"num_mines must be fewer than rows*cols, got {self._n} for {self._R}x{self._C}")
        self._r_step = float(c["penalty_for_step"])
        self._r_win = float(c["reward_win"])
        self._r_mine = float(c["penalty_mine"])
        self._r_reveal = float(c["reward_reveal"])
        self._safe_first = bool(c["safe_first_reveal"])
        self._nb = _neighbours(self._R, self._C)
        self._seed: int | None = None
        self._set_mines([])

    # -- setup --------------------------------------------------------------------------
    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        options = options or {}
        self._seed = int(seed) if seed is not None else 0
        if options.get("mines") is not None:
            # A known board, for tests and curated tasks: [[row, col], ...].
            mines = sorted({int(r) * self._C + int(c) for r, c in options["mines"]})
            if len(mines) != self._n or any(not 0 <= m < self._R * self._C for m in mines):
                raise ValueError(f"options.mines must be {self._n} distinct cells of the {self._R}x{self._C} board")
        else:
            rng = np.random.default_rng(self._seed % _SEED_MOD)
            mines = sorted(int(i) for i in rng.choice(self._R * self._C, size=self._n, replace=False))
        self._set_mines(mines)

    def _set_mines(self, mines: list[int]) -> None:
        self._mines = set(mines)
        self._counts = [sum(1 for j in nb if j in self._mines) for nb in self._nb]
        self._revealed = [False] * (self._R * self._C)
        self._num_revealed = 0
        self._first_done = False
        self._exploded: int | None = None
        self._done = self._success = False

    # -- the step -----------------------------------------------------------------------
    def parse(self, action: str) -> tuple[int, int] | str:
        """(row, col) or the feedback of an invalid action."""
        m = _ACTION_RE.match(action.strip()) if isinstance(action, str) else None
        if m is None:
            return (f"Invalid action {action!r}. Reveal one hidden cell as (row, col) with 0-based "
                    f"indices, e.g. (0, {min(1, self._C - 1)}).")
        r, c = (int(g) for g in m.groups() if g is not None)
        if not (0 <= r < self._R and 0 <= c < self._C):
            return (f"Invalid action {action!r}: row must be 0 to {self._R - 1} and column 0 to "
                    f"{self._C - 1}.")
        if self._revealed[r * self._C + c]:
            return f"Invalid action {action!r}: cell ({r}, {c}) is already revealed. Pick a hidden cell (?)."
        return r, c

    def step(self, action: str) -> ActionOutcome:
        if self._done:
            return ActionOutcome(valid=False, feedback="The game is over; reset the environment.")
        cell = self.parse(action)
        if isinstance(cell, str):
            return ActionOutcome(valid=False, feedback=cell)
        r, c = cell
        i = r * self._C + c
        info: dict[str, Any] = {}
        if not self._first_done and self._safe_first and i in self._mines:
            moved_to = next(j for j in range(self._R * self._C) if j != i and j not in self._mines)
            self._move_mine(i, moved_to)
            info["mine_moved"] = [[r, c], [*divmod(moved_to, self._C)]]
        self._first_done = True
        components = {"step": self._r_step}
        if i in self._mines:
            self._exploded = i
            self._done = True
            components["mine"] = self._r_mine
            feedback = f"({r}, {c}) was a mine. You lost."
        else:
            opened = self._open(i)
            if self._r_reveal:
                components["reveal"] = self._r_reveal * opened
            feedback = f"Revealed ({r}, {c}): {opened} cell{'s' if opened != 1 else ''} opened."
            if self._num_revealed == self._R * self._C - len(self._mines):
                self._done = self._success = True
                components["win"] = self._r_win
                feedback += " Every safe cell is revealed. You won!"
        return ActionOutcome(reward=sum(components.values()), done=self._done, success=self._success,
                             feedback=feedback, components=components, info=info)

    def _move_mine(self, src: int, dst: int) -> None:
        self._mines.discard(src)
        self._mines.add(dst)
        for j in self._nb[src]:
            self._counts[j] -= 1
        for j in self._nb[dst]:
            self._counts[j] += 1

    def _open(self, i: int) -> int:
        """Reveal safe cell i, flooding through zeros; the number of cells newly revealed."""
        revealed, counts, nb = self._revealed, self._counts, self._nb
        stack, opened = [i], 0
        revealed[i] = True
        while stack:
            j = stack.pop()
            opened += 1
            if counts[j] == 0:
                for k in nb[j]:
                    # A zero has no mine neighbours, so everything it floods into is safe.
                    if not revealed[k]:
                        revealed[k] = True
                        stack.append(k)
        self._num_revealed += opened
        return opened

    # -- observations -------------------------------------------------------------------
    def _tokens(self) -> list[str]:
        show_mines = self._exploded is not None
        out = []
        for i, (rev, n) in enumerate(zip(self._revealed, self._counts)):
            if rev:
                out.append(str(n))
            elif show_mines and i in self._mines:
                out.append(MINE)
            else:
                out.append(HIDDEN)
        return out

    def visible_rows(self) -> list[str]:
        t, C = self._tokens(), self._C
        return ["".join(t[i:i + C]) for i in range(0, len(t), C)]

    def render_text(self) -> str:
        t, C = self._tokens(), self._C
        wd = len(str(max(self._R, self._C) - 1))
        lines = [" " * wd + " " + " ".join(str(c).rjust(wd) for c in range(C))]
        for r in range(self._R):
            lines.append(str(r).rjust(wd) + " " + " ".join(x.rjust(wd) for x in t[r * C:(r + 1) * C]))
        return "\n".join(lines)

    def _rc_list(self, cells) -> list[list[int]]:
        return [[*divmod(i, self._C)] for i in sorted(cells)]

    def ground_truth(self) -> GroundTruth:
        C = self._C
        board = "".join(MINE if i in self._mines else str(n) for i, n in enumerate(self._counts))
        safe_left = self._R * C - len(self._mines) - self._num_revealed
        status = "won" if self._success else "lost" if self._done else "playing"
        state = {
            "mines": self._rc_list(self._mines),
            "revealed": self._rc_list(i for i, rev in enumerate(self._revealed) if rev),
            "board": [board[i:i + C] for i in range(0, len(board), C)],
            "visible": self.visible_rows(),
            "rows": self._R,
            "cols": C,
            "num_mines": len(self._mines),
            "safe_cells_left": safe_left,
            "status": status,
        }
        relations = []
        for i, rev in enumerate(self._revealed):
            n = self._counts[i]
            if rev and n:
                hidden = sum(1 for k in self._nb[i] if not self._revealed[k])
                if hidden:
                    relations.append(f"cell ({i // C}, {i % C}) shows {n} and has {hidden} hidden "
                                     f"neighbour{'s' if hidden != 1 else ''}")
        return GroundTruth(state, relations)

    def anchor_data(self) -> Any:
        # What the agent sees plus where the mines are (they can move on the first reveal),
        # as a string, which the session hashes without a JSON dump.
        return "\n".join(self.visible_rows()) + "\nmines " + " ".join(map(str, sorted(self._mines)))

    def valid_actions(self) -> list[str]:
        if self._done:
            return []
        C = self._C
        return [f"({i // C}, {i % C})" for i, rev in enumerate(self._revealed) if not rev]

    def render_image(self, size: int):
        t, C = self._tokens(), self._C
        return render_grid([t[i:i + C] for i in range(0, len(t), C)], size, _TILES)

    # -- copies -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return {"seed": self._seed, "mines": sorted(self._mines),
                "revealed": [i for i, rev in enumerate(self._revealed) if rev],
                "first_done": self._first_done, "exploded": self._exploded,
                "done": self._done, "success": self._success}

    def restore(self, snap: dict) -> None:
        self._seed = snap["seed"]
        self._set_mines(list(snap["mines"]))
        for i in snap["revealed"]:
            self._revealed[i] = True
        self._num_revealed = len(snap["revealed"])
        self._first_done, self._exploded = snap["first_done"], snap["exploded"]
        self._done, self._success = snap["done"], snap["success"]
