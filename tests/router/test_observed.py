"""The router's metrics and spans on the real app (scripted local engine, the fake upstream process):
route decisions match the ``x-specgate-route`` header, upstream calls, retries and fallbacks are
counted, and an upstream call is a CLIENT span in the request's trace whose ``traceparent`` is the
one, and the only one, that the upstream receives."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway.app import create_app
from gateway.observability import Observability
from gateway.settings import load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.router.conftest import FakeUpstream

HARD = "Prove step by step that the algorithm's complexity is O(n log n), and explain why."
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class GaugedEngine(ScriptedEngine):
    queue_depth = 0  # read by the engine gauges at scrape time
    active = 0


def observed() -> tuple[Observability, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Observability(tracer_provider=provider, from_env=False), exporter


@pytest.fixture
async def gateway(upstream: FakeUpstream) -> AsyncIterator[Callable[[Observability], Any]]:
    """Tiers: small (the local "fake", no speculation), then remote (upstream "a"), falling back to small."""
    upstream.script([])
    apps: list[Any] = []

    def make(obs: Observability) -> Any:
        settings = load_settings(
            overrides={
                "models": [{"name": "fake", "source": "tiny-random"}],
                "cache": {"enabled": False},
                "upstreams": [
                    {
                        "name": "a",
                        "base_url": upstream.base_url,
                        "model": "up-model",
                        "retries": 1,
                        "backoff_s": 0.01,
                    }
                ],
                "router": {
                    "tiers": [
                        {"name": "small", "model": "fake", "speculation": False},
                        {"name": "remote", "upstream": "a", "threshold": 0.25, "fallback": ["small"]},
                    ]
                },
            },
            env={},
        )
        engine = GaugedEngine([token_ids("Use "), token_ids("reversed().")])
        apps.append(create_app(settings, engine=engine, observability=obs))  # type: ignore[arg-type]
        return apps[-1]

    yield make
    for app in apps:
        await app.state.gateway.router.aclose()


async def ask(app: Any, model: str, prompt: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 8,
    }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=30
    ) as c:
        r = await c.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.text
    return r


def route_of(r: httpx.Response) -> tuple[str, str]:
    kv = dict(part.strip().split("=", 1) for part in r.headers["x-specgate-route"].split(";"))
    return kv["tier"], kv["strategy"]


async def test_route_decisions_match_the_header(gateway: Callable[[Observability], Any]) -> None:
    obs, _ = observed()
    app = gateway(obs)
    rs = [await ask(app, "auto", "hi"), await ask(app, "auto", HARD), await ask(app, "fake", HARD)]
    routes = Counter(route_of(r) for r in rs)
    assert routes == {("small", "off"): 1, ("remote", "off"): 1, ("explicit", "auto"): 1}
    m = obs.metrics
    for (tier, strategy), n in routes.items():
        assert m.value("specgate_route_decisions_total", tier=tier, strategy=strategy) == n
    decisions = next(f for f in m.registry.collect() if f.name == "specgate_route_decisions")
    assert sum(s.value for s in decisions.samples if s.name.endswith("_total")) == len(rs)
    assert m.value("specgate_route_decision_duration_seconds_count") == len(rs)
    assert m.value("specgate_upstream_requests_total", upstream="a", outcome="ok") == 1
    assert m.value("specgate_upstream_request_duration_seconds_count", upstream="a") == 1
    assert m.value("specgate_circuit_state", component="a") == 0


async def test_retries_and_fallbacks_are_counted(
    gateway: Callable[[Observability], Any], upstream: FakeUpstream
) -> None:
    obs, _ = observed()
    app = gateway(obs)
    m = obs.metrics
    upstream.script([{"kind": "status", "status": 503}])  # one 503, then the retry succeeds
    assert route_of(await ask(app, "auto", HARD)) == ("remote", "off")
    assert m.value("specgate_upstream_retries_total", upstream="a", reason="http_5xx") == 1
    assert m.value("specgate_upstream_requests_total", upstream="a", outcome="http_5xx") == 1
    assert m.value("specgate_upstream_requests_total", upstream="a", outcome="ok") == 1

    upstream.script([{"kind": "status", "status": 503}] * 2)  # both attempts fail: the small tier serves
    assert route_of(await ask(app, "auto", HARD)) == ("small", "off")
    assert m.value("specgate_upstream_fallbacks_total", from_tier="remote", to_tier="small") == 1
    assert m.value("specgate_upstream_requests_total", upstream="a", outcome="http_5xx") == 3
    assert m.value("specgate_upstream_retries_total", upstream="a", reason="http_5xx") == 2
    # decisions count the router's pick; the header names the route that served, after the fallback
    assert m.value("specgate_route_decisions_total", tier="remote", strategy="off") == 2
    assert m.value("specgate_route_decisions_total", tier="small", strategy="off") == 0


async def test_an_upstream_call_continues_the_request_trace(
    gateway: Callable[[Observability], Any], upstream: FakeUpstream
) -> None:
    obs, exporter = observed()
    incoming = f"00-{TRACE_ID}-{PARENT_ID}-01"
    r = await ask(gateway(obs), "auto", HARD, {"traceparent": incoming})
    assert route_of(r) == ("remote", "off")
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    [call] = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert format(call.context.trace_id, "032x") == format(root.context.trace_id, "032x") == TRACE_ID
    assert call.parent is not None and call.parent.span_id == root.context.span_id
    [seen] = upstream.seen()
    assert seen["traceparents"] == [f"00-{TRACE_ID}-{call.context.span_id:016x}-01"], "one, the call's own"
    assert seen["headers"]["x-request-id"] == r.headers["x-request-id"]

    upstream.script([])
    await ask(gateway(Observability(from_env=False)), "auto", HARD, {"traceparent": incoming})
    [seen] = upstream.seen()
    assert seen["traceparents"] == [incoming], "tracing off: the incoming context passes through, once"
