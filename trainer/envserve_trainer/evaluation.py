"""Evaluation metrics over rollout records, a JSONL metrics log, and a progress display.

Every metric is a pure function of `trajectory.Trial` / `Episode` / `Turn` records. A metric whose
denominator is empty (no trials, no episodes, no turns) is undefined and returns None rather than
0 or NaN: 0 would read as "the agent never succeeded", and NaN is not JSON.

Definitions
  success rate            trials whose deciding episode succeeded / trials. EvalConfig.success_episode
                          picks that episode: "last" (default; LaMer's final attempt), "first", or
                          "any". A trial without episodes counts as a failure.
  episode success rate    successful episodes / episodes, every episode of every trial.
  success by episode      per episode index n: successes among the trials' n-th episodes / trials
                          that have an n-th episode (LaMer's improvement across attempts).
  mean score              mean episode return (sum of the turns' rewards) over episodes.
  mean turns              mean number of turns per episode.
  invalid-action rate     turns with action_valid False / turns.
  repetitive-action rate  repeated turns / turns, where a turn repeats when its (state_anchor, action)
                          pair already occurred earlier in the same episode: the agent took the same
                          action in the same state again (RLVMR's "repetitive action"). A turn with no
                          state_anchor falls back to "same action as the previous turn of the episode".
                          The action is the parsed actions joined by "," (Episode.actions), or the raw
                          action text when nothing parsed, so invalid turns can repeat too.
  pass@k (episodes)       LaMer: a trial passes at k when any of its first k episodes succeeded;
                          reported for k = 1..N, N the most episodes any trial has. A trial with fewer
                          than k episodes is judged on the ones it has (a trial that stopped after its
                          success keeps passing).
  pass@k (unbiased)       Chen et al. 2021 over the K single-episode samples of a group: with n samples
                          of which c succeeded, 1 - C(n-c, k) / C(n, k), averaged over groups.
  trajectory diversity    LaMer: Shannon entropy, in nats (natural log), of the empirical distribution
                          of distinct trajectories (the tuple of an episode's actions) among the samples
                          of one group at one episode index, averaged over such groups that have at
                          least EvalConfig.diversity_min_samples samples (one sample has entropy 0 by
                          construction, which says nothing about diversity).
"""
from __future__ import annotations

import io
import json
import math
import os
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, TextIO

from .config.checks import one_of
from .rollout.trajectory import Episode, Trial

SUCCESS_EPISODES = ("last", "first", "any")


