"""POSTs to an HTTP endpoint with retries, shared by the LLM judge and the trainer's OpenAI-compatible
backend, which call the same kind of servers (vLLM, hosted chat-completion APIs).

The loop is tenacity's (AsyncRetrying); this module says what is retried and how long to wait.
Retried: transport errors (connect errors, timeouts), 408, 409, 429 and 5xx, after the server's
Retry-After when it sends one (a number of seconds or an HTTP date), else after an exponential
backoff with jitter (base * 2^n capped at max, drawn from [d/2, d], so many clients that failed
together do not retry together). A Retry-After longer than the cap ends the retries at once (the
caller would rather fail than stall), and so does a wait that would end past the caller's
`deadline`. Other 4xx are not retried: the request itself is wrong. Cancelling the caller's task
cancels a wait at once. The caller turns the outcome into its own error type and counts what it
wants from `Counters`.
"""
from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from tenacity import (AsyncRetrying, RetryCallState, retry_if_exception_type, retry_if_result,
                      stop_after_attempt)

RETRY_STATUS = frozenset({408, 409, 429})


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The Retry-After header in seconds (a number or an HTTP date); None when absent or unreadable."""
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def backoff_s(attempt: int, base_s: float, max_s: float, rng: random.Random) -> float:
    """The wait before retry number attempt + 1: d = min(max, base * 2^attempt), drawn from [d/2, d]."""
    d = min(max_s, base_s * 2 ** attempt)
    return rng.uniform(d / 2, d)


def retried_status(status: int) -> bool:
    """Whether a reply with this status is worth asking again (a non-200 the server may not repeat)."""
    return status != 200 and (status >= 500 or status in RETRY_STATUS)


@dataclass
class Counters:
    requests: int = 0
    retries: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int
    backoff_base_s: float
    backoff_max_s: float


@dataclass(frozen=True)
class PostOutcome:
    response: Any | None      # the 200 response; None when none came
    attempts: int
    status: int | None        # the last HTTP status (None after a transport error)
    last: str                 # what went wrong last ("" on success)
    refused: bool = False     # a 4xx that retrying cannot fix


async def post_with_retries(client, url: str, body: Mapping[str, Any], policy: RetryPolicy, *,
                            slots: asyncio.Semaphore, counters: Counters, rng: random.Random,
                            before_send: Callable[[], Awaitable[None]] | None = None,
                            detail_chars: int = 200, deadline: float | None = None) -> PostOutcome:
    """POST `body` as JSON with `client` (an httpx.AsyncClient) until a 200, a refusal or the last
    retry. Each attempt holds one of `slots` (the caller's concurrency bound) and runs `before_send`
    first inside it (a rate limiter). `deadline` (time.monotonic()): no wait ends after it."""
    import httpx
    attempts = 0

    async def attempt() -> Any:
        nonlocal attempts
        async with slots:
            if before_send is not None:
                await before_send()
            attempts += 1
            counters.in_flight += 1
            counters.peak_in_flight = max(counters.peak_in_flight, counters.in_flight)
            counters.requests += 1
            try:
                return await client.post(url, json=body)
            finally:
                counters.in_flight -= 1

    def wait(state: RetryCallState) -> float:
        if state.attempt_number > policy.max_retries:
            return 0.0   # the last attempt: no wait follows, so no jitter is drawn from the caller's rng
        if not state.outcome.failed:
            after = retry_after_s(state.outcome.result().headers)
            if after is not None:
                return after
        return backoff_s(state.attempt_number - 1, policy.backoff_base_s, policy.backoff_max_s, rng)

    def asks_too_long(state: RetryCallState) -> bool:
        # Backoff never exceeds the cap, so only a Retry-After can.
        return state.upcoming_sleep > policy.backoff_max_s

    def past_deadline(state: RetryCallState) -> bool:
        return deadline is not None and time.monotonic() + state.upcoming_sleep > deadline

    def count_retry(state: RetryCallState) -> None:
        counters.retries += 1

    def gave_up(state: RetryCallState) -> PostOutcome:
        """The outcome after the last retried failure: what went wrong, and why no retry followed."""
        if state.outcome.failed:
            error = state.outcome.exception()
            status, last = None, f"{type(error).__name__}: {error}"
        else:
            status, last = state.outcome.result().status_code, _http_detail(state.outcome.result(), detail_chars)
        if state.attempt_number <= policy.max_retries:   # stopped before the last attempt
            if asks_too_long(state):
                last += f" (asks to wait {state.upcoming_sleep:.0f} s, more than backoff_max_s)"
            else:
                last += f" (the next attempt, {state.upcoming_sleep:.1f} s away, would start after the deadline)"
        return PostOutcome(None, attempts, status, last)

    result = await AsyncRetrying(
        retry=(retry_if_exception_type(httpx.TransportError)   # connect errors and timeouts
               | retry_if_result(lambda r: retried_status(r.status_code))),
        wait=wait, stop=stop_after_attempt(policy.max_retries + 1) | asks_too_long | past_deadline,
        before_sleep=count_retry, retry_error_callback=gave_up)(attempt)
    if isinstance(result, PostOutcome):
        return result
    if result.status_code == 200:
        return PostOutcome(result, attempts, 200, "")
    return PostOutcome(None, attempts, result.status_code, _http_detail(result, detail_chars), refused=True)


def _http_detail(response: Any, detail_chars: int) -> str:
    return f"HTTP {response.status_code}: {response.text[:detail_chars]}"
