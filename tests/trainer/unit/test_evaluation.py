"""Evaluation metrics against numbers worked by hand, the JSONL metrics log, and the progress display."""
from __future__ import annotations

import io
import json
import math
import sys

import numpy as np
import pytest

from envserve_trainer.evaluation import (EvalConfig, MetricsLog, Progress, entropy_nats, episode_success_rate,
                                         format_error_rate, group_pass_at_k, group_pass_at_ks, invalid_action_rate, mean_score,
                                         mean_turns, pass_at_k_episodes, pass_at_k_unbiased, read_metrics,
                                         repeated_turns, repetitive_action_rate, success_by_episode, success_rate,
                                         summarize, tqdm_available, trajectory_diversity)
from envserve_trainer.rollout.trajectory import Episode, Trial, Turn


def turn(action="a", valid=True, reward=0.0, success=False, anchor="", parsed=None, i=0):
    return Turn(turn=i, prompt_ids=[1], completion_ids=[2], logprobs=[-0.1], text=action, action=action,
                observation="", reward=reward, action_valid=valid, parsed_actions=list(parsed or []),
                state_anchor=anchor, success=success, done=success)


def episode(turns, group="g", sample=0, index=0, split="train"):
    return Episode(env_id="env", split=split, task_seed=0, group=group, sample=sample, episode=index, turns=list(turns))


def trial(*episodes, group="g", sample=0):
    return Trial(group=group, sample=sample, episodes=list(episodes))


def outcome_trial(*successes, group="g", sample=0):
    """A trial with one single-turn episode per entry, succeeding where the entry is True."""
    return trial(*[episode([turn(success=s)], group, sample, n) for n, s in enumerate(successes)],
                 group=group, sample=sample)


def actions_trial(*actions, group="g", sample=0):
    """A single-episode trial whose turns take `actions` in order."""
    return trial(episode([turn(a) for a in actions], group, sample), group=group, sample=sample)


# Shared data set:
#   g1/s0 (train): turns a (valid, r 0), b (valid, r 1, success)  -> success, score 1.0, 2 turns
#   g1/s1 (train): turns a (invalid, r -0.1) x2, c (valid, r 0)   -> failure, score -0.2, 3 turns
#   g2/s0 (test):  an episode with no turns                       -> failure, score 0.0, 0 turns
def dataset():
    return [
        trial(episode([turn("a"), turn("b", reward=1.0, success=True)], "g1", 0), group="g1", sample=0),
        trial(episode([turn("a", valid=False, reward=-0.1), turn("a", valid=False, reward=-0.1), turn("c")],
                      "g1", 1), group="g1", sample=1),
        trial(episode([], "g2", 0, split="test"), group="g2", sample=0),
    ]


# -- success, score, length ------------------------------------------------------------------------

def test_success_score_turns_and_invalid_rate_by_hand():
    ts = dataset()
    assert success_rate(ts) == pytest.approx(1 / 3)            # 1 of 3 trials
    assert episode_success_rate(ts) == pytest.approx(1 / 3)    # 1 of 3 episodes
    assert mean_score(ts) == pytest.approx((1.0 - 0.2 + 0.0) / 3)  # 0.26667
    assert mean_turns(ts) == pytest.approx((2 + 3 + 0) / 3)    # 5/3
    assert invalid_action_rate(ts) == pytest.approx(2 / 5)     # 2 invalid of 5 turns; the empty episode adds none


def test_format_errors_are_the_turns_that_did_not_parse():
    # An unparsed answer runs no action (a format error, also invalid); a parsed but impossible move is
    # invalid without being a format error.
    ts = [trial(episode([turn("x", valid=False), turn("Jump", valid=False, parsed=["Jump"]),
                         turn("Up", parsed=["Up"]), turn("Up", parsed=["Up"])]))]
    assert format_error_rate(ts) == pytest.approx(1 / 4)
    assert invalid_action_rate(ts) == pytest.approx(2 / 4)
    assert format_error_rate([]) is None