@dataclass(frozen=True)
class EvalConfig:
    # Which episode of a multi-episode trial decides its success: LaMer scores the last attempt.
    success_episode: str = "last"
    # Groups with fewer samples than this are left out of the diversity average.
    diversity_min_samples: int = 2
    # Largest k reported for pass@k (both kinds); 0 reports every k the data supports.
    max_pass_k: int = 0

    def __post_init__(self) -> None:
        one_of("success_episode", self.success_episode, SUCCESS_EPISODES)
        if self.diversity_min_samples < 1:
            raise ValueError(f"diversity_min_samples must be >= 1, got {self.diversity_min_samples}")
        if self.max_pass_k < 0:
            raise ValueError(f"max_pass_k must be >= 0 (0: no cap), got {self.max_pass_k}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> "EvalConfig":
        """From a YAML/CLI mapping; unknown keys and wrong types are refused."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in (data or {}).items():
            if key not in known:
                raise ValueError(f"unknown EvalConfig key {key!r}; known: {sorted(known)}")
            default = known[key].default
            if isinstance(default, str) and not isinstance(value, str):
                raise ValueError(f"EvalConfig {key!r} must be a string, got {value!r}")
            if isinstance(default, int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"EvalConfig {key!r} must be an integer, got {value!r}")
            kwargs[key] = value
        return cls(**kwargs)


_DEFAULT = EvalConfig()


def _trials(trials: Iterable[Trial]) -> list[Trial]:
    out = list(trials)
    for t in out:
        if not isinstance(t, Trial):
            raise TypeError(f"expected trajectory.Trial records, got {type(t).__name__}")
    return out


def _episodes(trials: Sequence[Trial]) -> list[Episode]:
    return [e for t in trials for e in t.episodes]


def _mean(values: Sequence[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


# -- success, score, length ------------------------------------------------------------------------

def trial_success(trial: Trial, cfg: EvalConfig = _DEFAULT) -> bool:
    """Whether the trial succeeded, judged on the episode EvalConfig.success_episode picks."""
    if not trial.episodes:
        return False
    if cfg.success_episode == "any":
        return any(e.success for e in trial.episodes)
    return trial.episodes[-1 if cfg.success_episode == "last" else 0].success


def success_rate(trials: Iterable[Trial], cfg: EvalConfig = _DEFAULT) -> float | None:
    ts = _trials(trials)
    return _mean([float(trial_success(t, cfg)) for t in ts])


def episode_success_rate(trials: Iterable[Trial]) -> float | None:
    return _mean([float(e.success) for e in _episodes(_trials(trials))])


def success_by_episode(trials: Iterable[Trial]) -> dict[int, float]:
    """Episode index n -> success rate of the n-th episodes, over the trials that reached one."""
    by_index: dict[int, list[float]] = defaultdict(list)
    for t in _trials(trials):
        for n, e in enumerate(t.episodes):
            by_index[n].append(float(e.success))
    return {n: sum(v) / len(v) for n, v in sorted(by_index.items())}


def mean_score(trials: Iterable[Trial]) -> float | None:
    return _mean([e.score for e in _episodes(_trials(trials))])


def signal_free_group_share(trials: Iterable[Trial]) -> float | None:
    """The share of groups (two trials or more) whose trials all scored the same: a group-relative
    advantage is zero there, so the group teaches nothing."""
    scores: dict[str, list[float]] = defaultdict(list)
    for t in _trials(trials):
        scores[t.group].append(round(sum(e.score for e in t.episodes), 9))
    groups = [s for s in scores.values() if len(s) > 1]
    return _mean([1.0 if len(set(s)) == 1 else 0.0 for s in groups])


def mean_turns(trials: Iterable[Trial]) -> float | None:
    return _mean([float(len(e.turns)) for e in _episodes(_trials(trials))])


# -- action quality ----------------------------------------------------------------------------------

def invalid_action_rate(trials: Iterable[Trial]) -> float | None:
    turns = [turn for e in _episodes(_trials(trials)) for turn in e.turns]
    return _mean([0.0 if turn.action_valid else 1.0 for turn in turns])


def format_error_rate(trials: Iterable[Trial]) -> float | None:
    """Turns whose answer did not parse in the session's action format (no action executed); a
    subset of the invalid ones, which also count parsed but impossible moves."""
    turns = [turn for e in _episodes(_trials(trials)) for turn in e.turns]
    return _mean([0.0 if turn.parsed else 1.0 for turn in turns])


def repeated_turns(episode: Episode) -> list[bool]:
    """Per turn, whether it repeats an earlier (state_anchor, action) of the episode (module docstring)."""
    seen: set[tuple[str, str]] = set()
    out: list[bool] = []
    previous: str | None = None
    for turn, action in zip(episode.turns, episode.actions):
        if turn.state_anchor:
            key = (turn.state_anchor, action)
            out.append(key in seen)
            seen.add(key)
        else:
            out.append(previous is not None and action == previous)
        previous = action
    return out


def repetitive_action_rate(trials: Iterable[Trial]) -> float | None:
    flags = [r for e in _episodes(_trials(trials)) for r in repeated_turns(e)]
    return _mean([float(r) for r in flags])


# -- pass@k -------------------------------------------------------------------------------------------

def pass_at_k_episodes(trials: Iterable[Trial], cfg: EvalConfig = _DEFAULT) -> dict[int, float]:
    """k -> fraction of trials with a success among their first k episodes, k = 1..N (LaMer)."""
    ts = _trials(trials)
    n_max = max((len(t.episodes) for t in ts), default=0)
    if cfg.max_pass_k:
        n_max = min(n_max, cfg.max_pass_k)
    out: dict[int, float] = {}
    for k in range(1, n_max + 1):
        out[k] = sum(any(e.success for e in t.episodes[:k]) for t in ts) / len(ts)
    return out


def pass_at_k_unbiased(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: P(at least one of k samples drawn without replacement from n succeeds), c successes.

    1 - C(n-c, k) / C(n, k), with exact integer binomials (math.comb), so large n does not overflow.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an integer, got {v!r}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every draw of k holds a success
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _groups(trials: Sequence[Trial]) -> dict[str, list[Trial]]:
    out: dict[str, list[Trial]] = defaultdict(list)
    for t in trials:
        out[t.group].append(t)
    return dict(out)


def group_pass_at_k(trials: Iterable[Trial], k: int, cfg: EvalConfig = _DEFAULT) -> float | None:
    """The unbiased pass@k of each group's samples (trial success per EvalConfig), averaged over groups.

    Every group needs at least k samples; None when there are no trials.
    """
    groups = _groups(_trials(trials))
    if not groups:
        return None
    values = []
    for name, members in groups.items():
        if len(members) < k:
            raise ValueError(f"group {name!r} has {len(members)} samples, fewer than k={k}")
        c = sum(trial_success(t, cfg) for t in members)
        values.append(pass_at_k_unbiased(len(members), c, k))
    return sum(values) / len(values)


def group_pass_at_ks(trials: Iterable[Trial], cfg: EvalConfig = _DEFAULT) -> dict[int, float]:
    """k -> group_pass_at_k for k = 1..(smallest group size), capped by EvalConfig.max_pass_k."""
    ts = _trials(trials)
    groups = _groups(ts)
    if not groups:
        return {}
    k_max = min(len(m) for m in groups.values())
    if cfg.max_pass_k:
        k_max = min(k_max, cfg.max_pass_k)
    return {k: group_pass_at_k(ts, k, cfg) for k in range(1, k_max + 1)}  # type: ignore[misc]


# -- diversity -------------------------------------------------------------------------------------

def entropy_nats(counts: Iterable[int]) -> float:
    """Shannon entropy in nats of the distribution proportional to `counts` (zeros ignored)."""
    cs = [c for c in counts if c > 0]
    total = sum(cs)
    return float(-sum(c / total * math.log(c / total) for c in cs)) if total else 0.0


def trajectory_diversity(trials: Iterable[Trial], cfg: EvalConfig = _DEFAULT) -> float | None:
    """Mean over (group, episode index) of the entropy in nats of distinct action sequences (module docstring)."""
    buckets: dict[tuple[str, int], Counter] = defaultdict(Counter)
    for t in _trials(trials):
        for n, e in enumerate(t.episodes):
            buckets[(t.group, n)][tuple(e.actions)] += 1
    values = [entropy_nats(c.values()) for c in buckets.values() if sum(c.values()) >= cfg.diversity_min_samples]
    return _mean(values)


# -- summary ---------------------------------------------------------------------------------------

def _stats(trials: list[Trial], cfg: EvalConfig) -> dict[str, Any]:
    episodes = _episodes(trials)
    return {
        "trials": len(trials),
        "episodes": len(episodes),
        "turns": sum(len(e.turns) for e in episodes),
        "generated_tokens": sum(len(t.completion_ids) for e in episodes for t in e.turns),
        "groups": len({t.group for t in trials}),
        "signal_free_groups": signal_free_group_share(trials),
        "success_rate": success_rate(trials, cfg),
        "episode_success_rate": episode_success_rate(trials),
        "success_by_episode": {str(n): v for n, v in success_by_episode(trials).items()},
        "mean_score": mean_score(trials),
        "mean_turns": mean_turns(trials),
        "invalid_action_rate": invalid_action_rate(trials),
        "format_error_rate": format_error_rate(trials),
        "repetitive_action_rate": repetitive_action_rate(trials),
        "pass_at_k": {str(k): v for k, v in pass_at_k_episodes(trials, cfg).items()},
        "pass_at_k_unbiased": {str(k): v for k, v in group_pass_at_ks(trials, cfg).items()},
        "trajectory_diversity": trajectory_diversity(trials, cfg),
    }


def summarize(trials: Iterable[Trial], by_split: bool = True, cfg: EvalConfig | None = None) -> dict[str, Any]:
    """Every metric above, as {"overall": {...}, "splits": {split: {...}}} (no "splits" when by_split is False).

    Plain dicts of str/int/float/None (dict keys are strings, so pass@k is keyed "1", "2", ...), ready
    for json.dumps. Undefined metrics (empty denominators) are None; empty input gives zero counts.
    """
    cfg = cfg or _DEFAULT
    ts = _trials(trials)
    out: dict[str, Any] = {"overall": _stats(ts, cfg)}
    if by_split:
        splits: dict[str, list[Trial]] = defaultdict(list)
        for t in ts:
            splits[t.split].append(t)
        out["splits"] = {name: _stats(members, cfg) for name, members in sorted(splits.items())}
    return out


# -- JSONL metrics log ----------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    # numpy and torch scalars (and 0-d arrays/tensors) carry .item(); arrays .tolist().
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"metrics value of type {type(value).__name__} is not JSON-serialisable: {value!r}")


def read_metrics(path: str | os.PathLike[str], dedupe: bool = True, strict: bool = False) -> list[dict[str, Any]]:
    """The records of a metrics file.

    With dedupe, a later record for an iteration replaces earlier ones (a run resumed from an older
    checkpoint logs those iterations again) and the result is sorted by iteration; without it, every
    record in file order. A line that is not a JSON object (a fragment left by a crash mid-write) is
    skipped with a RuntimeWarning naming it, or raises ValueError when strict. A missing file reads
    as no records.
    """
    p = Path(path)
    if not p.exists():
        return []
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if not isinstance(rec, dict):
            if strict:
                raise ValueError(f"{p}:{i}: not a JSON object: {line[:80]!r}")
            bad.append(i)
            continue
        records.append(rec)
    if bad:
        warnings.warn(f"{p}: skipped malformed metrics lines {bad}", RuntimeWarning, stacklevel=2)
    if not dedupe:
        return records
    latest: dict[Any, dict[str, Any]] = {}
    for rec in records:
        latest[rec.get("iteration")] = rec
    numbered = [r for k, r in latest.items() if isinstance(k, int) and not isinstance(k, bool)]
    others = [r for k, r in latest.items() if not (isinstance(k, int) and not isinstance(k, bool))]
    return sorted(numbered, key=lambda r: r["iteration"]) + others


class MetricsLog:
    """Appends one JSON object per line: {"iteration", "time" (unix seconds), **fields}.

    Opening an existing file resumes it: records are only ever appended, never rewritten, so what a
    crashed run logged survives; readers take the newest record of each iteration (read_metrics).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, iteration: int, **fields_: Any) -> dict[str, Any]:
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be a non-negative integer, got {iteration!r}")
        reserved = {"iteration", "time"} & set(fields_)
        if reserved:
            raise ValueError(f"{sorted(reserved)} are set by the log itself")
        record = {"iteration": iteration, "time": time.time(), **fields_}
        line = json.dumps(record, default=_jsonable)
        # A crash mid-write can leave a fragment without its newline: start on a fresh line.
        prefix = ""
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    prefix = "\n"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(prefix + line + "\n")
            f.flush()
        return json.loads(line)

    def read(self, dedupe: bool = True, strict: bool = False) -> list[dict[str, Any]]:
        return read_metrics(self.path, dedupe=dedupe, strict=strict)

    def last_iteration(self) -> int | None:
        recs = [r for r in self.read() if isinstance(r.get("iteration"), int)]
        return max((r["iteration"] for r in recs), default=None)


