"""The remote path against a misbehaving upstream: a raw asyncio HTTP server on loopback that sends
exactly the bytes each test scripts, and the gateway served by uvicorn in this process."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.settings import load_settings
from router.upstream import MAX_ERROR_BYTES, MAX_EVENT_BYTES
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.servers import free_port, serve_in_loop

Action = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
CLOSE = b"connection: close\r\n\r\n"  # one request a connection: the gateway never reuses one this closes
CHAT = {"model": "up-model", "messages": [{"role": "user", "content": "hi"}]}


class RawUpstream:
    """Answers each request with the next scripted action (default: a short good stream) and
    records whether the gateway closed the connection while an action waited on it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.actions: list[Action] = []
        self.requests = 0
        self.holding = asyncio.Event()  # a `hold` action has the request
        self.closed_by_gateway = asyncio.Event()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await r.readexactly(length)
            self.requests += 1
            await (self.actions.pop(0) if self.actions else stream(good_chunks()))(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "up-model",
            "choices": [choice], **fields}  # fmt: skip


def good_chunks() -> list[dict[str, Any]]:
    return [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hello"}), chunk({}, "stop")]


def stream(events: list[dict[str, Any]], done: bool = True) -> Action:
    """A 200 text/event-stream of ``events`` (chunked), then ``[DONE]``."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + CLOSE
        )
        body = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
        for piece in [*body, *([b"data: [DONE]\n\n"] if done else [])]:
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    return act


def status(
    code: int,
    body: bytes = b'{"error": {"message": "scripted", "type": "server_error"}}',
    headers: bytes = b"",
) -> Action:
    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % (
            code,
            len(body),
        )
        w.write(head + headers + CLOSE + body)
        await w.drain()

    return act


def hold(up: RawUpstream) -> Action:
    """Accept the request and answer nothing until the gateway closes the connection."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        up.holding.set()
        while await r.read(1024):
            pass
        up.closed_by_gateway.set()

    return act


@pytest.fixture
async def upstream() -> AsyncIterator[RawUpstream]:
    up = RawUpstream()
    await up.start()
    yield up
    await up.stop()


async def serve_gateway(
    up: RawUpstream, cache: bool = False, limits: dict[str, Any] | None = None, **upstream_settings: Any
) -> tuple[str, uvicorn.Server, asyncio.Task[None]]:
    """The gateway with a local model `fake` and the upstream `u` serving `up-model`; `auto` goes
    to the upstream first and falls back to the local tier."""
    u = {"name": "u", "base_url": f"http://127.0.0.1:{up.port}/v1", "model": "up-model", "retries": 0,
         "timeout_s": 2.0, "breaker_failures": 100} | upstream_settings  # fmt: skip
    settings = load_settings(env={}, overrides={
        "cache": {"enabled": cache}, "upstreams": [u], "models": [{"name": "fake", "source": "x"}],
        "limits": limits or {},
        "router": {"tiers": [{"name": "local", "model": "fake"},
                             {"name": "remote", "upstream": "u", "threshold": 0.0, "fallback": ["local"]}]},
    })  # fmt: skip
    app = create_app(settings, engine=ScriptedEngine([token_ids("local answer")]))  # type: ignore[arg-type]
    url, server, task = await serve_in_loop(app)
    return url + "/v1", server, task


@pytest.fixture
async def gateway(upstream: RawUpstream) -> AsyncIterator[str]:
    base, server, task = await serve_gateway(upstream)
    yield base
    server.should_exit = True
    await task


def data_events(text: str) -> list[str]:
    return [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]


UNREADABLE = {
    "choice is a string": {"choices": ["Hello"]},
    "index is a string": chunk({"content": "a"})
    | {"choices": [{"index": "zero", "delta": {"content": "a"}}]},
    "index past n": chunk({"content": "a"}) | {"choices": [{"index": 3, "delta": {"content": "a"}}]},
    "usage count is a string": {"choices": [], "usage": {"prompt_tokens": "x", "completion_tokens": 2}},
    "content is an object": chunk({"content": {"text": "a"}}),
}


@pytest.mark.parametrize("bad", UNREADABLE.values(), ids=UNREADABLE.keys())
async def test_unreadable_upstream_chunks_are_the_upstreams_fault(
    upstream: RawUpstream, gateway: str, bad: dict[str, Any]
) -> None:
    """A chunk whose fields have the wrong types is a 502 `upstream_bad_response` (an in-band error
    event once the stream has started): they were a 500 with a traceback (a choice that was a
    string, an index past n) or a 400 `invalid_request_error` blaming the client (int("x"))."""
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [stream([bad]), stream([*good_chunks()[:2], bad])]
        first = await c.post(gateway + "/chat/completions", json=CHAT)
        streamed = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": True})
    assert first.status_code == 502, first.text
    if bad is UNREADABLE["index past n"]:  # only the formatter knows n: found after the headers
        assert first.json()["error"]["code"] == "upstream_bad_response"
    else:
        assert first.json()["error"] == {"message": first.json()["error"]["message"], "type": "server_error",
                                         "param": None, "code": "upstream_bad_response"}  # fmt: skip
    events = data_events(streamed.text)
    assert streamed.status_code == 200 and events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]  # a stream's break is reported as one, naming its cause
    assert err["type"] == "server_error" and err["code"] in (
        "upstream_stream_broken",
        "upstream_bad_response",
    )