def test_which_episode_decides_a_trials_success():
    # Episode outcomes: T1 F,T,F  T2 F,F,F  T3 T,F,F  T4 F,T (a shorter trial).
    ts = [outcome_trial(False, True, False), outcome_trial(False, False, False),
          outcome_trial(True, False, False), outcome_trial(False, True)]
    assert success_rate(ts) == 0.25                                          # last: only T4
    assert success_rate(ts, EvalConfig(success_episode="first")) == 0.25     # first: only T3
    assert success_rate(ts, EvalConfig(success_episode="any")) == 0.75       # any: T1, T3, T4
    assert episode_success_rate(ts) == pytest.approx(3 / 11)                 # 3 successes in 11 episodes
    # Index 0: F,F,T,F -> 1/4; index 1: T,F,F,T -> 2/4; index 2: F,F,F (T4 has none) -> 0.
    assert success_by_episode(ts) == {0: 0.25, 1: 0.5, 2: 0.0}


def test_empty_input_and_turnless_trials():
    assert success_rate([]) is None and mean_score([]) is None and mean_turns([]) is None
    assert invalid_action_rate([]) is None and repetitive_action_rate([]) is None
    assert pass_at_k_episodes([]) == {} and group_pass_at_ks([]) == {} and trajectory_diversity([]) is None
    # An episode with no turns: a failed episode with score 0 and 0 turns; turn rates stay undefined.
    empty = [trial(episode([]))]
    assert success_rate(empty) == 0.0 and mean_score(empty) == 0.0 and mean_turns(empty) == 0.0
    assert invalid_action_rate(empty) is None and repetitive_action_rate(empty) is None
    # A trial with no episodes at all counts as a failed trial and adds no episodes.
    bare = [Trial(group="g", sample=0)]
    assert success_rate(bare) == 0.0 and mean_score(bare) is None


def test_non_trial_input_is_refused():
    with pytest.raises(TypeError, match="Trial"):
        success_rate([episode([turn()])])


# -- repetitive actions ---------------------------------------------------------------------------

def test_repetition_is_same_action_in_same_state_within_the_episode():
    # (state_anchor, action):   (s0,a) (s1,b) (s0,a) (s0,b) (s1,b) ("",b) ("",c)
    # repeated:                   no     no    yes    no     yes    yes*    no
    # * no anchor: compared with the previous turn's action (b == b). 3 of 7 turns repeat.
    ep = episode([turn("a", anchor="s0"), turn("b", anchor="s1"), turn("a", anchor="s0"), turn("b", anchor="s0"),
                  turn("b", anchor="s1"), turn("b"), turn("c")])
    assert repeated_turns(ep) == [False, False, True, False, True, True, False]
    assert repetitive_action_rate([trial(ep)]) == pytest.approx(3 / 7)


def test_repetition_does_not_cross_episodes_and_uses_parsed_actions():
    # Episode 0: (s0,a) then (s0,a) -> 1 repeat. Episode 1 starts fresh: (s0,a) is new.
    # Episode 2: the raw texts differ but both parse to "go north,look" in state s0 -> a repeat;
    # the first turn without an anchor has no previous turn -> not a repeat. Total 2 of 6.
    ep0 = episode([turn("a", anchor="s0"), turn("a", anchor="s0")])
    ep1 = episode([turn("a", anchor="s0")], index=1)
    ep2 = episode([turn("x"), turn("<a>go north, look</a>", anchor="s0", parsed=["go north", "look"]),
                   turn("go north then look", anchor="s0", parsed=["go north", "look"])], index=2)
    assert repeated_turns(ep2) == [False, False, True]
    assert repetitive_action_rate([trial(ep0, ep1, ep2)]) == pytest.approx(2 / 6)


# -- pass@k --------------------------------------------------------------------------------------------

def test_pass_at_k_across_a_trials_episodes():
    # T1 F,T,F  T2 F,F,F  T3 T,F,F  T4 F,T.
    # k=1: T3 -> 1/4.  k=2: T1, T3, T4 -> 3/4.  k=3: T1, T3, T4 (T4 judged on its 2) -> 3/4.
    ts = [outcome_trial(False, True, False), outcome_trial(False, False, False),
          outcome_trial(True, False, False), outcome_trial(False, True)]
    assert pass_at_k_episodes(ts) == {1: 0.25, 2: 0.75, 3: 0.75}
    assert pass_at_k_episodes(ts, EvalConfig(max_pass_k=2)) == {1: 0.25, 2: 0.75}


def test_unbiased_pass_at_k_by_hand():
    assert pass_at_k_unbiased(5, 2, 2) == pytest.approx(1 - 3 / 10)   # 1 - C(3,2)/C(5,2)
    assert pass_at_k_unbiased(4, 1, 1) == pytest.approx(0.25)         # k=1 reduces to c/n
    assert pass_at_k_unbiased(3, 2, 2) == 1.0                         # n-c = 1 < k: every draw succeeds
    assert pass_at_k_unbiased(6, 0, 3) == 0.0
    # C(999,10)/C(1000,10) = 990/1000, exact even where the binomials are ~1e23.
    assert pass_at_k_unbiased(1000, 1, 10) == pytest.approx(0.01, rel=1e-12)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_unbiased_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k_unbiased(n, c, k)


