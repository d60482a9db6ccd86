"""Steps of a caller stepping alone, each the replica's only request out: the front polls the
worker's reply pipe for them instead of sleeping in its event loop (WorkerPool.await_lone_reply),
and the worker polls its request pipe for the next one (worker.NextRequestWait). Driven through a
real WorkerPool with real worker processes, as the replica drives it."""
import asyncio
import os
import signal
import time

from envserve.server import pool as pool_module
from envserve.server.pool import LONE_STREAK, LONE_WAIT_BACKOFF, WorkerPool
from envserve.v1 import envserve_pb2 as pb


def drive(workers, wait_s, body, request_wait_s=0.0):
    """Runs `await body(pool)` on a pool of `workers` sokoban worker processes whose lone replies
    are awaited for up to wait_s (and whose workers await a lone caller's next request for up to
    request_wait_s), with two sessions open on each worker, then closes it."""
    async def main():
        pool = WorkerPool(workers, ["sokoban"], lambda h: None, lone_reply_wait_s=wait_s,
                          lone_request_wait_s=request_wait_s)
        await pool.start()
        try:
            for w in pool.workers:
                ids = [f"r/{w.slot}a", f"r/{w.slot}b"]
                assert (await pool.call(w, "open", ("sokoban", {}, "no_think", ids, "")))[0] == "ok"
            # Resets sent at once, one request a session: no step is alone yet.
            await asyncio.gather(*[pool.call(w, "batch", [("reset", f"r/{w.slot}{x}", 3, "", "", False)])
                                   for w in pool.workers for x in "ab"])
            await body(pool)
        finally:
            await pool.close()
    asyncio.run(main())


async def one_turn():
    """Lets the loop turn once. The pool's check for a lone step, scheduled when the step was
    sent, runs first on that turn; the loop reads the worker's replies only after this returns."""
    await asyncio.sleep(0)


def step_stream(pool, w, sids, got):
    pool.stream(w, [("step", sid, "<answer>Left</answer>") for sid in sids], got.append)


async def through_the_loop(pool, w, sid, got):
    """One lone step that is not polled for: its reply comes through the loop."""
    step_stream(pool, w, [sid], got)
    await one_turn()
    assert len(w.pending) == 1
    while w.pending:
        await asyncio.sleep(0.001)


async def settle_into_serial(pool, w, got):
    """The LONE_STREAK steps a serial caller makes before its replies are polled for."""
    for _ in range(LONE_STREAK):
        await through_the_loop(pool, w, "r/0b", got)


def turns(got):
    return sorted((r.session_id, r.turn) for reply in got for _, data, _ in reply
                  for r in [pb.StepResult.FromString(data)])


def test_a_serial_callers_step_is_answered_before_the_loop_runs_again():
    async def body(pool):
        (w,) = pool.workers
        got = []
        await settle_into_serial(pool, w, got)
        got.clear()
        step_stream(pool, w, ["r/0a"], got)
        await one_turn()
        # Read by the pool's check on the loop's next turn, before the loop's own reader ran.
        assert turns(got) == [("r/0a", 1)]
        assert w.pending == {}
        # A batch (the unary Step's path) is answered the same way: its future is already done.
        fut = pool.call(w, "batch", [("step", "r/0b", "<answer>Left</answer>")])
        await one_turn()
        assert fut.done() and len(fut.result()) == 1
    drive(1, 5.0, body)


def test_without_the_wait_the_reply_comes_through_the_loop():
    async def body(pool):
        (w,) = pool.workers
        got = []
        step_stream(pool, w, ["r/0a"], got)
        await one_turn()
        assert got == [] and len(w.pending) == 1
        while w.pending:
            await asyncio.sleep(0.001)
        assert turns(got) == [("r/0a", 1)]
    drive(1, 0.0, body)


def test_no_wait_while_more_than_one_request_is_out_and_the_streak_starts_again():
    async def body(pool):
        a, b = pool.workers
        got = []
        await settle_into_serial(pool, a, got)
        got.clear()
        step_stream(pool, a, ["r/0a"], got)
        step_stream(pool, b, ["r/1a"], got)
        await one_turn()
        # Two workers are stepping: the loop takes both replies, whichever comes first.
        assert got == []
        while a.pending or b.pending:
            await asyncio.sleep(0.001)
        assert turns(got) == [("r/0a", 1), ("r/1a", 1)]
        # Callers overlapped: lone steps go through the loop until a streak builds again.
        await settle_into_serial(pool, a, got)
        step_stream(pool, a, ["r/0a"], got)
        await one_turn()
        assert a.pending == {}
    drive(2, 5.0, body)


