"""RRO (Reward Rising Optimisation): a step's candidates are sampled until one's process reward rises.

    R(prefix) = mean outcome of m rollouts from the prefix (Fork at the prefix's state)
    at step t: candidates a^1, a^2, ... in sampling order, each scored R(prefix + a^i);
    stop at the first i with R(prefix + a^i) >= R_{t-1} (the process reward the previous step reached),
    or after max_candidates; the best and the worst candidates seen form the step's DPO pair,
    and the accepted candidate (the best one when none rose) continues the trajectory.

The number explored per step is reported (the notes: about 1.9 on average).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ...config.process import RROConfig


def process_reward(outcomes: Sequence[float]) -> float:
    """R(prefix) = the mean of the outcomes of the m rollouts from it."""
    if not len(outcomes):
        raise ValueError("a process reward needs at least one rollout's outcome")
    return sum(outcomes) / len(outcomes)


@dataclass(frozen=True)
class RisingSearch:
    rewards: tuple[float, ...]     # process rewards of the candidates explored, in sampling order
    accepted: int | None           # the first candidate whose reward >= the previous step's
    best: int                      # highest reward seen (first on ties)
    worst: int                     # lowest reward seen (first on ties)

    @property
    def explored(self) -> int:
        return len(self.rewards)

    @property
    def chosen(self) -> int:
        """The candidate that continues the trajectory: the accepted one, else the best seen."""
        return self.best if self.accepted is None else self.accepted

    @property
    def pair(self) -> tuple[int, int] | None:
        """(chosen, rejected) for DPO: best and worst seen, None when their rewards are equal (one
        candidate explored, or all tied): DPO needs a preference."""
        return None if self.rewards[self.best] == self.rewards[self.worst] else (self.best, self.worst)


def reward_rising_search(candidate_rewards: Iterable[float], previous: float,
                         max_candidates: int = RROConfig.max_candidates) -> RisingSearch:
    """Consumes candidate_rewards lazily (a generator that samples a candidate and rolls it out only
    when asked) until one is >= previous or max_candidates have been seen."""
    if max_candidates < 1:
        raise ValueError("max_candidates must be >= 1")
    seen: list[float] = []
    accepted = None
    for r in candidate_rewards:
        seen.append(float(r))
        if r >= previous:
            accepted = len(seen) - 1
            break
        if len(seen) == max_candidates:
            break
    if not seen:
        raise ValueError("no candidates")
    best = max(range(len(seen)), key=lambda i: (seen[i], -i))
    worst = min(range(len(seen)), key=lambda i: (seen[i], i))
    return RisingSearch(tuple(seen), accepted, best, worst)


def mean_explored(searches: Sequence[RisingSearch]) -> float:
    """Candidates explored per step, averaged over the searches (0 for none)."""
    return sum(s.explored for s in searches) / len(searches) if searches else 0.0
