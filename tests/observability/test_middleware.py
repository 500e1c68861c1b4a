"""The middleware, engine proxy and request log on a small in-process app and a scripted engine."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.observability import Observability, ObservabilitySettings
from tests.observability.app import make_app
from tests.observability.conftest import CANARY, ScriptedEngine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
STEPS = [(4, 2, [1, 2, 3]), (0, 0, [4]), (2, 2, [5, 6, 7])]  # 7 tokens, drafted 6, accepted 4


def _body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"say {CANARY}"}],
        "completion_text": CANARY,
        **extra,
    }


async def _post(app: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        return await c.post("/v1/chat/completions", json=body, headers=headers or {})


async def test_metrics_match_what_happened(provider: TracerProvider) -> None:
    obs = Observability(tracer_provider=provider, models=["tiny"])
    app = make_app(obs, ScriptedEngine(STEPS))
    for _ in range(2):
        r = await _post(app, _body())
        assert r.status_code == 200
    m = obs.metrics
    assert m.value("specgate_requests_total", route="/v1/chat/completions", model="tiny", status="200") == 2
    assert m.value("specgate_completion_tokens_total", model="tiny") == 14
    assert m.value("specgate_prompt_tokens_total", model="tiny") == 2 * len(f"say {CANARY}")
    assert m.value("specgate_spec_drafted_tokens_total", model="tiny") == 12
    assert m.value("specgate_spec_accepted_tokens_total", model="tiny") == 8
    assert m.value("specgate_time_to_first_token_seconds_count", model="tiny") == 2
    assert (
        m.value("specgate_generations_total", model="tiny", finish_reason="length", drafter="draft-model")
        == 2
    )
    assert m.value("specgate_requests_in_flight", route="/v1/chat/completions") == 0
    scrape = await _get(app, "/metrics")
    assert scrape.status_code == 200 and "specgate_spec_accepted_tokens_total" in scrape.text


async def _get(app: Any, path: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        return await c.get(path)


async def test_spans_structure_attributes_and_incoming_traceparent(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    obs = Observability(tracer_provider=provider, models=["tiny"])
    app = make_app(obs, ScriptedEngine(STEPS))
    r = await _post(app, _body(), {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "abc"})
    assert r.status_code == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "POST /v1/chat/completions",
        "specgate.cache.lookup",
        "specgate.route",
        "chat tiny",
        "specgate.queue",
        "specgate.prefill",
        "specgate.decode",
    }
    root = spans["POST /v1/chat/completions"]
    assert root.kind == SpanKind.SERVER
    assert format(root.context.trace_id, "032x") == TRACE_ID  # continues the caller's trace
    assert root.parent is not None and format(root.parent.span_id, "016x") == PARENT_ID
    for name in ("specgate.cache.lookup", "specgate.route", "chat tiny"):
        assert spans[name].parent.span_id == root.context.span_id, name
    gen = spans["chat tiny"]
    for name in ("specgate.queue", "specgate.prefill", "specgate.decode"):
        assert spans[name].parent.span_id == gen.context.span_id, name
    q, p, d = spans["specgate.queue"], spans["specgate.prefill"], spans["specgate.decode"]
    assert q.start_time <= q.end_time <= p.start_time + 1 and p.end_time <= d.start_time + 1
    assert d.end_time <= gen.end_time <= root.end_time
    assert gen.attributes["gen_ai.request.model"] == "tiny"
    assert gen.attributes["gen_ai.usage.output_tokens"] == 7
    assert gen.attributes["specgate.spec.accepted"] == 4
    assert gen.attributes["specgate.spec.drafted"] == 6
    assert tuple(gen.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.usage.input_tokens"] == len(f"say {CANARY}")
    assert a["gen_ai.usage.output_tokens"] == 7
    assert a["specgate.request_id"] == "abc"
    assert a["specgate.route.tier"] == "large" and a["specgate.route.strategy"] == "draft"
    assert a.get("http.response.status_code", a.get("http.status_code")) == 200


async def test_traceparent_is_forwarded_to_an_upstream(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    obs = Observability(tracer_provider=provider)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as upstream:
        app = make_app(obs, ScriptedEngine(STEPS), upstream)
        r = await _post(app, _body(), {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200 and len(seen) == 1
    _, trace_id, parent_id, _ = seen[0].headers["traceparent"].split("-")
    assert trace_id == TRACE_ID
    client = next(s for s in exporter.get_finished_spans() if s.kind == SpanKind.CLIENT)
    root = next(s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert format(client.context.span_id, "016x") == parent_id  # the upstream's parent is our client span
    assert client.parent.span_id == root.context.span_id


async def test_tracing_off_still_forwards_the_incoming_context() -> None:
    seen: list[httpx.Request] = []
    obs = Observability(from_env=False)
    assert not obs.tracing.enabled
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: seen.append(r) or httpx.Response(200))
    ) as up:
        app = make_app(obs, ScriptedEngine(STEPS), up)
        await _post(app, _body(), {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert TRACE_ID in seen[0].headers["traceparent"]


async def test_canary_absent_from_logs_spans_and_metrics(
    provider: TracerProvider, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    obs = Observability(ObservabilitySettings(log_json=True), tracer_provider=provider, models=["tiny"])
    app = make_app(obs, ScriptedEngine(STEPS))
    with caplog.at_level(logging.DEBUG, logger="specgate"):
        assert (await _post(app, _body())).status_code == 200
        assert (await _post(app, _body(stream=True))).status_code == 200
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert logs.count('"route":"/v1/chat/completions"') == 2
    assert CANARY not in logs
    assert CANARY not in _all_span_text(exporter)
    assert CANARY not in obs.metrics.render().decode()


async def test_canary_present_when_log_content_is_on(
    provider: TracerProvider, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    obs = Observability(ObservabilitySettings(log_json=True, log_content=True), tracer_provider=provider)
    app = make_app(obs, ScriptedEngine(STEPS))
    with caplog.at_level(logging.INFO, logger="specgate.request"):
        await _post(app, _body())
    line = json.loads(caplog.records[-1].getMessage())
    assert CANARY in line["prompt"] and line["completion"] == CANARY
    assert CANARY in _all_span_text(exporter)
    assert CANARY not in obs.metrics.render().decode()  # never in metrics


async def test_request_log_line(provider: TracerProvider, caplog: pytest.LogCaptureFixture) -> None:
    obs = Observability(ObservabilitySettings(log_json=True), tracer_provider=provider)
    app = make_app(obs, ScriptedEngine(STEPS))
    with caplog.at_level(logging.INFO, logger="specgate.request"):
        await _post(app, _body(), {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "rid-9"})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            await c.post("/v1/completions", json={})
    ok, bad = (json.loads(r.getMessage()) for r in caplog.records[-2:])
    assert ok["request_id"] == "rid-9" and ok["trace_id"] == TRACE_ID and ok["status"] == 200
    assert (
        ok["model"] == "tiny" and ok["prompt_tokens"] == len(f"say {CANARY}") and ok["completion_tokens"] == 7
    )
    assert ok["spec_accepted"] == 4 and ok["spec_drafted"] == 6 and ok["finish_reasons"] == "length"
    assert {"duration_ms", "ttft_ms", "queue_ms", "prefill_ms", "decode_ms"} <= set(ok)
    assert bad["status"] == 400 and bad["error_type"] == "invalid_request_error"
    assert "secret text" not in caplog.text
    assert (
        obs.metrics.value("specgate_requests_total", route="/v1/completions", model="none", status="400") == 1
    )


async def test_client_disconnect_is_counted_as_an_abort_in_decode(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A client leaving is counted as an abort, and no span calls it an error: the engine's span
    was ERROR GeneratorExit, so every stream a client closed early was an engine failure in a
    trace search for errors."""
    obs = Observability(tracer_provider=provider, models=["tiny"])
    engine = ScriptedEngine([(2, 1, [i]) for i in range(50)], delay=0.01)
    app = make_app(obs, engine)
    body = json.dumps(_body(stream=True)).encode()
    sent: list[dict[str, Any]] = []
    stage = 0

    async def receive() -> dict[str, Any]:
        nonlocal stage
        stage += 1
        if stage == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(0.1)  # a few steps stream out, then the client goes away
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json")], "client": ("t", 1), "server": ("gw", 80),
    }  # fmt: skip
    await app(scope, receive, send)
    assert engine.aborted, "leaving the stream must abort the generation"
    assert (
        obs.metrics.value("specgate_aborted_requests_total", route="/v1/chat/completions", phase="decode")
        == 1
    )
    assert any(m.get("body") for m in sent)
    spans = exporter.get_finished_spans()
    assert all(s.status.status_code is not StatusCode.ERROR for s in spans), [s.name for s in spans]
    assert [s.name for s in spans if (s.attributes or {}).get("specgate.aborted")] == ["chat tiny"]


