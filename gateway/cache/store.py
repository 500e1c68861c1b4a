"""Where entries live: the interface both stores implement, and the in-process one.

An entry is the response blob plus, when the request was semantic-eligible, its embedding (float16
bytes) and guard key terms; semantic entries are also listed in one LSH bucket per band, within
their scope. ``ttl_s`` bounds each entry; ``cap`` bounds each tenant's entry count (the entries
closest to expiry go first).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SemanticPart:
    scope: str  # scope key plus the LSH fingerprint
    signatures: list[str]  # one bucket id per band
    vector: bytes  # float16
    key_terms: bytes  # the guard's key terms, JSON


@dataclass(frozen=True)
class Candidate:
    key: str
    vector: bytes
    key_terms: bytes


class CacheStore(Protocol):
    async def get(self, tag: str, key: str) -> bytes | None: ...

    async def candidates(
        self, tag: str, scope: str, signatures: list[str], limit: int
    ) -> list[Candidate]: ...

    async def put(
        self, tag: str, key: str, blob: bytes, ttl_s: int, cap: int, semantic: SemanticPart | None
    ) -> None: ...

    async def close(self) -> None: ...


def rank_by_collisions(hits: list[list[str]], limit: int) -> list[str]:
    """Keys seen in the most bands first (sharing more bands means a smaller angle), at most ``limit``."""
    counts = collections.Counter(k for bucket in hits for k in dict.fromkeys(bucket))
    return [k for k, _ in counts.most_common(limit)]


@dataclass
class _Entry:
    tenant: str
    blob: bytes
    expires: float
    semantic: SemanticPart | None


class MemoryStore:
    """Bounded LRU in this process: the default when no Redis is configured. Same semantics as Redis
    (TTL, per-tenant cap, LSH buckets), minus sharing between processes."""

    def __init__(self, max_entries: int, clock: collections.abc.Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.clock = clock
        self._entries: collections.OrderedDict[tuple[str, str], _Entry] = collections.OrderedDict()
        self._tenants: dict[str, collections.OrderedDict[str, None]] = {}
        self._buckets: dict[tuple[str, str, str], dict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, tag: str, key: str) -> _Entry | None:
        e = self._entries.get((tag, key))
        if e is not None and e.expires <= self.clock():
            self._drop(tag, key)
            return None
        return e

    def _drop(self, tag: str, key: str) -> None:
        e = self._entries.pop((tag, key), None)
        if e is None:
            return
        self._tenants[tag].pop(key, None)
        if not self._tenants[tag]:
            del self._tenants[tag]
        if e.semantic is not None:
            for sig in e.semantic.signatures:
                bucket = self._buckets.get((tag, e.semantic.scope, sig))
                if bucket is not None:
                    bucket.pop(key, None)
                    if not bucket:
                        del self._buckets[(tag, e.semantic.scope, sig)]

    async def get(self, tag: str, key: str) -> bytes | None:
        e = self._live(tag, key)
        if e is None:
            return None
        self._entries.move_to_end((tag, key))  # LRU: a hit keeps the entry
        return e.blob

    async def candidates(self, tag: str, scope: str, signatures: list[str], limit: int) -> list[Candidate]:
        hits = [list(self._buckets.get((tag, scope, sig), {}))[-limit:] for sig in signatures]
        out = []
        for key in rank_by_collisions(hits, limit * 2):
            e = self._live(tag, key)
            if e is not None and e.semantic is not None:
                out.append(Candidate(key, e.semantic.vector, e.semantic.key_terms))
        return out

    async def put(
        self, tag: str, key: str, blob: bytes, ttl_s: int, cap: int, semantic: SemanticPart | None
    ) -> None:
        self._drop(tag, key)
        self._entries[(tag, key)] = _Entry(tag, blob, self.clock() + ttl_s, semantic)
        self._tenants.setdefault(tag, collections.OrderedDict())[key] = None
        if semantic is not None:
            for sig in semantic.signatures:
                self._buckets.setdefault((tag, semantic.scope, sig), {})[key] = None
        tenant = self._tenants[tag]
        while len(tenant) > cap:
            self._drop(tag, next(iter(tenant)))
        while len(self._entries) > self.max_entries:
            (old_tag, old_key), _ = next(iter(self._entries.items()))
            self._drop(old_tag, old_key)

    async def close(self) -> None:
        self._entries.clear()
        self._tenants.clear()
        self._buckets.clear()
