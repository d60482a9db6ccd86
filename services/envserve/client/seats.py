"""The seats at tables (envserve.common.tables) this process opened.

A seat's call is answered at its next turn, after the other seat's move, which may come on the
same Interact stream. A stream's lone-caller path holds every other write back until its own
answer arrives, so a seat's call must not take it: streams ask here. Ids are noted when an Open
with a table config answers and forgotten when they are closed.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from envserve.common.tables import sessions_per_table

_seats: set[str] = set()


def note_opened(ids: Iterable[str], config: "Mapping[str, Any] | None") -> None:
    if sessions_per_table(config) > 1:
        _seats.update(ids)


def note_closed(ids: Iterable[str]) -> None:
    if _seats:
        _seats.difference_update(ids)


def is_seat(session_id: str) -> bool:
    return session_id in _seats