def _all_span_text(exporter: InMemorySpanExporter) -> str:
    parts = []
    for s in exporter.get_finished_spans():
        parts.append(s.name)
        parts.extend(f"{k}={v}" for k, v in (s.attributes or {}).items())
        parts.extend(str(e.attributes) for e in s.events)
    return "\n".join(parts)


async def test_the_server_span_keeps_no_query_string_and_a_bounded_path(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """``http.url`` carried a query string whole (a key sent as ``?api-key=``) and ``http.target``
    a 20 KB path."""
    obs = Observability(tracer_provider=provider, models=["tiny"])
    app = make_app(obs, ScriptedEngine(STEPS))
    await _get(app, "/v1/models/" + "m" * 20_000 + f"?api-key={CANARY}")
    await _get(app, f"/v1/models?q={CANARY}")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        await c.get("/v1/models", headers={"user-agent": "u" * 20_000})  # and the user agent, cut
    spans = exporter.get_finished_spans()[:2]
    assert len(spans) == 2
    text = _all_span_text(exporter)
    assert CANARY not in text and len(text) < 5_000
    assert spans[1].attributes["http.url"] == "http://gw/v1/models"
    assert spans[1].attributes["http.target"] == "/v1/models"


@pytest.mark.parametrize(
    ("host", "path"),
    [
        ("healthbot.internal", "/v1/chat/completions"),  # a deployment's own name
        ("metrics-gw:8000", "/v1/chat/completions"),
        ("gw", "/v1/models/ready"),  # a client's path that holds an untraced one
        ("gw", "/v1/models/x/metrics"),
    ],
)
async def test_only_the_probe_and_scrape_paths_go_untraced(
    provider: TracerProvider, exporter: InMemorySpanExporter, host: str, path: str
) -> None:
    """Untraced URLs were regexes searched anywhere in ``scheme://host/path``: every request to a
    host named ``healthbot...`` or ``metrics-gw`` (the Host header's, a client's to set) went
    untraced, and so did any path holding ``/ready`` or ``/metrics``."""
    obs = Observability(tracer_provider=provider, models=["tiny"])
    app = make_app(obs, ScriptedEngine(STEPS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}") as c:
        if path == "/v1/chat/completions":
            await c.post(path, json=_body())
        else:
            await c.get(path)
        for probe in ("/metrics", "/health", "/ready", "/dashboard"):
            await c.get(probe)
    servers = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert [s.attributes["http.target"] for s in servers] == [path]
