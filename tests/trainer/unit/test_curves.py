"""Training-curve PNGs from the JSONL metrics log."""
from __future__ import annotations

import sys

import pytest

from envserve_trainer.curves import flatten, plot_curves, select_series
from envserve_trainer.evaluation import MetricsLog


def summary(success, score, invalid):
    return {"overall": {"success_rate": success, "episode_success_rate": success, "mean_score": score,
                        "invalid_action_rate": invalid, "repetitive_action_rate": invalid / 2,
                        "pass_at_k": {"1": success, "2": min(1.0, 2 * success)}, "trajectory_diversity": None},
            "splits": {}}


def write_log(path, iterations=6, eval_every=2):
    log = MetricsLog(path)
    for it in range(iterations):
        fields = {"loss": 1.0 / (it + 1), "train": summary(it / 10, it * 0.5, 0.5 - it / 20)}
        if it % eval_every == 0:
            fields["eval"] = summary(it / 12, it * 0.4, 0.4 - it / 30)
        log.log(it, **fields)
    return path


def test_flatten_keeps_numeric_leaves_only():
    rec = {"loss": 0.5, "ok": True, "name": "x", "none": None, "train": {"overall": {"success_rate": 1, "x": [1]}}}
    assert flatten(rec) == {"loss": 0.5, "train.overall.success_rate": 1.0}


def test_keys_match_consecutive_name_parts():
    records = [{"iteration": 0, "loss": float("nan"), "train": summary(0.1, 1.0, 0.5), "eval": summary(0.2, 2.0, 0.4)},
               {"iteration": 1, "loss": 0.5, "train": summary(0.3, 1.5, 0.3)},
               {"loss": 9.0}]   # no iteration: ignored
    got = select_series(records, ["success_rate", "eval.overall.mean_score", "pass_at_k", "loss", "absent"])
    # "success_rate" takes both overall series but not episode_success_rate (a different whole part).
    assert set(got["success_rate"]) == {"train.overall.success_rate", "eval.overall.success_rate"}
    assert got["success_rate"]["train.overall.success_rate"] == ([0.0, 1.0], [0.1, 0.3])
    assert got["success_rate"]["eval.overall.success_rate"] == ([0.0], [0.2])   # eval only at iteration 0
    assert set(got["eval.overall.mean_score"]) == {"eval.overall.mean_score"}
    assert set(got["pass_at_k"]) == {f"{s}.overall.pass_at_k.{k}" for s in ("train", "eval") for k in "12"}
    assert got["loss"] == {"loss": ([1.0], [0.5])}                              # the NaN point is dropped
    assert "absent" not in got


def test_plot_curves_writes_a_png_with_drawn_lines(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the `plot` extra")
    from PIL import Image

    png = plot_curves(write_log(tmp_path / "metrics.jsonl"), tmp_path / "out" / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = Image.open(png).convert("RGB")
    # Default keys, all present: success_rate, mean_score, invalid_action_rate, repetitive_action_rate,
    # loss -> 5 panels in 2 columns, 3 rows of 5x3 inches at 100 dpi = 1000 x 900 pixels.
    assert img.size == (1000, 900)
    pixels = list(img.getdata())
    drawn = sum(1 for p in pixels if min(p) < 200)                  # text, axes, lines
    coloured = sum(1 for p in pixels if max(p) - min(p) > 80)      # the curves (matplotlib's colour cycle)
    assert drawn > 5000 and coloured > 500


def test_plot_curves_with_explicit_keys_and_title(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is the `plot` extra")
    from PIL import Image

    png = plot_curves(write_log(tmp_path / "m.jsonl"), tmp_path / "c.png", keys=["loss"], title="run",
                      dpi=50)
    assert Image.open(png).size == (250, 150)    # one 5x3 inch panel at 50 dpi


def test_plot_curves_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics log"):
        plot_curves(tmp_path / "missing.jsonl", tmp_path / "c.png")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no records"):
        plot_curves(tmp_path / "empty.jsonl", tmp_path / "c.png")
    log = write_log(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match=r"no numeric field matches \['reward'\].*available: .*loss"):
        plot_curves(log, tmp_path / "c.png", keys=["loss", "reward"])
    assert not (tmp_path / "c.png").exists()


def test_plot_curves_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    log = write_log(tmp_path / "m.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # as if the extra were not installed
    with pytest.raises(RuntimeError, match=r"envserve-trainer\[plot\]"):
        plot_curves(log, tmp_path / "c.png")
