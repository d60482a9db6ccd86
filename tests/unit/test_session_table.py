"""The routed clients' session table: what it keeps of each session to rebuild it elsewhere."""
import time

import grpc

from envserve.client import RecoverySettings, messages as pb
from envserve.client.recovery import SessionTable

LOST = grpc.StatusCode.DATA_LOSS.value[0]


def _reset(seed: int, anchor: str, trial=0, episode=0) -> pb.StepResult:
    r = pb.StepResult(session_id="r/1", anchor=anchor, trial=trial, episode=episode)
    r.info.update({"seed": seed})
    return r


def test_history_is_the_reset_and_the_turns_since():
    t = SessionTable()
    t.opened(["a"], "sokoban", {"max_turns": 5}, "free_think")
    t.answer("a", _reset(7, "r0"), None)
    for k in range(3):
        t.answer("a", pb.StepResult(anchor=f"s{k}"), f"act{k}")
    t.answer("a", pb.StepResult(status=pb.ItemStatus(code=9, message="over")), "ignored")  # failed: not kept
    h = t.history("a")
    assert (h.env_id, h.seed, h.reset_anchor, h.action_format) == ("sokoban", 7, "r0", "free_think")
    assert [(x.action, x.anchor) for x in h.turns] == [("act0", "s0"), ("act1", "s1"), ("act2", "s2")]
    assert h.config.fields["max_turns"].number_value == 5
    t.answer("a", _reset(7, "r1", episode=1), None)  # a same-task reset starts the history again
    assert t.history("a").episode == 1 and not t.history("a").turns


def test_a_fork_inherits_and_a_close_forgets():
    t = SessionTable()
    t.opened(["p"], "frozenlake", None, "")
    t.answer("p", _reset(3, "x"), None)
    t.answer("p", pb.StepResult(anchor="y"), "go")
    t.forked("p", ["c1", "c2"])
    t.answer("c1", pb.StepResult(anchor="z"), "more")
    assert len(t.history("c2").turns) == 1 and len(t.history("c1").turns) == 2
    t.moved("p", "other/9")
    assert t.current("p") == "other/9" and t.caller_id("other/9") == "p"
    t.closed(["p"])
    assert t.log("p") is None and t.current("p") == "p" and t.caller_id("other/9") == "other/9"
    assert t.recoverable("c1", LOST) and not t.recoverable("p", LOST) and not t.recoverable("c1", 9)


def test_an_episode_past_max_turns_is_not_kept_and_says_so():
    t = SessionTable(RecoverySettings(max_turns=2))
    t.opened(["a"], "sokoban", None, "")
    t.answer("a", _reset(1, "r"), None)
    for k in range(3):
        t.answer("a", pb.StepResult(anchor=str(k)), "x")
    assert "longer than the 2 turns" in t.why_not("a")
    assert t.why_not("nobody") == "no history of it is kept"


def test_histories_of_sessions_left_open_are_forgotten():
    t = SessionTable(RecoverySettings(forget_seconds=0.05))
    t.opened(["old"], "sokoban", None, "")
    time.sleep(0.1)
    t.opened([f"n{i}" for i in range(1024)], "sokoban", None, "")  # a sweep runs every 1,024 opens
    assert t.log("old") is None and len(t) == 1024


def test_results_show_the_callers_id():
    t = SessionTable()
    t.opened(["mine"], "sokoban", None, "")
    t.moved("mine", "b/2")
    r = t.answer("mine", pb.StepResult(session_id="b/2", anchor="q"), "act")
    assert r.session_id == "mine" and t.history("mine").turns[0].anchor == "q"


def test_off_keeps_nothing():
    t = SessionTable(RecoverySettings(enabled=False))
    t.opened(["a"], "sokoban", None, "")
    assert len(t) == 0 and not t.recoverable("a", LOST)
