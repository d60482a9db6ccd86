"""Training curves: a PNG of metrics against iteration, read from the JSONL metrics log.

Records are nested (e.g. {"iteration": 3, "loss": 0.2, "train": {"overall": {"success_rate": 0.5}}}),
and flatten to dotted names ("train.overall.success_rate"). A key selects every flattened name in
which its dot-separated parts occur as a consecutive run: "success_rate" draws
train.overall.success_rate, eval.overall.success_rate and the per-split ones as lines of one panel;
"eval.overall.success_rate" draws just that; "pass_at_k" draws pass_at_k.1, pass_at_k.2, ...

matplotlib is the extra `plot`; it is imported only when a plot is drawn, with the Agg backend so no
display is needed.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .evaluation import read_metrics

DEFAULT_KEYS = ("success_rate", "mean_score", "invalid_action_rate", "repetitive_action_rate", "loss")
# Bookkeeping fields of a record, never plotted.
_SKIP = {"iteration", "time"}


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested record as {dotted.name: value}; bools, strings and None are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def _matches(key: str, name: str) -> bool:
    want, have = key.split("."), name.split(".")
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def select_series(records: Sequence[Mapping[str, Any]], keys: Iterable[str]) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """key -> {flattened name -> (iterations, values)} for the keys that match something.

    Records without an iteration are ignored; a record lacking a name leaves a gap (eval runs every
    few iterations), and non-finite values are dropped so one NaN loss does not blank the axis.
    """
    flat = [(r["iteration"], flatten({k: v for k, v in r.items() if k not in _SKIP}))
            for r in records if isinstance(r.get("iteration"), (int, float)) and not isinstance(r.get("iteration"), bool)]
    names = sorted({n for _, f in flat for n in f})
    out: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for key in keys:
        series: dict[str, tuple[list[float], list[float]]] = {}
        for name in (n for n in names if _matches(key, n)):
            xs, ys = [], []
            for it, f in flat:
                v = f.get(name)
                if v is not None and math.isfinite(v):
                    xs.append(float(it))
                    ys.append(v)
            if xs:
                series[name] = (xs, ys)
        if series:
            out[key] = series
    return out


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting training curves needs matplotlib: pip install 'envserve-trainer[plot]'") from None
    # Agg renders to files without a display; set before pyplot is first imported.
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def plot_curves(jsonl_path: str | os.PathLike[str], png_path: str | os.PathLike[str],
                keys: Sequence[str] | None = None, *, title: str | None = None, dpi: int = 100,
                panel_size: tuple[float, float] = (5.0, 3.0), columns: int = 2) -> Path:
    """Draw one panel per key (lines per matched name) against iteration; returns the PNG path.

    keys=None uses DEFAULT_KEYS and leaves out those the log lacks. Explicit keys must each match a
    numeric field, otherwise ValueError names what the log has. An empty or missing log is an error.
    """
    src = Path(jsonl_path)
    if not src.exists():
        raise FileNotFoundError(f"no metrics log at {src}")
    records = read_metrics(src)
    if not records:
        raise ValueError(f"metrics log {src} holds no records")
    if isinstance(keys, str):
        keys = [keys]
    wanted = list(DEFAULT_KEYS if keys is None else keys)
    if not wanted:
        raise ValueError("keys must name at least one metric")
    if columns < 1 or dpi < 1:
        raise ValueError("columns and dpi must be >= 1")
    series = select_series(records, wanted)
    available = sorted({n for r in records for n in flatten({k: v for k, v in r.items() if k not in _SKIP})})
    missing = [k for k in wanted if k not in series]
    if keys is not None and missing:
        raise ValueError(f"no numeric field matches {missing} in {src}; available: {available}")
    if not series:
        raise ValueError(f"none of {wanted} is in {src}; available: {available}")

    plt = _pyplot()
    panels = [k for k in wanted if k in series]
    cols = min(columns, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows), squeeze=False)
    try:
        for ax, key in zip(axes.flat, panels):
            for name, (xs, ys) in series[key].items():
                # Markers keep sparse series (eval every few iterations, or a single point) visible.
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=name)
            ax.set_title(key)
            ax.set_xlabel("iteration")
            ax.grid(True, alpha=0.3)
            if len(series[key]) > 1 or series[key].keys() != {key}:
                ax.legend(fontsize="x-small")
        for ax in list(axes.flat)[len(panels):]:
            ax.set_visible(False)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        out = Path(png_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return out
