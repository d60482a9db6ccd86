"""Dataset rows drawn where the agent can learn: a torch `Sampler` any trainer's DataLoader takes.

The rows are a trainer's dataset (`envserve tasks export`'s, or any rows naming their task by
`task_id` or `seed`, at the top or in `extra_info`, as the adapters read them). Each batch of
`batch_size` different tasks is drawn by `envserve.client.sampling` (uniform, or learnability from
the run's outcome statistics, read again before every batch), each index given `mini_repeat_count`
times in a row (a GRPO group) and the whole batch `repeat_count` times (updates that reuse one
generation): the order TRL's RepeatSampler gives, so a trainer that groups consecutive indices
groups one task's trials. An epoch draws as many tasks as the dataset has rows.

    sampler = TaskSampler(rows, stats=lambda: client.task_stats("frozenlake", "my-run"))

The statistics are what the replicas recorded for the run's stats scope (sessions opened with
`stats_scope=`); a stats read that fails keeps the weights it had, so training never stops on it.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from torch.utils.data import Sampler

from envserve.client.sampling import make_sampler

from ._common import row_reset_args

log = logging.getLogger(__name__)


def row_task(row: Mapping[str, Any]) -> str:
    """The task id a row names (its task_id, else its seed: a seed is its own task id)."""
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), Mapping) else None
    seed, task_id, _ = row_reset_args(row, extra)
    if task_id:
        return task_id
    if seed is None:
        raise ValueError(f"a row names no task (task_id or seed, at the top or in extra_info): {sorted(row)}")
    return str(seed)


class TaskSampler(Sampler):
    """Row indices by task: see the module. kind: "uniform" or "learnability" (floor, cost_power,
    cost: envserve.client.sampling.LearnabilitySampler's). stats: returns the scope's TaskStats (a client's
    `task_stats(env_id, scope)`); None for uniform."""

    def __init__(self, rows: Sequence[Mapping[str, Any]], stats: "Callable[[], Iterable] | None" = None,
                 kind: str = "learnability", *, mini_repeat_count: int = 1, batch_size: int = 1,
                 repeat_count: int = 1, seed: int = 0, floor: float = 0.05, cost_power: float = 0.0,
                 cost: str = "turns"):
        if min(mini_repeat_count, batch_size, repeat_count) < 1:
            raise ValueError("mini_repeat_count, batch_size and repeat_count must be >= 1")
        if kind == "learnability" and stats is None:
            raise ValueError("a learnability sampler reads outcome statistics: pass stats=")
        self.rows_of: dict[str, list[int]] = {}
        for i in range(len(rows)):
            self.rows_of.setdefault(row_task(rows[i]), []).append(i)
        self.num_rows = len(rows)
        extra = {"floor": floor, "cost_power": cost_power, "cost": cost} if kind == "learnability" else {}
        self.sampler = make_sampler(kind, list(self.rows_of), seed, **extra)
        self.stats, self.kind = stats, kind
        self.mini_repeat_count, self.batch_size, self.repeat_count = mini_repeat_count, batch_size, repeat_count
        self.batches_drawn = 0

    def __len__(self) -> int:
        return (self.num_rows // self.batch_size) * self.batch_size * self.mini_repeat_count * self.repeat_count

    def refresh(self) -> None:
        if self.stats is None:
            return
        try:
            self.sampler.update(self.stats())
        except Exception as e:  # the service briefly unreachable: draw with what is known
            log.warning("task statistics not read, drawing with the last ones: %s", e)

    def draw_batch(self) -> list[int]:
        """One batch of row indices, each a different task where there are enough of them."""
        self.refresh()
        tasks = self.sampler.sample_distinct(self.batch_size)
        while len(tasks) < self.batch_size:   # fewer tasks than a batch: some twice
            tasks += self.sampler.sample_distinct(self.batch_size - len(tasks))
        self.batches_drawn += 1
        rng = self.sampler.rng
        return [rng.choice(self.rows_of[t]) for t in tasks]

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.num_rows // self.batch_size):
            batch = self.draw_batch()
            for _ in range(self.repeat_count):
                for index in batch:
                    for _ in range(self.mini_repeat_count):
                        yield index
