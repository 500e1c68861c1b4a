"""Entries in plain Redis 7 (no vector search module), through redis-py's asyncio client.

Key layout; ``{t}`` is the tenant's hash tag, so a tenant's keys share one Redis Cluster slot and
the multi-key transactions below stay legal on a cluster:

    <prefix>:{t}:e:<exact key>                  hash  r=response blob, v=float16 vector, g=guard key terms
    <prefix>:{t}:idx                            zset  exact key -> expiry (unix s): the per-tenant cap
    <prefix>:{t}:b:<scope>:<band>:<bits>        zset  exact key -> expiry: one LSH bucket

Entries expire by their own TTL. Index and bucket members of expired or evicted entries are
trimmed by score on every write and skipped on read, so nothing ever scans all entries.

Fail open: redis-py's own retries are off (they would multiply the per-operation budget), each
operation runs under ``timeout``, and the breaker turns a dead server into immediate misses. Every
failure surfaces as ``CacheUnavailable``; the cache turns that into a miss or a skipped write. A failed
command (not a refusal by the open circuit) is also reported to ``on_error`` with its operation:
``get``, ``search`` (semantic candidates) or ``set`` (a write, eviction included).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.cache.store import Candidate, SemanticPart, rank_by_collisions
from router.breaker import CircuitBreaker

T = TypeVar("T")


def fail_fast_client(url: str, timeout_s: float, connect_timeout_s: float) -> aioredis.Redis:
    """redis-py's asyncio client for calls that must fail within a budget rather than retry
    (its own retries would multiply the timeout): the cache's and the rate limits'."""
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
    )


class CacheUnavailable(Exception):
    """Redis refused, timed out or the circuit is open; the request goes on uncached."""


class RedisStore:
    def __init__(
        self,
        url: str,
        prefix: str,
        timeout_s: float,
        connect_timeout_s: float,
        breaker: CircuitBreaker,
        on_error: Callable[[str], None] | None = None,
    ):
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.breaker = breaker
        self.on_error = on_error
        self.client = fail_fast_client(url, timeout_s, connect_timeout_s)

    def _k(self, tag: str, *parts: str) -> str:
        return ":".join((self.prefix, "{" + tag + "}", *parts))

    async def _guarded(self, name: str, op: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise CacheUnavailable("circuit open")
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await op()
        except (RedisError, OSError, TimeoutError) as exc:
            if self.on_error is not None:
                self.on_error(name)
            self.breaker.record_failure()
            raise CacheUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self.breaker.record_success()
        return result

    async def get(self, tag: str, key: str) -> bytes | None:
        blob = await self._guarded("get", lambda: self.client.hget(self._k(tag, "e", key), "r"))
        return blob if isinstance(blob, bytes) else None  # decode_responses is off: bytes or None

    async def candidates(self, tag: str, scope: str, signatures: list[str], limit: int) -> list[Candidate]:
        now = time.time()

        async def read() -> list[Candidate]:
            pipe = self.client.pipeline(transaction=False)
            for sig in signatures:  # newest-expiring first, live members only
                pipe.zrange(
                    self._k(tag, "b", scope, sig), "+inf", now, desc=True, byscore=True, offset=0, num=limit
                )
            buckets = await pipe.execute()
            keys = rank_by_collisions([[k.decode() for k in b] for b in buckets], limit * 2)
            if not keys:
                return []
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.hmget(self._k(tag, "e", k), "v", "g")
            rows = await pipe.execute()
            return [
                Candidate(k, v, g)
                for k, (v, g) in zip(keys, rows, strict=True)
                if v is not None and g is not None
            ]

        return await self._guarded("search", read)

    async def put(
        self, tag: str, key: str, blob: bytes, ttl_s: int, cap: int, semantic: SemanticPart | None
    ) -> None:
        now = time.time()
        expires = now + ttl_s
        entry, idx = self._k(tag, "e", key), self._k(tag, "idx")

        async def write() -> None:
            evicted: list[Any]
            pipe = self.client.pipeline(transaction=True)  # one slot (hash tag), so MULTI is cluster-safe
            fields: dict[str, bytes] = {"r": blob}
            if semantic is not None:
                fields |= {"v": semantic.vector, "g": semantic.key_terms}
            pipe.delete(entry)  # a re-store must not keep a stale vector from an earlier write
            pipe.hset(entry, mapping=fields)  # type: ignore[arg-type]
            pipe.expire(entry, ttl_s)
            pipe.zadd(idx, {key: expires})
            pipe.zremrangebyscore(idx, "-inf", now)
            pipe.expire(idx, ttl_s, gt=True)
            pipe.expire(idx, ttl_s, nx=True)
            if semantic is not None:
                for sig in semantic.signatures:
                    bucket = self._k(tag, "b", semantic.scope, sig)
                    pipe.zadd(bucket, {key: expires})
                    pipe.zremrangebyscore(bucket, "-inf", now)
                    pipe.expire(bucket, ttl_s, nx=True)  # a new bucket lives as long as its newest member
                    pipe.expire(bucket, ttl_s, gt=True)
            pipe.zcard(idx)
            size = (await pipe.execute())[-1]
            if size > cap:
                # ZPOPMIN is atomic, so two gateways evicting at once never pick the same entries.
                evicted = list(await self.client.zpopmin(idx, size - cap))
                if evicted:
                    await self.client.delete(*(self._k(tag, "e", k.decode()) for k, _ in evicted))

        await self._guarded("set", write)

    async def close(self) -> None:
        await self.client.aclose()
