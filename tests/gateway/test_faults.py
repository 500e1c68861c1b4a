"""Faults an outside probe found, in process: colliding client request ids, client strings as metric
labels, the OpenAPI document's loose ends, answers given before the body was read, and requests
carrying two keys."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace
from typing import Any

import pytest
from starlette.types import Message

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from decoding.static import StaticModel
from gateway.app import create_app
from gateway.settings import load_settings
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


def _keyed(**overrides: Any) -> Any:
    s = load_settings(
        overrides={"auth": {"api_keys": ["sk-a"]}, "cache": {"enabled": False}, **overrides}, env={}
    )
    return create_app(s, engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]


async def _drive(
    app: Any, method: str, path: str, headers: dict[str, str], parts: list[bytes]
) -> list[Message]:
    """The app's messages for one request, by hand: the body's ``parts`` (the last one ending it
    unless more was declared), then a client gone quiet, whose next part never comes."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    declared = int(headers.get("content-length", "0"))
    queue = list(parts)
    sent_bytes = 0
    quiet = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent_bytes
        if not queue:
            await quiet.wait()  # never set: the test's bound ends a request that waits for it
        part = queue.pop(0)
        sent_bytes += len(part)
        return {"type": "http.request", "body": part, "more_body": sent_bytes < declared}

    out: list[Message] = []

    async def send(message: Message) -> None:
        out.append(message)

    await asyncio.wait_for(app(scope, receive, send), 60)  # a bound against a hang, not a timing
    return out


def _start(messages: list[Message]) -> tuple[int, dict[str, str]]:
    start = messages[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


KEY = {"authorization": "Bearer sk-a"}
MEGABYTE = {"content-type": "application/json", "content-length": "1000000"}


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("POST", "/v1/chat/completions", MEGABYTE, 401),  # no key
        ("POST", "/v1/nothing", MEGABYTE | KEY, 404),
        ("POST", "/v1/chat/completions", {**MEGABYTE, "content-length": "2000000"} | KEY, 413),
        ("GET", "/v1/models", MEGABYTE | KEY, 200),  # a body no GET route reads
    ],
)
async def test_an_answer_before_the_body_is_read_closes_the_connection(
    method: str, path: str, headers: dict[str, str], status: int
) -> None:
    """The rest of the body is never read, so the connection cannot carry a next request: the
    answer says ``Connection: close`` (the server then closes it: test_slow_clients)."""
    messages = await _drive(_keyed(), method, path, headers, [b"{"])
    got, head = _start(messages)
    assert got == status and head["connection"] == "close"
    if status != 200:
        assert set(json.loads(messages[1]["body"])["error"]) == {"message", "type", "param", "code"}


async def test_an_answer_after_the_whole_body_keeps_the_connection() -> None:
    body = json.dumps({"model": "fake", "messages": MSGS, "max_tokens": 2}).encode()
    cases = [
        ("POST", "/v1/chat/completions", {"content-length": str(len(body))} | KEY, [body], 200),
        ("GET", "/v1/models", {}, [], 401),  # no body to read: refused, and kept
        ("GET", "/v1/models", KEY, [], 200),
    ]
    for method, path, headers, parts, status in cases:
        got, head = _start(await _drive(_keyed(), method, path, headers, parts))
        assert got == status and "connection" not in head, (method, path, status)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_two_authorization_headers_are_refused(path: str) -> None:
    """The last of two keys won (wrong, then right: 200): a proxy in front that reads the first
    would judge another key than the gateway. Two are a 400 in OpenAI's shape, whatever they are."""
    app = _keyed()
    body = {"model": "fake", "messages": MSGS, "max_tokens": 2}
    async with client(app) as c:

        async def call(*keys: str) -> Any:
            headers = [("authorization", f"Bearer {k}") for k in keys]
            if path == "/v1/models":
                return await c.get(path, headers=headers)
            return await c.post(path, json=body, headers=headers)

        assert (await call("sk-a")).status_code == 200
        for keys in (("sk-b", "sk-a"), ("sk-a", "sk-b"), ("sk-a", "sk-a")):
            r = await call(*keys)
            assert r.status_code == 400, keys
            assert r.json()["error"] == {
                "message": "The request carries more than one Authorization header; send exactly one.",
                "type": "invalid_request_error",
                "param": None,
                "code": "duplicate_authorization_header",
            }
            assert r.headers["x-request-id"]


async def test_two_authorization_headers_pass_where_no_key_is_read() -> None:
    """A public path, or a gateway without keys, reads no Authorization header at all."""
    twice = [("authorization", "Bearer sk-b"), ("authorization", "Bearer sk-a")]
    async with client(_keyed()) as c:
        assert (await c.get("/health", headers=twice)).status_code == 200
    async with client(create_app(settings(), engine=ScriptedEngine([token_ids("ok")]))) as c:  # type: ignore[arg-type]
        assert (await c.get("/v1/models", headers=twice)).status_code == 200
