"""The upstream client against a real OpenAI-compatible server over loopback (tests/router/fake_upstream.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.breaker import BreakerState
from router.config import RouterSettings, TierSettings, UpstreamSettings
from router.faults import (
    CircuitOpen,
    UpstreamConnectError,
    UpstreamHTTPError,
    UpstreamRejected,
    UpstreamStreamBroken,
    UpstreamTimeout,
    UpstreamUnavailable,
    malformed,
)
from router.policy import Router
from router.pool import UpstreamPool, first_available
from router.upstream import Rewrite, UpstreamClient, encode_event
from tests.router.conftest import FakeUpstream

BODY: dict[str, Any] = {
    "model": "auto",
    "messages": [{"role": "user", "content": "hi"}],
    "speculative": {"mode": "off"},
}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def settings(fake: FakeUpstream, **kw: Any) -> UpstreamSettings:
    base: dict[str, Any] = {"name": f"fake{fake.port}", "base_url": fake.base_url, "model": "up-model",
                            "timeout_s": 5.0, "retries": 2, "backoff_s": 0.01}  # fmt: skip
    return UpstreamSettings(**(base | kw))


@pytest.fixture
async def client(upstream: FakeUpstream) -> AsyncIterator[UpstreamClient]:
    upstream.script([])
    c = UpstreamClient(settings(upstream))
    yield c
    await c.aclose()


async def collect(
    c: UpstreamClient, rewrite: Rewrite | None = None, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    stream = await c.open_stream("chat/completions", BODY, headers, rewrite)
    return [event async for event in stream]


async def test_stream_passthrough_is_byte_correct(upstream: FakeUpstream, client: UpstreamClient) -> None:
    # The fake splits events inside multi-byte characters and between the two newlines.
    raw = httpx.get(f"http://127.0.0.1:{upstream.port}/_raw", params={"model": "up-model"}).content
    events = await collect(client, headers={"TraceParent": TRACEPARENT, "authorization": "Bearer client-key"})
    assert b"".join(encode_event(e) for e in events) + b"data: [DONE]\n\n" == raw
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello, wörld ✓ 日本語!"
    [req] = upstream.seen()
    headers, body = req["headers"], req["body"]
    assert isinstance(headers, dict) and isinstance(body, dict)
    assert headers["traceparent"] == TRACEPARENT
    assert "authorization" not in headers  # the client's key is ours, never the upstream's
    assert body["model"] == "up-model" and body["stream"] is True and "speculative" not in body


async def test_requests_one_after_another_reuse_one_connection(
    upstream: FakeUpstream, client: UpstreamClient
) -> None:
    """A whole answer's connection goes back to the pool: closed before the chunked body's end was
    read (it follows [DONE]), each request opened a new one, a TLS handshake each to a hosted API."""
    for _ in range(5):
        events = await collect(client)
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        await asyncio.sleep(0.05)  # the body's end is read in the background, after the answer
    assert len({s["peer"] for s in upstream.seen()}) == 1


async def test_chunks_rewritten_to_our_id_and_model(client: UpstreamClient) -> None:
    rw = Rewrite(id="chatcmpl-ours", model="auto", created=123, include_usage=True)
    events = await collect(client, rw)
    assert {(e["id"], e["model"], e["created"]) for e in events} == {("chatcmpl-ours", "auto", 123)}
    assert all(e["usage"] is None for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_non_stream(upstream: FakeUpstream, client: UpstreamClient) -> None:
    out = await client.complete(
        "chat/completions", BODY, {"traceparent": TRACEPARENT}, Rewrite(id="chatcmpl-x", model="auto")
    )
    assert out["id"] == "chatcmpl-x" and out["model"] == "auto"
    assert out["choices"][0]["message"]["content"] == "Hello, wörld ✓ 日本語!"
    assert upstream.seen()[0]["body"]["stream"] is False


async def test_in_band_error_is_passed_on(upstream: FakeUpstream, client: UpstreamClient) -> None:
    upstream.script([{"kind": "ok", "error_after": 2}])
    events = await collect(client)
    assert events[-1] == {
        "error": {"message": "upstream exploded", "type": "server_error", "param": None, "code": "boom"}
    }
    assert [e["choices"][0]["delta"].get("content") for e in events[:-1]] == ["", "Hello", ", wörld"]


@pytest.mark.parametrize("status", [503, 429, 500])
async def test_retries_on_5xx_and_429(upstream: FakeUpstream, client: UpstreamClient, status: int) -> None:
    upstream.script([{"kind": "status", "status": status}, {"kind": "status", "status": status}])
    events = await collect(client)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(upstream.seen()) == 3


async def test_retry_after_is_honoured(upstream: FakeUpstream, client: UpstreamClient) -> None:
    upstream.script([{"kind": "status", "status": 429, "retry_after": 0.3}])
    t0 = time.perf_counter()
    await collect(client)
    assert time.perf_counter() - t0 >= 0.3


async def test_no_retry_on_400_and_error_passed_on(upstream: FakeUpstream, client: UpstreamClient) -> None:
    err = {
        "error": {
            "message": "max_tokens is too large",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
    upstream.script([{"kind": "status", "status": 400, "body": err}])
    with pytest.raises(UpstreamRejected) as info:
        await collect(client)
    assert info.value.status == 400 and info.value.error_body() == err
    assert len(upstream.seen()) == 1
    assert client.breaker.state == BreakerState.CLOSED


async def test_5xx_exhausted_maps_to_openai_error(upstream: FakeUpstream, client: UpstreamClient) -> None:
    upstream.script([{"kind": "status", "status": 503, "retry_after": 0}] * 3)
    with pytest.raises(UpstreamHTTPError) as info:
        await collect(client)
    assert len(upstream.seen()) == 3
    assert info.value.status == 503
    body = info.value.error_body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "server_error"


async def test_timeout_is_not_retried(upstream: FakeUpstream) -> None:
    upstream.script([{"kind": "hang", "seconds": 3}])
    c = UpstreamClient(settings(upstream, timeout_s=0.3))
    try:
        with pytest.raises(UpstreamTimeout) as info:
            await collect(c)
        assert info.value.status == 504 and len(upstream.seen()) == 1
    finally:
        await c.aclose()


async def test_dead_upstream_falls_back_before_the_first_byte(
    upstream: FakeUpstream, upstream_b: FakeUpstream
) -> None:
    upstream.script([])
    upstream_b.kill()
    pool = UpstreamPool([settings(upstream_b, name="b", retries=1), settings(upstream, name="a")])
    try:
        label, stream = await first_available(
            [
                (name, lambda name=name: pool[name].open_stream("chat/completions", BODY))
                for name in ("b", "a")
            ]
        )
        assert label == "a"
        assert [e async for e in stream][-1]["choices"][0]["finish_reason"] == "stop"
    finally:
        await pool.aclose()


async def test_only_a_real_fallback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Every 503 of an overloaded engine with no fallback logged a WARNING 'falling back' (to
    nothing): under overload, one line a refused request."""

    async def refused() -> str:
        raise UpstreamUnavailable("u", "full: the prompt 'secret plans' is too long")

    async def served() -> str:
        return "ok"

    with caplog.at_level(logging.WARNING, logger="specgate.router"):
        with pytest.raises(UpstreamUnavailable):
            await first_available([("only", refused)])
        assert caplog.records == []
        assert await first_available([("a", refused), ("b", served)]) == ("b", "ok")
    # ... naming the upstream and the error's code, not its message, which may quote the request
    assert [r.getMessage() for r in caplog.records] == [
        "route a failed before the first byte, falling back: upstream 'u': upstream_error"
    ]


