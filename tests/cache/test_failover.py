"""Fail open against real redis-servers: stopped, restarted, and one that never answers; the breaker;
the key layout (one hash tag per tenant, compact entries, no prompt text)."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import redis.asyncio as aioredis

from decoding.embedder import SentenceEmbedder
from gateway.cache import CacheSettings, ResponseCache
from tests.cache.test_cache import chat, get, put
from tests.servers import RedisProcess


def redis_cache(url: str, embedder: SentenceEmbedder, **overrides: object) -> ResponseCache:
    settings = CacheSettings(redis_url=url, key_prefix=f"t-{uuid.uuid4().hex[:8]}", **overrides)  # type: ignore[arg-type]
    return ResponseCache(settings, embedder=embedder)


async def timed(coro: object) -> tuple[object, float]:
    t0 = time.perf_counter()
    result = await coro  # type: ignore[misc]
    return result, time.perf_counter() - t0


async def test_redis_stopped_then_restarted(own_redis: RedisProcess, embedder: SentenceEmbedder) -> None:
    cache = redis_cache(own_redis.url, embedder, breaker_failures=3, breaker_cooldown_s=0.3)
    await put(cache, chat("before"), "x")
    assert await get(cache, chat("before")) == "exact:x"

    own_redis.stop()
    for _ in range(3):  # each fails fast (connection refused / 50 ms timeout) and counts as a miss
        hit, took = await timed(get(cache, chat("before")))
        assert hit is None and took < 0.5
    assert not await put(cache, chat("during"), "y"), "a write to a dead Redis is skipped"
    assert cache.breaker.state == "open"
    hit, took = await timed(get(cache, chat("before")))
    assert hit is None and took < 0.02, "an open circuit answers without touching the network"
    assert cache.stats["errors"] >= 4

    own_redis.start()  # same port, empty (no persistence)
    await asyncio.sleep(0.35)  # past the cooldown: the next call is the probe
    assert await get(cache, chat("before")) is None
    assert cache.breaker.state == "closed"
    assert await put(cache, chat("after"), "z")
    assert await get(cache, chat("after")) == "exact:z", "caching resumes on its own"
    await cache.entries.close()


async def test_redis_that_never_answers_times_out(embedder: SentenceEmbedder) -> None:
    """A server that accepts connections and then says nothing (a hung or overloaded Redis)."""
    held: list[asyncio.StreamWriter] = []

    async def hang(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cache = redis_cache(f"redis://127.0.0.1:{port}/0", embedder, timeout_ms=50, breaker_failures=2)
    hit, took = await timed(get(cache, chat("anything")))
    assert hit is None and took < 0.3, f"lookup took {took:.3f}s against a 50 ms budget"
    stored, took = await timed(put(cache, chat("anything"), "x"))
    assert stored is False and took < 0.3
    assert cache.breaker.state == "open"
    await cache.entries.close()
    for w in held:
        w.close()
    server.close()
    await server.wait_closed()


async def test_nothing_listening(embedder: SentenceEmbedder) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connection refused
    cache = redis_cache(f"redis://127.0.0.1:{port}/0", embedder)
    assert await get(cache, chat("q")) is None
    assert not await put(cache, chat("q"), "x")
    await cache.entries.close()


async def test_key_layout_and_entry_size(redis_server: RedisProcess, embedder: SentenceEmbedder) -> None:
    cache = redis_cache(redis_server.url, embedder)
    long_system = "You are a careful assistant. " * 200
    for i in range(3):
        await put(
            cache,
            chat(f"How do I reverse a list number {i} in Python?", system=long_system),
            "use reversed()",
        )
    await put(cache, chat("What is a mutex?"), "a lock", tenant="globex")
    client = aioredis.Redis.from_url(redis_server.url)
    keys = [k.decode() async for k in client.scan_iter(f"{cache.settings.key_prefix}:*")]
    tags = {k.split(":")[1] for k in keys}
    assert len(tags) == 2 and all(t.startswith("{") and t.endswith("}") for t in tags), keys
    entries = [k for k in keys if ":e:" in k]
    assert len(entries) == 4
    for k in entries:
        fields = await client.hgetall(k)
        assert len(fields[b"v"]) == 384 * 2, "float16 embedding"
        assert b"careful assistant" not in b"".join(fields.values()), "no copy of the prompt"
        assert 0 < await client.ttl(k) <= cache.settings.ttl_s
    await client.delete(*keys)
    await client.aclose()
    await cache.entries.close()


async def test_entries_hold_no_words_of_the_prompt(
    redis_server: RedisProcess, embedder: SentenceEmbedder
) -> None:
    """The guard's key terms are what an entry keeps of the question: as digests, since they are the
    very words that matter (names, numbers, quoted strings), and they were stored as typed."""
    cache = redis_cache(redis_server.url, embedder)
    question = 'Why was card 4111 1111 1111 1234 of Alice Smith declined with "hunter2 secret"?'
    await put(cache, chat(question), "no idea")
    assert await get(cache, chat(question.replace("Why was", "Why has"))) is not None, "still matches"
    client = aioredis.Redis.from_url(redis_server.url)
    keys = [k async for k in client.scan_iter(f"{cache.settings.key_prefix}:*")]
    try:
        stored = b"".join(keys)
        for k in keys:
            if b":e:" in k:
                stored += b"".join((await client.hgetall(k)).values())
        for secret in (b"4111", b"1234", b"alice", b"smith", b"hunter2", b"declined", b"card"):
            assert secret not in stored.lower(), secret
    finally:
        await client.delete(*keys)
        await client.aclose()
        await cache.entries.close()


async def test_lookup_reads_bounded_candidates(
    redis_server: RedisProcess, embedder: SentenceEmbedder
) -> None:
    cache = redis_cache(redis_server.url, embedder, lsh_bucket_limit=8)
    topics = ["sorting", "hashing", "threads", "sockets", "regex", "recursion", "closures", "generators"]
    for t in topics:
        for form in (f"Explain {t} in Python.", f"Explain {t} in Go.", f"What are {t} used for?"):
            await put(cache, chat(form), f"about {t}")
    q = cache.query(chat("Please explain regex in Python."), tenant="acme", endpoint="chat")
    assert q is not None
    hit = await cache.lookup(q)
    assert hit is not None and hit.response.choices[0].text == "about regex"
    assert q.embedding is not None
    cands = await cache.entries.candidates(
        q.tenant_tag, cache._scope(q), cache.lsh.signatures(q.embedding), 8
    )
    assert len(cands) <= 16
    client = aioredis.Redis.from_url(redis_server.url)
    keys = [k async for k in client.scan_iter(f"{cache.settings.key_prefix}:*")]
    await client.delete(*keys)
    await client.aclose()
    await cache.entries.close()


class StuckEmbedder:
    """An embedder whose model never answers (a wedged torch thread, a starved CPU)."""

    id = "fake:stuck"
    ready = True

    def __init__(self) -> None:
        self.never = asyncio.Event()

    async def embed(self, text: str) -> None:
        await self.never.wait()


async def test_a_stuck_embedder_is_a_miss_not_a_hang(redis_server: RedisProcess) -> None:
    """The semantic tier fails open as Redis does: an embedding slower than ``embed_timeout_ms`` is a
    semantic miss, the answer is still stored for the exact tier, and nothing waits on the embedder."""
    settings = CacheSettings(
        redis_url=redis_server.url,
        key_prefix=f"t-{uuid.uuid4().hex[:8]}",
        embed_timeout_ms=50,
        timeout_ms=2000,
    )
    cache = ResponseCache(settings, embedder=StuckEmbedder())
    try:
        # wait_for only guards the test run against the hang itself; nothing here is timed
        assert await asyncio.wait_for(get(cache, chat("What is a mutex?")), 30) is None
        assert cache.stats["errors"] == 1, "counted as the semantic tier's failure"
        assert await asyncio.wait_for(put(cache, chat("What is a mutex?"), "a lock"), 30), (
            "stored all the same"
        )
        assert await asyncio.wait_for(get(cache, chat("What is a mutex?")), 30) == "exact:a lock"
    finally:
        client = aioredis.Redis.from_url(redis_server.url)
        keys = [k async for k in client.scan_iter(f"{settings.key_prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await cache.entries.close()