ERROR_EVENT = {"error": {"message": "engine failed", "code": "boom"}}  # no type: the upstream's fault


@pytest.mark.parametrize("stream_", [False, True])
async def test_an_error_as_the_first_event_is_a_plain_502_or_a_fallback(
    upstream: RawUpstream, gateway: str, stream_: bool
) -> None:
    """Nothing has reached the client when the upstream's first event is an error: the client gets
    a plain 502 with the upstream's error (a stream got a 200 holding only that error, a request
    not streamed a 500), and a route with a fallback falls back."""
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [stream([ERROR_EVENT])]
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
        assert r.status_code == 502, r.text
        assert r.json()["error"] == {"message": "engine failed", "type": "server_error", "param": None,
                                     "code": "boom"}  # fmt: skip
        upstream.actions = [stream([ERROR_EVENT])]
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "model": "auto", "stream": stream_})
    assert r.status_code == 200 and r.headers["x-specgate-route"].startswith("tier=local;")
    assert "local answer" in (r.text if stream_ else r.json()["choices"][0]["message"]["content"])


async def test_an_error_event_mid_stream_is_a_502_for_a_request_not_streamed(
    upstream: RawUpstream, gateway: str
) -> None:
    """The upstream failed, not the gateway: a 502 (it was a 500 `server_error`, a gateway fault)."""
    upstream.actions = [stream([*good_chunks()[:2], ERROR_EVENT])]
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gateway + "/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert r.json()["error"] == {
        "message": "engine failed",
        "type": "server_error",
        "param": None,
        "code": "boom",
    }


@pytest.mark.parametrize("stream_", [False, True])
async def test_a_fallbacks_answer_names_the_model_that_gave_it(
    upstream: RawUpstream, gateway: str, stream_: bool
) -> None:
    """The upstream fails before its first byte and the local tier answers: every chunk's `model`
    named the upstream's model, which gave nothing, while x-specgate-route named the local one."""
    upstream.actions = [status(500)]
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "model": "auto", "stream": stream_})
    assert r.status_code == 200 and r.headers["x-specgate-route"].startswith("tier=local; model=fake;")
    bodies = [json.loads(e) for e in data_events(r.text)[:-1]] if stream_ else [r.json()]
    assert bodies and {b["model"] for b in bodies} == {"fake"}


async def test_a_fallbacks_answer_is_not_cached_as_the_upstreams(upstream: RawUpstream) -> None:
    """The cache key names the routed pick's model: a local fallback's answer, stored under it, was
    served for the upstream for the cache's ttl (an hour by default) once the upstream recovered."""
    base, server, task = await serve_gateway(upstream, cache=True)
    try:
        body = {**CHAT, "model": "auto", "temperature": 0}
        async with httpx.AsyncClient(timeout=10) as c:
            upstream.actions = [status(503)]
            r = await c.post(base + "/chat/completions", json=body)
            assert r.headers["x-specgate-route"].startswith("tier=local;")
            r = await c.post(base + "/chat/completions", json=body)  # the upstream is back
            assert r.headers["x-specgate-route"].startswith("tier=remote;")
            assert r.json()["choices"][0]["message"]["content"] == "Hello", (r.headers, upstream.requests)
            assert r.json()["model"] == "up-model"
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("stream_", [False, True])
async def test_a_client_that_leaves_before_the_first_event_ends_the_upstream_call(
    upstream: RawUpstream, stream_: bool
) -> None:
    """The upstream's call stayed open until its first event or its timeout_s (60 s by default,
    4 s measured here at timeout_s 4): nothing listened for the client before the response began."""
    base, server, task = await serve_gateway(upstream, timeout_s=600)
    try:
        upstream.actions = [hold(upstream)]
        async with httpx.AsyncClient(timeout=None) as c:
            call = asyncio.ensure_future(c.post(base + "/chat/completions", json={**CHAT, "stream": stream_}))
            await asyncio.wait_for(upstream.holding.wait(), 30)
            call.cancel()  # the client goes away: its connection closes
            await asyncio.wait({call})
        await asyncio.wait_for(upstream.closed_by_gateway.wait(), 30)  # well inside the 600 s timeout
    finally:
        server.should_exit = server.force_exit = True  # not waiting for a request still held
        await task


