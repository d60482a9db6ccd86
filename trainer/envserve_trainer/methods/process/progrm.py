"""ProgRM: progress labels without annotation, from recipes of successful trajectories.

1. Cluster the successful trajectories (by a task key, or by the Jaccard overlap of their action sets).
2. A cluster's recipe L is the longest common subsequence (LCS) of its members' action sequences,
   folded left to right: LCS(LCS(a, b), c)...
3. A trajectory's recipe is the one it covers best: max |LCS(L, actions)| / |L|, the first on ties.
4. Labels: align the trajectory with its recipe by an LCS; the step that matches the k-th aligned
   key step is labelled k / |L|; every other step carries the last label forward (0 before the first).
5. Progress reward r_t = Prog(s_t) - Prog(s_{t-1}) with Prog(s_0) = 0, so the rewards of a
   trajectory sum to its final progress; the progress model is trained by BCE on the labels.

Actions are compared for equality, so the caller passes them normalised (stripped, lower-cased,
the action alone without the reasoning around it).
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from ...config.process import ProgRMConfig
from .agentprm import prm_bce_loss


def _lcs_table(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[list[int]]:
    """table[i][j] = |LCS(a[i:], b[j:])| (suffix form, so an alignment is read from the front)."""
    n, m = len(a), len(b)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            table[i][j] = table[i + 1][j + 1] + 1 if a[i] == b[j] else max(table[i + 1][j], table[i][j + 1])
    return table


def lcs_alignment(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[tuple[int, int]]:
    """Index pairs (i, j), a[i] == b[j], of a longest common subsequence, read from the front: equal
    elements are matched at once (that never shortens the LCS), and where either skip keeps it
    optimal an element of a is skipped, so b's elements are matched as early as they can be."""
    table = _lcs_table(a, b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] == b[j]:
            out.append((i, j))
            i, j = i + 1, j + 1
        elif table[i + 1][j] >= table[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


def lcs(a: Sequence[Hashable], b: Sequence[Hashable]) -> list[Hashable]:
    """A longest common subsequence of a and b (the earliest-matching one, see lcs_alignment)."""
    return [a[i] for i, _ in lcs_alignment(a, b)]


def recipe(successes: Sequence[Sequence[Hashable]]) -> list[Hashable]:
    """A cluster's recipe: the LCS of its action sequences folded left to right; [] for no members."""
    if not successes:
        return []
    out = list(successes[0])
    for seq in successes[1:]:
        out = lcs(out, seq)
    return out


def cluster_by_key(keys: Sequence[Hashable]) -> list[list[int]]:
    """Indices grouped by equal key, clusters in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    return list(groups.values())


def jaccard(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """|A & B| / |A | B| of the action sets; 1 for two empty sequences."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def cluster_by_jaccard(action_seqs: Sequence[Sequence[Hashable]],
                       threshold: float = ProgRMConfig.jaccard_threshold) -> list[list[int]]:
    """Single-link clustering in input order: a sequence joins the first cluster that holds a member
    whose action set has Jaccard >= threshold with its own, else starts a new cluster. Deterministic
    (the same input order gives the same clusters)."""
    clusters: list[list[int]] = []
    for i, seq in enumerate(action_seqs):
        for members in clusters:
            if any(jaccard(seq, action_seqs[j]) >= threshold for j in members):
                members.append(i)
                break
        else:
            clusters.append([i])
    return clusters


def cluster_recipes(action_seqs: Sequence[Sequence[Hashable]], clusters: Sequence[Sequence[int]],
                    min_cluster_size: int = ProgRMConfig.min_cluster_size) -> list[list[Hashable]]:
    """One recipe per cluster of at least min_cluster_size members; a cluster whose LCS is empty
    gives none."""
    out = []
    for members in clusters:
        if len(members) < min_cluster_size:
            continue
        r = recipe([action_seqs[i] for i in members])
        if r:
            out.append(r)
    return out


def best_recipe(actions: Sequence[Hashable], recipes: Sequence[Sequence[Hashable]]) -> int | None:
    """Index of the recipe with the largest covered fraction |LCS(L, actions)| / |L| (the first on
    ties); None when there is no non-empty recipe or none shares a step with the trajectory."""
    best, best_score = None, 0.0
    for i, r in enumerate(recipes):
        if not r:
            continue
        score = len(lcs_alignment(r, actions)) / len(r)
        if score > best_score:
            best, best_score = i, score
    return best


def progress_labels(actions: Sequence[Hashable], key_steps: Sequence[Hashable]) -> list[float]:
    """Prog(s_t) for t = 1..T: the k-th step of an LCS alignment with the recipe gets k/|L|, every
    other step the last label (0 before the first key step, and everywhere for an empty recipe)."""
    labels = [0.0] * len(actions)
    if not key_steps:
        return labels
    matched = {i: k for k, (_, i) in enumerate(lcs_alignment(key_steps, actions), start=1)}
    current = 0.0
    for t in range(len(actions)):
        if t in matched:
            current = matched[t] / len(key_steps)
        labels[t] = current
    return labels


def progress_rewards(progress: Sequence[float], start: float = 0.0) -> list[float]:
    """r_t = Prog(s_t) - Prog(s_{t-1}), Prog(s_0) = start."""
    out, prev = [], start
    for p in progress:
        out.append(p - prev)
        prev = p
    return out


def progress_bce_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The progress model's loss: BCE of sigma(logits) against the labels k/|L| (prm_bce_loss)."""
    return prm_bce_loss(logits, labels, mask)