def test_group_pass_at_k_averages_over_groups():
    # Group A: 4 samples, 1 success; group B: 4 samples, 2 successes.
    # k=1: A 1/4, B 2/4                           -> 0.375
    # k=2: A 1 - C(3,2)/C(4,2) = 1/2, B 1 - C(2,2)/C(4,2) = 5/6   -> 2/3
    # k=3: A 1 - C(3,3)/C(4,3) = 3/4, B n-c = 2 < 3 -> 1            -> 0.875
    # k=4: both 1
    ts = ([outcome_trial(i == 0, group="A", sample=i) for i in range(4)]
          + [outcome_trial(i < 2, group="B", sample=i) for i in range(4)])
    assert group_pass_at_k(ts, 2) == pytest.approx(2 / 3)
    got = group_pass_at_ks(ts)
    assert list(got) == [1, 2, 3, 4]
    assert [got[k] for k in got] == pytest.approx([0.375, 2 / 3, 0.875, 1.0])
    with pytest.raises(ValueError, match="fewer than k=5"):
        group_pass_at_k(ts, 5)


# -- diversity -----------------------------------------------------------------------------------------

def test_entropy_worked_example():
    # A, A, B, C: p = (1/2, 1/4, 1/4); H = -(1/2 ln 1/2 + 2 * 1/4 ln 1/4) = 0.5 ln 2 + 0.5 ln 4 = 1.03972.
    assert entropy_nats([2, 1, 1]) == pytest.approx(1.0397208, rel=1e-6)
    assert entropy_nats([4]) == 0.0 and entropy_nats([]) == 0.0


def test_trajectory_diversity_by_hand():
    # G1: four samples with trajectories (a,b) (a,b) (a,c) (d) -> counts 2,1,1 -> 1.03972.
    # G2: two identical samples -> 0.  G3: one sample -> left out (min 2 samples).
    # Mean over G1, G2 = 0.51986.  With min 1 sample, G3 (entropy 0) counts: 1.03972 / 3 = 0.34657.
    ts = [actions_trial("a", "b", group="G1", sample=0), actions_trial("a", "b", group="G1", sample=1),
          actions_trial("a", "c", group="G1", sample=2), actions_trial("d", group="G1", sample=3),
          actions_trial("x", group="G2", sample=0), actions_trial("x", group="G2", sample=1),
          actions_trial("y", group="G3", sample=0)]
    assert trajectory_diversity(ts) == pytest.approx(1.0397208 / 2, rel=1e-6)
    assert trajectory_diversity(ts, EvalConfig(diversity_min_samples=1)) == pytest.approx(1.0397208 / 3, rel=1e-6)
    # Four distinct trajectories: uniform over 4 -> ln 4 = 1.38629.
    distinct = [actions_trial(a, group="G", sample=i) for i, a in enumerate("abcd")]
    assert trajectory_diversity(distinct) == pytest.approx(math.log(4))


def test_trajectory_diversity_compares_episodes_at_the_same_index():
    # Two samples of 2 episodes: episode 0 identical (H 0), episode 1 differs (H ln 2) -> mean ln2/2 = 0.34657.
    ts = [trial(episode([turn("a")]), episode([turn("b")], index=1), sample=0),
          trial(episode([turn("a")], sample=1), episode([turn("c")], sample=1, index=1), sample=1)]
    assert trajectory_diversity(ts) == pytest.approx(math.log(2) / 2)


# -- summary ---------------------------------------------------------------------------------------