def call(
    index: int, id_: str | None = None, name: str | None = None, args: str | None = None
) -> dict[str, Any]:
    return {"index": index, **({"id": id_, "type": "function"} if id_ else {}),
            "function": {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}}  # fmt: skip


TOOL_STREAMS = {
    "the name on every delta": [call(0, "call_a", "get", '{"a"'), call(0, None, "get", ":1}")],
    "counted from 1": [call(1, "call_a", "get", '{"a"'), call(1, None, None, ":1}")],
    "the name after the opening": [call(0, "call_a", None, ""), call(0, None, None, '{"a":1}')],
}


@pytest.mark.parametrize("calls", TOOL_STREAMS.values(), ids=TOOL_STREAMS.keys())
async def test_upstream_tool_call_deltas_open_one_call_per_index(
    upstream: RawUpstream, gateway: str, calls: list[dict[str, Any]]
) -> None:
    """A call opens the first time its index shows up: a name repeated on every delta opened a second,
    empty call (and streamed two openings for index 0), and an index 1 first or an opening without
    a name was a 500."""
    events = [chunk({"tool_calls": [c]}) for c in calls] + [chunk({}, "tool_calls")]
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "get", "parameters": {}}}]}
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [stream(events), stream(events)]
        whole = await c.post(gateway + "/chat/completions", json=body)
        streamed = await c.post(gateway + "/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    [only] = whole.json()["choices"][0]["message"]["tool_calls"]
    assert only["id"] == "call_a" and only["function"]["arguments"] == '{"a":1}'
    pieces = [
        t for e in data_events(streamed.text)[:-1] for ch in json.loads(e)["choices"]
        for t in ch["delta"].get("tool_calls") or []
    ]  # fmt: skip
    assert [t["id"] for t in pieces if "id" in t] == ["call_a"] and {t["index"] for t in pieces} == {0}
    assert "".join(t["function"].get("arguments", "") for t in pieces) == '{"a":1}'


async def test_a_long_retry_after_is_passed_on_not_waited_out(upstream: RawUpstream) -> None:
    """A 429 whose Retry-After is longer than max_retry_wait_s goes to the client at once, header
    kept, or to the route's fallback: each retry waited it out (up to timeout_s), so Retry-After 2
    held the request 4 s with 2 retries before the same 429, or before the fallback. A short one is
    still retried."""
    base, server, task = await serve_gateway(upstream, retries=2, timeout_s=30)
    limited = status(429, headers=b"retry-after: 20\r\n")
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            upstream.actions = [limited] * 3
            r = await c.post(base + "/chat/completions", json=CHAT)
            assert (r.status_code, r.headers["retry-after"], upstream.requests) == (429, "20", 1)
            r = await c.post(base + "/chat/completions", json={**CHAT, "model": "auto"})
            assert r.headers["x-specgate-route"].startswith("tier=local;") and upstream.requests == 2
            upstream.actions = [status(429, headers=b"retry-after: 0\r\n")]
            r = await c.post(base + "/chat/completions", json=CHAT)
            assert r.status_code == 200 and upstream.requests == 4  # retried, then answered
    finally:
        server.should_exit = True
        await task


@pytest.mark.parametrize("stream_", [False, True])
async def test_a_finished_stream_without_done_is_an_answer(
    upstream: RawUpstream, gateway: str, stream_: bool
) -> None:
    """Some servers end the body after the last chunk and never send [DONE]; the SDK reading them
    ends there. Every choice had finished, yet the answer was a 502 (streamed: an error event
    after the last chunk). A body that ends before a choice's finish is still an error."""
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [
            stream([*good_chunks(), usage], done=False),
            stream(good_chunks()[:2], done=False),
        ]
        finished = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
        cut = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
    assert finished.status_code == 200, finished.text
    if stream_:
        assert "error" not in finished.text and data_events(finished.text)[-1] == "[DONE]"
        assert json.loads(data_events(finished.text)[-2])["choices"][0]["finish_reason"] == "stop"
        assert json.loads(data_events(cut.text)[-2])["error"]["code"] == "upstream_stream_broken"
    else:
        assert finished.json()["choices"][0]["message"]["content"] == "Hello"
        assert finished.json()["usage"]["completion_tokens"] == 1
        assert cut.status_code == 502


async def test_upstream_error_fields_are_bounded_strings(upstream: RawUpstream, gateway: str) -> None:
    """An upstream's error object is passed on as strings, bounded: a `param` that was an object
    failed the gateway's own error model (a 400 blaming the client's 'param'; mid-stream, a stream
    cut with neither its error event nor [DONE]), and a 3 MB message came back whole."""
    odd = {"error": {"message": "M" * 3_000_000, "type": "invalid_request_error", "param": {"a": 1}}}
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [status(400, json.dumps(odd).encode()), stream([*good_chunks()[:2], odd])]
        refused = await c.post(gateway + "/chat/completions", json=CHAT)
        streamed = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": True})
    err = refused.json()["error"]
    assert (
        refused.status_code == 400 and err["param"] == '{"a": 1}' and err["type"] == "invalid_request_error"
    )
    assert err["message"].startswith("MMM") and len(err["message"]) < 2000
    events = data_events(streamed.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["param"] == '{"a": 1}'


async def test_a_body_that_is_no_event_stream_is_not_asked_for_again(upstream: RawUpstream) -> None:
    """An upstream that ignores `stream` answers a whole JSON completion: a 502 bad response, asked
    once. Its clean end was taken for a broken connection and retried, a whole generation each time."""
    base, server, task = await serve_gateway(upstream, retries=2, backoff_s=0)
    whole = {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]}
    try:
        upstream.actions = [status(200, json.dumps(whole).encode())] * 3
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(base + "/chat/completions", json={**CHAT, "stream": True})
        assert (r.status_code, r.json()["error"]["code"], upstream.requests) == (
            502,
            "upstream_bad_response",
            1,
        )
    finally:
        server.should_exit = True
        await task


def pinging(events: list[dict[str, Any]]) -> Action:
    """A 200 event stream of ``events``, then `: ping` comments every 0.1 s and nothing else, until
    the gateway closes the connection."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + CLOSE
        )
        pieces = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
        while True:
            for piece in pieces or [b": ping\n\n"]:
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
            pieces = []
            await asyncio.sleep(0.1)

    return act


@pytest.mark.parametrize("stream_", [False, True])
async def test_keep_alive_comments_alone_time_out(upstream: RawUpstream, stream_: bool) -> None:
    """An upstream that sends `: ping` and never an event is a 504 `upstream_timeout` after
    `timeout_s` (before its first event; a route with a fallback falls back), or a stream's error
    event after it: each comment reset httpx's read timeout, and the client waited forever."""
    base, server, task = await serve_gateway(upstream, timeout_s=0.5)
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            upstream.actions = [pinging([]), pinging(good_chunks()[:2]), pinging([])]
            before = await c.post(base + "/chat/completions", json={**CHAT, "stream": stream_})
            after = await c.post(base + "/chat/completions", json={**CHAT, "stream": stream_})
            fell_back = await c.post(base + "/chat/completions", json={**CHAT, "model": "auto"})
    finally:
        server.should_exit = True
        await task
    assert before.status_code == 504, before.text
    assert before.json()["error"]["code"] == "upstream_timeout"
    if stream_:
        events = data_events(after.text)
        assert after.status_code == 200 and events[-1] == "[DONE]"
        assert "Hello" in after.text and "no event in 0.5 s" in json.loads(events[-2])["error"]["message"]
    else:
        assert after.status_code == 502 and "no event in 0.5 s" in after.json()["error"]["message"]
    assert fell_back.status_code == 200 and fell_back.headers["x-specgate-route"].startswith("tier=local;")


@pytest.mark.parametrize("stream_", [False, True])
async def test_a_stream_of_only_done_is_no_answer(upstream: RawUpstream, gateway: str, stream_: bool) -> None:
    """`[DONE]` before any choice (or after a usage chunk alone) is a 502 `upstream_bad_response`,
    not an empty 200 (for a request not streamed, a message of empty content that was cached)."""
    usage = {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}}
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [stream([]), stream([usage])]
        bare = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
        usage_only = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
    assert bare.status_code == 502, bare.text
    assert bare.json()["error"]["code"] == "upstream_bad_response"
    if stream_:  # the usage chunk was an event: the stream had begun
        assert json.loads(data_events(usage_only.text)[-2])["error"]["code"] == "upstream_stream_broken"
        assert "[DONE] before any choice" in usage_only.text
    else:
        assert usage_only.status_code == 502 and "[DONE] before any choice" in usage_only.text


