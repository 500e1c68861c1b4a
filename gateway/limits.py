"""Request limits: body size (also for chunked uploads), body read time, and per-key rate limits.

Rate limits are token buckets per tenant, refilled continuously. Requests are charged on arrival.
Tokens are reserved once the request is read, as OpenAI counts them: its prompt plus max_tokens for
every choice, refused (429, Retry-After) while the bucket holds fewer, and refused at once (no
Retry-After) when the whole tpm is fewer. When the response is done the reservation is settled to
the tokens it used (prompt + completion), so a request without max_tokens can leave the bucket in
debt; a tenant whose token bucket is empty or in debt is refused until it refills, as OpenAI does.

The buckets live in this process, or in Redis when one is configured, so that N gateway replicas
enforce one limit and not N (``RedisBuckets``). A Redis that fails or is slow costs a request
nothing: the limiter falls back to this process's buckets for the call (fail open, but still
limited), and a circuit breaker skips Redis until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from dataclasses import dataclass, field

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.types import Message, Receive

from gateway.cache.redis_store import fail_fast_client
from gateway.errors import APIError
from router.breaker import CircuitBreaker


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


def body_deadline(receive: Receive, timeout_s: float, stop: asyncio.Event, retry_after: int) -> Receive:
    """``receive`` for one request, bounded while its body arrives: a body not complete within
    ``timeout_s`` of the headers is a 408, and a body still arriving when ``stop`` is set (the
    drain began) is a 503 at once, so an idle upload neither holds a connection nor the drain.
    Once the body is in, messages (the disconnect listeners') pass through untouched."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    body_done = False

    async def bounded() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        message = asyncio.ensure_future(receive())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            done, _ = await asyncio.wait(
                {message, stopped}, timeout=max(0.0, deadline - loop.time()), return_when="FIRST_COMPLETED"
            )
        finally:
            stopped.cancel()
            if not message.done():
                message.cancel()
        if message in done:
            got = message.result()
            body_done = got["type"] != "http.request" or not got.get("more_body", False)
            return got
        close = {"Connection": "close"}  # the rest of the body is never read
        if stop.is_set():
            raise APIError(
                503,
                "The server is shutting down; retry on another replica.",
                "server_error",
                code="unavailable",
                headers=close | {"Retry-After": str(retry_after)},
            )
        raise APIError(
            408,
            f"The request body did not arrive within {timeout_s:g}s (server.body_timeout_s).",
            code="request_timeout",
            headers=close,
        )

    return bounded


@dataclass
class Decision:
    """One admission: seconds to wait (0: admitted, and the request was charged) and each
    bucket's level afterwards ("requests", "tokens")."""

    wait: float
    levels: dict[str, float] = field(default_factory=dict)


@dataclass
class _Bucket:
    capacity: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60.0)
        self.stamp = now


def _wait(capacity: float, level: float, need: float = 1) -> float:
    """Seconds until ``need`` units are available in a bucket refilled at capacity per minute."""
    return 0.0 if level >= need else (need - level) / (capacity / 60.0)


class LocalBuckets:
    """The buckets of this process."""

    def __init__(self) -> None:
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()
        self._now = time.monotonic

    def _bucket(self, kind: str, key: str, capacity: int, now: float) -> _Bucket:
        b = self._buckets.get((kind, key))
        if b is None:
            b = self._buckets[(kind, key)] = _Bucket(float(capacity), float(capacity), now)
        b.refill(now)
        return b

    def admit(self, key: str, rpm: int | None, tpm: int | None) -> Decision:
        now = self._now()
        with self._lock:
            tokens = self._bucket("tokens", key, tpm, now) if tpm is not None else None
            requests = self._bucket("requests", key, rpm, now) if rpm is not None else None
            wait = max(
                _wait(tpm, tokens.level) if tokens is not None and tpm is not None else 0.0,
                _wait(rpm, requests.level) if requests is not None and rpm is not None else 0.0,
            )
            if wait == 0 and requests is not None:
                requests.level -= 1
            levels = {k: b.level for k, b in (("requests", requests), ("tokens", tokens)) if b is not None}
            return Decision(wait, levels)

    def reserve(self, key: str, tpm: int, tokens: int) -> Decision:
        with self._lock:
            b = self._bucket("tokens", key, tpm, self._now())
            wait = _wait(tpm, b.level, tokens)
            if wait == 0:
                b.level -= tokens
            return Decision(wait, {"tokens": b.level})

    def charge(self, key: str, tpm: int, tokens: int) -> None:
        """Take ``tokens`` (a negative count gives them back, up to the bucket's capacity)."""
        with self._lock:
            b = self._bucket("tokens", key, tpm, self._now())
            b.level = min(b.capacity, b.level - tokens)

    def refund(self, key: str, rpm: int) -> None:
        with self._lock:
            b = self._bucket("requests", key, rpm, self._now())
            b.level = min(b.capacity, b.level + 1)


