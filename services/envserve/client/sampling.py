"""Which task to play next: uniformly, or where the agent can learn.

A GRPO group whose trials all fail (or all succeed) has equal rewards and gives no gradient. The
learnability sampler weighs each task by p(1-p), p its success rate so far (GetTaskStats, summed by
every replica over every trainer process of the run's stats scope): tasks solved about half the
time weigh most, tasks never or always solved least. A task with no episodes yet counts as p = 0.5
(Beta(1, 1) prior: exploration), and every task keeps at least `floor` of the largest weight, so none
starves. With cost_power > 0 a task's weight is divided by its mean cost per episode to that power:
env steps (cost="turns"), or the tokens the callers reported generating (cost="tokens",
StepItem.generated_tokens): learnability per step or per token instead of per episode.
"""
from __future__ import annotations

import random
from typing import Callable, Iterable, Sequence

# p(1-p) of an unseen task under the Beta(1, 1) prior: the largest any task can weigh.
MAX_LEARNABILITY = 0.25
# What an episode's cost is read from: TaskStat's field per cost name.
COSTS = {"turns": "turns_sum", "tokens": "tokens_sum"}


class UniformSampler:
    """Every task equally often (with replacement), from `seed`."""

    def __init__(self, tasks: Sequence[str], seed: int = 0):
        if not tasks:
            raise ValueError("a sampler needs at least one task")
        self.tasks = list(tasks)
        self.rng = random.Random(seed)

    def update(self, stats: Iterable) -> None:
        pass

    def sample(self, k: int) -> list[str]:
        return [self.rng.choice(self.tasks) for _ in range(k)]

    def weights(self) -> list[float]:
        return [1.0] * len(self.tasks)

    def sample_distinct(self, k: int) -> list[str]:
        """k different tasks (all of them, in a drawn order, when there are fewer), each drawn with
        probability proportional to its weight among those not drawn yet (keys u ** (1 / w))."""
        keyed = sorted(((self.rng.random() ** (1.0 / w), t) for t, w in zip(self.tasks, self.weights())),
                       reverse=True)
        return [t for _, t in keyed[:k]]


class LearnabilitySampler(UniformSampler):
    """Tasks drawn with probability proportional to their learnability (see the module)."""

    def __init__(self, tasks: Sequence[str], seed: int = 0, floor: float = 0.05, cost_power: float = 0.0,
                 stats: "Callable[[], Iterable] | None" = None, cost: str = "turns"):
        super().__init__(tasks, seed)
        if not 0 < floor <= 1:
            raise ValueError(f"floor must be in (0, 1], got {floor}")
        if cost not in COSTS:
            raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
        self.floor, self.cost_power, self.source, self.cost = floor, cost_power, stats, cost
        self.seen: dict[str, tuple[int, int, float]] = {}    # task -> (episodes, successes, cost sum)

    def update(self, stats: Iterable) -> None:
        """Takes GetTaskStats' TaskStats (or anything with task_id, episodes, successes and turns_sum
        or tokens_sum): the scope's totals, replacing what was known."""
        field = COSTS[self.cost]
        self.seen = {s.task_id: (int(s.episodes), int(s.successes), float(getattr(s, field, 0))) for s in stats}

    def refresh(self) -> None:
        """Reads the statistics again from the source given at construction (a client's task_stats)."""
        if self.source is not None:
            self.update(self.source())

    def weight(self, task: str) -> float:
        n, s, cost = self.seen.get(task, (0, 0, 0.0))
        p = (s + 1) / (n + 2)
        w = max(p * (1 - p), self.floor * MAX_LEARNABILITY)
        if self.cost_power and n:
            w /= max(cost / n, 1.0) ** self.cost_power
        return w

    def weights(self) -> list[float]:
        return [self.weight(t) for t in self.tasks]

    def sample(self, k: int) -> list[str]:
        return self.rng.choices(self.tasks, weights=self.weights(), k=k)


def make_sampler(kind: str, tasks: Sequence[str], seed: int = 0, **kw) -> UniformSampler:
    """"uniform" or "learnability" (kw: floor, cost_power, cost, stats)."""
    if kind == "uniform":
        return UniformSampler(tasks, seed)
    if kind == "learnability":
        return LearnabilitySampler(tasks, seed, **kw)
    raise ValueError(f"unknown task sampler {kind!r}: uniform or learnability")
