"""A worker that answered a lone caller's step polls its request pipe for the caller's next step
(worker.NextRequestWait) instead of sleeping in the pipe's read. Real pipes."""
import multiprocessing as mp
import threading
import time

from envserve.server.worker import NEXT_REQUEST_WAIT_BACKOFF, NextRequestWait


def test_no_window_no_wait():
    r, w = mp.Pipe(duplex=False)
    assert NextRequestWait().wait(r, 0.0) == "skipped"


def test_a_request_already_there_or_arriving_during_the_window_ends_the_wait():
    r, w = mp.Pipe(duplex=False)
    waiting = NextRequestWait()
    w.send("first")
    assert waiting.wait(r, 60.0) == "ready"
    assert r.recv() == "first"
    sender = threading.Timer(0.05, w.send, args=("second",))
    sender.start()
    assert waiting.wait(r, 60.0) == "ready"
    assert r.recv() == "second"
    sender.join()


def test_the_front_closing_its_end_ends_the_wait():
    r, w = mp.Pipe(duplex=False)
    w.close()
    assert NextRequestWait().wait(r, 60.0) == "ready"


def test_a_missed_window_turns_waiting_off_for_the_backoff_then_it_waits_again():
    r, w = mp.Pipe(duplex=False)
    waiting = NextRequestWait()
    assert waiting.wait(r, 0.01) == "missed"
    # Each of these would poll for a minute if the backoff did not hold.
    for _ in range(NEXT_REQUEST_WAIT_BACKOFF):
        assert waiting.wait(r, 60.0) == "skipped"
    w.send("next")
    assert waiting.wait(r, 60.0) == "ready"
    assert waiting.wait(r, 0.0) == "skipped"  # unhinted: no wait, and the backoff is not touched
    assert waiting.skips == 0
