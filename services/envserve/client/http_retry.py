"""POSTs to an HTTP endpoint with retries, shared by the LLM judge and the trainer's OpenAI-compatible
backend, which call the same kind of servers (vLLM, hosted chat-completion APIs).

Retried: transport errors (connect errors, timeouts), 408, 409, 429 and 5xx, after the server's
Retry-After when it sends one (a number of seconds or an HTTP date), else after an exponential
backoff with jitter (base * 2^n capped at max, drawn from [d/2, d], so many clients that failed
together do not retry together). A Retry-After longer than the cap ends the retries at once (the
caller would rather fail than stall). Other 4xx are not retried: the request itself is wrong.
The caller turns the outcome into its own error type and counts what it wants from `Counters`.
"""
from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

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
                            detail_chars: int = 200) -> PostOutcome:
    """POST `body` as JSON with `client` (an httpx.AsyncClient) until a 200, a refusal or the last
    retry. Each attempt holds one of `slots` (the caller's concurrency bound) and runs `before_send`
    first inside it (a rate limiter)."""
    import httpx
    last, status = "", None
    attempt = 0
    for attempt in range(policy.max_retries + 1):
        response = None
        async with slots:
            if before_send is not None:
                await before_send()
            counters.in_flight += 1
            counters.peak_in_flight = max(counters.peak_in_flight, counters.in_flight)
            counters.requests += 1
            try:
                response = await client.post(url, json=body)
            except httpx.TransportError as e:   # connect errors and timeouts
                last, status = f"{type(e).__name__}: {e}", None
            finally:
                counters.in_flight -= 1
        wait = None
        if response is not None:
            status = response.status_code
            if status == 200:
                return PostOutcome(response, attempt + 1, status, "")
            last = f"HTTP {status}: {response.text[:detail_chars]}"
            if status < 500 and status not in RETRY_STATUS:
                return PostOutcome(None, attempt + 1, status, last, refused=True)
            wait = retry_after_s(response.headers)
        if attempt == policy.max_retries:
            break
        if wait is not None and wait > policy.backoff_max_s:
            last += f" (asks to wait {wait:.0f} s, more than backoff_max_s)"
            break
        counters.retries += 1
        await asyncio.sleep(wait if wait is not None else backoff_s(attempt, policy.backoff_base_s,
                                                                     policy.backoff_max_s, rng))
    return PostOutcome(None, attempt + 1, status, last)
