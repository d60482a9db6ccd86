"""envserve.client.http_retry on its own, against the scripted loopback endpoint of
test_llm_judge_retries.py: giving up after N attempts, Retry-After before backoff, no retry on
other 4xx, the caller's deadline and cancel. The judge's own retry tests cover the statuses retried,
Retry-After as a date and beyond the cap, timeouts and unreachable endpoints through LLMJudge.
"""
from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from envserve.client.http_retry import Counters, RetryPolicy, post_with_retries
from test_llm_judge_retries import YES, endpoint, error  # noqa: F401  (endpoint: the loopback double fixture)


def post(url: str, policy: RetryPolicy, rng: random.Random | None = None, counters: Counters | None = None,
         **kwargs):
    """One post_with_retries in a fresh event loop; (outcome, counters)."""
    counters = counters or Counters()

    async def main():
        async with httpx.AsyncClient(timeout=5.0) as client:
            return await post_with_retries(client, url + "/chat/completions", {"q": 1}, policy,
                                           slots=asyncio.Semaphore(4), counters=counters,
                                           rng=rng or random.Random(0), **kwargs)
    return asyncio.run(main()), counters


def test_gives_up_after_max_retries_plus_one_attempts(endpoint):
    ep = endpoint([], default=error(503, body="overloaded"))
    rng = random.Random(0)
    outcome, counters = post(ep.base_url, RetryPolicy(3, 0.01, 0.05), rng)
    assert (outcome.response, outcome.attempts, outcome.status, outcome.refused) == (None, 4, 503, False)
    assert outcome.last == "HTTP 503: overloaded"
    assert len(ep.requests) == 4 and (counters.requests, counters.retries, counters.in_flight) == (4, 3, 0)
    # one jitter draw per wait (3), none after the last attempt: the caller's rng stays reproducible
    expected = random.Random(0)
    for _ in range(3):
        expected.random()
    assert rng.random() == expected.random()


def test_success_after_retries_reports_the_attempts(endpoint):
    ep = endpoint([error(500), error(429)], default=YES)
    outcome, counters = post(ep.base_url, RetryPolicy(2, 0.01, 0.05))
    assert outcome.response is not None and outcome.response.status_code == 200
    assert (outcome.attempts, outcome.status, outcome.last) == (3, 200, "")
    assert (counters.requests, counters.retries) == (3, 2)


def test_retry_after_is_used_instead_of_the_backoff(endpoint):
    # The backoff (60-120 s) would end past the deadline, so a second attempt means Retry-After: 0 was
    # what set the wait.
    ep = endpoint([error(503, {"Retry-After": "0"})], default=YES)
    outcome, _ = post(ep.base_url, RetryPolicy(2, 120.0, 240.0), deadline=time.monotonic() + 60)
    assert outcome.response is not None and outcome.attempts == 2 and len(ep.requests) == 2


@pytest.mark.parametrize("status", [400, 401, 404, 422, 201, 302])
def test_other_statuses_are_refused_without_a_retry(endpoint, status):
    ep = endpoint([error(status, body="bad model")], default=YES)
    outcome, counters = post(ep.base_url, RetryPolicy(3, 0.01, 0.05))
    assert (outcome.response, outcome.attempts, outcome.status, outcome.refused) == (None, 1, status, True)
    assert outcome.last == f"HTTP {status}: bad model" and len(ep.requests) == 1 and counters.retries == 0


def test_no_wait_ends_past_the_deadline(endpoint):
    # The first backoff is drawn from [0.5, 1] s; the deadline is 0.2 s away when the call starts.
    ep = endpoint([], default=error(503))
    outcome, counters = post(ep.base_url, RetryPolicy(5, 1.0, 2.0), deadline=time.monotonic() + 0.2)
    assert outcome.response is None and outcome.attempts == 1 and len(ep.requests) == 1
    assert outcome.status == 503 and "deadline" in outcome.last and counters.retries == 0


def test_cancel_ends_a_wait(endpoint):
    ep = endpoint([], default=error(503))
    counters = Counters()

    async def main():
        async with httpx.AsyncClient(timeout=5.0) as client:
            # waits of 30-60 s: a second request would mean the cancel did not end the wait
            task = asyncio.ensure_future(post_with_retries(
                client, ep.base_url + "/chat/completions", {}, RetryPolicy(3, 60.0, 60.0),
                slots=asyncio.Semaphore(1), counters=counters, rng=random.Random(0)))
            while counters.retries == 0:   # in the wait after the first 503
                await asyncio.sleep(0.01)
            task.cancel()
            [result] = await asyncio.gather(task, return_exceptions=True)
            return result

    result = asyncio.run(main())
    assert isinstance(result, asyncio.CancelledError)
    assert len(ep.requests) == 1 and (counters.requests, counters.in_flight) == (1, 0)
