"""FrozenLake: gymnasium's FrozenLakeEnv (not slippery) on a random map from the task seed.

gymnasium runs the transitions; this class owns the rewards, the text and image views
(PIL, never gymnasium's pygame renderer) and the ground truth.
"""
from __future__ import annotations

from typing import Any, Mapping

from envserve.core.env import REWARD_BOUNDS, ActionOutcome, Environment, EnvSpec, GroundTruth, seeded_splits
from envserve.core.relations import grid_relation, indexed_names

from ..grid_render import Mark, Tile, render_grid

FROZEN, HOLE, GOAL = "_", "O", "G"
PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL = "P", "X", "√"

# gymnasium's action numbers.
_ACTION_IDS = {"left": 0, "down": 1, "right": 2, "up": 3}
_INVALID = "Invalid action {!r}. Valid actions: Left, Down, Right, Up."
# gymnasium seeds must be non-negative: negative task seeds wrap around.
_SEED_MOD = 2 ** 64

SYSTEM_PROMPT = """You are playing FrozenLake.
The lake is a grid. In the text observation each line is one row (row 0 at the top) and each character is one cell (column 0 at the left):
_ frozen ice, safe to stand on
O hole
G goal
P you, the player
X you, fallen into a hole
√ you, standing on the goal
In the image observation: ice is pale blue, holes are dark blue, the goal is green and you are the red circle (a red cross when you fell into a hole).
Goal: walk to the goal without stepping into a hole. The ice is not slippery: every move goes exactly where you say. Moving off the edge of the lake leaves you in place.
Actions: Left, Down, Right, Up, each one cell. Stepping into a hole ends the episode in failure; reaching the goal ends it in success.
Rewards (defaults): -0.1 per action, +10 for reaching the goal.
You may give several actions in one answer, separated by commas; they are executed in order."""

_ICE = (200, 230, 245)
_TILES = {
    FROZEN: Tile(_ICE),
    HOLE: Tile((20, 40, 90)),
    GOAL: Tile((50, 180, 70), (Mark("diamond", (250, 220, 40), 0.25),)),
    PLAYER: Tile(_ICE, (Mark("circle", (220, 40, 40), 0.2),)),
    PLAYER_IN_HOLE: Tile((20, 40, 90), (Mark("cross", (220, 40, 40), 0.2),)),
    PLAYER_ON_GOAL: Tile((50, 180, 70), (Mark("circle", (220, 40, 40), 0.2),)),
}


def _gym():
    # Imported on first use so listing environments stays light.
    from gymnasium.envs.toy_text import frozen_lake
    return frozen_lake


