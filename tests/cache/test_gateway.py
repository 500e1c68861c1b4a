"""The cache inside the gateway app (scripted engine, in process): hits served as normal responses,
streamed as SSE with usage, the x-specgate-cache header, what gets stored and what never does."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from decoding.embedder import SentenceEmbedder
from gateway.app import create_app
from gateway.cache import CacheSettings, ResponseCache
from gateway.cache.seam import GatewayCache
from gateway.settings import load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.servers import RedisProcess

CHAT = [{"role": "user", "content": "How do I reverse a list in Python?"}]
GREEDY = {"model": "fake", "messages": CHAT, "temperature": 0}


def app_with_cache(engine: ScriptedEngine, embedder: SentenceEmbedder, **cache: Any) -> Any:
    settings = load_settings(env={})
    app = create_app(settings, engine=engine)  # type: ignore[arg-type]
    # the session's embedder, already loaded (the app's own would load in the background)
    app.state.gateway.cache = GatewayCache(ResponseCache(CacheSettings(**cache), embedder=embedder))
    return app


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_data(raw: str) -> list[str]:
    return [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]


async def drained(app: Any) -> None:
    await app.state.gateway.cache.cache.drain()


async def close_and_forget(apps: list[Any], url: str, prefix: str) -> None:
    """Close the gateways' Redis connections and delete the keys they wrote (the prefix is the test's
    own: the server may hold others')."""
    for app in apps:
        await app.state.gateway.cache.cache.entries.close()
    redis = aioredis.Redis.from_url(url)
    keys = [k async for k in redis.scan_iter(f"{prefix}:*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine([token_ids("Use "), token_ids("reversed().")])


async def test_miss_then_exact_hit(engine: ScriptedEngine, embedder: SentenceEmbedder) -> None:
    app = app_with_cache(engine, embedder)
    async with client(app) as c:
        first = await c.post("/v1/chat/completions", json=GREEDY)
        assert first.status_code == 200 and first.headers["x-specgate-cache"] == "miss"
        await drained(app)
        second = await c.post("/v1/chat/completions", json=GREEDY)
    assert second.headers["x-specgate-cache"] == "exact; similarity=1.0000"
    assert len(engine.requests) == 1, "a hit does not generate"
    a, b = first.json(), second.json()
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"] == "Use reversed()."
    assert b["choices"][0]["finish_reason"] == "length"
    assert b["usage"]["prompt_tokens"] == a["usage"]["prompt_tokens"]
    assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"] > 0
    assert b["id"] != a["id"] and b["object"] == "chat.completion"


async def test_streamed_semantic_hit_is_proper_sse(
    engine: ScriptedEngine, embedder: SentenceEmbedder
) -> None:
    app = app_with_cache(engine, embedder)
    async with client(app) as c:
        await c.post("/v1/chat/completions", json=GREEDY)
        await drained(app)
        para = {**GREEDY, "messages": [{"role": "user", "content": "How can I reverse a list in Python?"}]}
        body = {**para, "stream": True, "stream_options": {"include_usage": True}}
        r = await c.post("/v1/chat/completions", json=body)
    assert r.headers["x-specgate-cache"].startswith("semantic; similarity=0.9")
    assert r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len({ch["id"] for ch in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == "Use reversed()."
    finish = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(ch["usage"] is None for ch in chunks[:-1])
    assert len(engine.requests) == 1


async def test_stream_is_stored_and_replayed(engine: ScriptedEngine, embedder: SentenceEmbedder) -> None:
    app = app_with_cache(engine, embedder)
    body = {"model": "fake", "prompt": "def f():", "temperature": 0, "stream": True}
    async with client(app) as c:
        first = await c.post("/v1/completions", json=body)
        await drained(app)
        second = await c.post("/v1/completions", json=body)
        plain = await c.post("/v1/completions", json={**body, "stream": False})
    assert first.headers["x-specgate-cache"] == "miss"
    assert second.headers["x-specgate-cache"].startswith("exact")
    texts = [json.loads(d)["choices"][0]["text"] for d in sse_data(second.text)[:-1]]
    assert "".join(texts) == "Use reversed()." and plain.json()["choices"][0]["text"] == "Use reversed()."
    assert len(engine.requests) == 1


async def test_failed_generation_is_not_stored(embedder: SentenceEmbedder) -> None:
    engine = ScriptedEngine([token_ids("partial")], fail="boom")
    app = app_with_cache(engine, embedder)
    async with client(app) as c:
        for stream in (False, True, False):
            r = await c.post("/v1/chat/completions", json={**GREEDY, "stream": stream})
            await drained(app)
            assert r.headers.get("x-specgate-cache") in ("miss", None)
    assert len(engine.requests) == 3


async def test_aborted_stream_leaves_no_entry(embedder: SentenceEmbedder) -> None:
    engine = ScriptedEngine([token_ids("tok ")] * 50, delay=0.02)
    app = app_with_cache(engine, embedder)
    raw = json.dumps({**GREEDY, "stream": True}).encode()
    gone, first_body = asyncio.Event(), asyncio.Event()
    read = False

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and b"tok" in message.get("body", b""):
            first_body.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
        "root_path": "", "query_string": b"", "client": ("test", 1), "server": ("test", 80),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    }  # fmt: skip
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(first_body.wait(), 10)
    gone.set()  # the client hangs up mid-stream
    await asyncio.wait_for(task, 10)
    await drained(app)
    cache: ResponseCache = app.state.gateway.cache.cache
    assert cache.stats["stores"] == 0
    async with client(app) as c:
        r = await c.post("/v1/chat/completions", json=GREEDY)
    assert r.headers["x-specgate-cache"] == "miss"


async def test_controls_and_bad_cache_field(engine: ScriptedEngine, embedder: SentenceEmbedder) -> None:
    app = app_with_cache(engine, embedder)
    async with client(app) as c:
        r = await c.post("/v1/chat/completions", json={**GREEDY, "cache": {"no_store": True}})
        await drained(app)
        assert r.headers["x-specgate-cache"] == "miss"
        r = await c.post("/v1/chat/completions", json=GREEDY)
        await drained(app)
        assert r.headers["x-specgate-cache"] == "miss", "no_store kept it out"
        r = await c.post("/v1/chat/completions", json=GREEDY, headers={"Cache-Control": "no-cache"})
        assert r.headers["x-specgate-cache"] == "miss"
        r = await c.post("/v1/chat/completions", json={**GREEDY, "cache": {"ttl": -1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache"
        r = await c.post("/v1/chat/completions", json={**GREEDY, "logprobs": True})
        assert r.status_code == 200 and "x-specgate-cache" in r.headers
    assert len(engine.requests) == 4


async def test_echo_with_logprobs_is_never_answered_from_the_cache(
    engine: ScriptedEngine, embedder: SentenceEmbedder
) -> None:
    """A cached answer holds no logprobs, least of all the prompt's: a completion that asks for them
    with echo is neither looked up (the plain answer stored for the same prompt would lack them) nor
    stored."""
    app = app_with_cache(engine, embedder)
    body = {"model": "fake", "prompt": "How do I reverse a list?", "temperature": 0, "max_tokens": 4}
    async with client(app) as c:
        await c.post("/v1/completions", json=body)
        await drained(app)
        assert (await c.post("/v1/completions", json=body)).headers["x-specgate-cache"].startswith("exact")
        for stream in (False, True, False):
            r = await c.post("/v1/completions", json={**body, "echo": True, "logprobs": 1, "stream": stream})
            await drained(app)
            assert r.status_code == 200 and r.headers["x-specgate-cache"] == "miss"
            first = json.loads(sse_data(r.text)[0]) if stream else r.json()
            lp = first["choices"][0]["logprobs"]
            assert lp["tokens"][: len(body["prompt"])] == list(body["prompt"])
            assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1] == -1.0
    assert len(engine.requests) == 4, "the plain answer once, and each echo with logprobs"


async def test_gateway_serves_through_a_dead_redis(
    own_redis: RedisProcess, embedder: SentenceEmbedder
) -> None:
    engine = ScriptedEngine([token_ids("ok")])
    app = app_with_cache(engine, embedder, redis_url=own_redis.url, breaker_cooldown_s=0.2)
    async with client(app) as c:
        await c.post("/v1/chat/completions", json=GREEDY)
        await drained(app)
        assert (
            (await c.post("/v1/chat/completions", json=GREEDY))
            .headers["x-specgate-cache"]
            .startswith("exact")
        )
        own_redis.stop()
        for _ in range(8):
            r = await c.post("/v1/chat/completions", json=GREEDY)
            assert r.status_code == 200 and r.headers["x-specgate-cache"] == "miss"
            assert r.json()["choices"][0]["message"]["content"] == "ok"
        await drained(app)
        own_redis.start()
        await asyncio.sleep(0.25)
        await c.post("/v1/chat/completions", json=GREEDY)  # the probe: a miss on the empty server, stored
        await drained(app)
        assert (
            (await c.post("/v1/chat/completions", json=GREEDY))
            .headers["x-specgate-cache"]
            .startswith("exact")
        )
    await app.state.gateway.cache.cache.entries.close()


async def test_semantic_hit_reports_its_own_prompt_tokens(
    engine: ScriptedEngine, embedder: SentenceEmbedder
) -> None:
    """A paraphrase's prompt is not the stored question's: usage (and the tokens the rate limit
    charges) counts the prompt that was sent, as a fresh generation of it would, streamed or not."""
    app = create_app(load_settings(env={}), engine=engine)  # type: ignore[arg-type]
    app.state.gateway.cache.cache.embedder = embedder  # the session's, already loaded
    para = "Could you tell me how I can reverse a list in Python?"
    fresh_body = {**GREEDY, "messages": [{"role": "user", "content": para}]}
    async with client(app) as c:
        stored = await c.post("/v1/chat/completions", json=GREEDY)
        await drained(app)
        fresh = await c.post(
            "/v1/chat/completions", json=fresh_body, headers={"Cache-Control": "no-cache, no-store"}
        )
        hit = await c.post("/v1/chat/completions", json=fresh_body)
        streamed = await c.post(
            "/v1/chat/completions",
            json={**fresh_body, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert hit.headers["x-specgate-cache"].startswith("semantic")
    want = fresh.json()["usage"]["prompt_tokens"]
    assert want != stored.json()["usage"]["prompt_tokens"], "the two prompts differ in length"
    assert hit.json()["usage"]["prompt_tokens"] == want
    assert hit.json()["usage"]["total_tokens"] == want + hit.json()["usage"]["completion_tokens"]
    assert json.loads(sse_data(streamed.text)[-2])["usage"]["prompt_tokens"] == want


async def test_completion_prefixes_never_hit_by_similarity(embedder: SentenceEmbedder) -> None:
    """Through the app: a completion of a prompt one character away from a stored one is generated,
    not replayed ("x = [10, 20" continued with ", 30]" would make "x = [10, 20,, 30]")."""
    engine = ScriptedEngine([token_ids(", 30]")])
    app = app_with_cache(engine, embedder)
    body = {"model": "fake", "prompt": "x = [10, 20", "temperature": 0, "max_tokens": 5}
    async with client(app) as c:
        await c.post("/v1/completions", json=body)
        await drained(app)
        for near in ("x = [10, 20,", "x = [10, 20, ", "x = [10, 20\n"):
            r = await c.post("/v1/completions", json={**body, "prompt": near})
            assert r.headers["x-specgate-cache"] == "miss", near
        assert (await c.post("/v1/completions", json=body)).headers["x-specgate-cache"].startswith("exact")
    assert len(engine.requests) == 4


async def test_an_answer_cut_at_another_default_limit_is_not_replayed(
    redis_server: RedisProcess, embedder: SentenceEmbedder
) -> None:
    """A chat request without max_tokens is bounded by the gateway's default (limits.default_max_tokens,
    else max_max_tokens): two gateways on one Redis with different defaults (a rolling deploy of a new
    default, 512 until 2026-12-04) must not serve each other's answers, or the one cut short at 4 tokens
    comes back, finish_reason "length", to a request the other would answer whole."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    apps, engines = [], []
    for default in ("4", ""):
        env = {
            "SPECGATE_LIMITS__DEFAULT_MAX_TOKENS": default,
            "SPECGATE_CACHE__REDIS_URL": redis_server.url,
            "SPECGATE_CACHE__KEY_PREFIX": prefix,
            "SPECGATE_CACHE__TIMEOUT_MS": "2000",
        }
        engines.append(ScriptedEngine([token_ids("Use "), token_ids("reversed().")]))
        apps.append(create_app(load_settings(env={k: v for k, v in env.items() if v}), engine=engines[-1]))  # type: ignore[arg-type]
        apps[-1].state.gateway.cache.cache.embedder = embedder
    cut, whole = apps
    try:
        async with client(cut) as c:
            assert (await c.post("/v1/chat/completions", json=GREEDY)).headers["x-specgate-cache"] == "miss"
            await drained(cut)
            assert (
                (await c.post("/v1/chat/completions", json=GREEDY))
                .headers["x-specgate-cache"]
                .startswith("exact")
            )
        async with client(whole) as c:
            r = await c.post("/v1/chat/completions", json=GREEDY)
            assert r.headers["x-specgate-cache"] == "miss", "the other default's answer"
            await drained(whole)
            assert (
                (await c.post("/v1/chat/completions", json=GREEDY))
                .headers["x-specgate-cache"]
                .startswith("exact")
            )
            asked = {**GREEDY, "max_tokens": 4}  # a limit the client sets is the same limit everywhere
            await c.post("/v1/chat/completions", json=asked)
            await drained(whole)
        async with client(cut) as c:
            assert (
                (await c.post("/v1/chat/completions", json=asked))
                .headers["x-specgate-cache"]
                .startswith("exact")
            )
        assert len(engines[0].requests) == 1 and len(engines[1].requests) == 2
    finally:
        await close_and_forget(apps, redis_server.url, prefix)


async def test_a_model_name_served_by_other_weights_does_not_share_answers(
    redis_server: RedisProcess, embedder: SentenceEmbedder
) -> None:
    """The key names the model a client asked for; the weights behind that name are the gateway's
    configuration. A gateway that serves `fake` from other weights (an upgrade under the same name, a
    replica on a new release, sharing the Redis) must not replay the old weights' answers."""
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    apps, engines = [], []
    for source in ("old-weights", "new-weights", "new-weights"):
        settings = load_settings(
            overrides={
                "models": [{"name": "fake", "source": source}],
                "cache": {"redis_url": redis_server.url, "key_prefix": prefix, "timeout_ms": 2000},
            },
            env={},
        )
        engines.append(ScriptedEngine([token_ids("Use "), token_ids("reversed().")]))
        apps.append(create_app(settings, engine=engines[-1]))  # type: ignore[arg-type]
        apps[-1].state.gateway.cache.cache.embedder = embedder
    try:
        for i, app in enumerate(apps):
            async with client(app) as c:
                r = await c.post("/v1/chat/completions", json=GREEDY)
                await drained(app)
                assert r.headers["x-specgate-cache"] == ("exact; similarity=1.0000" if i == 2 else "miss"), i
        assert [len(e.requests) for e in engines] == [1, 1, 0], "the same weights share their answers"
    finally:
        await close_and_forget(apps, redis_server.url, prefix)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_a_prompt_in_another_unicode_form_is_its_own_question(
    endpoint: str, embedder: SentenceEmbedder
) -> None:
    """ "café" composed (é, U+00E9) and decomposed (e + U+0301) are other bytes and other tokens to a
    tokenizer without an NFC step (byte-level BPE: tiktoken, Llama 3's): the exact key normalised
    both to NFC, so one came back as the other's exact hit, with the other prompt's answer and the
    other prompt's prompt_tokens. (A chat question may still hit by similarity, counted as itself.)"""
    app = create_app(
        load_settings(env={}), engine=ScriptedEngine([token_ids("Use "), token_ids("reversed().")])
    )  # type: ignore[arg-type]
    app.state.gateway.cache.cache.embedder = embedder  # the session's, already loaded
    composed, decomposed = "Order a caf\u00e9 au lait", "Order a cafe\u0301 au lait"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"

    def body(text: str) -> dict[str, Any]:
        if endpoint == "chat":
            return {**GREEDY, "messages": [{"role": "user", "content": text}]}
        return {"model": "fake", "prompt": text, "temperature": 0}

    async with client(app) as c:
        first = await c.post(path, json=body(composed))
        await drained(app)
        fresh = await c.post(path, json=body(decomposed), headers={"Cache-Control": "no-cache, no-store"})
        second = await c.post(path, json=body(decomposed))
    want = fresh.json()["usage"]["prompt_tokens"]
    assert want != first.json()["usage"]["prompt_tokens"], "the two forms are other tokens"
    assert not second.headers["x-specgate-cache"].startswith("exact")
    assert second.json()["usage"]["prompt_tokens"] == want
