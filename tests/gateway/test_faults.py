"""Faults an outside probe found, in process: colliding client request ids, client strings as metric
labels, and the OpenAPI document's loose ends."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import Any

import pytest

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from decoding.static import StaticModel
from gateway.app import create_app
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.gateway.test_app import MSGS, client, settings, sse_data


async def test_requests_sharing_an_x_request_id_do_not_collide(tiny_models: Any) -> None:
    """The client's id is a label: the engine keys each choice by an id of its own. With static
    KV caches a collision also leaked the slot of the request it overwrote, for good."""
    statics = {
        name: StaticModel(tiny_models[name].model, max_len=256, slots=2, graphs=False)
        for name in ("tiny", "tiny-draft")
    }
    models = {
        name: replace(tiny_models[name], runner_factory=s.runner, draft_runner_factory=s.draft_runner)
        for name, s in statics.items()
    }
    engine = AsyncEngine(Engine(models), max_active=2, max_queued=16)
    try:
        app = create_app(settings(), engine=engine)
        async with client(app) as c:
            body = {"model": "tiny", "messages": MSGS, "max_tokens": 12, "temperature": 0}
            same = {"x-request-id": "shared-id"}
            calls = [c.post("/v1/chat/completions", json=body, headers=same) for _ in range(5)]
            calls.append(c.post("/v1/chat/completions", json={**body, "n": 2}, headers=same))
            # a bound, not a timing: before the fix colliding requests never finished at all
            replies = await asyncio.wait_for(asyncio.gather(*calls), 120)
        for r in replies:
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "shared-id"  # still the client's label
            assert all(ch["finish_reason"] in ("stop", "length") for ch in r.json()["choices"])
        texts = {ch["message"]["content"] for r in replies for ch in r.json()["choices"]}
        assert len(texts) == 1  # greedy, one prompt: every one of the 7 generations is the same
        for _ in range(200):  # the worker releases a finished request's slots right after its last step
            if engine.active == 0:
                break
            await asyncio.sleep(0.01)
        assert {name: len(s._free) for name, s in statics.items()} == {"tiny": 2, "tiny-draft": 2}
    finally:
        engine.shutdown()


async def test_unknown_model_names_are_one_metric_label_and_logged_bounded(caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="specgate.request")
    app = create_app(settings(), engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]
    async with client(app) as c:
        for i in range(3):
            name = f"{i}" + "m" * 100_000
            r = await c.post("/v1/chat/completions", json={"model": name, "messages": MSGS})
            assert r.status_code == 404
        assert (
            await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS})
        ).status_code == 200
        scrape = (await c.get("/metrics")).text
    m = app.state.metrics
    assert (
        m.value("specgate_requests_total", route="/v1/chat/completions", model="unknown", status="404") == 3
    )
    assert m.value("specgate_requests_total", route="/v1/chat/completions", model="fake", status="200") == 1
    assert "mmmm" not in scrape and len(scrape) < 200_000
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specgate.request"]
    assert lines and max(len(line) for line in lines) < 2_000


async def test_error_messages_quote_an_unknown_model_name_bounded() -> None:
    """A 404 quoted the whole name a client sent: 200 KB in, 200 KB of error out."""
    app = create_app(settings(), engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]
    name = "m" * 200_000
    async with client(app) as c:
        replies = [
            await c.post("/v1/chat/completions", json={"model": name, "messages": MSGS}),
            await c.post("/v1/completions", json={"model": name, "prompt": "hi"}),
            await c.get("/v1/models/" + name[:20_000]),
        ]
    for r in replies:
        assert r.status_code == 404, r.text[:200]
        error = r.json()["error"]
        assert error["code"] == "model_not_found"
        assert error["message"].startswith("The model 'mmm") and len(error["message"]) < 400


async def test_openapi_declares_path_parameters_and_405_carries_allow() -> None:
    app = create_app(settings(), engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]
    async with client(app) as c:
        doc = (await c.get("/openapi.json")).json()
        r = await c.delete("/v1/models")
    # ranges render as JSON Schema's minimum/maximum, never as pydantic's stray "ge"/"le" keys
    assert '"ge":' not in json.dumps(doc) and '"le":' not in json.dumps(doc)
    seed = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed == {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}
    params = doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert params == [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("stream", [False, True])
async def test_requests_running_at_the_drain_timeout_are_told(stream: bool) -> None:
    """At the drain timeout (``state.cut``) a plain request gets a 503 and a stream one error event
    and [DONE], each in OpenAI's shape, instead of a connection that just ends."""
    engine = ScriptedEngine([token_ids("a")] * 10_000, delay=0.01)
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    body = {"model": "fake", "messages": MSGS, "stream": stream}
    async with client(app) as c:
        reply = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
        while engine.engine.total_steps < 3:
            await asyncio.sleep(0.01)
        app.state.gateway.cut.set()
        r = await asyncio.wait_for(reply, 60)
    if stream:
        events = sse_data(r.text)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
    else:
        assert r.status_code == 503 and r.headers["retry-after"]
        err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "unavailable"
