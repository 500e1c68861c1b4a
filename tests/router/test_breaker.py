"""The circuit breaker's state machine on a hand-driven clock."""

from __future__ import annotations

from router.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(3, 10.0, Clock())
    b.record_failure()
    b.record_failure()
    b.record_success()  # a success in between resets the count
    b.record_failure()
    b.record_failure()
    assert b.state == BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state == BreakerState.OPEN and not b.allow()


def test_half_open_lets_one_probe_through_and_recovers() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 10.0, clock)
    b.record_failure()
    clock.t = 4.0
    assert not b.allow() and b.retry_after() == 6.0
    clock.t = 10.0
    assert b.state == BreakerState.HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow()  # everyone else waits for it
    b.record_success()
    assert b.state == BreakerState.CLOSED and b.allow() and b.retry_after() == 0.0


def test_failed_probe_reopens_and_an_abandoned_probe_expires() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 10.0, clock)
    b.record_failure()
    clock.t = 10.0
    assert b.allow()
    b.record_failure()  # the probe failed: wait the full reset time again
    assert b.state == BreakerState.OPEN
    clock.t = 20.0
    assert b.allow()  # probe whose caller is cancelled and never reports
    clock.t = 29.0
    assert not b.allow()
    clock.t = 30.0
    assert b.allow()  # the abandoned probe expired; a new one goes


def test_on_change_hears_each_transition_once() -> None:
    clock = Clock()
    heard: list[BreakerState] = []
    b = CircuitBreaker(2, 1.0, clock, on_change=heard.append, name="cache: Redis")
    b.record_failure()
    assert b.state == BreakerState.CLOSED and b.allow()
    b.record_failure()
    assert b.state == BreakerState.OPEN and not b.allow()
    clock.t = 1.0
    assert b.allow() and b.state == BreakerState.HALF_OPEN, "one probe after the cooldown"
    assert not b.allow(), "only one probe at a time"
    b.record_failure()
    assert b.state == BreakerState.OPEN and not b.allow(), "a failed probe reopens for a full cooldown"
    clock.t = 2.5
    assert b.allow()
    b.record_success()
    assert b.state == BreakerState.CLOSED and b.times_opened == 1
    assert heard == ["open", "half_open", "open", "half_open", "closed"]