async def test_an_unknown_models_404_lists_what_the_router_serves(gateway: str) -> None:
    """The 404 names every model /v1/models lists: it listed the local engine's alone, not `auto`
    or the upstreams' models, which are served too."""
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "model": "gpt-9"})
        listed = {m["id"] for m in (await c.get(gateway + "/models")).json()["data"]}
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert listed == {"auto", "fake", "up-model"}
    assert r.json()["error"]["message"].endswith("Available: " + ", ".join(sorted(listed)))


REFUSALS = {
    401: b'{"error": {"message": "Incorrect API key provided.", "type": "authentication_error", '
    b'"code": "invalid_api_key"}}',
    403: b'{"error": {"message": "Project lacks access", "type": "permission_error"}}',
    404: b'{"error": {"message": "The model \'up-model\' does not exist.", "type": "invalid_request_error", '
    b'"param": "model", "code": "model_not_found"}}',
}


@pytest.mark.parametrize("code", REFUSALS)
async def test_an_upstream_refusing_the_gateway_is_no_client_error(
    upstream: RawUpstream, gateway: str, code: int
) -> None:
    """401, 403 and 404 answer the gateway's settings (its key, model, base_url), not the client's
    request. Passed on, a client with a good key got the SDK's AuthenticationError ("Incorrect API
    key") and a client asking for `auto` a 404 for a model it never named, with no fallback: a real
    second gateway requiring keys answered so. Now a 502 naming the upstream, and `auto` falls back."""
    async with httpx.AsyncClient(timeout=10) as c:
        upstream.actions = [status(code, REFUSALS[code])]
        r = await c.post(gateway + "/chat/completions", json=CHAT)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "upstream_refused_gateway"
        assert err["param"] is None and f"upstream 'u': HTTP {code}" in err["message"]
        for stream_ in (False, True):
            upstream.actions = [status(code, REFUSALS[code])]
            r = await c.post(gateway + "/chat/completions", json={**CHAT, "model": "auto", "stream": stream_})
            assert r.status_code == 200 and r.headers["x-specgate-route"].startswith("tier=local;")
            assert "local answer" in r.text