async def test_upstream_killed_mid_stream_ends_with_a_clean_error(upstream_b: FakeUpstream) -> None:
    upstream_b.script([{"kind": "ok", "delay": 0.3}])
    c = UpstreamClient(settings(upstream_b))
    try:
        stream = await c.open_stream("chat/completions", BODY)
        seen = []
        with pytest.raises(UpstreamStreamBroken) as info:
            async for event in stream:
                seen.append(event)
                if len(seen) == 1:
                    upstream_b.kill()
        assert len(seen) >= 1  # the first event went out; no fallback is possible after it
        body = info.value.error_body()
        assert body["error"]["code"] == "upstream_stream_broken" and body["error"]["type"] == "server_error"
    finally:
        await c.aclose()


async def test_circuit_breaker_opens_and_recovers(upstream_b: FakeUpstream) -> None:
    c = UpstreamClient(settings(upstream_b, retries=0, breaker_failures=2, breaker_reset_s=0.5))
    try:
        upstream_b.kill()
        for _ in range(2):
            with pytest.raises(UpstreamConnectError):
                await collect(c)
        assert c.breaker.state == BreakerState.OPEN
        with pytest.raises(CircuitOpen) as info:
            await collect(c)  # refused without touching the network
        assert info.value.status == 503 and info.value.retry_after is not None and info.value.retry_after > 0
        upstream_b.start()
        await asyncio.sleep(0.5)
        assert c.breaker.state == BreakerState.HALF_OPEN
        assert (await collect(c))[-1]["choices"][0]["finish_reason"] == "stop"  # the probe
        assert c.breaker.state == BreakerState.CLOSED
    finally:
        await c.aclose()


