"""The real gateway app on tiny random models: metrics, spans and logs match what the responses say.

``tiny-self`` drafts for itself, so greedy speculation accepts every drafted token: the accepted
counts are large and exact. ``echo`` puts the prompt into the completion text, which is how a canary
gets into a completion of a random model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from gateway.app import create_app
from gateway.observability import Observability, ObservabilitySettings
from gateway.settings import load_settings
from tests.observability.conftest import CANARY
from tests.observability.test_middleware import PARENT_ID, TRACE_ID, _all_span_text

MODEL = "tiny-self"


@pytest.fixture
def engine(tiny_models: Any) -> Iterator[AsyncEngine]:
    e = AsyncEngine(Engine(tiny_models), max_active=2, max_queued=8)
    yield e
    e.shutdown()


def _app(engine: AsyncEngine, obs: Observability) -> Any:
    settings = load_settings(overrides={"cache": {"enabled": False}}, env={})
    return create_app(settings, engine=engine, observability=obs)


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60)


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    # a fixed k: on a CPU the goodput check (rightly) keeps a draft as costly as its target off
    spec = {"mode": "draft", "max_k": 4, "adaptive": False}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "speculative": spec,
        **extra,
    }


async def test_metrics_match_the_responses(engine: AsyncEngine, provider: TracerProvider) -> None:
    obs = Observability(tracer_provider=provider)
    app = _app(engine, obs)
    usages = []
    async with _client(app) as c:
        for i, n in enumerate((5, 9, 13)):
            r = await c.post("/v1/chat/completions", json=_chat(f"count {i}", max_tokens=n))
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        r = await c.post(
            "/v1/chat/completions",
            json=_chat("stream", max_tokens=7, stream=True, stream_options={"include_usage": True}),
        )
        assert r.status_code == 200
        assert (await c.post("/v1/chat/completions", json=_chat("x", model="nope"))).status_code == 404
        scrape = (await c.get("/metrics")).text
    m = obs.metrics
    assert m.value("specgate_requests_total", route="/v1/chat/completions", model=MODEL, status="200") == 4
    assert (
        m.value("specgate_requests_total", route="/v1/chat/completions", model="unknown", status="404") == 1
    )
    spec = [u["speculative"] for u in usages]
    completion = sum(u["completion_tokens"] for u in usages) + 7
    assert m.value("specgate_completion_tokens_total", model=MODEL) == completion
    assert m.value("specgate_prompt_tokens_total", model=MODEL) >= sum(u["prompt_tokens"] for u in usages)
    accepted = m.value("specgate_spec_accepted_tokens_total", model=MODEL)
    drafted = m.value("specgate_spec_drafted_tokens_total", model=MODEL)
    assert accepted >= sum(s["accepted_tokens"] for s in spec) > 0
    assert accepted == drafted  # the model drafting for itself, greedy: every draft is accepted
    steps = m.value("specgate_engine_steps_total", model=MODEL, kind="spec") + m.value(
        "specgate_engine_steps_total", model=MODEL, kind="plain"
    )
    assert steps >= sum(s["steps"] for s in spec)
    assert m.value("specgate_time_to_first_token_seconds_count", model=MODEL) == 4
    assert m.value("specgate_generations_total", model=MODEL, finish_reason="length", drafter="draft") == 4
    assert "specgate_engine_queue_depth 0.0" in scrape
    # the engine's own steps: every step of these requests, one request each (run one after another)
    assert m.value("specgate_engine_batch_rows_count", model=MODEL) == steps
    assert m.value("specgate_engine_batch_rows_sum", model=MODEL) == steps
    assert m.value("specgate_engine_step_tokens_sum", model=MODEL) == completion
    assert m.value("specgate_engine_step_k_count", model=MODEL, batch="1") == steps
    assert "specgate_engine_step_k_bucket" in scrape


async def test_spans_on_the_real_app(
    engine: AsyncEngine, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    app = _app(engine, Observability(tracer_provider=provider))
    async with _client(app) as c:
        r = await c.post(
            "/v1/chat/completions",
            json=_chat("trace me", max_tokens=9),
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
        )
    assert r.status_code == 200
    usage = r.json()["usage"]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, gen = spans["POST /v1/chat/completions"], spans[f"chat {MODEL}"]
    assert root.kind == SpanKind.SERVER and format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_ID
    assert gen.parent.span_id == root.context.span_id
    for name in ("specgate.queue", "specgate.prefill", "specgate.decode"):
        assert spans[name].parent.span_id == gen.context.span_id
    assert root.attributes["specgate.request_id"] == r.headers["x-request-id"]
    # the GenAI conventions' response id is the completion's, as the client sees it
    assert root.attributes["gen_ai.response.id"] == r.json()["id"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 9
    assert root.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    assert gen.attributes["specgate.spec.accepted"] == usage["speculative"]["accepted_tokens"]
    assert gen.attributes["gen_ai.request.temperature"] == 0.0


async def test_canary_stays_out_of_logs_spans_and_metrics(
    engine: AsyncEngine,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    obs = Observability(ObservabilitySettings(log_json=True), tracer_provider=provider)
    app = _app(engine, obs)
    with caplog.at_level(logging.DEBUG):
        async with _client(app) as c:
            r = await c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": f"say {CANARY}", "echo": True, "max_tokens": 4},
            )
            s = await c.post("/v1/chat/completions", json=_chat(f"say {CANARY}", max_tokens=4, stream=True))
            bad = await c.post("/v1/chat/completions", json=_chat(f"{CANARY}", max_tokens=-1))
    assert r.status_code == 200 and CANARY in r.json()["choices"][0]["text"]  # it is in the completion
    assert s.status_code == 200 and bad.status_code == 400
    assert any(rec.name == "specgate.request" for rec in caplog.records)
    assert CANARY not in caplog.text
    assert CANARY not in _all_span_text(exporter)
    assert CANARY not in obs.metrics.render().decode()


async def test_log_content_puts_prompt_and_completion_in_the_log_line_and_span(
    engine: AsyncEngine,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``observability.log_content`` reached only a test app's handlers: the real gateway never
    handed the record any text, so the setting did nothing."""
    obs = Observability(ObservabilitySettings(log_json=True, log_content=True), tracer_provider=provider)
    app = _app(engine, obs)
    with caplog.at_level(logging.INFO, logger="specgate.request"):
        async with _client(app) as c:
            s = await c.post("/v1/chat/completions", json=_chat(f"say {CANARY}", max_tokens=4, stream=True))
            r = await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "plain prompt", "max_tokens": 4}
            )
    assert s.status_code == 200 and r.status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specgate.request"]
    assert len(lines) == 2 and f"user: say {CANARY}" in lines[0] and "plain prompt" in lines[1]
    roots = [s for s in exporter.get_finished_spans() if s.name.startswith("POST /v1/")]
    assert [s.attributes["gen_ai.prompt"] for s in roots] == [f"user: say {CANARY}", "plain prompt"]
    events = [json.loads(e[6:]) for e in s.text.split("\n\n") if e.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert roots[0].attributes["gen_ai.completion"] == streamed
    assert roots[1].attributes["gen_ai.completion"] == r.json()["choices"][0]["text"]
    assert CANARY not in obs.metrics.render().decode()


@pytest.mark.parametrize("page", ["metrics", "dashboard"])
async def test_observability_settings_turn_their_pages_off(page: str) -> None:
    """`observability.metrics: false` (a deployment scraping only `metrics_port`, or none) takes
    /metrics off the API's port, as `dashboard: false` takes /dashboard off."""
    on = create_app(load_settings(env={}))
    off = create_app(load_settings(env={f"SPECGATE_OBSERVABILITY__{page.upper()}": "false"}))
    async with _client(on) as c:
        assert (await c.get(f"/{page}")).status_code == 200
    async with _client(off) as c:
        r = await c.get(f"/{page}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        assert f"/{page}" not in (await c.get("/openapi.json")).json()["paths"]
