"""Observability settings (the `observability:` section of specgate.yaml). Owned by observability.

Tracing is deliberately not configured here: the exporter, endpoint, headers, sampler and service
name come from the standard ``OTEL_*`` environment variables (see ``tracing.py``), so the same
deployment manifests work for specgate as for any other OpenTelemetry service.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ObservabilitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log_json: bool = False  # one JSON object per request line instead of key=value text
    log_requests: bool = True  # the per-request line on the `specgate.request` logger
    log_content: bool = False  # prompt/completion text in logs and spans: off unless asked for
    metrics: bool = True  # serve /metrics on the gateway's own port
    metrics_port: int | None = Field(default=None, ge=1, le=65535)  # also serve /metrics here
    dashboard: bool = True  # the built-in /dashboard page
