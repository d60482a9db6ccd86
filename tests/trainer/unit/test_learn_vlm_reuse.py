"""bench/learn_vlm.py --from-run: RL again from a finished run's SFT policy, on that run's clock."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import learn_vlm  # noqa: E402


def _finished_run(root: Path, sft: dict, held_out: dict | None = None) -> Path:
    """The files a finished run leaves: summary.json and sft/checkpoint-N/ with its policy/."""
    run = root / "run"
    for step in (8, 16):   # the later checkpoint is the SFT policy RL starts from
        (run / "sft" / f"checkpoint-{step}" / "policy").mkdir(parents=True)
        (run / "sft" / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    result = {"collect": {"episodes": 60}, "blind": {"greedy_success": 0.44}, "perception": {"seconds": 200},
              "sft": sft,
              "stages": {"sft": {"greedy_success": 0.69}, "rl-seed0": {"greedy_success": 0.75}},
              "rl": {"0": {"seconds": 700.0, "iteration_seconds": [60.0] * 10},
                     "1": {"seconds": 660.0, "iteration_seconds": [54.0] * 10}}}
    if held_out is not None:
        result["held_out"] = held_out
    (run / "summary.json").write_text(json.dumps({"summary": {"minutes": 40.0}, "result": result}))
    return run


def test_a_reused_run_gives_its_sft_stages_and_clock_and_not_its_rl(tmp_path):
    run = _finished_run(tmp_path, {"steps": 352})
    result = {"stages": {}}
    policy, eval_seconds = learn_vlm.reuse_run(run, result, lambda msg: None)
    assert policy == str(run / "sft" / "checkpoint-16" / "policy")
    assert result["stages"] == {"sft": {"greedy_success": 0.69}}     # its RL stages are not taken
    assert result["collect"]["episodes"] == 60 and result["perception"]["seconds"] == 200
    assert result["from_run"] == str(run)
    # A run that did not keep them: each RL stage's time past its iterations is an evaluation
    # (100 s and 120 s), and SFT ended when the RL stages began (40 min - 1,360 s).
    assert eval_seconds == pytest.approx(110.0)
    assert result["sft"]["ended_minutes"] == pytest.approx(40.0 - 1360.0 / 60, abs=0.01)


def test_a_reused_run_keeps_the_times_it_recorded(tmp_path):
    run = _finished_run(tmp_path, {"steps": 352, "eval_seconds": 95.0, "ended_minutes": 17.5})
    result = {"stages": {}}
    _, eval_seconds = learn_vlm.reuse_run(run, result, lambda msg: None)
    assert eval_seconds == 95.0 and result["sft"]["ended_minutes"] == 17.5


SIXTEEN = {"seed_start": 10_000, "tasks": 16, "samples": 2}


def test_a_reused_run_scored_on_other_maps_leaves_its_scores_out(tmp_path):
    run = _finished_run(tmp_path, {"steps": 352, "eval_seconds": 95.0, "ended_minutes": 17.5}, held_out=SIXTEEN)
    same = {"stages": {}, "held_out": dict(SIXTEEN)}
    learn_vlm.reuse_run(run, same, lambda msg: None)
    assert same["stages"] == {"sft": {"greedy_success": 0.69}} and same["blind"] == {"greedy_success": 0.44}
    # 48 maps: the 16-map scores would not compare with RL's, so SFT and the blind plan are scored again
    more = {"stages": {}, "held_out": {**SIXTEEN, "tasks": 48}}
    policy, _ = learn_vlm.reuse_run(run, more, lambda msg: None)
    assert more["stages"] == {} and "greedy_success" not in more["blind"]
    assert policy == str(run / "sft" / "checkpoint-16" / "policy") and more["sft"]["ended_minutes"] == 17.5
    # a run that did not record its held-out set is scored again too
    older = _finished_run(tmp_path / "older", {"steps": 352, "eval_seconds": 95.0, "ended_minutes": 17.5})
    fresh = {"stages": {}, "held_out": dict(SIXTEEN)}
    learn_vlm.reuse_run(older, fresh, lambda msg: None)
    assert fresh["stages"] == {}


def test_an_unfinished_run_is_refused(tmp_path):
    run = _finished_run(tmp_path, {"steps": 1})
    (run / "summary.json").unlink()
    with pytest.raises(SystemExit, match="no finished run"):
        learn_vlm.reuse_run(run, {"stages": {}}, lambda msg: None)
    with pytest.raises(SystemExit, match="no finished run"):
        learn_vlm.reuse_run(tmp_path / "nowhere", {"stages": {}}, lambda msg: None)


def test_a_reused_run_from_before_a_figure_existed_summarizes_it_as_none(tmp_path):
    """An older run's SFT stage lacks the figures added since; the new run's summary leaves them None."""
    run = _finished_run(tmp_path, {"steps": 352, "caption_samples": 447, "seconds": 850.0, "loss_first": 6.9,
                                   "loss_last": 0.05, "eval_seconds": 95.0, "ended_minutes": 17.5}, held_out=SIXTEEN)
    result = {"env": "frozenlake", "model": "qwen2_vl small", "estimator": "bilevel_gae", "device": "cpu",
              "stages": {}, "held_out": dict(SIXTEEN)}
    learn_vlm.reuse_run(run, result, lambda msg: None)
    del result["perception"]   # the fixture's holds its time only
    keys = ("sampled_success", "invalid_rate", "grounding_accuracy", "move_follows_reading")
    new = {"greedy_success": 0.75, **{k: 0.5 for k in keys}}
    result["stages"]["rl-seed0"] = new
    result["rl"] = {"0": {"iterations": 1, "seconds": 60.0, "train_success": [0.5], "iteration_seconds": [50.0]}}
    summary = learn_vlm.summarize(result, 20.0)
    assert summary["sft_greedy_success"] == 0.69 and summary["sft_move_follows_reading"] is None
    assert summary["rl_move_follows_reading"] == 0.5 and summary["rl_minus_sft_greedy"] == pytest.approx(0.06)


def test_a_run_stopped_during_rl_can_be_reused(tmp_path):
    """The summary written when SFT ends is enough for --from-run, before any RL seed has finished."""
    run = _finished_run(tmp_path, {"steps": 1})
    (run / "summary.json").unlink()
    sft = {"steps": 352, "samples": 300, "caption_samples": 447, "seconds": 850.0, "loss_first": 6.9,
           "loss_last": 0.05, "eval_seconds": 95.0, "ended_minutes": 17.5}
    stopped = {"env": "frozenlake", "model": "qwen2_vl small", "estimator": "bilevel_gae", "device": "cpu",
               "collect": {"episodes": 60}, "blind": {"greedy_success": 0.44}, "sft": sft,
               "stages": {"sft": {"greedy_success": 0.69}}, "held_out": dict(SIXTEEN)}
    summary = learn_vlm.write_summary(run, stopped, 18.0)
    assert summary["sft_greedy_success"] == 0.69 and summary["rl_greedy_success"] is None
    assert summary["rl_iterations"] == {} and summary["rl_minus_sft_greedy"] is None
    result = {"stages": {}, "held_out": dict(SIXTEEN)}
    policy, eval_seconds = learn_vlm.reuse_run(run, result, lambda msg: None)
    assert policy == str(run / "sft" / "checkpoint-16" / "policy") and eval_seconds == 95.0
    assert result["stages"] == {"sft": {"greedy_success": 0.69}} and result["sft"]["ended_minutes"] == 17.5


def _scored(sft_greedy: float, rl_greedy: list[float], targets: dict | None) -> dict:
    """A result as a finished run leaves it: an SFT stage and one stage per RL seed."""
    stages = {"sft": {"greedy_success": sft_greedy, "grounding_accuracy": 0.81}}
    stages.update({f"rl-seed{i}": {"greedy_success": g} for i, g in enumerate(rl_greedy)})
    return {"env": "frozenlake", "model": "qwen2_vl small", "estimator": "bilevel_gae", "device": "cpu",
            "collect": {"episodes": 60}, "blind": {"greedy_success": 0.4},
            "sft": {"steps": 528, "caption_samples": 447, "seconds": 1200.0, "loss_first": 6.9, "loss_last": 0.01},
            "stages": stages, "held_out": {"seed_start": 10_000, "tasks": 48, "samples": 1},
            "rl": {str(i): {"iterations": 15, "iteration_seconds": [55.0]} for i in range(len(rl_greedy))},
            **({"targets": targets} if targets is not None else {})}


TARGETS = {"greedy_success_after_rl": 0.5, "sft_grounding_accuracy": 0.8}


def test_the_summary_says_which_targets_the_run_met():
    # 37 of 48 maps after SFT; 39 and 35 after RL: no gain on average, a spread of 4 maps
    summary = learn_vlm.summarize(_scored(37 / 48, [39 / 48, 35 / 48], TARGETS), 56.0)
    assert summary["rl_minus_sft_greedy"] == 0.0 and summary["rl_seed_spread"] == pytest.approx(4 / 48, abs=1e-4)
    assert summary["held_out"]["tasks"] == 48
    assert summary["targets_met"] == {"greedy_success_after_rl": True, "sft_grounding_accuracy": True,
                                      "rl_above_seed_spread": False}
    # both seeds gain 5 maps: the gain is above a spread of none
    met = learn_vlm.summarize(_scored(37 / 48, [42 / 48, 42 / 48], TARGETS), 56.0)["targets_met"]
    assert met["rl_above_seed_spread"] and met["greedy_success_after_rl"]
    # a weak policy misses the success target
    assert not learn_vlm.summarize(_scored(0.2, [0.3, 0.3], TARGETS), 56.0)["targets_met"]["greedy_success_after_rl"]
    # no targets in the config, or no RL stage yet: nothing to check
    assert "targets_met" not in learn_vlm.summarize(_scored(0.7, [0.8, 0.7], None), 56.0)
    assert "targets_met" not in learn_vlm.summarize(_scored(0.7, [], TARGETS), 56.0)