async def test_an_upstream_is_served_by_its_name_too(upstream: RawUpstream, gateway: str) -> None:
    """`model: "u"` (the upstream's configured name, the router's explicit route) reaches it: the
    404 check for unknown models took it for one (tests/gateway/test_drain.py names upstreams so)."""
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "model": "u"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello"


async def test_an_upstreams_429_is_not_charged_to_the_clients_rate_limit(upstream: RawUpstream) -> None:
    """A request an upstream turned away (its 429, passed on) was not served: it is given back to
    the key's requests-per-minute, as the gateway's own failures (5xx) are. It counted, so a client
    at rpm 1 got the upstream's 429 and then the gateway's own for the retry its SDK made."""
    base, server, task = await serve_gateway(upstream, limits={"rpm": 1})
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            upstream.actions = [status(429, headers=b"retry-after: 20\r\n")]
            turned_away = await c.post(base + "/chat/completions", json=CHAT)
            served = await c.post(base + "/chat/completions", json=CHAT)
            limited = await c.post(base + "/chat/completions", json=CHAT)
    finally:
        server.should_exit = True
        await task
    assert turned_away.status_code == 429 and "upstream 'u'" in turned_away.json()["error"]["message"]
    assert served.status_code == 200, served.text
    assert upstream.requests == 2  # the third is the key's own limit, refused here
    assert limited.status_code == 429 and "upstream" not in limited.json()["error"]["message"]


