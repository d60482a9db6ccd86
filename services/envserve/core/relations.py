"""Relation sentences between grid objects and the player, in the phrasing VAGEN's judge uses.

Rows grow downwards and columns to the right, as in the text grids.
"""
from __future__ import annotations

from envserve.common.naming import indexed_names  # noqa: F401  (re-exported: the envs name objects with it)


def grid_relation(name: str, pos: tuple[int, int], ref: tuple[int, int], ref_name: str = "the player") -> str:
    """E.g. 'box0 is above and on the left side of the player',
    'target is at the same row and to the right of the player'."""
    (r, c), (rr, rc) = pos, ref
    if r == rr and c == rc:
        return f"{name} is at the same place as {ref_name}"
    if r == rr:
        side = "to the left of" if c < rc else "to the right of"
        return f"{name} is at the same row and {side} {ref_name}"
    vertical = "above" if r < rr else "below"
    if c == rc:
        return f"{name} is {vertical} {ref_name} and at the same column"
    side = "on the left side of" if c < rc else "on the right side of"
    return f"{name} is {vertical} and {side} {ref_name}"


