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


def _gone(pid: int) -> bool:
    """Ended (a copy is not our child: it may be a zombie until its own parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, seconds: float = 10.0) -> bool:
    import time
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_fork_is_a_copy_with_the_state_that_then_goes_its_own_way(child):
    child.call("set", "board", [1, 2, 3])
    copy = child.fork()
    try:
        assert copy.pid not in (-1, child.pid) and copy.call("pid") == copy.pid and copy.alive()
        assert copy.call("get", "board") == [1, 2, 3]
        copy.call("set", "board", "moved")
        assert child.call("get", "board") == [1, 2, 3] and copy.call("get", "board") == "moved"
        grandcopy = copy.fork()                       # a copy can be copied in turn
        assert grandcopy.call("get", "board") == "moved"
        grandcopy.close()
        with pytest.raises(ChildGone, match="exited") as e:
            copy.call("die", 3)                       # a copy's death is ChildGone too
        assert not e.value.timed_out and not copy.alive()
        assert child.call("get", "board") == [1, 2, 3]   # the original lives on
    finally:
        copy.kill()


def test_a_killed_copy_ends_and_closing_the_original_leaves_copies_serving(child):
    copy = child.fork()
    pid = copy.pid
    copy.kill()
    assert _wait_gone(pid) and copy.pid == -1
    other = child.fork()
    child.close()
    try:
        assert other.call("echo", "still") == ("still",)
    finally:
        other.close()
    assert _wait_gone(other.hello[1])


def test_copies_serve_a_copy_to_each_connection_until_idle(child):
    child.call("set", "seed", 41)
    address = child.copies(ttl_s=1.5)
    child.call("set", "seed", 99)                     # later changes are not in the frozen copy
    a, b = ChildProcess.connect(address), ChildProcess.connect(address)
    try:
        assert a.pid != b.pid and a.call("get", "seed") == b.call("get", "seed") == 41
        a.call("set", "seed", 0)
        assert b.call("get", "seed") == 41
    finally:
        a.close()
        b.close()
    import time
    time.sleep(3.0)                                   # idle past its ttl: the frozen copy has ended
    with pytest.raises(ChildGone, match="no child process copy at that address"):
        ChildProcess.connect(address)