def raw_stream(events: list[dict[str, Any]], eol: bytes = b"\n") -> Action:
    """A 200 stream of ``events`` as a server writes them with raw UTF-8 (pydantic's and
    ``ensure_ascii=False``'s JSON: vLLM's, and the gateway's own), each line ended by ``eol``."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + CLOSE
        )
        lines = [b"data: " + json.dumps(e, ensure_ascii=False).encode() for e in events] + [b"data: [DONE]"]
        for line in lines:
            piece = line + eol + eol
            for part in (piece[: len(piece) - 1], piece[-1:]):  # an eol split between two chunks too
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
                await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    return act


TEXT = "line one\u2028two\u2029three\x85four"  # separators str.splitlines knows and SSE does not
ENDINGS = {"LF": b"\n", "CRLF": b"\r\n", "CR": b"\r"}


@pytest.mark.parametrize("eol", ENDINGS.values(), ids=ENDINGS.keys())
@pytest.mark.parametrize("stream_", [True, False], ids=["stream", "whole"])
async def test_text_holding_unicode_line_separators_passes_through(
    upstream: RawUpstream, gateway: str, eol: bytes, stream_: bool
) -> None:
    """httpx's aiter_lines ends a line wherever str.splitlines does (U+2028, U+2029, U+0085 and
    more), which JSON leaves raw inside a string: such an answer broke mid-stream
    ("invalid JSON (Unterminated string)") or was a 502. SSE ends lines at CR, LF and CRLF only."""
    upstream.actions = [raw_stream([chunk({"role": "assistant", "content": ""}), chunk({"content": TEXT}),
                                    chunk({}, "stop")], eol)]  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
    assert r.status_code == 200, r.text
    if stream_:
        events = data_events(r.text)
        assert events[-1] == "[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    else:
        text = r.json()["choices"][0]["message"]["content"]
    assert text == TEXT


def endless_event(up: RawUpstream, first: bool) -> Action:
    """An event that never ends: data without a line end, more than the gateway reads of one event,
    then the connection held open (nothing would end the read but timeout_s)."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + CLOSE
        )
        head = b"" if first else b"data: " + json.dumps(chunk({"content": "Hi"})).encode() + b"\n\n"
        head += b'data: {"choices": [{"index": 0, "delta": {"content": "'
        w.write(b"%x\r\n%s\r\n" % (len(head), head))
        blob = b"x" * (1 << 20)
        try:
            for _ in range((MAX_EVENT_BYTES >> 20) + 2):
                w.write(b"%x\r\n%s\r\n" % (len(blob), blob))
                await w.drain()
            while await r.read(1024):
                pass
        except ConnectionError:
            pass  # the gateway hung up while this still wrote (unread data: a reset)
        up.closed_by_gateway.set()

    return act


@pytest.mark.parametrize("first", [True, False], ids=["first event", "mid-stream"])
async def test_an_event_past_the_size_limit_is_the_upstreams_fault(
    upstream: RawUpstream, first: bool
) -> None:
    """An upstream's event was read whole, however long, until timeout_s passed between events: one
    event of 400 MB held ~1.7 GB of the gateway's memory for 2 s, and at the default 60 s any
    upstream sending bytes without a line end could take the process down, every tenant with it."""
    base, server, task = await serve_gateway(upstream, timeout_s=600)
    try:
        upstream.actions = [endless_event(upstream, first)]
        async with httpx.AsyncClient(timeout=None) as c:
            body = {**CHAT, "model": "up-model", "stream": not first}
            r = await asyncio.wait_for(c.post(base + "/chat/completions", json=body), 120)  # not 600 s
        if first:  # before the first byte: the upstream's fault, and the route falls back (none here)
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "upstream_bad_response"
        else:
            events = data_events(r.text)
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "upstream_stream_broken" and "over" in err["message"], err
        await asyncio.wait_for(upstream.closed_by_gateway.wait(), 30)
    finally:
        server.should_exit = True
        await task


def http_date(seconds_ahead: float) -> bytes:
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds_ahead)
    return email.utils.format_datetime(when, usegmt=True).encode()


BUSY = {  # the upstream's status and Retry-After header, our status, the least Retry-After we may say
    "429 without Retry-After": (429, lambda: b"", 429, 1),
    "503 without Retry-After": (503, lambda: b"", 503, 1),
    # the date is written when the test runs: one written at collection had passed in a long suite
    "429 with an HTTP date": (429, lambda: b"retry-after: " + http_date(600) + b"\r\n", 429, 500),
    "429 with an infinite one": (429, lambda: b"retry-after: inf\r\n", 429, 1),
    "503 with nan": (503, lambda: b"retry-after: nan\r\n", 503, 1),
}


