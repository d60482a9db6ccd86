"""VAGEN's repetition penalty: a low-scoring response that the policy keeps repeating earns a penalty.

A policy rewarded for its descriptions can find one stock sentence that is often partly right and
repeat it everywhere. VAGEN counts the responses it judges (per field: grounding and world modelling
apart) and, when a response is among the k most frequent so far and scores below the F1 threshold,
gives it a small negative reward (-0.1) instead of its F1.

Here the counts live in a dict keyed by the normalized response (lowercase words and numbers, so
spacing, case and punctuation do not make a repeat look new), and the most frequent are found with a
max-heap of (-count, key) entries. Counts only grow, so an increment pushes a fresh entry and leaves the
old one in place; an entry whose count no longer matches the dict is stale and is dropped when it
surfaces (lazy deletion). The heap is rebuilt, keeping the `max_tracked` most frequent keys, when it
grows past four times that; the rest are forgotten, as in VAGEN's bounded tracker. Ties at the k-th
place go to the alphabetically first key (the heap's tuple order), so the result is deterministic.
"""
from __future__ import annotations

import heapq
import re
from collections import OrderedDict
from typing import Iterable

from .config import JudgeConfig


def normalize_response(text: str) -> str:
    """'The box is  above the player.' and 'the box is above the player' are the same response."""
    return " ".join(re.findall(r"-?[a-z0-9]+(?:\.[0-9]+)?", (text or "").lower()))


class RepetitionTracker:
    """Counts of normalized responses and their top k through a lazily cleaned max-heap."""

    def __init__(self, top_k: int = 5, max_tracked: int = 1000, min_count: int = 2):
        if top_k < 0 or max_tracked < max(1, top_k) or min_count < 1:
            raise ValueError("need top_k >= 0, max_tracked >= max(1, top_k), min_count >= 1")
        self.top_k, self.max_tracked, self.min_count = top_k, max_tracked, min_count
        self.counts: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []

    def add(self, text: str) -> str:
        """Count one occurrence; returns the normalized key (empty texts are not counted)."""
        key = normalize_response(text)
        if not key:
            return key
        count = self.counts.get(key, 0) + 1
        self.counts[key] = count
        heapq.heappush(self._heap, (-count, key))
        if len(self._heap) > 4 * self.max_tracked:
            self._compact()
        return key

    def add_all(self, texts: Iterable[str]) -> None:
        for t in texts:
            self.add(t)

    def count(self, text: str) -> int:
        return self.counts.get(normalize_response(text), 0)

    def top(self, k: int | None = None) -> list[tuple[str, int]]:
        """The k most frequent (key, count), most frequent first."""
        k = self.top_k if k is None else k
        out: list[tuple[str, int]] = []
        live: list[tuple[int, str]] = []
        while self._heap and len(out) < k:
            neg, key = heapq.heappop(self._heap)
            if self.counts.get(key) != -neg:
                continue  # stale: a newer entry holds this key's current count (or it was forgotten)
            out.append((key, -neg))
            live.append((neg, key))
        for entry in live:
            heapq.heappush(self._heap, entry)
        return out

    def is_frequent(self, text: str) -> bool:
        """Among the top k and seen at least min_count times."""
        key = normalize_response(text)
        if not key or self.counts.get(key, 0) < self.min_count:
            return False
        return any(key == k for k, _ in self.top())

    def _compact(self) -> None:
        keep = heapq.nsmallest(self.max_tracked, ((-c, k) for k, c in self.counts.items()))
        self.counts = {k: -neg for neg, k in keep}
        self._heap = list(keep)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self.counts)


class RepetitionPenalty:
    """One tracker per scope and judged field, and the rule that turns a frequent low score into
    the penalty. A scope is one caller's counts (a training run's): VAGEN counts within a run, and
    a judge serving several runs and evaluations must not let one's stock sentence penalise another.
    At most `repetition_max_scopes` scopes are kept; the least recently used goes first."""

    def __init__(self, config: JudgeConfig | None = None):
        self.config = config or JudgeConfig()
        self._trackers: OrderedDict[str, dict[str, RepetitionTracker]] = OrderedDict()

    def tracker(self, field_name: str, scope: str = "") -> RepetitionTracker:
        fields = self._trackers.get(scope)
        if fields is None:
            fields = self._trackers[scope] = {}
            while len(self._trackers) > self.config.repetition_max_scopes:
                self._trackers.popitem(last=False)
        else:
            self._trackers.move_to_end(scope)
        t = fields.get(field_name)
        if t is None:
            c = self.config
            t = fields[field_name] = RepetitionTracker(c.repetition_top_k, c.repetition_max_tracked,
                                                       c.repetition_min_count)
        return t

    @property
    def scopes(self) -> list[str]:
        """The scopes kept, least recently used first."""
        return list(self._trackers)

    def observe(self, field_name: str, texts: Iterable[str], scope: str = "") -> None:
        """Count a batch of responses before scoring them (VAGEN counts the whole batch first)."""
        self.tracker(field_name, scope).add_all(texts)

    def apply(self, field_name: str, text: str, f1: float, scope: str = "") -> tuple[float, bool]:
        """(score, penalized): the penalty when `text` is frequent in its scope and f1 is below the
        threshold, else f1. `text` must have been observed already."""
        if f1 < self.config.f1_threshold and self.tracker(field_name, scope).is_frequent(text):
            return self.config.repetition_penalty, True
        return f1, False
