"""Quotas per token on one replica: live sessions, items in flight, sessions opened per second.

A replica shared by several tokens gives each a share, so that no caller can take its capacity.
A token's own entry in the token file sets its quotas; the defaults entry ('*') sets them for the
rest; where neither does, sessions default to an equal share of the replica's capacity, items in
flight to twice the token's sessions, and opens to DEFAULT_OPENS_PER_SECOND in bursts of up to
max_open_per_call. Without tokens (one user) only the replica's own limits apply.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from envserve.rpc.auth import Authenticator, Quota

# Sessions opened (Open, Fork, Restore) per second and token where nothing else is said: far above
# what a trainer's start needs after its first burst (a burst takes up to max_open_per_call at once),
# and far below what would keep the workers building sessions for one caller alone.
DEFAULT_OPENS_PER_SECOND = 2000.0


class QuotaExceeded(Exception):
    """The call would pass one of the caller's quotas; the message names it."""


@dataclass
class _Bucket:
    rate: float
    burst: float
    level: float
    at: float

    def take(self, n: int, now: float) -> float:
        """Takes n tokens and returns 0, or takes none and returns the seconds until n are there."""
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if n <= self.level:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate


class Quotas:
    def __init__(self, auth: Authenticator, capacity: int, max_open_per_call: int, clock=time.monotonic):
        self.auth, self.clock = auth, clock
        self.burst = max(1, max_open_per_call)
        tokens = max(1, len(auth.policies))
        share = math.ceil(capacity / tokens)
        d = auth.default_quota
        self._fallback = Quota(max_sessions=d.max_sessions or share, max_in_flight=d.max_in_flight,
                               opens_per_second=d.opens_per_second or DEFAULT_OPENS_PER_SECOND,
                               open_burst=d.open_burst)
        self.sessions: dict[str, int] = {}
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def quota(self, owner: str) -> Quota | None:
        """The token's effective quotas; None without auth."""
        policy = self.auth.policy(owner)
        if policy is None:
            return None
        q, f = policy.quota, self._fallback
        sessions = q.max_sessions or f.max_sessions
        rate = q.opens_per_second or f.opens_per_second
        return Quota(max_sessions=sessions, max_in_flight=q.max_in_flight or f.max_in_flight or 2 * sessions,
                     opens_per_second=rate, open_burst=q.open_burst or f.open_burst or max(self.burst, math.ceil(rate)))

    def _name(self, owner: str) -> str:
        return self.auth.name_of(owner)

    def admit_sessions(self, owner: str, n: int) -> None:
        """Raises QuotaExceeded when n more sessions would pass the owner's session quota or rate."""
        q = self.quota(owner)
        if q is None:
            return
        held = self.sessions.get(owner, 0)
        if held + n > q.max_sessions:
            raise QuotaExceeded(f"quota max_sessions of token {self._name(owner)!r}: {held} of {q.max_sessions} "
                                f"sessions open here, {n} more asked; close some or ask the operator for more")
        bucket = self._buckets.get(owner)
        now = self.clock()
        if bucket is None or bucket.rate != q.opens_per_second or bucket.burst != q.open_burst:
            bucket = self._buckets[owner] = _Bucket(q.opens_per_second, q.open_burst, q.open_burst, now)
        wait = bucket.take(n, now) if n <= bucket.burst else math.inf
        if wait:
            raise QuotaExceeded(f"quota opens_per_second of token {self._name(owner)!r}: {q.opens_per_second:g} "
                                f"sessions a second (bursts up to {bucket.burst:g}); "
                                + (f"retry in {wait:.2f} s" if math.isfinite(wait) else
                                   f"open at most {bucket.burst:g} in one call"))

    def opened(self, owner: str, n: int) -> None:
        if owner:
            self.sessions[owner] = self.sessions.get(owner, 0) + n

    def closed(self, owner: str, n: int = 1) -> None:
        if owner:
            left = self.sessions.get(owner, 0) - n
            if left > 0:
                self.sessions[owner] = left
            else:
                self.sessions.pop(owner, None)

    def take_items(self, owner: str, n: int) -> None:
        """Counts n items in flight for owner; raises QuotaExceeded (counting none) past its quota."""
        if not owner:
            return
        q = self.quota(owner)
        now = self.in_flight.get(owner, 0)
        if q is not None and now + n > q.max_in_flight:
            raise QuotaExceeded(f"quota max_in_flight of token {self._name(owner)!r}: {now} items in flight, "
                                f"{n} more asked, {q.max_in_flight} allowed; wait for results before sending more")
        self.in_flight[owner] = now + n

    def give_items(self, owner: str, n: int) -> None:
        if owner:
            left = self.in_flight.get(owner, 0) - n
            if left > 0:
                self.in_flight[owner] = left
            else:
                self.in_flight.pop(owner, None)