def test_summarize_overall_and_per_split():
    s = summarize(dataset())
    assert json.loads(json.dumps(s)) == s   # plain JSON types throughout
    o = s["overall"]
    assert (o["trials"], o["episodes"], o["turns"], o["groups"]) == (3, 3, 5, 2)
    assert o["success_rate"] == pytest.approx(1 / 3) and o["invalid_action_rate"] == pytest.approx(0.4)
    # Repeats: g1/s1 plays a, a, c with no anchors -> the second a repeats: 1 of 5 turns.
    assert o["repetitive_action_rate"] == pytest.approx(0.2)
    assert o["pass_at_k"] == {"1": pytest.approx(1 / 3)}
    # Unbiased pass@k up to the smallest group (g2 has 1 sample): g1 1/2, g2 0 -> 0.25.
    assert o["pass_at_k_unbiased"] == {"1": pytest.approx(0.25)}
    # g1: trajectories (a,b) and (a,a,c) differ -> ln 2; g2 has one sample and is left out.
    assert o["trajectory_diversity"] == pytest.approx(math.log(2))
    assert set(s["splits"]) == {"train", "test"}
    train, test = s["splits"]["train"], s["splits"]["test"]
    assert train["trials"] == 2 and train["success_rate"] == 0.5 and train["mean_score"] == pytest.approx(0.4)
    assert test["turns"] == 0 and test["success_rate"] == 0.0 and test["invalid_action_rate"] is None
    assert "splits" not in summarize(dataset(), by_split=False)
    assert summarize(dataset(), cfg=EvalConfig(success_episode="any"))["overall"]["success_rate"] == pytest.approx(1 / 3)


def test_summarize_empty_input():
    s = summarize([])
    assert s["splits"] == {}
    o = s["overall"]
    assert (o["trials"], o["episodes"], o["turns"], o["groups"]) == (0, 0, 0, 0)
    assert o["success_rate"] is None and o["mean_score"] is None and o["trajectory_diversity"] is None
    assert o["pass_at_k"] == {} and o["pass_at_k_unbiased"] == {}
    assert json.dumps(s)


def test_eval_config_validation():
    with pytest.raises(ValueError, match="success_episode"):
        EvalConfig(success_episode="best")
    with pytest.raises(ValueError, match="unknown EvalConfig key"):
        EvalConfig.from_mapping({"succes_episode": "last"})
    with pytest.raises(ValueError, match="integer"):
        EvalConfig.from_mapping({"max_pass_k": 2.5})
    assert EvalConfig.from_mapping({"success_episode": "any", "max_pass_k": 3}) == EvalConfig("any", 2, 3)


# -- metrics log -------------------------------------------------------------------------------------

