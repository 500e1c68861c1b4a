"""The circuit breaker: stop calling a dependency that keeps failing, so each request pays nothing for it
instead of a timeout. One per upstream (router/upstream.py), one for the cache's Redis and one for the
rate limits' Redis (gateway/cache/, gateway/limits.py).

    closed ──(failure_threshold consecutive failures)──> open ──(reset_s elapsed)──> half-open
      ^                                                    ^                            │
      └───────────────(the probe succeeds)─────────────────┼─────(the probe fails)──────┘

Half-open lets exactly one call through as a probe. A probe whose caller vanished (cancelled
before reporting) would wedge the breaker half-open forever, so an unanswered probe expires after
another reset_s and the next caller probes instead. The breaker recovers by itself; nothing resets it.
``on_change`` hears each transition as it happens (closed -> open on a failure, open -> half-open when
a probe is let through, back to open or closed when it reports); the gateway sets the
``specgate_circuit_state`` gauge from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from enum import StrEnum

log = logging.getLogger("specgate.breaker")


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        reset_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState], None] | None = None,
        name: str = "upstream",  # who is speaking in the log lines
    ):
        assert failure_threshold >= 1, f"failure_threshold must be >= 1, got {failure_threshold}"
        assert reset_s > 0, f"reset_s must be > 0, got {reset_s}"
        self.failure_threshold = failure_threshold
        self.reset_s = reset_s
        self.on_change = on_change
        self.name = name
        self.times_opened = 0  # closed -> open transitions
        self._clock = clock
        self._failures = 0  # consecutive, while closed
        self._opened_at: float | None = None  # None: closed
        self._probe_at: float | None = None  # when the half-open probe was let through
        self._reported = BreakerState.CLOSED  # the state on_change last heard

    @property
    def state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self._clock() - self._opened_at >= self.reset_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def allow(self) -> bool:
        """May a call go out now? In half-open, True once per probe."""
        state = self.state
        if state == BreakerState.CLOSED:
            return True
        if state == BreakerState.OPEN:
            return False
        now = self._clock()
        if self._probe_at is not None and now - self._probe_at < self.reset_s:
            return False  # a probe is in flight
        self._probe_at = now
        self._report(BreakerState.HALF_OPEN)
        return True

    def retry_after(self) -> float:
        """Seconds until a call may be let through (0 when one may go now)."""
        if self._opened_at is None:
            return 0.0
        now = self._clock()
        wait = self._opened_at + self.reset_s - now
        if self._probe_at is not None:
            wait = max(wait, self._probe_at + self.reset_s - now)
        return max(0.0, wait)

    def record_success(self) -> None:
        if self._opened_at is not None:
            log.info("%s: answering again, circuit closed", self.name)
        self._failures = 0
        self._opened_at = None
        self._probe_at = None
        self._report(BreakerState.CLOSED)

    def record_failure(self) -> None:
        if self._opened_at is not None:
            # A failed probe (or a straggler from before the circuit opened) restarts the wait.
            self._opened_at = self._clock()
            self._probe_at = None
            self._report(BreakerState.OPEN)
            return
        self._failures += 1
        if self._failures >= self.failure_threshold:
            log.warning(
                "%s: failing (%d in a row), circuit open for %.1fs", self.name, self._failures, self.reset_s
            )
            self.times_opened += 1
            self._opened_at = self._clock()
            self._report(BreakerState.OPEN)

    def _report(self, state: BreakerState) -> None:
        if state != self._reported:
            self._reported = state
            if self.on_change is not None:
                self.on_change(state)
