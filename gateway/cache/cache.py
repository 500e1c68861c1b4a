"""``ResponseCache``: the exact tier, then the semantic tier, over a Redis or in-process store.

It never raises into the request path: any store or embedder failure is logged, counted, and
answered as a miss (lookup) or a skipped write (store).

Observed through ``metrics`` (``gateway.observability.Metrics``) and ``tracer``, both optional. Each
tier a lookup consults is counted once, so ``tier="exact"`` counts every lookup and a paraphrase hit
counts as ``exact/miss`` plus ``semantic/hit``; the semantic tier is not counted when it does not
apply (long or tool prompt, embedder not loaded). A skipped lookup is ``exact/skip``; a failure
(Redis down, circuit open) is ``<tier being consulted>/error``. One ``specgate.cache.lookup`` span per
lookup says tier, outcome and similarity, never the prompt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from decoding.embedder import Embedder, SentenceEmbedder
from gateway.cache import guard
from gateway.cache.lsh import HyperplaneLSH, pack, unpack
from gateway.cache.query import CacheQuery, Endpoint, build_query, cacheable, deterministic, parse_controls
from gateway.cache.response import CachedResponse, CacheHit
from gateway.cache.settings import CacheSettings
from gateway.cache.store import CacheStore, MemoryStore, SemanticPart
from router.breaker import CircuitBreaker

log = logging.getLogger("specgate.cache")
EMBED_DIM = 384  # all-MiniLM-L6-v2


class CacheMetrics(Protocol):
    """What the cache reports (``gateway.observability.Metrics`` implements it)."""

    def observe_cache(self, tier: str, outcome: str, seconds: float | None = None) -> None: ...

    def observe_redis_error(self, op: str) -> None: ...

    def set_circuit_state(self, component: str, state: str) -> None: ...


class ResponseCache:
    def __init__(
        self,
        settings: CacheSettings,
        store: CacheStore | None = None,
        embedder: Embedder | None = None,
        metrics: CacheMetrics | None = None,
        tracer: trace.Tracer | None = None,
    ):
        self.settings = settings
        self.metrics = metrics
        self.tracer = tracer or trace.NoOpTracer()
        self.breaker = CircuitBreaker(
            settings.breaker_failures, settings.breaker_cooldown_s, name="cache: Redis"
        )
        if store is None:
            store = self._default_store(settings)
        self.entries = store
        if metrics is not None and self.kind == "redis":
            self.breaker.on_change = lambda state: metrics.set_circuit_state("redis", state)
            metrics.set_circuit_state("redis", self.breaker.state)
        self.embedder: Embedder | None = embedder
        if embedder is None and settings.semantic:
            self.embedder = SentenceEmbedder(settings.embedder_model, settings.embedder_threads)
        self.lsh = HyperplaneLSH(EMBED_DIM, settings.lsh_bands, settings.lsh_bits, settings.lsh_seed)
        self.stats: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[bool]] = set()

    def _default_store(self, s: CacheSettings) -> CacheStore:
        if s.redis_url is None:
            return MemoryStore(s.lru_size)
        from gateway.cache.redis_store import RedisStore

        on_error = self.metrics.observe_redis_error if self.metrics is not None else None
        return RedisStore(
            s.redis_url,
            s.key_prefix,
            s.timeout_ms / 1000,
            s.connect_timeout_ms / 1000,
            self.breaker,
            on_error,
        )

    @property
    def kind(self) -> str:
        return "redis" if self.settings.redis_url else "memory"

    async def start(self) -> None:
        """Begin loading the embedder in the background; the gateway serves (exact-only) meanwhile."""
        if self.settings.enabled and isinstance(self.embedder, SentenceEmbedder):
            self.embedder.start()

    async def close(self) -> None:
        await self.drain()
        await self.entries.close()
        if isinstance(self.embedder, SentenceEmbedder):
            self.embedder.close()

    # ---- building queries -----------------------------------------------------------------------

    def query(
        self,
        body: Mapping[str, Any],
        *,
        tenant: str,
        endpoint: Endpoint,
        headers: Mapping[str, str] | None = None,
        prompt_tokens: int | None = None,
        default_temperature: float = 1.0,
    ) -> CacheQuery | None:
        """The request as a ``CacheQuery``, or None when the cache must not touch it (disabled,
        logprobs asked for, or unseeded sampling unless ``cache_sampled``). Raises ``CacheControlError`` for a malformed ``cache`` body field."""
        controls = parse_controls(headers or {}, body, self.settings.max_ttl_s)
        if not self.settings.enabled or not cacheable(body):
            return None
        if not self.settings.cache_sampled and not deterministic(body, default_temperature):
            return None
        return build_query(
            body,
            tenant=tenant,
            endpoint=endpoint,
            controls=controls,
            default_temperature=default_temperature,
            semantic_max_temperature=self.settings.semantic_max_temperature,
            semantic_max_chars=self.settings.semantic_max_chars,
            embedder_id=self.embedder.id if self.embedder is not None else "",
            prompt_tokens=prompt_tokens,
        )

    # ---- lookup ---------------------------------------------------------------------------------

    async def lookup(self, q: CacheQuery | None) -> CacheHit | None:
        """``q=None``: the gateway leaves this request out of the cache (counted as skipped)."""
        with self.tracer.start_as_current_span("specgate.cache.lookup") as span:
            if q is None or not self.settings.enabled or q.controls.no_cache:
                self._observe(span, "exact", "skip")
                return None
            tier, t0 = "exact", time.perf_counter()
            try:
                hit = await self._exact(q)
                if hit is None:
                    self._observe(span, tier, "miss", t0)
                    tier, t0 = "semantic", time.perf_counter()
                    vec = await self._embed(q)
                    if vec is None:  # the semantic tier does not apply: the exact miss stands
                        self.stats["misses"] += 1
                        return None
                    hit = await self._semantic(q, vec)
            except Exception as exc:  # fail open: the request is served uncached
                self.stats["errors"] += 1
                log.debug("cache lookup failed open: %s", exc)
                self._observe(span, tier, "error", t0)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
                hit = None
            else:
                self._observe(span, tier, "hit" if hit else "miss", t0)
                if hit is not None:
                    span.set_attribute("specgate.cache.similarity", round(hit.similarity, 4))
            self.stats[hit.tier if hit else "misses"] += 1
            return hit

    def _observe(self, span: Span, tier: str, outcome: str, t0: float | None = None) -> None:
        """One tier's outcome; the span keeps the last (the tier that answered or failed)."""
        if self.metrics is not None:
            seconds = None if t0 is None else time.perf_counter() - t0
            self.metrics.observe_cache(tier, outcome, seconds)
        span.set_attributes({"specgate.cache.tier": tier, "specgate.cache.outcome": outcome})

    async def _exact(self, q: CacheQuery) -> CacheHit | None:
        blob = await self.entries.get(q.tenant_tag, q.exact_key)
        return CacheHit("exact", 1.0, CachedResponse.from_bytes(blob)) if blob is not None else None

    async def _semantic(self, q: CacheQuery, vec: np.ndarray) -> CacheHit | None:
        want = guard.key_terms(q.semantic_text or "").hashed(q.tenant)
        cands = await self.entries.candidates(
            q.tenant_tag, self._scope(q), self.lsh.signatures(vec), self.settings.lsh_bucket_limit
        )
        scored = sorted(((float(unpack(c.vector) @ vec), c) for c in cands), key=lambda t: -t[0])
        for sim, cand in scored:
            if sim < self.settings.semantic_threshold:
                break
            if not guard.compatible(want, guard.KeyTerms.from_json(json.loads(cand.key_terms))):
                self.stats["guard_refused"] += 1
                continue
            blob = await self.entries.get(q.tenant_tag, cand.key)
            if blob is not None:
                response = CachedResponse.from_bytes(blob)
                if cand.key == q.exact_key:  # its own entry, stored by a twin since the exact tier missed
                    return CacheHit("exact", 1.0, response)
                return CacheHit("semantic", min(sim, 1.0), response)
        return None

    async def _embed(self, q: CacheQuery) -> np.ndarray | None:
        if (
            q.embedding is None
            and q.semantic_text is not None
            and self.embedder is not None
            and self.settings.semantic
        ):
            # a queued embedding cancelled here never runs (one already running finishes unread)
            q.embedding = await asyncio.wait_for(
                self.embedder.embed(q.semantic_text), self.settings.embed_timeout_ms / 1000
            )
        return q.embedding

    def _scope(self, q: CacheQuery) -> str:
        # GUARD_VERSION: entries whose key terms were stored in another form (plain words before
        # 2026-12-04) are never candidates, rather than compared term for term with digests
        return f"{q.scope_key}:{self.lsh.fingerprint}:{guard.GUARD_VERSION}"

    # ---- store ----------------------------------------------------------------------------------

    async def store(self, q: CacheQuery, response: CachedResponse, ttl_s: int | None = None) -> bool:
        """Store a complete, successful generation. True when written; never raises."""
        if not self.settings.enabled or q.controls.no_store or not response.storable:
            return False
        try:
            blob = response.to_bytes()
            if len(blob) > self.settings.max_response_bytes:
                self.stats["store_too_large"] += 1
                return False
            ttl = min(q.controls.ttl_s or ttl_s or self.settings.ttl_s, self.settings.max_ttl_s)
            semantic = None
            try:
                vec = await self._embed(q)
            except Exception as exc:  # no embedding: the answer is still stored for the exact tier
                log.debug("cache store without its embedding: %s", exc)
                vec = None
            if vec is not None:
                terms = guard.key_terms(q.semantic_text or "").hashed(q.tenant)  # digests, never the text
                feats = json.dumps(terms.to_json(), separators=(",", ":"))
                semantic = SemanticPart(self._scope(q), self.lsh.signatures(vec), pack(vec), feats.encode())
            await self.entries.put(
                q.tenant_tag, q.exact_key, blob, ttl, self.settings.max_entries_per_tenant, semantic
            )
        except Exception as exc:  # fail open: the answer was already served
            self.stats["store_errors"] += 1
            log.debug("cache store skipped: %s", exc)
            return False
        self.stats["stores"] += 1
        return True

    def store_later(self, q: CacheQuery, response: CachedResponse, ttl_s: int | None = None) -> None:
        """``store`` in a background task, so the response is not held up by embedding or Redis."""
        task = asyncio.get_running_loop().create_task(self.store(q, response, ttl_s))
        self._tasks.add(task)  # keep a reference: the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for background stores (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def response_from_texts(
    texts: list[str], finish_reasons: list[str], prompt_tokens: int, completion_tokens: int
) -> CachedResponse:
    """Convenience for the gateway: one ``CachedResponse`` from per-choice texts and finish reasons."""
    from gateway.cache.response import CachedChoice

    choices = tuple(CachedChoice(i, t, f) for i, (t, f) in enumerate(zip(texts, finish_reasons, strict=True)))
    return CachedResponse(choices, prompt_tokens, completion_tokens, int(time.time()))
