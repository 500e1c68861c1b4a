"""One structured line per request on the ``specgate.request`` logger.

Fields: request id, trace id, method, route (template, never the raw path), status, models, tokens,
timings in milliseconds, cache and route decisions, speculation totals, abort phase, error type.
Text format is ``key=value`` pairs; JSON is one object per line. Prompt and completion text appear
only when ``log_content`` is on (they are not even kept on the record otherwise).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from gateway.observability.record import RequestRecord

log = logging.getLogger("specgate.request")

QUIET_ROUTES = frozenset({"/metrics", "/health", "/ready", "/dashboard"})  # logged at DEBUG


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def request_fields(rec: RequestRecord, trace_id: str | None) -> dict[str, Any]:
    spec = rec.spec_totals()
    fields: dict[str, Any] = {
        "request_id": rec.request_id,
        "trace_id": trace_id,
        "method": rec.method,
        "route": rec.route,
        "status": rec.status,
        "model": rec.model,
        "request_model": rec.request_model,
        "stream": rec.stream,
        "prompt_tokens": rec.prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "duration_ms": _ms(rec.duration_s),
        "ttft_ms": _ms(rec.ttft_s),
        "finish_reasons": ",".join(rec.finish_reasons) or None,
        "cache": rec.cache,
        "route_tier": rec.route_tier,
        "route_strategy": rec.route_strategy,
        "upstream": rec.upstream,
        "aborted_phase": rec.phase if rec.aborted else None,
        "error_type": rec.error_type,
    }
    if rec.generations:
        g = rec.generations
        fields["queue_ms"] = _ms(max(s.queue_s for s in g))
        fields["prefill_ms"] = _ms(sum(s.prefill_s for s in g))
        fields["decode_ms"] = _ms(sum(s.decode_s for s in g))
        fields["drafter"] = g[0].drafter
        fields.update({f"spec_{k}": v for k, v in spec.items()})
        decode_s = sum(s.decode_s for s in g)
        if decode_s > 0:
            fields["tokens_per_s"] = round(sum(s.completion_tokens for s in g) / decode_s, 1)
    if rec.log_content:
        fields["prompt"] = rec.prompt_text
        fields["completion"] = rec.completion_text
    return {k: v for k, v in fields.items() if v is not None}


def format_text(fields: dict[str, Any]) -> str:
    parts = []
    for k, v in fields.items():
        s = json.dumps(v) if isinstance(v, str) and (not v or any(c in v for c in ' "=\n')) else str(v)
        parts.append(f"{k}={s}")
    return " ".join(parts)


class RequestLogger:
    def __init__(self, json_lines: bool = False, enabled: bool = True, logger: logging.Logger = log):
        self.json_lines = json_lines
        self.enabled = enabled
        self.logger = logger

    def emit(self, rec: RequestRecord, trace_id: str | None) -> None:
        if not self.enabled:
            return
        level = logging.DEBUG if rec.route in QUIET_ROUTES and rec.status < 400 else logging.INFO
        if not self.logger.isEnabledFor(level):
            return
        fields = request_fields(rec, trace_id)
        line = json.dumps(fields, separators=(",", ":")) if self.json_lines else format_text(fields)
        self.logger.log(level, line, extra={"specgate": fields})
