"""ResponseCache over both stores (in-process and a real redis-server): tiers, scoping, guard,
controls, TTL and the per-tenant cap."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from gateway.cache import CacheControlError, CachedChoice, CachedResponse, ResponseCache, header_value
from gateway.cache.cache import response_from_texts

MakeCache = Callable[..., ResponseCache]


def chat(text: str, system: str | None = None, **params: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}
    ]
    return {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 32, **params}


async def put(
    cache: ResponseCache, body: dict[str, Any], answer: str, tenant: str = "acme", **kw: Any
) -> bool:
    q = cache.query(body, tenant=tenant, endpoint="chat", **kw)
    assert q is not None
    return await cache.store(q, response_from_texts([answer], ["stop"], 7, 3))


async def get(cache: ResponseCache, body: dict[str, Any], tenant: str = "acme", **kw: Any) -> str | None:
    q = cache.query(body, tenant=tenant, endpoint="chat", **kw)
    assert q is not None
    hit = await cache.lookup(q)
    return None if hit is None else f"{hit.tier}:{hit.response.choices[0].text}"


async def test_exact_hit_and_miss(make_cache: MakeCache) -> None:
    cache = make_cache()
    assert await get(cache, chat("What is the capital of France?")) is None
    assert await put(cache, chat("What is the capital of France?"), "Paris")
    assert await get(cache, chat("What is the capital of France?")) == "exact:Paris"
    assert await get(cache, chat("Explain quicksort.")) is None


async def test_hit_carries_the_stored_response(make_cache: MakeCache) -> None:
    cache = make_cache()
    resp = CachedResponse((CachedChoice(0, "a" * 5000, "length"), CachedChoice(1, "b", "stop")), 11, 32)
    q = cache.query(chat("two answers", n=2), tenant="acme", endpoint="chat")
    assert q is not None and await cache.store(q, resp)
    hit = await cache.lookup(q)
    assert hit is not None and hit.response == resp and header_value(hit) == "exact; similarity=1.0000"
    assert header_value(None) == "miss"
    kept = CachedResponse((CachedChoice(0, "x", "stop"),), 3, 4, 7, prediction_tokens=(5, 2))
    assert CachedResponse.from_bytes(kept.to_bytes()) == kept  # Predicted Outputs' counts travel with it


async def test_semantic_hit_on_paraphrase(make_cache: MakeCache) -> None:
    cache = make_cache()
    await put(cache, chat("How do I reverse a list in Python?"), "use reversed()")
    q = cache.query(chat("How can I reverse a list in Python?"), tenant="acme", endpoint="chat")
    assert q is not None
    hit = await cache.lookup(q)
    assert hit is not None and hit.tier == "semantic", "a paraphrase at temperature 0 should hit"
    assert hit.similarity >= cache.settings.semantic_threshold
    assert header_value(hit).startswith("semantic; similarity=0.9")


async def test_a_twin_stored_after_the_exact_miss_is_an_exact_hit(
    make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two identical requests at once: the second's exact lookup misses, and its own entry, stored by
    the first while its prompt was being embedded, is found by the semantic tier. That is the exact
    answer to this request, and the header says so (it read ``semantic; similarity=1.0000``)."""
    cache = make_cache()
    body = chat("What is the capital of France?")
    embed, twin_stored = cache._embed, []

    async def embed_while_the_twin_stores(q: Any) -> Any:
        vec = await embed(q)
        if not twin_stored:
            twin_stored.append(None)  # the twin's own store embeds too
            twin_stored[0] = await put(cache, body, "Paris")
        return vec

    monkeypatch.setattr(cache, "_embed", embed_while_the_twin_stores)
    q = cache.query(body, tenant="acme", endpoint="chat")
    assert q is not None
    hit = await cache.lookup(q)
    assert twin_stored == [True] and hit is not None and hit.response.choices[0].text == "Paris"
    assert header_value(hit) == "exact; similarity=1.0000"