# The same buckets as LocalBuckets.admit, atomically in Redis, on the server's clock (gateways'
# clocks differ). KEYS: requests bucket, tokens bucket. ARGV: rpm, tpm (0: no such limit), and
# "charge": 1 to deduct a request when admitted, -1 to give one back (a request the gateway failed
# to serve); "spend" (ARGV[4], not 0) takes that many tokens unconditionally (a finished response's
# settlement; negative gives them back, up to tpm); "need" (ARGV[5] > 0) reserves that many tokens
# if the bucket holds them (LocalBuckets.reserve). A bucket is a hash {level, stamp} that
# expires once it would be full again, so idle tenants cost no memory. Returns wait, levels.
_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local function load(key, cap)
  local b = redis.call('HMGET', key, 'level', 'stamp')
  local level = tonumber(b[1]) or cap
  local stamp = tonumber(b[2]) or now
  return math.min(cap, level + math.max(0, now - stamp) * cap / 60)
end
local function store(key, cap, level)
  redis.call('HSET', key, 'level', tostring(level), 'stamp', tostring(now))
  redis.call('EXPIRE', key, math.ceil((cap - level) * 60 / cap) + 1)
end
local rpm, tpm, charge, spend = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local need = tonumber(ARGV[5])
local wait, rl, tl = 0, -1, -1
if tpm > 0 then
  tl = load(KEYS[2], tpm)
  if spend ~= 0 or need > 0 then
    if spend ~= 0 then tl = math.min(tpm, tl - spend)
    elseif tl < need then wait = (need - tl) * 60 / tpm
    else tl = tl - need end
    store(KEYS[2], tpm, tl)
    return {tostring(wait), tostring(rl), tostring(tl)}
  end
  if tl < 1 then wait = math.max(wait, (1 - tl) * 60 / tpm) end
end
if rpm > 0 then
  rl = load(KEYS[1], rpm)
  if rl < 1 then wait = math.max(wait, (1 - rl) * 60 / rpm) end
  if charge < 0 then rl = math.min(rpm, rl + 1)
  elseif wait == 0 and charge > 0 then rl = rl - 1 end
  store(KEYS[1], rpm, rl)
