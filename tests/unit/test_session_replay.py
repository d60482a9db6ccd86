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
