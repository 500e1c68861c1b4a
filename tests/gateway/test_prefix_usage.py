"""``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the engine reused from its prefix
cache (decoding/prefix.py), summed over choices, streamed and not, on chat and completions; 0 for an
answer replayed from the response cache, where no model read the prompt; and ``cache_salt`` reaching
the engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids

MSGS = [{"role": "user", "content": "hi"}]


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def last_usage(raw: str) -> dict[str, Any]:
    events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": MSGS}), ("/v1/completions", {"prompt": "hello there"})],
)
async def test_cached_tokens_are_reported_streamed_and_not_summed_over_choices(path, body) -> None:
    engine = ScriptedEngine([token_ids("ab"), token_ids("cd")], cached=6)
    settings = load_settings(overrides={"cache": {"enabled": False}}, env={})
    app = create_app(settings, engine=engine)  # type: ignore[arg-type]
    body = {"model": "fake", "n": 2, **body}
    async with client(app) as c:
        whole = (await c.post(path, json=body)).json()
        assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        assert last_usage((await c.post(path, json=stream)).text)["prompt_tokens_details"] == {
            "cached_tokens": 12
        }
        # a stop string ends the choices before the engine's last output: the steps said it already
        stopped = (await c.post(path, json={**body, "stop": ["c"]})).json()
        assert stopped["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}


async def test_a_replayed_answer_reports_no_cached_prompt_tokens() -> None:
    engine = ScriptedEngine([token_ids("ab")], cached=4)
    app = create_app(load_settings(env={}), engine=engine)  # type: ignore[arg-type]
    body = {"model": "fake", "messages": MSGS, "temperature": 0}  # the cache keeps deterministic answers
    async with client(app) as c:
        first = await c.post("/v1/chat/completions", json=body)
        await app.state.gateway.cache.cache.drain()
        again = await c.post("/v1/chat/completions", json=body)
    assert first.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert again.headers["x-specgate-cache"].startswith("exact")
    assert again.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_cache_salt_reaches_the_engine_and_an_empty_one_is_refused() -> None:
    engine = ScriptedEngine([token_ids("ab")])
    settings = load_settings(overrides={"cache": {"enabled": False}}, env={})
    app = create_app(settings, engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        ok = await c.post("/v1/completions", json={"model": "fake", "prompt": "x", "cache_salt": "tenant-7"})
        bad = await c.post("/v1/completions", json={"model": "fake", "prompt": "x", "cache_salt": ""})
    assert ok.status_code == 200 and engine.requests[-1].cache_salt == "tenant-7"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


async def test_per_key_prefix_caching_salts_each_tenants_requests_apart() -> None:
    engine = ScriptedEngine([token_ids("ab")])
    overrides = {
        "cache": {"enabled": False},
        "auth": {"api_keys": ["ka", "kb"], "prefix_cache_per_key": True},
    }
    app = create_app(load_settings(overrides=overrides, env={}), engine=engine)  # type: ignore[arg-type]
    salts = []
    async with client(app) as c:
        for key, salt in (("ka", None), ("kb", None), ("ka", None), ("ka", "s")):
            body = {"model": "fake", "prompt": "x", **({"cache_salt": salt} if salt else {})}
            r = await c.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
            salts.append(engine.requests[-1].cache_salt)
    assert None not in salts and salts[0] == salts[2] and len({salts[0], salts[1], salts[3]}) == 3


async def test_an_upstreams_cached_tokens_are_passed_through_and_its_salt_sent() -> None:
    from gateway.backends import Job
    from gateway.formatting import ChatFormat
    from gateway.remote import _body
    from tests.gateway.test_remote import read

    job = Job(request_id="r", kind="chat", model="m", messages=MSGS, cache_salt="s1")
    assert _body(job)["cache_salt"] == "s1"
    usage = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
             "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
    events = [
        {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
    ]
    gen, deltas = await read(job, events)
    fmt = ChatFormat("m", False, 1)
    for d in deltas:
        fmt.fold(d)
    assert fmt.whole(gen)["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