class FrozenLakeEnv(Environment):
    spec = EnvSpec(
        env_id="frozenlake",
        description="gymnasium FrozenLake, not slippery, random map per seed (VAGEN setting: 4x4).",
        system_prompt=SYSTEM_PROMPT,
        action_space="one of Left, Down, Right, Up (case-insensitive)",
        # VAGEN's FrozenLake: 3 actions per turn, 10 turns.
        max_turns=10,
        max_actions_per_turn=3,
        modalities=("text", "image"),
        difficulty_keys=("size", "p"),
        config_defaults={
            "size": 4,
            "p": 0.8,
            "reward_goal": 10.0,
            "penalty_for_step": -0.1,
            "penalty_hole": 0.0,
            "cell_separator": "",
        },
        config_docs={
            "size": "side of the square lake in cells",
            "p": "probability that a generated cell is frozen (else a hole); maps always have a path",
            "reward_goal": "reward for reaching the goal (episode ends, success)",
            "penalty_for_step": "reward of every valid action",
            "penalty_hole": "reward added when the player falls into a hole (episode ends, failure)",
            "cell_separator": "text put between the cells of a row in the text observation",
        },
        config_bounds={
            # gymnasium draws whole maps until one has a path, so the tries grow steeply as p falls
            # and the lake grows: on a 2-core machine a 32x32 map takes at most 17 ms over 10 seeds
            # at p 0.6, but 2.8 s at p 0.5 (16x16 at p 0.4: 3.4 s; smaller p hangs).
            "size": {"minimum": 2, "maximum": 32},
            "p": {"minimum": 0.6, "maximum": 1.0},
            "reward_goal": REWARD_BOUNDS,
            "penalty_for_step": REWARD_BOUNDS,
            "penalty_hole": REWARD_BOUNDS,
            "cell_separator": {"maxLength": 4},
        },
        splits=seeded_splits("random maps"),
        default_action_format="free_think",
    )

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        c = self.config
        self._r_step = float(c["penalty_for_step"])
        self._r_goal = float(c["reward_goal"])
        self._r_hole = float(c["penalty_hole"])
        self._sep = str(c["cell_separator"])
        self._seed: int | None = None
        self._env = None
        self._desc: tuple[str, ...] = ()
        self._done = False
        self._success = False
        self._rows: list[str] | None = None

    # -- setup --------------------------------------------------------------------------
    def reset(self, seed: int, options: Mapping[str, Any] | None = None) -> None:
        options = options or {}
        self._seed = int(seed) if seed is not None else 0
        if options.get("desc"):
            # A known map, for tests and curated tasks: gymnasium's S/F/H/G rows.
            desc = [str(r) for r in options["desc"]]
        else:
            desc = _gym().generate_random_map(size=int(self.config["size"]), p=float(self.config["p"]),
                                              seed=self._seed % _SEED_MOD)
        self._load(desc, None)

    def _load(self, desc: list[str], state: int | None) -> None:
        w = len(desc[0]) if desc else 0
        flat = "".join(desc)
        if not desc or any(len(r) != w for r in desc) or set(flat) - set("SFHG") \
                or flat.count("S") != 1 or flat.count("G") != 1:
            raise ValueError("desc must be equal-length rows of S, F, H, G with one S and one G")
        env = _gym().FrozenLakeEnv(desc=desc, is_slippery=False)
        # Seeded reset: the transitions are deterministic, but gymnasium still draws from
        # its RNG on each step, so give it a reproducible one.
        env.reset(seed=self._seed % _SEED_MOD)
        if state is not None:
            env.s = state
        self._env = env
        self._desc = tuple(desc)
        self._h, self._w = len(desc), w
        self._base = [HOLE if ch == "H" else GOAL if ch == "G" else FROZEN for ch in flat]
        self._goal = divmod(flat.index("G"), w)
        self._holes = [divmod(i, w) for i, ch in enumerate(flat) if ch == "H"]
        self._hole_names = indexed_names("hole", len(self._holes))
        self._done = self._success = False
        self._rows = None

    # -- the step -----------------------------------------------------------------------
    def step(self, action: str) -> ActionOutcome:
        a = _ACTION_IDS.get(action.strip().lower()) if isinstance(action, str) else None
        if a is None:
            return ActionOutcome(valid=False, feedback=_INVALID.format(action))
        if self._done:
            return ActionOutcome(valid=False, feedback="The episode is over; reset the environment.")
        before = int(self._env.s)
        s, _, terminated, _, _ = self._env.step(a)
        s = int(s)
        self._rows = None
        components = {"step": self._r_step}
        feedback = ""
        if terminated:
            self._done = True
            if self._base[s] == GOAL:
                self._success = True
                components["goal"] = self._r_goal
                feedback = "You reached the goal."
            else:
                if self._r_hole:
                    components["hole"] = self._r_hole
                feedback = "You fell into a hole."
        return ActionOutcome(reward=sum(components.values()), done=self._done, success=self._success,
                             feedback=feedback, components=components, info={"effective": s != before})

    # -- observations -------------------------------------------------------------------
    def _player(self) -> tuple[int, int]:
        return divmod(int(self._env.s), self._w)

    def grid_rows(self) -> list[str]:
        rows = self._rows
        if rows is None:
            cells = list(self._base)
            s = int(self._env.s)
            here = cells[s]
            cells[s] = PLAYER_IN_HOLE if here == HOLE else PLAYER_ON_GOAL if here == GOAL else PLAYER
            w = self._w
            rows = self._rows = ["".join(cells[i:i + w]) for i in range(0, len(cells), w)]
        return rows

    def render_text(self) -> str:
        rows = self.grid_rows()
        if self._sep:
            return "\n".join(self._sep.join(r) for r in rows)
        return "\n".join(rows)

    def ground_truth(self) -> GroundTruth:
        player = self._player()
        relations = [grid_relation("goal", self._goal, player)]
        relations += [grid_relation(n, h, player) for n, h in zip(self._hole_names, self._holes)]
        status = "goal" if self._success else "hole" if self._done else "playing"
        state = {
            "player": [*player],
            "goal": [*self._goal],
            "holes": [[*h] for h in self._holes],
            "size": self._h,
            "dim": [self._h, self._w],
            "grid": self.grid_rows()[:],
            "status": status,
        }
        return GroundTruth(state, relations)

    def anchor_data(self) -> Any:
        # The grid shows the map and the player; a string is hashed without a JSON dump.
        return "\n".join(self.grid_rows())

    def valid_actions(self) -> list[str]:
        # Every direction is legal (walking off the edge is a no-op) until the episode ends.
        return [] if self._done else ["Left", "Down", "Right", "Up"]

    def render_image(self, size: int):
        return render_grid(self.grid_rows(), size, _TILES)

    # -- copies -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        # Explicit and small: the map and the position rebuild the gymnasium env exactly.
        return {"seed": self._seed, "desc": list(self._desc),
                "s": int(self._env.s) if self._env is not None else None,
                "done": self._done, "success": self._success}

    def restore(self, snap: dict) -> None:
        self._seed = snap["seed"]
        if not snap["desc"]:
            return
        self._load(list(snap["desc"]), snap["s"])
        self._done, self._success = snap["done"], snap["success"]
