"""Prometheus metrics, OpenTelemetry traces and request logs.

One ``Observability`` object per app holds the three and is wired in at three seams:

- ``obs.install(app)``: the ASGI middleware (opentelemetry-instrumentation-asgi's server span,
  continuing an incoming ``traceparent``, around our ``ObservabilityMiddleware``) plus the
  ``/metrics`` and ``/dashboard`` routes;
- ``obs.observe_engine(engine)``: the ``EngineClient`` around the engine that observes every step;
- ``obs.metrics.observe_*`` / ``obs.tracing.span(...)`` / ``current_request()`` for the cache, the
  router and the upstream client, each calling one method per event.

Module map: ``metrics`` (registry and methods), ``tracing`` (provider from ``OTEL_*``, helpers),
``record`` (the per-request record), ``middleware``, ``engine`` (the observed engine client), ``logs`` (the line),
``routes`` (/metrics and /dashboard).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.util.http import ExcludeList

from gateway.observability.logs import RequestLogger
from gateway.observability.metrics import Metrics
from gateway.observability.record import (
    MAX_CLIENT_CHARS,
    RequestRecord,
    current_request,
    note_completion,
    note_phase,
    note_response_id,
    note_served,
    note_stream_error,
    note_usage,
    observe_job,
)
from gateway.observability.settings import ObservabilitySettings
from gateway.observability.tracing import Tracing, provider_from_env

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from decoding.client import EngineClient
    from gateway.observability.engine import ObservedEngine

__all__ = [
    "Metrics",
    "Observability",
    "ObservabilitySettings",
    "RequestRecord",
    "Tracing",
    "current_request",
    "note_completion",
    "note_phase",
    "note_response_id",
    "note_served",
    "note_stream_error",
    "note_usage",
    "observe_job",
]

# Scrapes and probes get no spans (they would drown the traces); they are still counted. The
# instrumentation searches these regexes anywhere in ``scheme://host/path`` (the Host header's host):
# unanchored, every request to a host named ``healthbot...`` or ``metrics-gw``, or whose path held
# ``/ready``, went untraced. So: the whole path, after the host.
UNTRACED = ExcludeList([r"^[a-z]+://[^/]*/(metrics|health|ready|dashboard)$"])


class Observability:
    def __init__(
        self,
        settings: ObservabilitySettings | None = None,
        *,
        tracer_provider: TracerProvider | None = None,
        models: Iterable[str] = (),
        upstreams: Iterable[str] = (),
        from_env: bool = True,
    ):
        """``tracer_provider``: tests pass one with an in-memory exporter; otherwise it comes from the
        ``OTEL_*`` environment (``from_env=False`` keeps tracing off)."""
        self.settings = settings or ObservabilitySettings()
        provider = (
            tracer_provider if tracer_provider is not None else (provider_from_env() if from_env else None)
        )
        self.metrics = Metrics(models=models, upstreams=upstreams)
        self.tracing = Tracing(provider, log_content=self.settings.log_content)
        self.logger = RequestLogger(json_lines=self.settings.log_json, enabled=self.settings.log_requests)
        self._metrics_server: Any = None
        self._metrics_thread: threading.Thread | None = None

    def install(self, app: Starlette) -> None:
        """Middleware and routes; call before the app serves its first request."""
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

        from gateway.observability.middleware import ObservabilityMiddleware
        from gateway.observability.routes import routes

        app.add_middleware(ObservabilityMiddleware, obs=self)
        app.add_middleware(
            OpenTelemetryMiddleware,
            tracer_provider=self.tracing._api_provider,
            excluded_urls=UNTRACED,
            exclude_spans=["receive", "send"],
            default_span_details=_span_details,
            server_request_hook=_bounded_url,
        )
        taken = {getattr(r, "path", None) for r in app.router.routes}
        for route in routes(self):
            if route.path not in taken:  # an app may serve /metrics itself, from our registry
                app.router.routes.append(route)

    def observe_engine(self, engine: EngineClient) -> ObservedEngine:
        from gateway.observability.engine import ObservedEngine

        return ObservedEngine(engine, self)

    def start_metrics_server(self, host: str = "0.0.0.0", port: int | None = None) -> None:
        """Serve /metrics on its own port too (``observability.metrics_port``)."""
        from prometheus_client import start_http_server

        port = port or self.settings.metrics_port
        assert port, "observability.metrics_port is not set"
        self._metrics_server, self._metrics_thread = start_http_server(
            port, host, registry=self.metrics.registry
        )

    def shutdown(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self.tracing.shutdown()


def _span_details(scope: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``POST /v1/chat/completions``: the route template, never a raw path with ids in it."""
    from gateway.observability.metrics import route_label

    route = route_label(scope.get("path", ""))
    return f"{scope.get('method', 'HTTP')} {route}", {"http.route": route}


_URL_KEYS = ("http.target", "http.url", "url.path", "url.full", "url.query")
# other client strings the instrumentation copies from headers: kept, cut like the rest
_HEADER_KEYS = ("http.user_agent", "user_agent.original", "http.host", "net.host.name", "server.address")


def _bounded_url(span: Any, scope: dict[str, Any]) -> None:
    """The ASGI instrumentation puts the raw path and the query string on the server span whole
    (``http.target``, ``http.url``): a client's strings, a 60 KB model id or a key sent as
    ``?api-key=`` among them. Keep the path, cut to ``MAX_CLIENT_CHARS``, and no query."""
    attrs = getattr(span, "attributes", None) or {}  # an SDK span's, as the instrumentation set them
    path = str(scope.get("path", ""))[:MAX_CLIENT_CHARS]
    for key in (k for k in _URL_KEYS if k in attrs):
        if key in ("http.url", "url.full"):
            url = urlsplit(str(attrs[key]))
            span.set_attribute(key, urlunsplit((url.scheme, url.netloc[:MAX_CLIENT_CHARS], path, "", "")))
        else:
            span.set_attribute(key, "" if key == "url.query" else path)
    for key in (k for k in _HEADER_KEYS if k in attrs):
        span.set_attribute(key, str(attrs[key])[:MAX_CLIENT_CHARS])
