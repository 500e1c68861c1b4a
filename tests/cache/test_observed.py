"""The cache's metrics and spans after real requests: per-tier lookup counts and latency, Redis errors
and the Redis circuit state, and one ``specgate.cache.lookup`` span that never holds the prompt."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.cache import CacheSettings, ResponseCache
from gateway.observability import Metrics, Observability
from gateway.settings import load_settings
from tests.cache.test_cache import chat, get, put
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.servers import UNHURRIED_REDIS, RedisProcess

SHARED_REDIS = "redis://127.0.0.1:6379/0"
PROMPT = "How do I reverse a list in Python?"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
LOOKUPS = "specgate_cache_lookups_total"


def observed() -> tuple[Observability, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Observability(tracer_provider=provider, from_env=False), exporter


class GaugedEngine(ScriptedEngine):
    queue_depth = 0  # read by the engine gauges at scrape time
    active = 0


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Any]]:
    """The real app (its own cache wiring) on a scripted engine serving the model "fake"."""
    apps: list[Any] = []

    def make(obs: Observability, **cache: Any) -> Any:
        settings = load_settings(overrides={"cache": {"semantic": False, **cache}}, env={})
        engine = GaugedEngine([token_ids("Use "), token_ids("reversed().")])
        apps.append(create_app(settings, engine=engine, observability=obs))  # type: ignore[arg-type]
        return apps[-1]

    yield make
    for app in apps:
        await app.state.gateway.cache.close()


async def ask(app: Any, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **extra}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    await app.state.gateway.cache.cache.drain()  # the miss's background store
    return r


@pytest.fixture
async def shared_redis_prefix() -> AsyncIterator[str]:
    """A key prefix of our own on the shared redis-server; only our keys are deleted afterwards."""
    client = aioredis.Redis.from_url(SHARED_REDIS, socket_connect_timeout=0.5)
    try:
        await client.ping()
    except (OSError, aioredis.RedisError):
        await client.aclose()
        pytest.skip("no redis-server on 127.0.0.1:6379")
    prefix = f"t-obs-{uuid.uuid4().hex[:8]}"
    yield prefix
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_a_miss_then_an_exact_hit(gateway: Callable[..., Any], shared_redis_prefix: str) -> None:
    obs, exporter = observed()
    app = gateway(obs, redis_url=SHARED_REDIS, key_prefix=shared_redis_prefix, **UNHURRIED_REDIS)
    parent = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}
    first = await ask(app, headers=parent)
    second = await ask(app)
    sampled = await ask(app, temperature=0.7)  # unseeded sampling is never looked up
    assert [r.headers["x-specgate-cache"] for r in (first, second, sampled)] == [
        "miss",
        "exact; similarity=1.0000",
        "miss",
    ]
    m = obs.metrics
    assert m.value(LOOKUPS, tier="exact", outcome="miss") == 1
    assert m.value(LOOKUPS, tier="exact", outcome="hit") == 1
    assert m.value(LOOKUPS, tier="exact", outcome="skip") == 1
    assert m.value(LOOKUPS, tier="exact", outcome="error") == 0
    assert m.value(LOOKUPS, tier="semantic", outcome="miss") == 0, "semantic is off"
    assert m.value("specgate_cache_lookup_duration_seconds_count", tier="exact") == 2, "skips are not timed"
    assert m.value("specgate_circuit_state", component="redis") == 0
    assert m.value("specgate_cache_redis_errors_total", op="get") == 0

    spans = [s for s in exporter.get_finished_spans() if s.name == "specgate.cache.lookup"]
    assert [(s.attributes["specgate.cache.tier"], s.attributes["specgate.cache.outcome"]) for s in spans] == [
        ("exact", "miss"),
        ("exact", "hit"),
        ("exact", "skip"),
    ]
    assert spans[1].attributes["specgate.cache.similarity"] == 1.0
    assert "specgate.cache.similarity" not in spans[0].attributes
    root = next(s for s in exporter.get_finished_spans() if s.name == "POST /v1/chat/completions")
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert spans[0].parent is not None and spans[0].parent.span_id == root.context.span_id
    for s in spans:
        assert not any("reverse" in str(v) for v in s.attributes.values()), "no prompt text in the span"


async def test_redis_circuit_opening_is_visible(gateway: Callable[..., Any], own_redis: RedisProcess) -> None:
    obs, _ = observed()
    app = gateway(obs, redis_url=own_redis.url, breaker_failures=2, breaker_cooldown_s=1.0)
    m = obs.metrics
    assert m.value("specgate_circuit_state", component="redis") == 0, "the gauge exists from the start"
    await ask(app)  # up: a miss, then stored

    own_redis.stop()
    r = await ask(app)  # the lookup fails (1), then its store fails (2): the circuit opens
    assert r.headers["x-specgate-cache"] == "miss", "fails open"
    assert m.value("specgate_cache_redis_errors_total", op="get") == 1
    assert m.value("specgate_cache_redis_errors_total", op="set") == 1
    assert m.value("specgate_circuit_state", component="redis") == 2
    await ask(app)  # refused by the open circuit: a failed lookup, but no Redis command was sent
    assert m.value(LOOKUPS, tier="exact", outcome="error") == 2
    assert m.value("specgate_cache_redis_errors_total", op="get") == 1

    own_redis.start()  # same port, empty
    await asyncio.sleep(1.05)  # past the cooldown: the next lookup is the probe
    await ask(app)
    assert m.value("specgate_circuit_state", component="redis") == 0
    assert m.value(LOOKUPS, tier="exact", outcome="miss") == 2


class OneDirection:
    """Every text embeds to the same unit vector: any two semantic-eligible prompts are neighbours."""

    id = "fake:one-direction"
    ready = True

    async def embed(self, text: str) -> np.ndarray | None:
        v = np.zeros(384, dtype=np.float32)
        v[0] = 1.0
        return v


async def test_each_tier_consulted_is_counted_once() -> None:
    m = Metrics()
    cache = ResponseCache(CacheSettings(), embedder=OneDirection(), metrics=m)  # in-process
    assert await get(cache, chat(PROMPT)) is None  # exact miss, then semantic miss
    assert await put(cache, chat(PROMPT), "use reversed()")
    assert await get(cache, chat(PROMPT)) == "exact:use reversed()"
    assert await get(cache, chat("How can I reverse a list in Python?")) == "semantic:use reversed()"
    assert await get(cache, chat("x" * 2000)) is None  # too long for the semantic tier: exact only
    assert await cache.lookup(None) is None  # the gateway left the request out
    counts = {
        (t, o): m.value(LOOKUPS, tier=t, outcome=o)
        for t in ("exact", "semantic")
        for o in ("hit", "miss", "skip")
    }
    assert counts == {
        ("exact", "hit"): 1,
        ("exact", "miss"): 3,
        ("exact", "skip"): 1,
        ("semantic", "hit"): 1,
        ("semantic", "miss"): 1,
        ("semantic", "skip"): 0,
    }
    assert m.value("specgate_cache_lookup_duration_seconds_count", tier="semantic") == 2
    assert m.registry.get_sample_value("specgate_circuit_state", {"component": "redis"}) is None, "no Redis"
