"""Outcome statistics: each finished episode of a session opened with a stats scope is summed per
task into the directory, where every replica sharing it, and GetTaskStats, read one table.

A scope is its opener's: the key holds the owner (a token's digest, rpc/auth.py), so a caller reads
the scopes its own token recorded and no other team's.
"""
from __future__ import annotations

from envserve.directory.base import TaskOutcomes

MAX_SCOPE_CHARS = 128


class BadScope(ValueError):
    pass


def stats_key(owner: str, env_id: str, scope: str) -> str:
    """The directory's name for a caller's scope of an env ("" when the scope is empty)."""
    if len(scope) > MAX_SCOPE_CHARS:
        raise BadScope(f"stats_scope is {len(scope)} characters; at most {MAX_SCOPE_CHARS}")
    return f"{owner or '-'}/{env_id}/{scope}" if scope else ""


def scope_of_key(key: str) -> str:
    """The scope name a stats key was made from (a moved session's SessionHistory carries it)."""
    return key.split("/", 2)[2]


def aggregate(records) -> dict[str, dict[str, TaskOutcomes]]:
    """Workers' finished episodes [(key, task id, success, return, turns, unix, tokens)] summed per key
    and task."""
    out: dict[str, dict[str, TaskOutcomes]] = {}
    for key, task_id, success, episode_return, turns, unix, *tokens in records:
        o = out.setdefault(key, {}).setdefault(task_id, TaskOutcomes())
        o.add(TaskOutcomes(1, int(bool(success)), float(episode_return), int(turns), float(unix),
                           int(tokens[0]) if tokens else 0))
    return out
