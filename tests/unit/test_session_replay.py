"""Session.restore and Session.replay: the one replay mechanism behind Restore and Fork-by-replay."""
import dataclasses

import pytest

from envserve.core.registry import get_env_class, register, unregister
from envserve.core.session import Session, SessionError

ANSWERS = ["<think>-</think><answer>Up</answer>", "<think>-</think><answer>Left</answer>",
           "<think>-</think><answer>Down</answer>", "nonsense", "<think>-</think><answer>Right</answer>"]


def _played(env_id="sokoban", seed=9, same_task_episodes=0):
    s = Session(env_id, {"history_turns": 16}, "free_think")
    first = s.reset(seed=seed)
    for _ in range(same_task_episodes):
        s.step(ANSWERS[0])
        first = s.reset(same_task=True)
    anchors = [s.step(a).anchor for a in ANSWERS]
    return s, first, anchors


def test_restore_ends_where_the_session_is_with_its_ground_truth():
    s, first, anchors = _played(same_task_episodes=2)
    r = Session.restore("sokoban", {"history_turns": 16}, "free_think", s.seed, s.trial, s.episode, ANSWERS,
                        anchors, first.anchor)
    assert (r.anchor, r.turn, r.episode, r.trial, r.done) == (s.anchor, s.turn, s.episode, s.trial, s.done)
    assert r.episode == 2
    for turn in range(len(ANSWERS) + 1):
        assert r.get_state(turn) == s.get_state(turn)
    assert r.step(ANSWERS[1]).anchor == s.step(ANSWERS[1]).anchor


def test_a_wrong_anchor_fails_naming_its_turn():
    s, first, anchors = _played()
    anchors[3] = "0" * 16
    with pytest.raises(SessionError) as e:
        Session.restore("sokoban", {"history_turns": 16}, "free_think", s.seed, s.trial, s.episode, ANSWERS,
                        anchors, first.anchor)
    assert e.value.code == "FAILED_PRECONDITION" and "diverged at turn 4" in e.value.message
    with pytest.raises(SessionError, match="diverged at turn 0"):
        Session.restore("sokoban", {"history_turns": 16}, "free_think", s.seed + 1, s.trial, s.episode, [],
                        [], first.anchor)


def test_a_never_reset_history_restores_an_unstarted_session():
    r = Session.restore("frozenlake", None, "", None, -1, -1, [], [])
    assert r.seed is None and not r.history


@pytest.fixture
def inexact_env():
    base = get_env_class("frozenlake")

    class InexactFrozenLake(base):
        spec = dataclasses.replace(base.spec, env_id="inexact_frozenlake", replay_exact=False)
    register("inexact_frozenlake", InexactFrozenLake)
    yield "inexact_frozenlake"
    unregister("inexact_frozenlake")


def test_an_env_whose_replay_is_not_exact_refuses_restore(inexact_env):
    with pytest.raises(SessionError, match="replay is not exact"):
        Session.restore(inexact_env, None, "", 3, 0, 0, [], [])


def test_fork_by_replay_checks_that_the_copy_ends_where_its_parent_is():
    s, _, _ = _played("frozenlake")
    blob = s.to_blob()
    blob.pop("env_snapshot", None)  # as an env that cannot snapshot: copied by replay
    copy = Session.from_blob(blob)
    assert (copy.anchor, copy.turn, list(copy.history)) == (s.anchor, s.turn, list(s.history))
    blob["anchor"] = "f" * 16
    with pytest.raises(SessionError, match=f"diverged at turn {len(ANSWERS)}"):
        Session.from_blob(blob)


def test_an_episode_past_its_replay_budget_steps_on_but_is_not_copied_by_replay():
    s = Session("frozenlake", {"max_replay_chars": 100, "max_turns": 1000}, "no_think")
    s.reset(seed=3)
    answer = "<answer>Left</answer>"      # 21 characters: the fifth passes 100
    for _ in range(4):
        s.step(answer)
    assert s.replay_record()["actions"] == [answer] * 4
    s.step(answer)
    assert s.replay_log is None and s.replay_record() is None
    assert s.step(answer).turn == 6              # it steps on
    copy = Session.from_blob(s.to_blob())        # a snapshot still copies it
    assert copy.anchor == s.anchor and copy.replay_log is None
    s.reset(seed=3)                              # a reset starts a new budget
    s.step(answer)
    assert s.replay_record()["actions"] == [answer]


def test_a_session_without_snapshots_past_its_budget_cannot_be_forked(monkeypatch):
    cls = get_env_class("frozenlake")
    monkeypatch.setattr(cls, "spec", dataclasses.replace(cls.spec, supports_snapshot=False))
    s = Session("frozenlake", {"max_replay_chars": 30, "max_turns": 1000}, "no_think")
    s.reset(seed=3)
    s.step("<answer>Left</answer>")
    s.step("<answer>Left</answer>")
    with pytest.raises(SessionError) as e:
        s.to_blob()
    assert e.value.code == "FAILED_PRECONDITION" and "max_replay_chars" in e.value.message
