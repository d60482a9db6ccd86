"""Tasks as data: a split's tasks, listed a page at a time without building any (ListTasks).

A split is a range of seeds (core/env.py Split); a task's id is its seed, which Reset's task_id
takes back. What a task is beyond its seed (goal, kind, difficulty) is the env's to say, through
Environment.describe_task, and only where it can say it without building the task.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Type

from .env import EnvSpec, Environment


@dataclass(frozen=True)
class Task:
    task_id: str
    split: str
    seed: int
    description: str = ""
    task_type: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)


class TaskListError(ValueError):
    """A split or page token the env does not have (the caller's mistake: INVALID_ARGUMENT)."""


def parse_page_token(token: str, total: int) -> int:
    """The index a page token names: the empty token is the first page. Tokens are the decimal
    index of the page's first task; callers treat them as opaque."""
    if not token:
        return 0
    if not token.isdigit() or len(token) > 19 or int(token) > total:
        raise TaskListError(f"page_token {token[:40]!r} is not one this split's listing gave")
    return int(token)


def list_tasks(env_class: Type[Environment], spec: EnvSpec, split: str, start: int,
               size: int) -> tuple[list[Task], int, int | None]:
    """Up to `size` tasks of `split` from index `start`: (tasks, the split's size, the index the
    next page starts at, or None after the last). Costs `size` describe_task calls, whatever the
    split's size."""
    try:
        sp = spec.split(split) if split else spec.splits[0]
    except KeyError as e:
        raise TaskListError(str(e.args[0])) from None
    end = min(sp.num_tasks, start + max(size, 0))
    tasks = []
    for index in range(start, end):
        seed = sp.seed_offset + index
        d = env_class.describe_task(spec, seed)
        tasks.append(Task(str(seed), sp.name, seed, d.description, d.task_type, dict(d.parameters)))
    return tasks, sp.num_tasks, (end if end < sp.num_tasks else None)
