"""A circuit breaker so a dead or slow Redis costs each request nothing, not a timeout.

closed --(``failures`` in a row)--> open --(``cooldown_s``)--> half-open --(probe ok)--> closed
                                      ^------------------(probe fails)-------------'
While open, calls are refused at once. Half-open lets exactly one call through as a probe.
``on_change`` hears every transition (the gateway sets the ``specgate_circuit_state`` gauge from it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

log = logging.getLogger("specgate.cache")

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        failures: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[State], None] | None = None,
        what: str = "cache",  # who is speaking in the log lines
    ):
        self.failures_to_open = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.on_change = on_change
        self.what = what
        self.state: State = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.times_opened = 0

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self._enter("half_open")  # this caller is the probe; others stay refused until it reports
            return True
        return False

    def success(self) -> None:
        if self.state != "closed":
            log.info("%s: Redis reachable again, circuit closed", self.what)
        self.failures = 0
        self._enter("closed")

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.failures_to_open):
            if self.state == "closed":
                log.warning(
                    "%s: Redis failing (%d in a row), circuit open for %.1fs",
                    self.what,
                    self.failures,
                    self.cooldown_s,
                )
                self.times_opened += 1
            self.opened_at = self.clock()
            self._enter("open")

    def _enter(self, state: State) -> None:
        if state != self.state:
            self.state = state
            if self.on_change is not None:
                self.on_change(state)