async def test_semantic_only_at_temperature_zero_and_without_tools(make_cache: MakeCache) -> None:
    cache = make_cache()
    for params in (
        {"temperature": 0.7, "seed": 1},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
    ):
        await put(cache, chat("How do I reverse a list in Python?", **params), "x")
        assert await get(cache, chat("How do I reverse a list in Python?", **params)) == "exact:x"
        assert await get(cache, chat("How can I reverse a list in Python?", **params)) is None
    body = chat("How do I reverse a list in Python?", seed=5)
    del body["temperature"]  # the gateway's default temperature (1.0 here) is not greedy
    await put(cache, body, "y")
    body["messages"][0]["content"] = "How can I reverse a list in Python?"
    assert await get(cache, body) is None


@pytest.mark.parametrize(
    "variant",
    [
        {"tenant": "other"},
        {"body": {"model": "m2"}},
        {"system": "You are a pirate."},
        {"body": {"temperature": 0.5, "seed": 1}},
        {"body": {"max_tokens": 33}},
        {"body": {"stop": ["\n"]}},
        {"body": {"seed": 1}},
        {"body": {"top_p": 0.9}},
        {"body": {"presence_penalty": 0.5}},
        {"body": {"response_format": {"type": "json_object"}}},
    ],
)
async def test_scoping(make_cache: MakeCache, variant: dict[str, Any]) -> None:
    """Neither tier crosses tenant, model, system prompt or any output-changing parameter."""
    cache = make_cache()
    await put(cache, chat("How do I reverse a list in Python?", system="Be brief."), "stored")
    tenant = variant.get("tenant", "acme")
    system = variant.get("system", "Be brief.")
    same = chat("How do I reverse a list in Python?", system=system, **variant.get("body", {}))
    para = chat("How can I reverse a list in Python?", system=system, **variant.get("body", {}))
    assert await get(cache, same, tenant=tenant) is None
    assert await get(cache, para, tenant=tenant) is None


async def test_lossless_and_transport_fields_share_entries(make_cache: MakeCache) -> None:
    cache = make_cache()
    await put(cache, chat("What is a mutex?"), "a lock")
    for extra in (
        {"speculative": {"mode": "off"}},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"n": 1, "top_p": 1.0, "temperature": 0.0},
        {"user": "u1"},
    ):
        assert await get(cache, chat("What is a mutex?", **extra)) == "exact:a lock", extra


@pytest.mark.parametrize(
    ("stored", "asked"),
    [
        ("What is a prime number?", "What is not a prime number?"),
        ("Which countries use the euro?", "Which countries don't use the euro?"),
        ("Give me 3 tips for better sleep.", "Give me 5 tips for better sleep."),
        ("List five sorting algorithms.", "List seven sorting algorithms."),
        ("What is the capital of Austria?", "What is the capital of Australia?"),
        ("Sort the list in ascending order.", "Sort the list in descending order."),
        ("Is Python faster than Java?", "Is Java faster than Python?"),  # similarity 0.993
        ("Convert Celsius to Fahrenheit.", "Convert Fahrenheit to Celsius."),
        # digits inside words are numbers; words negated by a prefix; compounds and plurals of
        # polarity words (each of these hit at the product's 0.9 threshold before 2026-12-04)
        ("what year did ww2 end", "what year did ww1 end"),  # similarity 0.92
        ("Is it safe to eat raw eggs?", "Is it unsafe to eat raw eggs?"),  # 0.99
        ("How do I make a case-sensitive search in vim?", "How do I make a case-insensitive search in vim?"),
        ("What is a blocking socket?", "What is a non-blocking socket?"),
        ("How to uppercase a string in Python", "How to lowercase a string in Python"),  # 0.90
        ("how to sort a dict by key in python", "how to sort a dict by value in python"),  # 0.93
        ("Explain recursion briefly.", "Explain recursion in detail."),  # 0.99
        ("Give me a synonym for happy.", "Give me an antonym for happy."),  # 0.93
        ("什么是递归？", "什么是闭包？"),  # 1.000: MiniLM has no token for these characters
        ("What does 😂 mean?", "What does 😭 mean?"),  # 1.000, as for most symbols
        ("Why does this fail?\nif x:\nprint(x)", "Why does this fail?\nif x:\n    print(x)"),  # 1.000
    ],
)
async def test_guard_refuses_near_misses(make_cache: MakeCache, stored: str, asked: str) -> None:
    cache = make_cache(semantic_threshold=0.5)  # low, so only the guard stands between them
    await put(cache, chat(stored), "stored")
    assert await get(cache, chat(asked)) is None