# -- progress display ------------------------------------------------------------------------------

def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def tqdm_available() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class Progress:
    """Iteration progress: a tqdm bar on a terminal, plain periodic lines otherwise, or nothing.

    mode "auto" uses tqdm when it is importable and `stream` is a TTY, else lines; "tqdm" and
    "lines" force one; enabled=False (or mode "off") prints nothing. Lines are written at most every
    `interval_s` seconds of `clock` (0: on every update), and always for the last step and on close.
    Use as a context manager, or call close().
    """

    MODES = ("auto", "tqdm", "lines", "off")

    def __init__(self, total: int | None = None, desc: str = "train", *, enabled: bool = True,
                 mode: str = "auto", stream: TextIO | None = None, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        one_of("progress mode", mode, self.MODES)
        if total is not None and total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.total, self.desc, self.interval_s, self.clock = total, desc, interval_s, clock
        self.stream = stream if stream is not None else sys.stdout
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._bar = None
        self._start = clock()
        self._last_line: float | None = None
        self._written_n = 0
        self._closed = False
        if not enabled or mode == "off":
            self.mode = "off"
        elif mode == "auto":
            self.mode = "tqdm" if tqdm_available() and _isatty(self.stream) else "lines"
        else:
            self.mode = mode
        if self.mode == "tqdm":
            try:
                from tqdm import tqdm
            except ImportError:
                raise RuntimeError("progress mode 'tqdm' needs the tqdm package (pip install tqdm)") from None
            self._bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by n steps; keyword arguments replace the shown metrics (e.g. loss=0.3)."""
        if self._closed:
            raise RuntimeError("update on a closed Progress")
        self.n += n
        self.postfix.update(postfix)
        if self.mode == "tqdm":
            if postfix:
                self._bar.set_postfix({k: _fmt(v) for k, v in self.postfix.items()}, refresh=False)
            self._bar.update(n)
        elif self.mode == "lines":
            now = self.clock()
            finished = self.total is not None and self.n >= self.total
            if finished or self._last_line is None or now - self._last_line >= self.interval_s:
                self._write_line(now)

    def line(self, now: float | None = None) -> str:
        """The plain-text status line: 'desc 3/10 (30%) 12s elapsed, eta 28s | loss=0.12'."""
        now = self.clock() if now is None else now
        elapsed = now - self._start
        parts = [self.desc]
        if self.total:
            parts.append(f"{self.n}/{self.total} ({100 * self.n / self.total:.0f}%)")
            eta = elapsed / self.n * (self.total - self.n) if self.n else None
            parts.append(f"{elapsed:.0f}s elapsed" + (f", eta {eta:.0f}s" if eta is not None else ""))
        else:
            parts.append(f"{self.n}")
            parts.append(f"{elapsed:.0f}s elapsed")
        text = " ".join(parts)
        if self.postfix:
            text += " | " + " ".join(f"{k}={_fmt(v)}" for k, v in self.postfix.items())
        return text

    def _write_line(self, now: float) -> None:
        self.stream.write(self.line(now) + "\n")
        self.stream.flush()
        self._last_line = now
        self._written_n = self.n

    def close(self) -> None:
        """Finish the bar, or write a last line when steps were taken since the last one."""
        if self._closed:
            return
        self._closed = True
        if self.mode == "tqdm":
            self._bar.close()
        elif self.mode == "lines" and self._written_n != self.n:
            self._write_line(self.clock())

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False
