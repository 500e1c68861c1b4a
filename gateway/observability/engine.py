"""``ObservedEngine``: an ``EngineClient`` around another, with every step observed.

It implements ``decoding.client.EngineClient`` by delegating to the engine it wraps, so the gateway
wires observability into local generation with one line and no change to its loop. Per step it
feeds the speculation metrics; per generation it records the GenAI span and its ``specgate.queue`` /
``specgate.prefill`` / ``specgate.decode`` children (timed on the engine thread, so recorded after
the fact with explicit timestamps) and fills the request record. A refusal by ``submit`` gets its
span too, marked with the error.

The spans are started with an explicit parent and never made current: a stream is iterated in its
consumer's context, and attaching a span across the consumer's awaits would leak it into the handler.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from decoding.client import EngineClient, StepStream, Tokenizer
from decoding.params import GenerationRequest, RequestStats, StepOutput
from gateway.observability import tracing as tr
from gateway.observability.record import RequestRecord, current_request

if TYPE_CHECKING:
    from gateway.observability import Observability


class ObservedEngine:
    def __init__(self, inner: EngineClient, obs: Observability):
        self._inner = inner
        self._obs = obs
        obs.metrics.bind_engine(inner)

    @property
    def model_names(self) -> list[str]:
        return self._inner.model_names

    def tokenizer(self, model: str) -> Tokenizer:
        return self._inner.tokenizer(model)

    def max_context(self, model: str) -> int:
        return self._inner.max_context(model)

    @property
    def queue_depth(self) -> int:
        return self._inner.queue_depth

    @property
    def active(self) -> int:
        return self._inner.active

    def shutdown(self, timeout: float = 5.0) -> None:
        self._inner.shutdown(timeout)

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        return await self._inner.prepare(request)

    def submit(self, request: GenerationRequest) -> StepStream:
        obs, rec = self._obs, current_request()
        model, p = request.model, request.params
        parent = otel_context.get_current()
        t0, t0_ns = tr.now_pair()
        if rec is not None:
            rec.model = rec.model or model
            rec.temperature, rec.top_p, rec.max_tokens, rec.seed = (
                p.temperature,
                p.top_p,
                p.max_tokens,
                p.seed,
            )
        operation = rec.operation if rec is not None and rec.operation else "generate"
        span = obs.tracing.start_span(
            f"{operation} {model}",
            parent,
            t0_ns,
            {
                tr.GEN_AI_OPERATION: operation,
                tr.GEN_AI_PROVIDER: tr.PROVIDER,
                tr.GEN_AI_REQUEST_MODEL: model,
                tr.GEN_AI_REQUEST_TEMPERATURE: p.temperature,
                tr.GEN_AI_REQUEST_TOP_P: p.top_p,
                tr.GEN_AI_REQUEST_MAX_TOKENS: p.max_tokens,
                "specgate.spec.mode": request.spec.mode.value,
                "specgate.spec.max_k": request.spec.max_k,
            },
        )
        observed = _ObservedSteps(self, span, rec, model, parent, t0, t0_ns)
        if rec is not None:
            rec.phase = "queued"
        try:
            observed.steps = self._inner.submit(request)
        except BaseException as exc:
            observed.fail(type(exc).__name__)
            raise
        return observed

    def _close(
        self,
        span: trace.Span,
        rec: RequestRecord | None,
        model: str,
        parent: otel_context.Context,
        t0: float,
        t0_ns: int,
        first: float | None,
        stats: RequestStats | None,
        finish: str | None,
        n_tokens: int,
    ) -> None:
        obs, t_end = self._obs, time.perf_counter()
        if stats is not None and finish is not None:
            obs.metrics.observe_generation_done(model, stats, finish)
        if rec is not None:
            if stats is not None:
                rec.generations.append(stats)
            if finish is not None:
                rec.finish_reasons.append(finish)
            if not rec.usage_set:
                done = stats.completion_tokens if stats is not None else n_tokens
                rec.prompt_tokens = max(rec.prompt_tokens, stats.prompt_tokens if stats else 0)
                rec.completion_tokens += done
        if not span.is_recording():
            span.end()
            return
        ctx = trace.set_span_in_context(span, parent)

        def at(perf: float) -> int:
            return tr.epoch_ns(perf, t0, t0_ns)

        attrs: dict[str, Any] = {tr.GEN_AI_RESPONSE_MODEL: model}
        if stats is not None:
            q_end = min(t0 + stats.queue_s, t_end)  # engine-thread times, clamped to what we saw
            p_end = min(q_end + stats.prefill_s, first or t_end, t_end)
            obs.tracing.add_span("specgate.queue", ctx, t0_ns, at(q_end))
            obs.tracing.add_span(
                "specgate.prefill",
                ctx,
                at(q_end),
                at(p_end),
                {"gen_ai.usage.input_tokens": stats.prompt_tokens},
            )
            obs.tracing.add_span("specgate.decode", ctx, at(p_end), at(t_end), _spec_attrs(stats))
            attrs.update(_spec_attrs(stats))
            attrs[tr.GEN_AI_INPUT_TOKENS] = stats.prompt_tokens
            attrs[tr.GEN_AI_OUTPUT_TOKENS] = stats.completion_tokens
        elif first is not None:  # left early (client gone, stop string): no final stats
            obs.tracing.add_span("specgate.decode", ctx, at(first), at(t_end))
            attrs[tr.GEN_AI_OUTPUT_TOKENS] = n_tokens
        if finish is not None:
            attrs[tr.GEN_AI_FINISH_REASONS] = [finish]
        else:
            attrs["specgate.left_early"] = True
        span.set_attributes(attrs)
        span.end(end_time=at(t_end))


class _ObservedSteps:
    """The wrapped engine's steps, observed as they pass; the span ends with the stream (its last
    step, an error, or ``aclose``)."""

    def __init__(
        self,
        engine: ObservedEngine,
        span: trace.Span,
        rec: RequestRecord | None,
        model: str,
        parent: otel_context.Context,
        t0: float,
        t0_ns: int,
    ):
        self.steps: StepStream | None = None  # set once the wrapped engine accepted the request
        self._engine, self._span, self._rec, self._model = engine, span, rec, model
        self._parent, self._t0, self._t0_ns = parent, t0, t0_ns
        self._first: float | None = None
        self._stats: RequestStats | None = None
        self._finish: str | None = None
        self._n_tokens = 0
        self._ended = False

    def __aiter__(self) -> _ObservedSteps:
        return self

    async def __anext__(self) -> StepOutput:
        if self._ended or self.steps is None:
            raise StopAsyncIteration
        try:
            step = await self.steps.__anext__()
        except StopAsyncIteration:
            self._end()
            raise
        except asyncio.CancelledError:
            self.left()
            raise
        except BaseException as exc:
            self.fail(type(exc).__name__)
            raise
        self._engine._obs.metrics.observe_step(self._model, step)
        if step.token_ids:
            self._n_tokens += len(step.token_ids)
            if self._first is None:
                self._first = time.perf_counter()
                if self._rec is not None:
                    self._rec.mark_first_token()
                    self._rec.phase = "decode"
        if step.finish_reason is not None:
            self._finish, self._stats = step.finish_reason.value, step.stats
            if step.error:
                tr.set_error(self._span, "engine_error")
        return step

    async def aclose(self) -> None:
        if self._ended:
            return
        if self._finish is None:
            self._span.set_attribute("specgate.aborted", True)  # the consumer left before the last step
        try:
            if self.steps is not None:
                await self.steps.aclose()
        finally:
            self._end()

    def left(self) -> None:
        """The consumer left (a client's disconnect cancelling its task): the span ends marked
        aborted, not failed, as the server span does (``specgate.aborted_phase``). Marked ERROR, every
        client that closed a stream early was an engine error in a trace search for errors."""
        if self._finish is None:
            self._span.set_attribute("specgate.aborted", True)
        self._end()

    def fail(self, kind: str) -> None:
        """The request was refused, or its stream raised: the span ends marked with ``kind``."""
        if self._finish is None:
            tr.set_error(self._span, kind)
        self._end()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            self._engine._close(
                self._span,
                self._rec,
                self._model,
                self._parent,
                self._t0,
                self._t0_ns,
                self._first,
                self._stats,
                self._finish,
                self._n_tokens,
            )


def _spec_attrs(stats: RequestStats) -> dict[str, Any]:
    return {
        "specgate.spec.drafter": stats.drafter,
        "specgate.spec.steps": stats.steps,
        "specgate.spec.verification_steps": stats.spec_steps,
        "specgate.spec.drafted": stats.drafted,
        "specgate.spec.accepted": stats.accepted,
        "specgate.spec.acceptance_rate": round(stats.acceptance_rate, 4),
        "specgate.spec.accepted_per_spec_step": round(stats.accepted_per_spec_step, 4),
        "specgate.spec.tokens_per_step": round(stats.tokens_per_step, 4),
        "specgate.spec.disabled_steps": stats.spec_disabled_steps,
        "specgate.spec.accepted_by_position": list(stats.accepted_by_position),
        "specgate.spec.drafted_by_position": list(stats.drafted_by_position),
    }
