"""Sokoban: rooms from gym-sokoban's generator, movement and push rules implemented here.

The state is kept as flat cell indices (r * width + c) over a static string of the room,
so a step is a few list look-ups: no numpy, no copies. Rooms always have a wall border
(gym-sokoban's and validated for given layouts), so a move never leaves the grid.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Mapping

from envserve.core.env import REWARD_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits
from envserve.core.session import SessionError, full_spec
from envserve.core.relations import grid_relation, indexed_names

from ..grid_render import Mark, Tile, render_grid
from . import generate as _gen

WALL, FLOOR, TARGET = "#", "_", "O"
BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "X", "√", "P", "S"
_LAYOUT_SYMBOLS = {WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET}

ACTIONS = ("Up", "Down", "Left", "Right")
_INVALID = "Invalid action {!r}. Valid actions: Up, Down, Left, Right."

SYSTEM_PROMPT = """You are playing Sokoban.
The room is a grid. In the text observation each line is one row (row 0 at the top) and each character is one cell (column 0 at the left):
# wall
_ empty floor
O target
X box
√ box on a target
P you, the player
S you, standing on a target
In the image observation: walls are dark brown, floor is light grey, targets are red outlined squares, boxes are orange squares, boxes on a target are green squares and you are the blue circle.
Goal: push every box onto a target.
Actions: Up, Down, Left, Right. Each moves you one cell in that direction. Walking into a box pushes it one cell further in the same direction, but only if the cell beyond the box is floor or a target. You cannot pull boxes, push two boxes at once, or walk through walls; a blocked move leaves everything in place.
A box pushed against a wall or into a corner may never reach a target again, so plan before you push.
Rewards (defaults): -0.1 per action, +1 when a box reaches a target, -1 when a box leaves a target, +10 when every box is on a target.
You may give several actions in one answer, separated by commas; they are executed in order."""

_TILES = {
    WALL: Tile((101, 67, 33)),
    FLOOR: Tile((214, 214, 214)),
    TARGET: Tile((214, 214, 214), (Mark("ring", (220, 30, 30), 0.15),)),
    BOX: Tile((214, 214, 214), (Mark("square", (235, 140, 20), 0.12),)),
    BOX_ON_TARGET: Tile((214, 214, 214), (Mark("ring", (220, 30, 30), 0.05),
                                          Mark("square", (40, 170, 60), 0.15))),
    PLAYER: Tile((214, 214, 214), (Mark("circle", (30, 80, 220), 0.15),)),
    PLAYER_ON_TARGET: Tile((214, 214, 214), (Mark("ring", (220, 30, 30), 0.05),
                                             Mark("circle", (30, 80, 220), 0.2))),
}


class _Room:
    """The static part of a room, computed once per layout and shared (read-only) by every
    env instance and GroundTruth on that layout: restore and same-seed resets reuse it."""

    __slots__ = ("h", "w", "static", "targets", "moves", "rc", "targets_rc", "truth_targets",
                 "truth_walls", "truth_dim", "box_names", "target_names")

    def __init__(self, static: str, w: int):
        h = len(static) // w
        self.h, self.w, self.static = h, w, static
        self.targets = frozenset(i for i, ch in enumerate(static) if ch == TARGET)
        moves = {"up": -w, "down": w, "left": -1, "right": 1}
        for name in ACTIONS:
            moves[name] = moves[name.upper()] = moves[name.lower()]
        self.moves = moves
        self.rc = [(i // w, i % w) for i in range(h * w)]
        self.targets_rc = [self.rc[i] for i in sorted(self.targets)]
        self.truth_targets = [[r, c] for r, c in self.targets_rc]
        self.truth_walls = [[*self.rc[i]] for i, ch in enumerate(static) if ch == WALL]
        self.truth_dim = [h, w]
        self.box_names = indexed_names("box", len(self.targets))
        self.target_names = indexed_names("target", len(self.targets))


_ROOMS: "OrderedDict[tuple[str, int], _Room]" = OrderedDict()
_ROOM_CACHE_SIZE = 4096
_ROOMS_LOCK = threading.Lock()


def _room(static: str, w: int) -> _Room:
    key = (static, w)
    with _ROOMS_LOCK:
        room = _ROOMS.get(key)
        if room is not None:
            _ROOMS.move_to_end(key)
            return room
    room = _Room(static, w)
    with _ROOMS_LOCK:
        _ROOMS[key] = room
        while len(_ROOMS) > _ROOM_CACHE_SIZE:
            _ROOMS.popitem(last=False)
    return room


# Most boxes per room side. gym-sokoban's generator searches the reverse play of every room (up
# to 300,000 states a try, 4 tries, then gen_attempts more keys), so its time grows with the floor
# and steeply with the boxes: {dim_room: 10, num_boxes: 4} takes 6 s median and 19 s for some seeds,
# {10, 6} 24 s. Measured on a 2-core machine, 30 seeds each at num_gen_steps 40 (the most allowed)
# and p_change_directions 0.35 or 1.0, the largest config each side allows takes at most 2.7 s
# (8x8 with 3 boxes: 2.7 s, median 0.3 s; 12x12 with 2: 2.2 s, median 0.2 s; 7x7 with 3: 1.3 s;
# 6x6 with 4: 0.6 s). Below 5 cells no room generates (4x4 fails for every seed); a 5x5 room
# with 3 boxes fails for 2 seeds in 10.
# A room side an operator allowed beyond these (core/limits.py) takes 2 boxes (15x15: 1.6 s); an
# operator who raises num_boxes' maximum above the built-in one lifts the table: any side then takes
# up to their maximum.
MAX_BOXES_BY_DIM = {5: 2, 6: 4, 7: 3, 8: 3, 9: 2, 10: 2, 11: 2, 12: 2}
_BUILTIN_MAX_BOXES = max(MAX_BOXES_BY_DIM.values())


def max_boxes(dim: int) -> int:
    """The most boxes a room of side dim may have under the bounds in force in this process."""
    allowed = full_spec(SokobanEnv.spec).config_bounds["num_boxes"].get("maximum", _BUILTIN_MAX_BOXES)
    return int(allowed) if allowed > _BUILTIN_MAX_BOXES else MAX_BOXES_BY_DIM.get(dim, 2)


@lru_cache(maxsize=4096)
def _generated_layout(seed: int, dim: int, num_boxes: int, steps: int, p_change: float,
                      attempts: int) -> tuple[str, ...]:
    """The symbol rows of a generated room. Cached: generation is a ~10 ms search, and
    GRPO groups reset many sessions on the same seed."""
    structure, state = _gen.generate(seed, dim, num_boxes, steps, p_change, attempts)
    rows = []
    for srow, prow in zip(structure.tolist(), state.tolist()):
        cells = []
        for s, p in zip(srow, prow):
            if p == 5:
                cells.append(PLAYER_ON_TARGET if s == 2 else PLAYER)
            elif p in (3, 4):
                cells.append(BOX_ON_TARGET if s == 2 else BOX)
            else:
                cells.append(WALL if s == 0 else TARGET if s == 2 else FLOOR)
        rows.append("".join(cells))
    return tuple(rows)


class SokobanEnv(Environment):
    spec = EnvSpec(
        env_id="sokoban",
        description="Sokoban box pushing on rooms from gym-sokoban's generator (VAGEN setting: 6x6, one box).",
        system_prompt=SYSTEM_PROMPT,
        action_space="one of Up, Down, Left, Right (case-insensitive)",
        # VAGEN's Sokoban: 3 actions per turn; 10 turns gives 30 moves, enough for 6x6 one-box rooms.
        max_turns=10,
        max_actions_per_turn=3,
        modalities=("text", "image"),
        difficulty_keys=("dim_room", "num_boxes", "num_gen_steps"),
        config_defaults={
            "dim_room": 6,
            "num_boxes": 1,
            "num_gen_steps": 0,
            "p_change_directions": 0.35,
            "gen_attempts": 20,
            "reward_box_on_target": 1.0,
            "penalty_box_off_target": -1.0,
            "reward_finished": 10.0,
            "penalty_for_step": -0.1,
            "cell_separator": "",
        },
        config_docs={
            "dim_room": "side of the square room in cells, walls included",
            "num_boxes": "boxes (and targets) in the room",
            "num_gen_steps": "random-walk steps of gym-sokoban's room topology; 0 = gym-sokoban's rule "
                             "int(1.7 * 2 * dim_room), 20 for 6x6",
            "p_change_directions": "probability that the topology walk turns at each step (gym-sokoban)",
            "gen_attempts": "seeds tried per task (seed, then seed*1000+k) when generation fails",
            "reward_box_on_target": "reward when a push puts a box on a target",
            "penalty_box_off_target": "reward when a push moves a box off a target",
            "reward_finished": "reward when every box is on a target (episode ends, success)",
            "penalty_for_step": "reward of every valid action",
            "cell_separator": "text put between the cells of a row in the text observation",
        },
        config_bounds={
            "dim_room": {"minimum": min(MAX_BOXES_BY_DIM), "maximum": max(MAX_BOXES_BY_DIM)},
            "num_boxes": {"minimum": 1, "maximum": _BUILTIN_MAX_BOXES},
            # 40 is the default walk of a 12x12 room; a longer walk opens more floor (12x12 with 2
            # boxes after 100 steps: 4.3 s for some seeds).
            "num_gen_steps": {"minimum": 0, "maximum": 40},
            "p_change_directions": {"minimum": 0.0, "maximum": 1.0},
            # Failed keys cost a search each: a caller may try fewer, never more.
            "gen_attempts": {"minimum": 1, "maximum": 20},
            "reward_box_on_target": REWARD_BOUNDS,
            "penalty_box_off_target": REWARD_BOUNDS,
            "reward_finished": REWARD_BOUNDS,
            "penalty_for_step": REWARD_BOUNDS,
            "cell_separator": {"maxLength": 4},
        },
        splits=seeded_splits("generated rooms"),
        default_action_format="free_think",
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        self._r_step = float(c["penalty_for_step"])
        self._r_on = float(c["reward_box_on_target"])
        self._r_off = float(c["penalty_box_off_target"])
        self._r_done = float(c["reward_finished"])
        self._sep = str(c["cell_separator"])
        dim, boxes = int(c["dim_room"]), int(c["num_boxes"])
        if boxes > max_boxes(dim):
            raise ValueError(f"num_boxes {boxes} is too many for dim_room {dim}: at most {max_boxes(dim)} (the room "
                             f"generator's search grows steeply with the boxes; most boxes by dim_room: "
                             f"{MAX_BOXES_BY_DIM})")
        self._seed: int | None = None
        self._room: _Room | None = None
        self._moves: dict[str, int] = {}  # the room's moves; empty before the first reset
        self._boxes: list[int] = []       # flat cell indices; list index = box identity
        self._player = 0
        self._on_target = 0
        self._done = False
        self._success = False
        self._rows: list[str] | None = None  # cached grid rows of the current state
        self._text: str | None = None        # cached "\n".join(rows)

    # -- setup --------------------------------------------------------------------------
    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        options = options or {}
        self._seed = int(seed) if seed is not None else 0
        if options.get("layout"):
            # A known state, for tests and curated tasks: rows of the text symbols.
            self._set_layout([str(r) for r in options["layout"]])
            return
        c = self.config
        dim = int(c["dim_room"])
        steps = int(c["num_gen_steps"]) or int(_gen.GEN_STEPS_PER_SIDE * 2 * dim)
        try:
            layout = _generated_layout(self._seed, dim, int(c["num_boxes"]), steps, float(c["p_change_directions"]),
                                       int(c["gen_attempts"]))
        except RuntimeError as e:  # no room for this seed and config: the task, not the server
            raise SessionError("FAILED_PRECONDITION", f"{e}; try another seed, fewer boxes or more "
                                                      f"gen_attempts") from None
        self._set_layout(list(layout))

    def _set_layout(self, rows: list[str]) -> None:
        h, w = len(rows), len(rows[0]) if rows else 0
        if h < 3 or w < 3 or any(len(r) != w for r in rows):
            raise ValueError("layout must be at least 3 equal-length rows")
        if set("".join(rows)) - _LAYOUT_SYMBOLS:
            raise ValueError(f"layout symbols are {sorted(_LAYOUT_SYMBOLS)}")
        if any(ch != WALL for ch in rows[0] + rows[-1]) or any(r[0] != WALL or r[-1] != WALL for r in rows):
            raise ValueError("layout must have a wall border")
        flat = "".join(rows)
        players = [i for i, ch in enumerate(flat) if ch in (PLAYER, PLAYER_ON_TARGET)]
        boxes = [i for i, ch in enumerate(flat) if ch in (BOX, BOX_ON_TARGET)]
        targets = {i for i, ch in enumerate(flat) if ch in (TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET)}
        if len(players) != 1 or not boxes or len(boxes) != len(targets):
            raise ValueError("layout needs one player and as many boxes as targets (at least one)")
        static = "".join(TARGET if i in targets else WALL if ch == WALL else FLOOR for i, ch in enumerate(flat))
        self._load(static, w, boxes, players[0])

    def _load(self, static: str, w: int, boxes: list[int], player: int) -> None:
        room = self._room = _room(static, w)
        self._moves = room.moves
        self._boxes = list(boxes)
        self._player = player
        self._on_target = sum(1 for b in boxes if b in room.targets)
        self._success = self._done = self._on_target == len(boxes)
        self._rows = self._text = None

    # -- the step -----------------------------------------------------------------------
    def step(self, action: str) -> ActionOutcome:
        delta = self._moves.get(action)
        if delta is None:
            delta = self._moves.get(action.strip().lower()) if isinstance(action, str) else None
            if delta is None:
                return ActionOutcome(valid=False, feedback=_INVALID.format(action))
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        reward = self._r_step
        components = {"step": reward}
        target = self._player + delta
        room = self._room
        static = room.static
        moved = False
        if static[target] != WALL:
            boxes = self._boxes
            if target in boxes:
                beyond = target + delta
                if static[beyond] != WALL and beyond not in boxes:
                    boxes[boxes.index(target)] = beyond
                    self._player = target
                    moved = True
                    targets = room.targets
                    was_on, now_on = target in targets, beyond in targets
                    if now_on != was_on:
                        part = self._r_on if now_on else self._r_off
                        components["box"] = part
                        reward += part
                        self._on_target += 1 if now_on else -1
                        if self._on_target == len(boxes):
                            components["success"] = self._r_done
                            reward += self._r_done
                            self._done = self._success = True
            else:
                self._player = target
                moved = True
        if moved:
            self._rows = self._text = None
        return ActionOutcome(reward=reward, done=self._done, success=self._success,
                             components=components, info={"effective": moved})

    # -- observations -------------------------------------------------------------------
    def grid_rows(self) -> list[str]:
        """The symbol grid, one string per row, no separators (cached per state)."""
        rows = self._rows
        if rows is None:
            room = self._room
            cells = list(room.static)
            targets = room.targets
            for b in self._boxes:
                cells[b] = BOX_ON_TARGET if b in targets else BOX
            p = self._player
            cells[p] = PLAYER_ON_TARGET if p in targets else PLAYER
            w = room.w
            rows = self._rows = ["".join(cells[i:i + w]) for i in range(0, len(cells), w)]
        return rows

    def _grid_text(self) -> str:
        text = self._text
        if text is None:
            text = self._text = "\n".join(self.grid_rows())
        return text

    def render_text(self) -> str:
        if self._sep:
            return "\n".join(self._sep.join(r) for r in self.grid_rows())
        return self._grid_text()

    def ground_truth(self) -> GroundTruth:
        room = self._room
        rc = room.rc
        player = rc[self._player]
        boxes = [rc[b] for b in self._boxes]
        relations = [grid_relation(n, b, player) for n, b in zip(room.box_names, boxes)]
        relations += [grid_relation(n, t, player) for n, t in zip(room.target_names, room.targets_rc)]
        # targets, walls and dim are the room's shared lists (copying ~30 wall cells would
        # double the cost of this call): ground-truth states are read-only to consumers.
        state = {
            "player": [*player],
            "boxes": [[*b] for b in boxes],
            "targets": room.truth_targets,
            "walls": room.truth_walls,
            "boxes_on_target": self._on_target,
            "grid": self.grid_rows()[:],
            "dim": room.truth_dim,
        }
        return GroundTruth(state, relations)

    def anchor_data(self) -> Any:
        # The grid shows player, boxes, targets and walls: it identifies the state. A string,
        # which the session hashes without a JSON dump.
        return self._grid_text()

    def valid_actions(self) -> list[str]:
        # Every direction is legal (a blocked move is a no-op), until the room is solved.
        return [] if self._done else list(ACTIONS)

    def render_image(self, size: int):
        return render_grid(self.grid_rows(), size, _TILES)

    # -- copies -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        room = self._room
        return {"seed": self._seed, "static": room.static if room else "", "w": room.w if room else 0,
                "boxes": list(self._boxes), "player": self._player,
                "done": self._done, "success": self._success}

    def restore(self, snap: dict) -> None:
        self._seed = snap["seed"]
        if not snap["static"]:
            return
        self._load(snap["static"], snap["w"], snap["boxes"], snap["player"])
        self._done, self._success = snap["done"], snap["success"]
