"""core.child: a fresh interpreter answering calls; its death, a missed deadline and its errors
reach the caller as what they are, and no process is left behind."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from envserve.core.child import ChildGone, ChildProcess

HERE = Path(__file__).resolve().parent


@pytest.fixture
def child(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    c = ChildProcess("child_targets:run", ("hi",), start_timeout=60, what="test child")
    yield c
    c.kill()


def _reaped(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_handshake_calls_and_errors(child):
    assert child.hello == ("ok", "hi") and child.alive()
    assert child.call("echo", 1, "two") == (1, "two")
    with pytest.raises(RuntimeError, match="^no, as such$"):
        child.call("refuse")
    with pytest.raises(RuntimeError, match="ValueError: unknown op"):
        child.call("nonsense")
    assert child.call("echo", 3) == (3,)          # an error leaves the child serving


def test_death_is_child_gone_with_the_exit_code_and_the_process_is_reaped(child):
    pid = child.pid
    with pytest.raises(ChildGone, match="exited with code 7") as e:
        child.call("die", 7)
    assert not e.value.timed_out and not child.alive() and _reaped(pid)
    with pytest.raises(ChildGone):
        child.call("echo")                        # gone stays gone; the caller starts another


def test_a_missed_deadline_kills_the_child(child):
    pid = child.pid
    with pytest.raises(ChildGone, match="no answer within 0.2 s") as e:
        child.call("sleep", 30, timeout=0.2)
    assert e.value.timed_out and _reaped(pid)


def test_close_asks_the_child_to_exit(child):
    pid = child.pid
    child.close()
    assert _reaped(pid) and not child.alive()