READABLE = {  # what OpenAI-compatible servers send, fields the gateway does not read included
    "vllm chat": {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant",
                  "content": "Hi", "reasoning_content": None}, "logprobs": None, "finish_reason": None,
                  "stop_reason": None}], "usage": None},
    "usage": {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
              "prompt_tokens_details": None}},
    "tool call": {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                  "function": {"name": "f", "arguments": ""}}]}}]},
    "completion": {"choices": [{"index": 0, "text": "a", "logprobs": {"tokens": ["a"]}, "finish_reason": "stop"}]},
    "error event": {"error": {"message": "x", "param": {"odd": 1}}},
}  # fmt: skip
UNREADABLE = {  # -> the field named in the reason
    "choices.0": {"choices": ["Hello"]},
    "choices.0.index": {"choices": [{"index": True, "delta": {"content": "a"}}]},
    "choices": {"choices": {"a": 1}},
    "usage.prompt_tokens": {"choices": [], "usage": {"prompt_tokens": "3", "completion_tokens": 2}},
    "choices.0.delta.content": {"choices": [{"index": 0, "delta": {"content": {"text": "a"}}}]},
    "choices.0.delta.tool_calls.0.index": {
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": -1}]}}]
    },
    "choices.0.delta.tool_calls.0.function.arguments": {
        "choices": [
            {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": {"a": 1}}}]}}
        ]
    },
}


@pytest.mark.parametrize("event", READABLE.values(), ids=READABLE.keys())
def test_chunks_of_openai_compatible_servers_are_readable(event: dict[str, Any]) -> None:
    assert malformed(event) is None


@pytest.mark.parametrize(("field", "event"), UNREADABLE.items(), ids=UNREADABLE.keys())
def test_an_unreadable_chunk_names_its_field(field: str, event: dict[str, Any]) -> None:
    """A field the gateway reads, of the wrong type (strictly: "3" is no count, true no index)."""
    reason = malformed(event)
    assert reason is not None and reason.startswith(field + ":"), reason


async def test_a_gateway_fallback_is_logged_by_its_tier_and_model(caplog: pytest.LogCaptureFixture) -> None:
    """The gateway's attempts are labelled by their RouteDecision, whose dataclass repr (every
    field, its fallbacks' in full: ~500 characters) was the warning's 'route ...' on every fallback."""
    s = RouterSettings(tiers=[
        TierSettings(name="small", model="m"),
        TierSettings(name="remote", upstream="u", threshold=0.0, fallback=["small"]),
    ])  # fmt: skip
    d = Router(s, [UpstreamSettings(name="u", base_url="http://x/v1", model="up-model")], {"m": None}).route(
        "auto", prompt="hi"
    )

    async def refused() -> str:
        raise UpstreamUnavailable("u", "down")

    async def served() -> str:
        return "ok"

    with caplog.at_level(logging.WARNING, logger="specgate.router"):
        assert await first_available([(d, refused), (d.fallbacks[0], served)]) == (d.fallbacks[0], "ok")
    assert [r.getMessage() for r in caplog.records] == [
        "route remote (upstream u, model up-model) failed before the first byte, falling back: "
        "upstream 'u': upstream_error"
    ]
