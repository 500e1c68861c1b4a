"""What a request served by a remote upstream tells the operator: the upstream that served it
(``specgate.upstream`` on the server span, ``upstream=`` in the log line), and, for a client that
leaves, the phase it left in (``upstream`` waiting for the first event, ``stream`` once the
upstream's stream was being passed on). Before, the record's upstream was never set, and a remote
request's abort was counted in phase ``other`` (the record's "gateway", no phase of the metric's).

The real app on uvicorn, a raw upstream on loopback, and the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.gateway.test_remote_faults import RawUpstream, chunk, hold
from tests.observability.test_stream_errors import serve, stop

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


async def server_span(exporter: InMemorySpanExporter) -> Any:
    """The request's server span, once the middleware has finished with it (it ends after the
    client has gone, in the server's own time)."""
    for _ in range(3000):
        spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
        if spans:
            assert len(spans) == 1
            return spans[0]
        await asyncio.sleep(0.01)
    raise AssertionError("the server span never ended")


def first_then_hold(up: RawUpstream) -> Any:
    """A 200 stream of the role and one content chunk, then nothing until the gateway hangs up."""

    async def act(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for e in (chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"})):
            piece = b"data: " + json.dumps(e).encode() + b"\n\n"
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        await w.drain()
        up.holding.set()
        while await r.read(1024):
            pass
        up.closed_by_gateway.set()

    return act


async def test_the_upstream_that_served_is_named_in_the_span_and_the_log_line(
    upstream: RawUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    base, _obs, exporter, handle = await serve(upstream, ScriptedEngine([token_ids("Hello")]))
    try:
        with caplog.at_level(logging.INFO, logger="specgate.request"):
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                r = await c.post("/v1/chat/completions", json=CHAT | {"model": "up-model"})
                assert r.status_code == 200
                span = await server_span(exporter)
                exporter.clear()
                r = await c.post("/v1/chat/completions", json=CHAT | {"model": "fake"})
                assert r.status_code == 200
                local = await server_span(exporter)
    finally:
        await stop(handle)
    assert span.attributes["specgate.upstream"] == "u"
    assert "specgate.upstream" not in local.attributes
    lines = [r.getMessage() for r in caplog.records if r.name == "specgate.request"]
    assert len(lines) == 2 and "upstream=u" in lines[0] and "upstream=" not in lines[1], lines


@pytest.mark.parametrize("phase", ["upstream", "stream"])
async def test_a_client_leaving_a_remote_request_is_counted_in_its_phase(
    upstream: RawUpstream, phase: str
) -> None:
    base, obs, exporter, handle = await serve(upstream, ScriptedEngine([token_ids("Hello")]))
    upstream.actions = [hold(upstream) if phase == "upstream" else first_then_hold(upstream)]
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            if phase == "upstream":  # no byte yet: the client gives up waiting
                call = asyncio.ensure_future(
                    c.post("/v1/chat/completions", json=CHAT | {"model": "up-model"})
                )
                await asyncio.wait_for(upstream.holding.wait(), 30)
                call.cancel()
                await asyncio.wait({call})
            else:  # the client reads the first content, then hangs up
                async with c.stream("POST", "/v1/chat/completions", json=CHAT | {"model": "up-model"}) as r:
                    async for line in r.aiter_lines():
                        if "Hel" in line:
                            break
            await asyncio.wait_for(upstream.closed_by_gateway.wait(), 30)
            span = await server_span(exporter)
    finally:
        await stop(handle)
    assert span.attributes["specgate.aborted_phase"] == phase
    assert (
        obs.metrics.value("specgate_aborted_requests_total", route="/v1/chat/completions", phase=phase) == 1
    )
    assert (
        obs.metrics.value("specgate_aborted_requests_total", route="/v1/chat/completions", phase="other") == 0
    )


async def test_a_remote_fallback_from_a_full_local_engine_is_labelled_with_the_model_that_served(
    upstream: RawUpstream,
) -> None:
    """The engine's wrapper names the record's model when a request is submitted, refused or not:
    a local tier whose engine was full, falling back to an upstream, was counted and traced as the
    local model's."""
    engine = ScriptedEngine([token_ids("Hello")], overloaded=1)
    tiers = [
        {"name": "local", "model": "fake", "fallback": ["remote"]},
        {"name": "remote", "upstream": "u", "threshold": 0.99},
    ]
    base, obs, exporter, handle = await serve(upstream, engine, tiers=tiers)
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            r = await c.post("/v1/chat/completions", json=CHAT | {"model": "auto"})
            assert r.status_code == 200 and r.headers["x-specgate-route"].startswith("tier=remote;"), r.text
            span = await server_span(exporter)
    finally:
        await stop(handle)
    assert span.attributes["gen_ai.response.model"] == "up-model"
    assert span.attributes["specgate.upstream"] == "u"
    labels = {"route": "/v1/chat/completions", "status": "200"}
    assert obs.metrics.value("specgate_requests_total", model="up-model", **labels) == 1
    assert obs.metrics.value("specgate_requests_total", model="fake", **labels) == 0