def test_a_reply_that_outlasts_the_wait_comes_through_the_loop_and_waiting_backs_off():
    async def body(pool):
        (w,) = pool.workers
        got = []
        await settle_into_serial(pool, w, got)
        got.clear()
        os.kill(w.pid, signal.SIGSTOP)
        try:
            step_stream(pool, w, ["r/0a"], got)
            # Returns with the stopped worker's reply still out: the loop is held for the wait,
            # not until the worker answers.
            await one_turn()
            assert got == [] and len(w.pending) == 1
            assert pool._lone_wait_skips == LONE_WAIT_BACKOFF
        finally:
            os.kill(w.pid, signal.SIGCONT)
        while w.pending:
            await asyncio.sleep(0.001)
        assert turns(got) == [("r/0a", 1)]
        # The next lone replies go to the loop without polling, then polling resumes.
        for _ in range(LONE_WAIT_BACKOFF):
            await through_the_loop(pool, w, "r/0b", got)
        step_stream(pool, w, ["r/0b"], got)
        await one_turn()
        assert w.pending == {}
        assert len(turns(got)) == 1 + LONE_WAIT_BACKOFF + 1
    drive(1, 2.0, body)


def test_a_worker_dying_during_the_wait_fails_its_request_as_lost():
    async def body(pool):
        (w,) = pool.workers
        got = []
        await settle_into_serial(pool, w, got)
        got.clear()
        os.kill(w.pid, signal.SIGKILL)
        w.process.join(10)
        step_stream(pool, w, ["r/0a"], got)
        await one_turn()
        # The pipe's hang-up ends the wait at once, and the request fails as the loop would fail it.
        assert len(got) == 1 and isinstance(got[0], pool_module.WorkerLost)
        assert not w.alive
    drive(1, 5.0, body)


def process_state(pid: int) -> str:
    """The kernel's state letter for a process: R running or runnable, S asleep."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def asleep(pid: int) -> bool:
    """Whether the process goes to sleep within 30 s: a worker that waits for the next request
    would poll (and stay runnable) for the whole minute of these tests' window."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process_state(pid) == "S":
            return True
        await asyncio.sleep(0.005)
    return False


async def polling(pid: int) -> bool:
    """Whether the process stays runnable across 50 looks over about 50 ms: polling with
    sched_yield never sleeps, a read on an empty pipe always does."""
    for _ in range(50):
        if process_state(pid) != "R":
            return False
        await asyncio.sleep(0.001)
    return True


def test_a_serial_callers_worker_polls_for_its_next_step_and_other_workers_sleep():
    async def body(pool):
        a, b = pool.workers
        got = []
        # Before the streak, a step goes out without the hint: its worker sleeps after answering.
        await settle_into_serial(pool, a, got)
        assert await asleep(a.pid)
        # A serial caller's step: after answering, its worker polls for the next one.
        step_stream(pool, a, ["r/0a"], got)
        await one_turn()
        assert a.pending == {}
        assert await polling(a.pid)
        # The next step is taken from the poll; the streak holds, so the worker polls again.
        step_stream(pool, a, ["r/0a"], got)
        await one_turn()
        assert a.pending == {}
        assert await polling(a.pid)
        # Callers overlap: the step sent while another is out carries no hint, and its worker
        # sleeps; the streak starts again, so the next lone step's worker sleeps too.
        step_stream(pool, a, ["r/0b"], got)
        step_stream(pool, b, ["r/1a"], got)
        while a.pending or b.pending:
            await asyncio.sleep(0.001)
        assert await asleep(b.pid)
        await through_the_loop(pool, a, "r/0a", got)
        assert await asleep(a.pid)
        assert turns(got) == [("r/0a", 1), ("r/0a", 2), ("r/0a", 3)] + [("r/0b", t) for t in range(1, 10)] + [("r/1a", 1)]
    drive(2, 5.0, body, request_wait_s=60.0)


def test_without_the_request_wait_a_serial_callers_worker_sleeps():
    async def body(pool):
        (w,) = pool.workers
        got = []
        await settle_into_serial(pool, w, got)
        step_stream(pool, w, ["r/0a"], got)
        await one_turn()
        assert w.pending == {}  # the front still polls for the reply
        assert await asleep(w.pid)
    drive(1, 5.0, body, request_wait_s=0.0)