@pytest.mark.parametrize(("answer", "header", "code", "least"), BUSY.values(), ids=BUSY.keys())
@pytest.mark.parametrize("stream_", [False, True], ids=["whole", "stream"])
async def test_an_upstreams_busy_answer_always_says_when_to_retry(
    upstream: RawUpstream,
    gateway: str,
    answer: int,
    header: Callable[[], bytes],
    code: int,
    least: int,
    stream_: bool,
) -> None:
    """A 429 or 503 is answered with Retry-After (OPENAI-CONTRACT: the SDK and proxies pace their
    retries by it): an upstream's without the header, or with an HTTP date (RFC 9110's other form,
    which was read as none), came back without one."""
    upstream.actions = [status(answer, headers=header())]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
    assert r.status_code == code, r.text
    assert int(r.headers["retry-after"]) >= least


async def test_an_upstream_refusing_connections_is_a_503_with_retry_after() -> None:
    up = RawUpstream()  # never started: nothing listens on its port
    base, server, task = await serve_gateway(up)
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(base + "/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable", r.text
        assert int(r.headers["retry-after"]) >= 1
    finally:
        server.should_exit = True
        await task


def endless_error(up: RawUpstream) -> Action:
    """A 500 whose body is longer than anything worth reading and never ends."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 500 X\r\ncontent-type: application/json\r\ncontent-length: 999999999\r\n" + CLOSE)
        w.write(b'{"error": {"message": "' + b"x" * (MAX_ERROR_BYTES * 2))
        try:
            await w.drain()
            while await r.read(1024):
                pass
        except ConnectionError:
            pass
        up.closed_by_gateway.set()

    return act


async def test_an_error_body_is_read_no_further_than_its_message(upstream: RawUpstream) -> None:
    """An upstream's error body was read whole before the gateway answered: one that never ended
    held the request until timeout_s (600 s here), then a 504 in place of the upstream's 502."""
    base, server, task = await serve_gateway(upstream, timeout_s=600)
    try:
        upstream.actions = [endless_error(upstream)]
        async with httpx.AsyncClient(timeout=None) as c:
            r = await asyncio.wait_for(c.post(base + "/chat/completions", json=CHAT), 120)
        assert r.status_code == 502 and len(r.json()["error"]["message"]) < 2_000, r.text[:300]
        await asyncio.wait_for(upstream.closed_by_gateway.wait(), 30)
    finally:
        server.should_exit = True
        await task


OLD_VLLM_ERROR = {"object": "error", "message": "boom", "type": "BadRequestError", "param": None, "code": 400}
CUT_SHORT = {  # what the upstream sent after its role chunk and "Hello"; what the client is told
    "[DONE] before the finish": ([], "[DONE] before choice 0 finished"),
    "vLLM's older error object": ([OLD_VLLM_ERROR], "boom"),
}


@pytest.mark.parametrize(("tail", "said"), CUT_SHORT.values(), ids=CUT_SHORT.keys())
@pytest.mark.parametrize("stream_", [False, True], ids=["whole", "stream"])
async def test_an_answer_the_upstream_never_finished_is_no_answer(
    upstream: RawUpstream, gateway: str, tail: list[dict[str, Any]], said: str, stream_: bool
) -> None:
    """A stream that ended ([DONE]) with a choice unfinished, or whose error came in vLLM's older
    shape (no "error" key, read as a chunk of no choices), was a complete answer: streamed without a
    finish chunk, or a 200 whose finish_reason the gateway made "stop" (and cached as such)."""
    upstream.actions = [stream([*good_chunks()[:2], *tail])]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": stream_})
    if stream_:
        events = data_events(r.text)
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert not any(json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2])
    else:
        assert r.status_code == 502, r.text
        err = r.json()["error"]
    assert said in err["message"], err


