"""Exact and semantic response cache (Redis, or in-process when no Redis is configured).

Using it from the gateway::

    cache = ResponseCache(settings.cache)          # Redis when cache.redis_url / SPECGATE_REDIS_URL is set
    await cache.start()                            # loads the embedder in the background
    q = cache.query(body, tenant=tenant, endpoint="chat", headers=request.headers,
                    prompt_tokens=n)               # None: leave the cache out of this request
    hit = await cache.lookup(q)                    # CacheHit | None; never raises
    response.headers["x-specgate-cache"] = header_value(hit)   # "exact; similarity=1.0000", "miss", ...
    ...                                            # on a miss, generate; when it finished cleanly:
    cache.store_later(q, CachedResponse(...))      # background write; never raises
    await cache.close()

Tiers, in order:
- exact: a hash of tenant, model, endpoint, the normalised messages (system prompt and all turns)
  or prompt, and every body field except those that cannot change the output (``stream``,
  ``stream_options``, ``user``, ``metadata``, ``cache``, and ``speculative``, which is lossless).
- semantic: chat only, when the final user text is short and answered in a new assistant turn, the
  request has no tools, and its temperature is at most ``semantic_max_temperature`` (0 by default);
  a continuation (legacy completions, ``continue_final_message``, ``add_generation_prompt: false``)
  is exact-only, since another text, however close, continues differently. Scope = everything the
  exact key holds except that final text, so tenant, model, system prompt, earlier turns and
  sampling parameters must all match; within the scope, LSH buckets give candidates, exact cosine re-ranks them, and
  ``guard`` refuses matches whose negations, numbers, polarity words or names differ (it keeps
  those key terms as digests keyed by tenant: Redis holds no word of a prompt).

Per-request control: ``Cache-Control: no-cache`` (skip the lookup) and ``no-store`` (skip the write)
request headers, and a ``cache`` body field ``{"no_cache": bool, "no_store": bool, "ttl": seconds}``.
Requests asking for logprobs are never cached (logprobs are not stored), and neither are unseeded
sampled ones (temperature > 0, no seed: each call asks for a fresh sample) unless ``cache_sampled``.

Failure model: the cache fails open. A Redis error or a call slower than ``timeout_ms`` is a miss
or a skipped write; after ``breaker_failures`` in a row the circuit opens and calls are skipped
without touching the network until one probe succeeds ``breaker_cooldown_s`` later. Until the
embedder has loaded (or if it cannot), the cache is exact-only; an embedding slower than
``embed_timeout_ms`` (queued behind others, or a wedged thread) is a semantic miss.

Exceptions: only ``CacheControlError`` (a ValueError, from ``query``) reaches the caller, for a
malformed ``cache`` field: the gateway answers 400 with ``param="cache"``.
"""

from __future__ import annotations

from gateway.cache.cache import ResponseCache, response_from_texts
from gateway.cache.query import CacheControlError, CacheControls, CacheQuery, build_query, parse_controls
from gateway.cache.response import CachedChoice, CachedResponse, CacheHit, header_value
from gateway.cache.settings import CacheSettings

__all__ = [
    "CacheControlError",
    "CacheControls",
    "CacheHit",
    "CacheQuery",
    "CacheSettings",
    "CachedChoice",
    "CachedResponse",
    "ResponseCache",
    "build_query",
    "header_value",
    "parse_controls",
    "response_from_texts",
]