end
return {tostring(wait), tostring(rl), tostring(tl)}
"""


class LimitsUnavailable(Exception):
    """Redis refused, timed out or the circuit is open: this call uses the local buckets."""


class RedisBuckets:
    """Buckets shared by every gateway on one Redis. Keys: ``<prefix>:rl:{<tenant>}:requests`` and
    ``...:tokens`` (a tenant's two keys share a cluster slot, as the script needs)."""

    def __init__(self, url: str, prefix: str, timeout_s: float, breaker: CircuitBreaker):
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.breaker = breaker
        self.client = fail_fast_client(url, timeout_s, timeout_s)
        self.script = self.client.register_script(_LUA)

    def keys(self, tenant: str) -> list[str]:
        return [f"{self.prefix}:rl:{{{tenant}}}:{kind}" for kind in ("requests", "tokens")]

    async def _run(self, tenant: str, *args: int) -> list[float]:
        if not self.breaker.allow():
            raise LimitsUnavailable("circuit open")
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self.script(keys=self.keys(tenant), args=list(args))
        except (RedisError, OSError, TimeoutError) as exc:
            self.breaker.record_failure()
            raise LimitsUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self.breaker.record_success()
        return [float(x) for x in out]

    async def admit(self, key: str, rpm: int | None, tpm: int | None) -> Decision:
        wait, rl, tl = await self._run(key, rpm or 0, tpm or 0, 1, 0, 0)
        levels = {k: v for k, v, limit in (("requests", rl, rpm), ("tokens", tl, tpm)) if limit is not None}
        return Decision(wait, levels)

    async def reserve(self, key: str, tpm: int, tokens: int) -> Decision:
        wait, _, tl = await self._run(key, 0, tpm, 0, 0, tokens)
        return Decision(wait, {"tokens": tl})

    async def charge(self, key: str, tpm: int, tokens: int) -> None:
        await self._run(key, 0, tpm, 0, tokens, 0)

    async def refund(self, key: str, rpm: int) -> None:
        await self._run(key, rpm, 0, -1, 0, 0)

    async def aclose(self) -> None:
        await self.client.aclose()


class RateLimiter:
    def __init__(self, rpm: int | None, tpm: int | None, shared: RedisBuckets | None = None):
        self.rpm = rpm
        self.tpm = tpm
        self.local = LocalBuckets()
        self.shared = shared
        self._pending: set[asyncio.Task[None]] = set()  # token charges on their way to Redis

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    async def admit(self, key: str) -> dict[str, str]:
        """Charge one request; raise 429 if the tenant is over either limit. Returns headers."""
        decision = None
        if self.shared is not None:
            # on failure the breaker logs it, and this process's buckets limit meanwhile
            with contextlib.suppress(LimitsUnavailable):
                decision = await self.shared.admit(key, self.rpm, self.tpm)
        if decision is None:
            decision = self.local.admit(key, self.rpm, self.tpm)
        headers: dict[str, str] = {}
        for kind, limit in (("tokens", self.tpm), ("requests", self.rpm)):
            if limit is not None:
                headers |= _headers(kind, limit, decision.levels[kind])
        if decision.wait > 0:
            headers["Retry-After"] = str(max(1, math.ceil(decision.wait)))
            raise APIError(
                429,
                f"Rate limit reached for this API key; retry in {decision.wait:.1f}s.",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers=headers,
            )
        return headers

    async def reserve(self, key: str, requested: int, model: str, headers: dict[str, str]) -> int:
        """Hold ``requested`` tokens (a request's prompt, plus max_tokens for every choice) of the
        key's tpm until ``charge_tokens`` settles them; returns the tokens held. Updates ``headers``'
        token levels; raises 429 if the bucket holds fewer (the request ``admit`` charged is given
        back, as admit charges none it refuses)."""
        if self.tpm is None or requested <= 0:
            return 0
        self.refuse_too_large(requested, model, headers)
        decision = None
        if self.shared is not None:
            with contextlib.suppress(LimitsUnavailable):
                decision = await self.shared.reserve(key, self.tpm, requested)
        if decision is None:
            decision = self.local.reserve(key, self.tpm, requested)
        headers |= _headers("tokens", self.tpm, decision.levels["tokens"])
        if decision.wait > 0:
            await self.refund(key)
            raise APIError(
                429,
                f"Rate limit reached for {model} on tokens per min (TPM): Limit {self.tpm}, Requested "
                f"{requested}; retry in {decision.wait:.1f}s.",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers=headers | {"Retry-After": str(max(1, math.ceil(decision.wait)))},
            )
        return requested

    def refuse_too_large(self, requested: int, model: str, headers: dict[str, str]) -> None:
        """Refuse a request whose own tokens (its prompt's, plus max_tokens for every choice) are more
        than the key's whole tpm, as OpenAI refuses one: no bucket ever holds that many, so waiting
        never helps. It was admitted, and its usage left the key in debt for minutes. A 429 in
        OpenAI's words for it, without Retry-After and with ``x-should-retry: false``, the header
        the OpenAI SDKs obey before their retry of every other 429."""
        if self.tpm is None or requested <= self.tpm:
            return
        raise APIError(
            429,
            f"Request too large for {model} on tokens per min (TPM): Limit {self.tpm}, Requested "
            f"{requested}. The input or output tokens must be reduced in order to run successfully.",
            "rate_limit_error",
            code="rate_limit_exceeded",
            headers={k: v for k, v in headers.items() if k.startswith("x-ratelimit-")}
            | {"x-should-retry": "false"},
        )

    async def refund(self, key: str) -> None:
        """Give back the request ``admit`` charged, for one the gateway failed to serve (overloaded,
        stopping, no backend up: a 5xx): a client retrying after Retry-After should not then meet a
        429 for requests that were never served. Client errors (4xx) keep their charge."""
        if self.rpm is None:
            return
        if self.shared is not None:
            with contextlib.suppress(LimitsUnavailable):
                await self.shared.refund(key, self.rpm)
                return
        self.local.refund(key, self.rpm)

    def charge_tokens(self, key: str, tokens: int) -> None:
        """A finished response's tokens, less those ``reserve`` held for it (a negative count gives
        back what it did not use). Called from the response's last callback, so the Redis write runs
        as its own task (kept here until done)."""
        if self.tpm is None or tokens == 0:
            return
        if self.shared is None:
            self.local.charge(key, self.tpm, tokens)
            return
        task = asyncio.ensure_future(self._charge_shared(key, self.tpm, tokens))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _charge_shared(self, key: str, tpm: int, tokens: int) -> None:
        assert self.shared is not None
        try:
            await self.shared.charge(key, tpm, tokens)
        except LimitsUnavailable:
            self.local.charge(key, tpm, tokens)

    async def settled(self) -> None:
        """Wait for the token charges on their way to Redis."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def aclose(self) -> None:
        await self.settled()
        if self.shared is not None:
            await self.shared.aclose()


def _headers(kind: str, limit: int, level: float) -> dict[str, str]:
    remaining = max(0, math.floor(level))
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(remaining),
        f"x-ratelimit-reset-{kind}": f"{max(0.0, limit - level) * 60.0 / limit:.1f}s",
    }