async def test_vllms_older_error_object_as_the_first_event_is_a_502(
    upstream: RawUpstream, gateway: str
) -> None:
    upstream.actions = [stream([OLD_VLLM_ERROR])]
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(gateway + "/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 502 and "boom" in r.json()["error"]["message"], r.text


def first_then_wait(up: RawUpstream, release: asyncio.Event) -> Action:
    """A stream's role chunk and first content, then the rest once ``release`` is set."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + CLOSE
        )
        for part in (good_chunks()[:2], [chunk({}, "stop")]):
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in part)
            if part[0].get("choices", [{}])[0].get("finish_reason"):
                await release.wait()
                body += b"data: [DONE]\n\n"
            w.write(b"%x\r\n%s\r\n" % (len(body), body))
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    return act


async def test_more_concurrent_streams_than_httpxs_pool_are_served(upstream: RawUpstream) -> None:
    """httpx's pool holds 100 connections by default: the 101st concurrent stream to one upstream
    waited timeout_s for a slot, then was a 504 counted against the upstream's breaker, which opened
    for every tenant though the upstream answered every call. `max_connections` (unset: no limit)."""
    base, server, task = await serve_gateway(upstream, timeout_s=600, breaker_failures=1)
    release = asyncio.Event()
    streams = 110
    upstream.actions = [first_then_wait(upstream, release) for _ in range(streams)]
    try:
        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as c:
            opened = asyncio.Queue[None]()

            async def one() -> list[str]:
                async with c.stream("POST", base + "/chat/completions", json={**CHAT, "stream": True}) as r:
                    assert r.status_code == 200, await r.aread()
                    lines = []
                    async for line in r.aiter_lines():
                        if "Hello" in line:
                            opened.put_nowait(None)
                        lines.append(line)
                    return lines

            calls = [asyncio.ensure_future(one()) for _ in range(streams)]
            for _ in range(streams):  # every stream has its first content: all are open at once
                await asyncio.wait_for(opened.get(), 120)
            release.set()
            for lines in await asyncio.gather(*calls):
                events = data_events("\n".join(lines) + "\n")
                assert events[-1] == "[DONE]" and '"finish_reason":"stop"' in events[-2], events[-2:]
    finally:
        release.set()
        server.should_exit = True
        await task


def trickle(release: asyncio.Event) -> Action:
    """A stream that sends a content chunk every 0.1 s (well inside timeout_s) until ``release``."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n" + CLOSE
        )
        events = [*good_chunks()[:2]]
        while True:
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            w.write(b"%x\r\n%s\r\n" % (len(body), body))
            await w.drain()
            if release.is_set():
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(release.wait(), 0.1)
            events = [chunk({"content": "."})] if not release.is_set() else [chunk({}, "stop")]
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"))
        await w.drain()

    return act


async def test_a_full_connection_pool_is_a_503_that_leaves_the_breaker_closed(upstream: RawUpstream) -> None:
    base, server, task = await serve_gateway(upstream, timeout_s=2.0, breaker_failures=1, max_connections=1)
    release = asyncio.Event()
    upstream.actions = [trickle(release)]
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", base + "/chat/completions", json={**CHAT, "stream": True}) as held:
                lines = held.aiter_lines()  # held: a dropped one closes the stream when collected
                async for line in lines:
                    if "Hello" in line:
                        break  # the one connection is this stream's
                r = await c.post(base + "/chat/completions", json=CHAT)
                assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_busy", r.text
                assert int(r.headers["retry-after"]) >= 1
                release.set()
            r = await c.post(base + "/chat/completions", json=CHAT)  # the circuit did not open
            assert r.status_code == 200, r.text
    finally:
        release.set()
        server.should_exit = True
        await task


async def test_a_request_larger_than_the_whole_tpm_never_reaches_the_upstream(upstream: RawUpstream) -> None:
    """An upstream's model has no tokenizer here: its prompt is estimated (four characters a token,
    as OpenAI estimates), and a request whose estimate plus max_tokens exceeds the key's tpm is
    refused before the upstream is called, as a local model's is."""
    base, server, task = await serve_gateway(upstream, limits={"tpm": 100})
    long_chat = {"model": "up-model", "messages": [{"role": "user", "content": "word " * 200}]}
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            too_large = await c.post(base + "/chat/completions", json=CHAT | {"max_tokens": 101})
            too_long = await c.post(base + "/chat/completions", json=long_chat | {"max_tokens": 1})
            fits = await c.post(base + "/chat/completions", json=CHAT | {"max_tokens": 50})
    finally:
        server.should_exit = True
        await task
    for r in (too_large, too_long):
        assert r.status_code == 429 and "Request too large for up-model" in r.json()["error"]["message"]
        assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
    assert fits.status_code == 200, fits.text
    assert upstream.requests == 1
