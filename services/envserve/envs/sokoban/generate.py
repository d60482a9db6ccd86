"""Seeded Sokoban rooms from the real gym-sokoban generator.

gym-sokoban's `generate_room` draws from Python's global `random` (room topology) AND
numpy's global legacy RNG (player and box placement), and keeps its search state in module
globals. So generation runs under a lock, seeds both global RNGs from the task seed, and
puts both RNG states back afterwards, so callers' randomness is untouched and concurrent
resets in a threaded server cannot interleave.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import random
import threading
import warnings
from typing import Callable

import numpy as np

_LOCK = threading.Lock()
_generate_room: Callable | None = None

# gym-sokoban's own default generation length: int(1.7 * (height + width)), 20 for 6x6.
GEN_STEPS_PER_SIDE = 1.7


def _load_generator() -> Callable:
    """gym_sokoban.envs.room_utils.generate_room, loaded on first use.

    room_utils.py needs only random, numpy and marshal, but importing it through its
    package runs gym_sokoban/__init__, which imports the unmaintained `gym` (0.7 s, a
    notice printed to stderr) and pkg_resources. So the module file of the installed
    package is loaded on its own; if the layout ever differs, the plain import is used.
    """
    global _generate_room
    if _generate_room is not None:
        return _generate_room
    fn = None
    try:
        pkg = importlib.util.find_spec("gym_sokoban")  # locates without executing __init__
        if pkg is not None and pkg.submodule_search_locations:
            path = os.path.join(list(pkg.submodule_search_locations)[0], "envs", "room_utils.py")
            if os.path.exists(path):
                spec = importlib.util.spec_from_file_location("_envserve_gym_sokoban_room_utils", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                fn = module.generate_room
    except Exception:  # noqa: BLE001 - any failure falls back to the ordinary import
        fn = None
    if fn is None:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            from gym_sokoban.envs.room_utils import generate_room as fn  # type: ignore
    _generate_room = fn
    return fn


def _numpy_seed(key: int):
    # The legacy global RNG takes a 32-bit int or an array of 32-bit words.
    if 0 <= key < 2 ** 32:
        return key
    k = key % 2 ** 64
    return [k & 0xFFFFFFFF, k >> 32]


def attempt_key(seed: int, attempt: int) -> int:
    """The RNG key of one generation attempt: the seed itself first (the same room
    gym-sokoban gives for that seed), then seed*1000+attempt for unlucky seeds."""
    return seed if attempt == 0 else seed * 1000 + attempt


def generate(seed: int, dim: int, num_boxes: int, num_steps: int, p_change_directions: float,
             attempts: int) -> tuple[np.ndarray, np.ndarray]:
    """(room_structure, room_state) in gym-sokoban's codes: 0 wall, 1 floor, 2 target,
    3/4 box, 5 player. Same arguments, same room, in any process."""
    gen = _load_generator()
    last_error: Exception | None = None
    with _LOCK:
        py_state = random.getstate()
        np_state = np.random.get_state()
        try:
            for attempt in range(max(1, attempts)):
                key = attempt_key(seed, attempt)
                random.seed(key)
                np.random.seed(_numpy_seed(key))
                try:
                    structure, state, _ = gen(dim=(dim, dim), p_change_directions=p_change_directions,
                                              num_steps=num_steps, num_boxes=num_boxes)
                except (RuntimeError, RuntimeWarning, ValueError) as e:
                    # score 0 or too few floor cells for this key: try the next derived key
                    last_error = e
                    continue
                return structure, state
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
    raise RuntimeError(f"no Sokoban room for seed {seed} (dim {dim}, {num_boxes} boxes) after "
                       f"{attempts} attempts: {last_error}")
