"""Rate limits shared through a real Redis: two gateways (two apps, each with its own limiter and
Redis client, as two replicas would have) enforce one limit; a dead Redis falls back to each
process's own buckets instead of failing or going unlimited."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.settings import SettingsError, load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.servers import UNHURRIED_REDIS, RedisProcess, free_port

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture
def redis_url(redis_server: RedisProcess) -> str:
    return redis_server.url


def gateway(url: str, prefix: str, engine: ScriptedEngine | None = None, **limits: Any) -> Any:
    """An app with these limits, its buckets in the Redis at ``url`` under ``prefix`` where shared."""
    s = load_settings(
        overrides={
            "limits": limits,
            "cache": {"enabled": False, "redis_url": url, "key_prefix": prefix, **UNHURRIED_REDIS},
        },
        env={},
    )
    return create_app(s, engine=engine or ScriptedEngine([token_ids("a" * 40)]))  # type: ignore[arg-type]


async def post(app: Any, path: str = "/v1/chat/completions") -> httpx.Response:
    body = {"model": "fake", "messages": MSGS} if "chat" in path else {"model": "fake", "prompt": "x"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return await c.post(path, json=body)


async def test_two_gateways_share_one_request_limit(redis_url: str) -> None:
    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"
    a, b = gateway(redis_url, prefix, rpm=3), gateway(redis_url, prefix, rpm=3)
    try:
        statuses = [(await post(app)).status_code for app in (a, b, a, b)]
        assert statuses == [200, 200, 200, 429]  # per process it would be 4 x 200
        r = await post(a)
        assert r.status_code == 429 and r.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(r.headers["retry-after"]) >= 1
        keys = redis.Redis.from_url(redis_url).keys(f"{prefix}:rl:*")
        assert keys and all(redis.Redis.from_url(redis_url).ttl(k) > 0 for k in keys)  # idle buckets expire
    finally:
        for app in (a, b):
            await app.state.gateway.limiter.aclose()


async def test_an_overloaded_503_gives_the_shared_request_back(redis_url: str) -> None:
    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"
    full = gateway(redis_url, prefix, ScriptedEngine([token_ids("a")], overloaded=3), rpm=1)
    a = gateway(redis_url, prefix, rpm=1)
    try:
        for _ in range(3):
            assert (await post(full)).status_code == 503
        level = redis.Redis.from_url(redis_url).hget(f"{prefix}:rl:{{anonymous}}:requests", "level")
        assert level is None or float(level) >= 1  # every charge given back
        assert (await post(a)).status_code == 200  # the other replica still has the minute's request
        assert (await post(full)).status_code == 429
    finally:
        for app in (full, a):
            await app.state.gateway.limiter.aclose()


async def test_tokens_spent_on_one_gateway_count_on_the_other(redis_url: str) -> None:
    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"
    a, b = gateway(redis_url, prefix, tpm=30), gateway(redis_url, prefix, tpm=30)
    try:
        assert (await post(a, "/v1/completions")).status_code == 200  # 40 completion tokens: in debt
        await a.state.gateway.limiter.aclose()  # waits for the charge on its way to Redis
        r = await post(b, "/v1/completions")
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        await b.state.gateway.limiter.aclose()


async def test_dead_redis_falls_back_to_local_buckets() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    app = gateway(dead, "test-limits-dead", rpm=2)
    gauge = app.state.metrics.circuit_state  # (the whole registry would also ask the fake engine)

    def circuit() -> float | None:
        samples = [s for m in gauge.collect() for s in m.samples if s.labels == {"component": "rate_limits"}]
        return samples[0].value if samples else None

    try:
        assert circuit() == 0  # closed
        statuses = [(await post(app)).status_code for _ in range(6)]
        assert statuses == [
            200,
            200,
            429,
            429,
            429,
            429,
        ]  # still limited, by this process's bucket, and no 500
        assert circuit() == 2  # five failures in a row opened it: Redis is skipped, and it shows
    finally:
        await app.state.gateway.limiter.aclose()


def test_shared_limits_need_a_redis() -> None:
    with pytest.raises(SettingsError, match=r"limits\.shared needs a Redis"):
        load_settings(overrides={"limits": {"rpm": 5, "shared": True}}, env={})
    s = load_settings(
        overrides={"limits": {"rpm": 5, "shared": False}, "cache": {"redis_url": "redis://x:1/0"}}, env={}
    )
    assert create_app(s, engine=ScriptedEngine([token_ids("a")])).state.gateway.limiter.shared is None  # type: ignore[arg-type]


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_a_request_larger_than_the_whole_tpm_is_refused_at_once(redis_url: str, shared: bool) -> None:
    """Prompt + max_tokens of every choice above the key's tpm could never fit a minute's tokens:
    a 429 in OpenAI's words, before anything generates, that the SDK does not retry (no Retry-After,
    x-should-retry: false), and that costs the key no tokens. It was admitted, and its usage then
    left the key in debt for minutes."""
    import openai

    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"
    engine = ScriptedEngine([token_ids("ab")])
    app = gateway(redis_url, prefix, engine, tpm=30, shared=shared)
    sent: list[httpx.Request] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request)

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), event_hooks={"request": [count]})
    sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=2)
    try:
        r = await http.post(
            "http://test/v1/completions", json={"model": "fake", "prompt": "xyz", "max_tokens": 10, "n": 3}
        )
        error = r.json()["error"]
        assert r.status_code == 429 and error["code"] == "rate_limit_exceeded", r.text
        assert "Limit 30, Requested 33" in error["message"] and error["message"].startswith(
            "Request too large"
        )
        assert "retry-after" not in r.headers and r.headers["x-should-retry"] == "false"
        assert r.headers["x-ratelimit-limit-tokens"] == "30"
        with pytest.raises(openai.RateLimitError, match="Request too large"):
            await sdk.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=100
            )
        assert len(sent) == 2  # the SDK asked once
        assert engine.requests == []
        # nothing was charged: a request that fits is served, holding its 3 of the minute's 30 tokens
        r = await http.post(
            "http://test/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2}
        )
        assert r.status_code == 200 and int(r.headers["x-ratelimit-remaining-tokens"]) >= 27, r.text
    finally:
        await http.aclose()
        await app.state.gateway.limiter.aclose()
        if shared:
            client = redis.Redis.from_url(redis_url)
            for key in client.keys(f"{prefix}:*"):
                client.delete(key)


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
async def test_concurrent_requests_reserve_their_tokens_on_admission(redis_url: str, shared: bool) -> None:
    """Each request holds its prompt + max_tokens of the key's tpm from admission until it is done,
    as OpenAI counts them: tokens were charged only once a response had finished, so any number
    of requests sent at once were all admitted against a full bucket (tpm 100 let five of 41
    tokens each through, and more the more were sent). What a request did not use is given back."""
    prefix = f"test-limits-{uuid.uuid4().hex[:8]}"
    app = gateway(
        redis_url, prefix, ScriptedEngine([token_ids("a"), token_ids("b")], delay=0.3), tpm=100, shared=shared
    )
    body = {"model": "fake", "prompt": "x", "max_tokens": 40}  # 41 tokens requested each
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(5)))
            statuses = sorted(r.status_code for r in rs)
            assert statuses == [200, 200, 429, 429, 429], [r.text for r in rs]
            refused = next(r for r in rs if r.status_code == 429)
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            assert refused.json()["error"]["code"] == "rate_limit_exceeded"
            await app.state.gateway.limiter.settled()  # the settling charges on their way to Redis
            # the two served used 3 tokens each of the 82 they held: the rest came back at once
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert int(r.headers["x-ratelimit-remaining-tokens"]) in range(100 - 6 - 41, 100 - 41 + 1)
    finally:
        await app.state.gateway.limiter.aclose()
        if shared:
            client = redis.Redis.from_url(redis_url)
            for key in client.keys(f"{prefix}:*"):
                client.delete(key)
