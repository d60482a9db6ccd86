"""Which game a seed plays: the official ALFWorld data when it is there, generated games otherwise.

Both sources have the same three base splits as ALFWorld's json_2.1.1 (train, valid_seen,
valid_unseen); the research splits are task-type filters over them (see SPLITS).

Official: $ALFWORLD_DATA/json_2.1.1/<split>/<task folder>/<trial>/{traj_data.json, game.tw-pddl},
scanned the way alfworld's AlfredTWEnv collects games (movable and sliced tasks skipped, only
games marked solvable), in sorted path order so every process numbers them alike.

Generated: game i of a base split is task type i mod 6, drawn by generate.py from a seed that
depends only on (split, i); valid_unseen uses floor plans the other two never use, like
ALFRED's unseen scenes. Games are written on first use under the games directory in the same
json_2.1.1 layout (so ALFWORLD_DATA can point at it), and read from there afterwards.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from functools import lru_cache

from . import generate

BASE_SPLITS = ("train", "valid_seen", "valid_unseen")
_GENERATED_SEED_BASE = {"train": 0, "valid_seen": 1_000_000_000, "valid_unseen": 2_000_000_000}
GENERATOR_VERSION = "v1"


@dataclass(frozen=True)
class GameRef:
    base: str
    index: int
    task_type: str
    path: str = ""  # official games: their game.tw-pddl


def official_root(data_dir: str) -> str:
    """The json_2.1.1 folder under data_dir (or $ALFWORLD_DATA), or "" when there is none."""
    base = data_dir or os.environ.get("ALFWORLD_DATA", "")
    if not base:
        return ""
    root = os.path.join(os.path.expanduser(base), "json_2.1.1")
    return root if os.path.isdir(root) else ""


@lru_cache(maxsize=4)
def scan_official(root: str) -> dict[str, tuple[GameRef, ...]]:
    out: dict[str, tuple[GameRef, ...]] = {}
    for base in BASE_SPLITS:
        refs = []
        for path in sorted(glob.glob(os.path.join(root, base, "*", "*", "game.tw-pddl"))):
            folder = os.path.dirname(path)
            if "movable" in folder or "Sliced" in folder:
                continue
            task_type = os.path.basename(os.path.dirname(folder)).split("-", 1)[0]
            if task_type not in generate.TASK_TYPES or not os.path.exists(os.path.join(folder, "traj_data.json")):
                continue
            with open(path, "rb") as f:
                data = f.read()
            # Reading the flag without parsing a few hundred KB of JSON per game.
            if not re.search(rb'"solvable":\s*true', data):
                continue
            refs.append(GameRef(base, len(refs), task_type, path))
        out[base] = tuple(refs)
    return out


def default_games_dir() -> str:
    return os.environ.get("ENVSERVE_ALFWORLD_GAMES") or os.path.join(
        os.path.expanduser("~"), ".cache", "envserve", "alfworld", GENERATOR_VERSION)


class GeneratedGames:
    def __init__(self, root: str, counts: dict[str, int], unseen_floor_plans: tuple[int, ...]):
        self.root = os.path.join(root or default_games_dir(), "json_2.1.1")
        self.counts = counts
        plans = generate.all_floor_plans()
        unknown = set(unseen_floor_plans) - set(plans)
        if unknown:
            raise ValueError(f"unknown floor plans {sorted(unknown)}; ALFRED has {plans[0]}..{plans[-1]}")
        self.unseen = tuple(n for n in plans if n in unseen_floor_plans)
        self.seen = tuple(n for n in plans if n not in unseen_floor_plans)

    def refs(self, base: str) -> tuple[GameRef, ...]:
        n = generate.TASK_TYPES
        return tuple(GameRef(base, i, n[i % len(n)]) for i in range(self.counts[base]))

    def floor_plans(self, base: str) -> tuple[int, ...]:
        return self.unseen if base == "valid_unseen" else self.seen

    def seed(self, ref: GameRef) -> int:
        return _GENERATED_SEED_BASE[ref.base] + ref.index

    def existing(self, ref: GameRef) -> str:
        """The game file of ref if an earlier run wrote it, else ""."""
        pattern = os.path.join(self.root, ref.base, f"{ref.task_type}-*", f"trial_G{self.seed(ref):010d}",
                               "game.tw-pddl")
        found = sorted(glob.glob(pattern))
        return found[0] if found else ""

    def out_dir(self, ref: GameRef) -> str:
        return os.path.join(self.root, ref.base)
