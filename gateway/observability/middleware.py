"""ASGI middleware: one record per HTTP request, turned into metrics, span attributes and a log line
when the response ends.

It sits inside opentelemetry-instrumentation-asgi's server span (see ``Observability.wrap``), so the
current span here is the request's root span, already continuing any incoming ``traceparent``.
What it cannot see from the ASGI messages (model, tokens, first token) comes from the engine
wrapper and handlers through ``current_request()``; what it can see it reads itself:

- status, ``x-request-id``, ``x-specgate-cache``, ``x-specgate-route`` and ``content-type`` from the
  response start;
- ``error.type`` from the OpenAI error body of a 4xx/5xx (type and code only, never the message),
  or from the error event a stream ended with after its 200 (``note_stream_error``, serving's): the
  span is then marked failed, and ``specgate_stream_errors_total`` counts it;
- an abort: ``http.disconnect`` received, or a send failing, before the last body byte went out.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.observability import tracing as tr
from gateway.observability.metrics import route_label
from gateway.observability.record import MAX_CLIENT_CHARS, RequestRecord, _current, error_kind

if TYPE_CHECKING:
    from gateway.observability import Observability

log = logging.getLogger("specgate.observability")

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def _parse_kv(value: str) -> dict[str, str]:
    """``tier=large; model=m; strategy=draft`` -> dict (the x-specgate-route header)."""
    out = {}
    for part in value.split(";"):
        k, _, v = part.strip().partition("=")
        if k and v:
            out[k.strip()] = v.strip()
    return out


class ObservabilityMiddleware:
    def __init__(self, app: ASGIApp, obs: Observability):
        self.app = app
        self.obs = obs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        rec = RequestRecord(method=scope["method"], route=route, log_content=self.obs.settings.log_content)
        rec.operation = OPERATIONS.get(route)
        for k, v in scope.get("headers", ()):
            if k == b"x-request-id":
                rec.request_id = v.decode("latin-1")[:128]
        done = False
        error_body = b""

        async def receive_wrapper() -> Message:
            msg = await receive()
            if msg["type"] == "http.disconnect" and not done:
                rec.aborted = True
            return msg

        async def send_wrapper(msg: Message) -> None:
            nonlocal done, error_body
            if msg["type"] == "http.response.start":
                rec.status = msg["status"]
                self._read_headers(rec, msg.get("headers", ()))
            elif msg["type"] == "http.response.body":
                body = msg.get("body", b"")
                if body and rec.first_byte is None:
                    rec.first_byte = time.perf_counter()
                if rec.status >= 400 and len(error_body) < 4096:
                    error_body += body
                if not msg.get("more_body", False):
                    done = True
                    rec.ended = time.perf_counter()
                    if error_body and rec.error_type is None:
                        rec.error_type = _error_type(error_body)
                    # the ASGI instrumentation ends the server span on this message: annotate first
                    self._annotate(rec)
            try:
                await send(msg)
            except BaseException:
                if not done:
                    rec.aborted = True
                raise

        token = _current.set(rec)
        self.obs.metrics.request_started(route)
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except BaseException:
            if rec.status == 0:
                rec.status = 500
            rec.error_type = rec.error_type or "internal_error"
            raise
        finally:
            rec.ended = rec.ended or time.perf_counter()
            self.obs.metrics.request_ended(route)
            if not done and rec.status:
                rec.aborted = True
            try:
                self._finish(rec)
            except Exception:  # observability never fails a request
                log.exception("could not record request %s", rec.request_id)
            _current.reset(token)

    @staticmethod
    def _read_headers(rec: RequestRecord, headers: Any) -> None:
        for k, v in headers:
            name, value = k.decode("latin-1").lower(), v.decode("latin-1")
            if name == "x-request-id":
                rec.request_id = value[:MAX_CLIENT_CHARS]
            elif name == "content-type":
                rec.stream = value.startswith("text/event-stream")
            elif name == "x-specgate-cache":
                rec.cache = value.split(";")[0].strip()[:16]
            elif name == "x-specgate-route":
                kv = _parse_kv(value)
                rec.route_tier = rec.route_tier or kv.get("tier")
                rec.route_strategy = rec.route_strategy or kv.get("strategy")
                rec.model = rec.model or kv.get("model")

    def _finish(self, rec: RequestRecord) -> None:
        obs = self.obs
        if rec.aborted:
            obs.metrics.observe_abort(rec.route, rec.phase)
        obs.metrics.observe_request_done(
            rec.route,
            rec.model,
            rec.status,
            rec.duration_s,
            ttft_s=rec.ttft_s,
            prompt_tokens=rec.prompt_tokens,
            completion_tokens=rec.completion_tokens,
            requested_model=rec.request_model,
            stream_error=rec.stream_error,
        )
        self._annotate(rec)
        obs.logger.emit(rec, tr.current_trace_id())

    @staticmethod
    def _annotate(rec: RequestRecord) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            _annotate(span, rec)


def _error_type(body: bytes) -> str | None:
    try:
        return error_kind(json.loads(body))
    except ValueError:
        return None


def _annotate(span: trace.Span, rec: RequestRecord) -> None:
    attrs: dict[str, Any] = {"http.route": rec.route, "specgate.stream": rec.stream}
    if rec.request_id:
        attrs["specgate.request_id"] = rec.request_id
    if rec.operation:
        attrs[tr.GEN_AI_OPERATION] = rec.operation
        attrs[tr.GEN_AI_PROVIDER] = tr.PROVIDER
        if rec.response_id:
            attrs[tr.GEN_AI_RESPONSE_ID] = rec.response_id
    for key, value in (
        (tr.GEN_AI_REQUEST_MODEL, rec.request_model or rec.model),
        (tr.GEN_AI_RESPONSE_MODEL, rec.model),
        (tr.GEN_AI_REQUEST_TEMPERATURE, rec.temperature),
        (tr.GEN_AI_REQUEST_TOP_P, rec.top_p),
        (tr.GEN_AI_REQUEST_MAX_TOKENS, rec.max_tokens),
        (tr.GEN_AI_REQUEST_SEED, rec.seed),
        ("specgate.cache.result", rec.cache),
        ("specgate.route.tier", rec.route_tier),
        ("specgate.route.strategy", rec.route_strategy),
        ("specgate.upstream", rec.upstream),
        ("error.type", rec.error_type),
    ):
        if value is not None:
            attrs[key] = value
    if rec.prompt_tokens or rec.completion_tokens or rec.operation:
        attrs[tr.GEN_AI_INPUT_TOKENS] = rec.prompt_tokens
        attrs[tr.GEN_AI_OUTPUT_TOKENS] = rec.completion_tokens
    if rec.finish_reasons:
        attrs[tr.GEN_AI_FINISH_REASONS] = list(rec.finish_reasons)
    if ttft := rec.ttft_s:
        attrs["specgate.ttft_ms"] = round(ttft * 1000, 3)
    if rec.generations:
        attrs.update({f"specgate.spec.{k}": v for k, v in rec.spec_totals().items()})
    if rec.aborted:
        attrs["specgate.aborted_phase"] = rec.phase
    if rec.stream_error is not None and rec.error_type is not None:
        # a 200 whose stream ended in an error event: the instrumentation, which sees the status
        # alone, left the span unset
        tr.set_error(span, rec.error_type)
    if rec.log_content:
        if rec.prompt_text is not None:
            attrs["gen_ai.prompt"] = rec.prompt_text
        if rec.completion_text is not None:
            attrs["gen_ai.completion"] = rec.completion_text
    span.set_attributes(attrs)