async def test_ttl_expiry(make_cache: MakeCache) -> None:
    cache = make_cache()
    await put(cache, chat("short lived", cache={"ttl": 1}), "x")
    await put(cache, chat("long lived"), "y")
    assert await get(cache, chat("short lived")) == "exact:x"
    await asyncio.sleep(1.2)
    assert await get(cache, chat("short lived")) is None
    assert await get(cache, chat("long lived")) == "exact:y"


async def test_entry_cap_per_tenant(make_cache: MakeCache) -> None:
    cache = make_cache(max_entries_per_tenant=3)
    for i in range(5):
        await put(cache, chat(f"question number {i}"), f"a{i}")
        await put(cache, chat(f"question number {i}"), f"b{i}", tenant="other")
    present = [i for i in range(5) if await get(cache, chat(f"question number {i}")) is not None]
    assert present == [2, 3, 4], "the oldest entries go first"
    assert await get(cache, chat("question number 4"), tenant="other") == "exact:b4"


async def test_request_controls(make_cache: MakeCache) -> None:
    cache = make_cache()
    assert not await put(cache, chat("q1"), "x", headers={"cache-control": "no-store"})
    assert not await put(cache, chat("q1", cache={"no_store": True}), "x")
    assert await get(cache, chat("q1")) is None
    await put(cache, chat("q1"), "x")
    assert await get(cache, chat("q1"), headers={"Cache-Control": "no-cache, max-age=0"}) is None
    assert await get(cache, chat("q1", cache={"no_cache": True})) is None
    assert await get(cache, chat("q1")) == "exact:x"
    for bad in ({"ttl": 0}, {"ttl": "5"}, {"no_cache": "yes"}, {"bogus": 1}, "on"):
        with pytest.raises(CacheControlError):
            cache.query(chat("q1", cache=bad), tenant="acme", endpoint="chat")


async def test_not_cached(make_cache: MakeCache) -> None:
    cache = make_cache()
    assert cache.query(chat("q", logprobs=True), tenant="acme", endpoint="chat") is None
    q = cache.query(chat("q"), tenant="acme", endpoint="chat")
    assert q is not None
    assert not await cache.store(q, response_from_texts(["partial"], ["abort"], 1, 1))
    assert not await cache.store(q, response_from_texts(["boom"], ["error"], 1, 1))
    assert await cache.lookup(q) is None
    assert make_cache(enabled=False).query(chat("q"), tenant="acme", endpoint="chat") is None


async def test_unseeded_sampling_is_not_replayed(make_cache: MakeCache) -> None:
    sampled = chat("Write a poem.", temperature=0.8)
    assert make_cache().query(sampled, tenant="acme", endpoint="chat") is None
    cache = make_cache(cache_sampled=True)
    await put(cache, sampled, "roses")
    assert await get(cache, sampled) == "exact:roses"


async def test_legacy_completions(make_cache: MakeCache) -> None:
    cache = make_cache()
    body = {"model": "m", "prompt": "def fib(n):", "temperature": 0, "max_tokens": 16}
    q = cache.query(body, tenant="acme", endpoint="completions")
    assert q is not None
    await cache.store(q, response_from_texts(["\n    return n"], ["length"], 4, 16))
    q2 = cache.query(body, tenant="acme", endpoint="completions")
    assert q2 is not None and (await cache.lookup(q2)) is not None
    chat_q = cache.query(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "def fib(n):"}],
            "temperature": 0,
            "max_tokens": 16,
        },
        tenant="acme",
        endpoint="chat",
    )
    assert chat_q is not None and await cache.lookup(chat_q) is None
