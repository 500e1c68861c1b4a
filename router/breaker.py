"""A per-upstream circuit breaker: stop sending requests to an upstream that keeps failing.

    closed ──(failure_threshold consecutive failures)──> open ──(reset_s elapsed)──> half-open
      ^                                                    ^                            │
      └───────────────(the probe succeeds)─────────────────┼─────(the probe fails)──────┘

Half-open lets exactly one request through as a probe. A probe whose caller vanished (cancelled
before reporting) would wedge the breaker half-open forever, so an unanswered probe expires after
another reset_s and the next caller probes instead. The breaker recovers by itself; nothing resets it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int, reset_s: float, clock: Callable[[], float] = time.monotonic):
        assert failure_threshold >= 1, f"failure_threshold must be >= 1, got {failure_threshold}"
        assert reset_s > 0, f"reset_s must be > 0, got {reset_s}"
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self._clock = clock
        self._failures = 0  # consecutive, while closed
        self._opened_at: float | None = None  # None: closed
        self._probe_at: float | None = None  # when the half-open probe was let through

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allow(self) -> bool:
        """May a request go out now? In half-open, True once per probe."""
        state = self.state
        if state == BreakerState.CLOSED:
            return True
        if state == BreakerState.OPEN:
            return False
        now = self._clock()
        if self._probe_at is not None and now - self._probe_at < self.reset_s:
            return False  # a probe is in flight
        self._probe_at = now
        return True

    def retry_after(self) -> float:
        """Seconds until a request may be let through (0 when one may go now)."""
        if self._opened_at is None:
            return 0.0
        now = self._clock()
        wait = self._opened_at + self.reset_s - now
        if self._probe_at is not None:
            wait = max(wait, self._probe_at + self.reset_s - now)
        return max(0.0, wait)

    def record_success(self) -> None:
        self._failures = 0
        self._opened_at = None
        self._probe_at = None

    def record_failure(self) -> None:
        if self._opened_at is not None:
            # A failed probe (or a straggler from before the circuit opened) restarts the wait.
            self._opened_at = self._clock()
            self._probe_at = None
            return
        self._failures += 1
        if self._failures >= self.failure_threshold:
            self._opened_at = self._clock()
