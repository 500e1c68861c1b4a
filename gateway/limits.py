"""Request limits: body size (also for chunked uploads) and per-key rate limits.

Rate limits are token buckets per tenant, refilled continuously. Requests are charged on arrival;
tokens (prompt + completion) once a response is done, because the completion length is unknown
before. A tenant whose token bucket is empty or in debt is refused until it refills, as OpenAI does.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from starlette.requests import Request

from gateway.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is larger than the limit of {limit} bytes.", code="request_too_large"
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes while reading: Content-Length can be absent
    (chunked transfer) or wrong, so the bytes themselves are counted."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class _Bucket:
    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        rate = self.capacity / 60.0  # per second
        self.level = min(self.capacity, self.level + (now - self.stamp) * rate)
        self.stamp = now

    def seconds_until(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 when it is)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / (self.capacity / 60.0)


class RateLimiter:
    def __init__(self, rpm: int | None, tpm: int | None):
        self.rpm = rpm
        self.tpm = tpm
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._lock = threading.Lock()
        self._now = time.monotonic

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def _bucket(self, table: dict[str, _Bucket], key: str, capacity: int, now: float) -> _Bucket:
        b = table.get(key)
        if b is None:
            b = table[key] = _Bucket(float(capacity), float(capacity), now)
        b.refill(now)
        return b

    def admit(self, key: str) -> dict[str, str]:
        """Charge one request; raise 429 if the tenant is over either limit. Returns headers."""
        now = self._now()
        with self._lock:
            headers: dict[str, str] = {}
            wait = 0.0
            if self.tpm is not None:
                t = self._bucket(self._tokens, key, self.tpm, now)
                wait = max(wait, t.seconds_until(1))
                headers |= _headers("tokens", self.tpm, t)
            if self.rpm is not None:
                r = self._bucket(self._requests, key, self.rpm, now)
                wait = max(wait, r.seconds_until(1))
                if wait == 0:
                    r.level -= 1
                headers |= _headers("requests", self.rpm, r)
            if wait > 0:
                headers["Retry-After"] = str(max(1, math.ceil(wait)))
                raise APIError(
                    429,
                    f"Rate limit reached for this API key; retry in {wait:.1f}s.",
                    "rate_limit_error",
                    code="rate_limit_exceeded",
                    headers=headers,
                )
            return headers

    def charge_tokens(self, key: str, tokens: int) -> None:
        if self.tpm is None or tokens <= 0:
            return
        with self._lock:
            self._bucket(self._tokens, key, self.tpm, self._now()).level -= tokens


def _headers(kind: str, limit: int, b: _Bucket) -> dict[str, str]:
    remaining = max(0, math.floor(b.level - (1 if kind == "requests" else 0)))
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(remaining),
        f"x-ratelimit-reset-{kind}": f"{b.seconds_until(b.capacity):.1f}s",
    }
