"""Stored Responses API responses (``store: true``), per tenant: what ``GET``/``DELETE
/v1/responses/{id}`` read and what ``previous_response_id`` continues from.

A record is JSON: ``{"response": <the response object>, "context": [<input items>]}``, where
``context`` is every input item the response answered (a previous response's context and output,
then its own input; never ``instructions``, which OpenAI does not carry over). Flattened so that
continuing a conversation is one read, and an expired ancestor cannot break a chain.

Keys hold the tenant, so one tenant's read of another's id finds nothing: the same 404 as a
missing id. In Redis (``cache.redis_url``, ``cache.key_prefix``) when configured, so replicas share
them; in process otherwise, bounded by ``responses.max_entries``. Both expire after
``responses.ttl_s``. Unlike the response cache this store does not fail open: a record that cannot
be read is a 503, never a silent "not found".
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from typing import Any, Protocol

from redis.exceptions import RedisError

from gateway.cache.redis_store import fail_fast_client
from gateway.errors import unavailable
from gateway.settings import ResponsesSettings


def _tag(tenant: str) -> str:
    """The tenant as keys hold it: a digest (tenant ids come from keys; Redis holds no key of theirs)."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:16]


class ResponseStore(Protocol):
    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None: ...

    async def put(self, tenant: str, response_id: str, record: dict[str, Any]) -> None: ...

    async def delete(self, tenant: str, response_id: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryResponses:
    """In process: an LRU of at most ``max_entries`` records, each dropped after ``ttl_s``."""

    def __init__(self, ttl_s: int, max_entries: int):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._records: collections.OrderedDict[tuple[str, str], tuple[float, str]] = collections.OrderedDict()

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        key = (_tag(tenant), response_id)
        held = self._records.get(key)
        if held is None:
            return None
        expires, blob = held
        if expires <= time.monotonic():
            del self._records[key]
            return None
        self._records.move_to_end(key)
        record: dict[str, Any] = json.loads(blob)  # a copy: callers may change what they read
        return record

    async def put(self, tenant: str, response_id: str, record: dict[str, Any]) -> None:
        key = (_tag(tenant), response_id)
        self._records[key] = (time.monotonic() + self.ttl_s, json.dumps(record, ensure_ascii=False))
        self._records.move_to_end(key)
        while len(self._records) > self.max_entries:
            self._records.popitem(last=False)

    async def delete(self, tenant: str, response_id: str) -> bool:
        found = await self.get(tenant, response_id) is not None  # drops an expired one
        self._records.pop((_tag(tenant), response_id), None)
        return found

    async def close(self) -> None:
        self._records.clear()


class RedisResponses:
    """``<prefix>:responses:{<tenant digest>}:<id>``, a string with its TTL (one cluster slot per tenant)."""

    def __init__(self, url: str, prefix: str, ttl_s: int, timeout_s: float):
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.client = fail_fast_client(url, timeout_s, timeout_s)

    def key(self, tenant: str, response_id: str) -> str:
        return f"{self.prefix}:responses:{{{_tag(tenant)}}}:{response_id}"

    async def _call(self, op: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await op
        except (RedisError, OSError, TimeoutError) as exc:
            # no record could be read or kept: a 503 to retry, never a "not found" that is not so
            raise unavailable(f"The response store is unavailable ({type(exc).__name__}).", 1) from exc

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        blob = await self._call(self.client.get(self.key(tenant, response_id)))
        if blob is None:
            return None
        record: dict[str, Any] = json.loads(blob)
        return record

    async def put(self, tenant: str, response_id: str, record: dict[str, Any]) -> None:
        blob = json.dumps(record, ensure_ascii=False)
        await self._call(self.client.set(self.key(tenant, response_id), blob, ex=self.ttl_s))

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._call(self.client.delete(self.key(tenant, response_id))))

    async def close(self) -> None:
        await self.client.aclose()


def response_store(settings: ResponsesSettings, redis_url: str | None, prefix: str) -> ResponseStore:
    if redis_url is not None:
        return RedisResponses(redis_url, prefix, settings.ttl_s, settings.timeout_ms / 1000)
    return MemoryResponses(settings.ttl_s, settings.max_entries)
