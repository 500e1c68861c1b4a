"""OpenTelemetry tracing: the tracer provider, chosen by the standard ``OTEL_*`` variables.

- ``OTEL_TRACES_EXPORTER``: ``otlp`` (OTLP over HTTP/protobuf to a collector or Jaeger),
  ``console`` (spans printed to stdout, for development), ``none``, or a comma list. Divergence from
  the OpenTelemetry default (``otlp``): unset means off, so tracing is opt-in and a plain
  ``specgate serve`` never tries to reach a collector.
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``..._HEADERS`` /
  ``..._TIMEOUT``, ``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and
  ``OTEL_SDK_DISABLED`` are read by the SDK itself, exactly as documented upstream.

No global is set: the provider is passed explicitly to our tracer and to the ASGI/httpx
instrumentation, so tests build apps with their own in-memory provider side by side. Propagation
uses the W3C ``traceparent`` (the global textmap, which defaults to tracecontext + baggage); with
tracing off the incoming context still flows through to upstream calls as a non-recording span.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

import httpx
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace import NoOpTracerProvider, Span, SpanKind, Status, StatusCode

# GenAI semantic conventions (incubating upstream, so spelled out here rather than imported from
# opentelemetry.semconv._incubating, whose module layout changes between releases).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
PROVIDER = "specgate"

EXPORTERS = ("otlp", "console", "none")


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable names something this build cannot do."""


def provider_from_env(environ: Mapping[str, str] | None = None) -> TracerProvider | None:
    """The provider that ``OTEL_TRACES_EXPORTER`` asks for, or None when tracing is off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip()]
    for n in names:
        if n not in EXPORTERS:
            raise TracingConfigError(f"OTEL_TRACES_EXPORTER: {n!r} is not one of {', '.join(EXPORTERS)}")
    names = [n for n in names if n != "none"]
    if not names:
        return None
    protocol = env.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    )
    if "otlp" in names and protocol != "http/protobuf":
        raise TracingConfigError(
            f"OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is installed, got {protocol!r} "
            "(point it at the collector's HTTP port, usually 4318)"
        )
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "specgate")})
    provider = TracerProvider(resource=resource)
    if "otlp" in names:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in names:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    return provider


def epoch_ns(perf: float, anchor_perf: float, anchor_ns: int) -> int:
    """A ``time.perf_counter()`` reading as epoch nanoseconds, given one reading of both clocks."""
    return anchor_ns + int((perf - anchor_perf) * 1e9)


class Tracing:
    """Our tracer plus the helpers the gateway, cache and router use. ``provider=None``: off."""

    def __init__(self, provider: TracerProvider | None = None, log_content: bool = False):
        self.provider = provider
        self.enabled = provider is not None
        self.log_content = log_content
        self._api_provider: trace.TracerProvider = provider if provider is not None else NoOpTracerProvider()
        self.tracer = trace.get_tracer("specgate", tracer_provider=self._api_provider)

    @contextmanager
    def span(
        self, name: str, attributes: Mapping[str, Any] | None = None, kind: SpanKind = SpanKind.INTERNAL
    ) -> Iterator[Span]:
        """A child of the current span, current while the block runs (do not hold it across an
        ``async`` generator's yield: use ``start_span`` with an explicit parent there)."""
        with self.tracer.start_as_current_span(name, kind=kind, attributes=dict(attributes or {})) as s:
            yield s

    def start_span(
        self,
        name: str,
        parent: otel_context.Context | None = None,
        start_ns: int | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        return self.tracer.start_span(
            name, context=parent, start_time=start_ns, attributes=dict(attributes or {})
        )

    def add_span(
        self,
        name: str,
        parent: otel_context.Context,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """A finished span recorded after the fact (queue wait, prefill: timed on the engine thread)."""
        s = self.start_span(name, parent, start_ns, attributes)
        s.end(end_time=max(end_ns, start_ns))

    @staticmethod
    def inject(headers: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
        """Add ``traceparent`` (and ``tracestate``/baggage) for the current context to ``headers``."""
        carrier: MutableMapping[str, str] = {} if headers is None else headers
        propagate.inject(carrier)
        return carrier

    def instrument_httpx(self, client: httpx.AsyncClient | httpx.Client) -> None:
        """One CLIENT span per upstream call, with ``traceparent`` injected (the maintained
        opentelemetry-instrumentation-httpx, bound to our provider rather than the global one)."""
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

        HTTPXClientInstrumentor.instrument_client(client, tracer_provider=self._api_provider)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits (for logs), or None outside any trace."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.trace_id else None


def set_error(span: Span, kind: str) -> None:
    span.set_status(Status(StatusCode.ERROR, kind))
    span.set_attribute("error.type", kind)


def now_pair() -> tuple[float, int]:
    return time.perf_counter(), time.time_ns()
