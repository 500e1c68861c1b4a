"""A circuit breaker so a dead or slow Redis costs each request nothing, not a timeout.

closed --(``failures`` in a row)--> open --(``cooldown_s``)--> half-open --(probe ok)--> closed
                                      ^------------------(probe fails)-------------'
While open, calls are refused at once. Half-open lets exactly one call through as a probe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

log = logging.getLogger("specgate.cache")

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic):
        self.failures_to_open = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.state: State = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.times_opened = 0

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and self.clock() - self.opened_at >= self.cooldown_s:
            self.state = "half_open"  # this caller is the probe; others stay refused until it reports
            return True
        return False

    def success(self) -> None:
        if self.state != "closed":
            log.info("cache: Redis reachable again, circuit closed")
        self.state, self.failures = "closed", 0

    def failure(self) -> None:
        self.failures += 1
        if self.state == "half_open" or (self.state == "closed" and self.failures >= self.failures_to_open):
            if self.state == "closed":
                log.warning(
                    "cache: Redis failing (%d in a row), circuit open for %.1fs",
                    self.failures,
                    self.cooldown_s,
                )
                self.times_opened += 1
            self.state, self.opened_at = "open", self.clock()
