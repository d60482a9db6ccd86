"""Tables: a two-player game whose seats are separate sessions, one per player.

Open with config `opponent: "session"` and an even count: the server seats every two sessions at
a table around one session of the game opened with `opponent: "self"` (server/tables.py). The
clients open such sessions in whole tables on one replica.
"""
from __future__ import annotations

from typing import Any, Mapping

TABLE_OPPONENT = "session"
SELF_PLAY_OPPONENT = "self"
SEATS_PER_TABLE = 2


def sessions_per_table(config: "Mapping[str, Any] | None") -> int:
    """How many sessions an Open with this config must keep together on one replica."""
    return SEATS_PER_TABLE if config and config.get("opponent") == TABLE_OPPONENT else 1


def count_problem(count: int) -> str:
    """Why an Open of `count` sessions cannot seat whole tables, or ""."""
    if count < SEATS_PER_TABLE or count % SEATS_PER_TABLE:
        return (f"opponent {TABLE_OPPONENT!r} opens {SEATS_PER_TABLE} seats per table: ask for an even count "
                f"of sessions, got {count}")
    return ""
