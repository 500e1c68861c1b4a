"""A stream that fails after its 200 went out (one error event, then [DONE]) is recorded as failed:
the server span's status and ``error.type``, the log line's ``error_type``, and
``specgate_stream_errors_total``; an upstream's in-band error mid-stream is that upstream call's
``error`` outcome. Before, such a request was a clean 200 everywhere, so the 5xx alert and a trace
search for errors never saw an engine that failed or an upstream that broke mid-answer.

The real app on uvicorn, a raw upstream on loopback (tests/gateway/test_remote_faults.py's), a
scripted local engine, and the SDK's in-memory exporter."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.app import create_app
from gateway.observability import Observability
from gateway.settings import load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.gateway.test_remote_faults import RawUpstream, chunk, data_events, stream
from tests.servers import serve_in_loop

SECRET = "zebra-canary-7f3a"  # the upstream's error message quotes it: it stays out of telemetry


async def serve(
    up: RawUpstream, engine: ScriptedEngine, tiers: list[dict[str, Any]] | None = None
) -> tuple[str, Observability, InMemorySpanExporter, Any]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    obs = Observability(tracer_provider=provider, from_env=False)
    u = {"name": "u", "base_url": f"http://127.0.0.1:{up.port}/v1", "model": "up-model", "retries": 0,
         "timeout_s": 5.0}  # fmt: skip
    settings = load_settings(env={}, overrides={
        "cache": {"enabled": False}, "upstreams": [u], "models": [{"name": "fake", "source": "x"}],
        "router": {"tiers": tiers or [{"name": "local", "model": "fake"}]},
    })  # fmt: skip
    app = create_app(settings, engine=engine, observability=obs)  # type: ignore[arg-type]
    url, server, task = await serve_in_loop(app)
    return url, obs, exporter, (server, task)


async def stop(handle: Any) -> None:
    server, task = handle
    server.should_exit = True
    await task


def server_span(exporter: InMemorySpanExporter) -> Any:
    spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


CASES = {
    "upstream error event": ("up-model", "boom"),
    "local engine failure": ("fake", "server_error"),
}


@pytest.mark.parametrize(("model", "kind"), CASES.values(), ids=CASES.keys())
async def test_a_stream_that_fails_after_its_200_is_recorded_as_failed(
    upstream: RawUpstream, caplog: pytest.LogCaptureFixture, model: str, kind: str
) -> None:
    upstream.actions = [
        stream([
            chunk({"role": "assistant", "content": ""}),
            chunk({"content": "Hel"}),
            {"error": {"message": f"exploded on {SECRET}", "type": "server_error", "code": "boom"}},
        ])
    ]  # fmt: skip
    engine = ScriptedEngine([token_ids("Hel"), token_ids("lo")], fail=f"exploded on {SECRET}")
    base, obs, exporter, handle = await serve(upstream, engine)
    try:
        body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        with caplog.at_level(logging.INFO, logger="specgate.request"):
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                r = await c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                events = data_events(r.text)
                assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events
                metrics = (await c.get("/metrics")).text
    finally:
        await stop(handle)

    span = server_span(exporter)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == kind
    assert span.attributes["http.status_code"] == 200
    assert (
        obs.metrics.value(
            "specgate_stream_errors_total", route="/v1/chat/completions", model=model, type="server_error"
        )
        == 1.0
    )
    assert (
        obs.metrics.value("specgate_requests_total", route="/v1/chat/completions", model=model, status="200")
        == 1.0
    )
    assert "specgate_stream_errors_total" in metrics
    if model == "up-model":  # the upstream's call failed, though it had answered 200
        assert obs.metrics.value("specgate_upstream_requests_total", upstream="u", outcome="error") == 1.0
        assert obs.metrics.value("specgate_upstream_requests_total", upstream="u", outcome="ok") == 0.0
    lines = [r.getMessage() for r in caplog.records if r.name == "specgate.request"]
    assert len(lines) == 1 and f"error_type={kind}" in lines[0], lines
    # the error's message (which may quote the prompt) stays in the client's event alone
    for s in exporter.get_finished_spans():
        assert SECRET not in repr(dict(s.attributes or {})) + repr([e.attributes for e in s.events])
    assert SECRET not in metrics and SECRET not in lines[0]


async def test_a_stream_that_finishes_is_no_stream_error(upstream: RawUpstream) -> None:
    base, obs, exporter, handle = await serve(upstream, ScriptedEngine([token_ids("Hello")]))
    try:
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            for model in ("up-model", "fake"):
                body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
                r = await c.post("/v1/chat/completions", json=body)
                assert data_events(r.text)[-1] == "[DONE]"
                assert not any("error" in e for e in data_events(r.text)[:-1])
    finally:
        await stop(handle)
    spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert len(spans) == 2
    for s in spans:
        assert s.status.status_code == StatusCode.UNSET and "error.type" not in (s.attributes or {})
    for model in ("up-model", "fake"):
        assert (
            obs.metrics.value(
                "specgate_stream_errors_total", route="/v1/chat/completions", model=model, type="server_error"
            )
            == 0.0
        )
    assert obs.metrics.value("specgate_upstream_requests_total", upstream="u", outcome="ok") == 1.0


def test_the_error_rate_alert_and_the_errors_panels_count_stream_errors() -> None:
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    rules = yaml.safe_load((deploy / "prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    (high,) = [r for r in rules if r["alert"] == "SpecgateHighErrorRate"]
    assert "specgate_stream_errors_total" in high["expr"]
    assert "specgate_stream_errors_total" in (deploy / "grafana/dashboards/specgate.json").read_text()
    builtin = deploy.parent / "gateway/static/dashboard.html"  # /dashboard's "Errors and aborts"
    assert "specgate_stream_errors_total" in builtin.read_text()