def test_metrics_log_appends_and_resumes(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLog(path)
    for it in range(3):
        log.log(it, loss=np.float32(0.5) / (it + 1), train=summarize(dataset(), by_split=False))
    first_bytes = path.read_bytes()
    # A resumed run (from the iteration-1 checkpoint) opens the same file and logs 2 and 3 again.
    resumed = MetricsLog(path)
    assert resumed.last_iteration() == 2
    resumed.log(2, loss=0.1)
    resumed.log(3, loss=0.05)
    assert path.read_bytes().startswith(first_bytes)        # appended, never rewritten
    assert len(resumed.read(dedupe=False)) == 5
    recs = read_metrics(path)
    assert [r["iteration"] for r in recs] == [0, 1, 2, 3]
    assert recs[1]["loss"] == pytest.approx(0.25)             # numpy float32 stored as a number
    assert recs[2]["loss"] == 0.1 and "train" not in recs[2]  # the newer record of iteration 2 wins
    assert recs[0]["train"]["overall"]["trials"] == 3 and isinstance(recs[0]["time"], float)


def test_metrics_log_survives_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    MetricsLog(path).log(0, loss=1.0)
    with path.open("a") as f:
        f.write('{"iteration": 1, "lo')          # a crash mid-write
    log = MetricsLog(path)
    log.log(1, loss=0.5)                          # starts on a fresh line
    with pytest.warns(RuntimeWarning, match=r"lines \[2\]"):
        assert [(r["iteration"], r["loss"]) for r in log.read()] == [(0, 1.0), (1, 0.5)]
    with pytest.raises(ValueError, match="m.jsonl:2"):
        read_metrics(path, strict=True)


def test_metrics_log_rejects_bad_input(tmp_path):
    log = MetricsLog(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="iteration"):
        log.log(-1)
    with pytest.raises(ValueError, match="set by the log"):
        log.log(0, time=3.0)
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        log.log(0, model=object())
    assert read_metrics(tmp_path / "missing.jsonl") == []


# -- progress display ------------------------------------------------------------------------------

class ClockDouble:
    """A clock that returns the given times in order (time.monotonic's stand-in in these tests)."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


class TTYStringIODouble(io.StringIO):
    """A StringIO that claims to be a terminal."""

    def isatty(self):
        return True


def test_progress_lines_are_rate_limited():
    out = io.StringIO()
    # Start at 0; updates at 1 (first: printed), 5 (4 s after the last line < 10: quiet),
    # 12 (printed), 13 (the last step: printed although only 1 s passed).
    p = Progress(4, "train", mode="lines", stream=out, interval_s=10, clock=ClockDouble(0, 1, 5, 12, 13))
    p.update(loss=0.5)
    p.update()
    p.update(loss=0.25)
    p.update()
    p.close()                                     # the last step is already shown: nothing more
    lines = out.getvalue().splitlines()
    # Line 1: 1 step in 1 s, 3 left -> eta 3 s.  Line 2: 3 steps in 12 s -> 4 s/step, eta 4 s.
    assert lines == ["train 1/4 (25%) 1s elapsed, eta 3s | loss=0.5",
                     "train 3/4 (75%) 12s elapsed, eta 4s | loss=0.25",
                     "train 4/4 (100%) 13s elapsed, eta 0s | loss=0.25"]


def test_progress_close_writes_unshown_steps_without_total():
    out = io.StringIO()
    with Progress(None, "eval", mode="lines", stream=out, interval_s=100, clock=ClockDouble(0, 1, 2, 3)) as p:
        p.update()
        p.update(2, success=1)
    assert out.getvalue().splitlines() == ["eval 1 1s elapsed", "eval 3 3s elapsed | success=1"]
    with pytest.raises(RuntimeError, match="closed"):
        p.update()


def test_progress_can_be_disabled():
    out = TTYStringIODouble()
    for p in (Progress(3, enabled=False, stream=out), Progress(3, mode="off", stream=out)):
        p.update(3, loss=1.0)
        p.close()
        assert p.mode == "off"
    assert out.getvalue() == ""


def test_progress_mode_selection(monkeypatch):
    assert Progress(3, stream=io.StringIO()).mode == "lines"          # not a terminal
    assert Progress(3, stream=TTYStringIODouble()).mode == ("tqdm" if tqdm_available() else "lines")
    monkeypatch.setitem(sys.modules, "tqdm", None)                      # tqdm not installed
    assert Progress(3, stream=TTYStringIODouble()).mode == "lines"
    with pytest.raises(RuntimeError, match="needs the tqdm package"):
        Progress(3, mode="tqdm", stream=io.StringIO())
    with pytest.raises(ValueError, match="progress mode"):
        Progress(3, mode="fancy")


def test_progress_tqdm_bar_shows_count_and_metrics():
    pytest.importorskip("tqdm", reason="tqdm is optional; the bar needs it")
    out = io.StringIO()
    with Progress(3, "train", mode="tqdm", stream=out) as p:
        p.update(loss=0.25)
        p.update(2)
    text = out.getvalue()
    assert "3/3" in text and "loss=0.25" in text and "train" in text


def test_signal_free_groups_are_those_whose_trials_all_scored_the_same():
    from envserve_trainer.evaluation import signal_free_group_share

    def scored(group, *rewards):
        return [trial(episode([turn(reward=r)], group=group), group=group, sample=k) for k, r in enumerate(rewards)]
    trials = scored("all-fail", 0.0, 0.0, 0.0) + scored("mixed", 0.0, 1.0, 0.0) + scored("all-win", 1.0, 1.0)
    assert signal_free_group_share(trials) == pytest.approx(2 / 3)
    assert signal_free_group_share(scored("alone", 1.0)) is None       # a lone trial is no group


def test_a_learnability_iteration_plays_different_tasks_each_its_own_group():
    from types import SimpleNamespace

    from envserve_trainer.config import load_config
    from envserve_trainer.train import task_sampler, task_schedule
    cfg = load_config("learn_frozenlake.yaml").with_overrides(
        env={"num_tasks": 6}, rollout={"task_sampler": "learnability", "tasks_per_iteration": 4})
    sampler = task_sampler(cfg)
    sampler.update([SimpleNamespace(task_id=str(i), episodes=8, successes=4, turns_sum=8) for i in range(3)])
    for it in range(50):
        seeds = [t.seed for t in task_schedule(cfg, it, sampler)]
        assert len(seeds) == len(set(seeds)) == 4 and set(seeds) <= set(range(6))
    small = cfg.with_overrides(env={"num_tasks": 3})
    few = [t.seed for t in task_schedule(small, 0, task_sampler(small))]
    assert len(few) == 4 and set(few) == {0, 1, 2}      # every task once, then one again
