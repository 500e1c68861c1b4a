"""Fixtures: an in-memory tracer provider, a scripted engine, and a small app wired like the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from decoding.params import FinishReason, GenerationRequest, RequestStats, StepOutput

CANARY = "zebra-canary-7f3a"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p


@dataclass
class ScriptedEngine:
    """Yields the scripted (drafted, accepted, tokens) steps, then a final step with stats."""

    steps: list[tuple[int, int, list[int]]]
    queue_depth: int = 0
    active: int = 0
    delay: float = 0.0
    aborted: list[str] = field(default_factory=list)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        stats = RequestStats(
            prompt_tokens=len(request.prompt_token_ids),
            drafter="draft-model",
            queue_s=0.0001,
            prefill_s=0.0002,
        )
        n_out, finished = 0, False
        try:
            for i, (k, n, toks) in enumerate(self.steps):
                await asyncio.sleep(self.delay)
                stats.steps += 1
                stats.decode_s += 0.001
                if k:
                    stats.spec_steps += 1
                    stats.drafted += k
                    stats.accepted += n
                n_out += len(toks)
                stats.completion_tokens = n_out
                last = finished = i == len(self.steps) - 1
                yield StepOutput(
                    request.request_id,
                    toks,
                    drafted=k,
                    accepted=n,
                    finish_reason=FinishReason.LENGTH if last else None,
                    stats=stats if last else None,
                )
        finally:  # like AsyncEngine: leaving early (closed or cancelled) aborts
            if not finished:
                self.aborted.append(request.request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
