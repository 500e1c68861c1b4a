"""Fixtures: an in-memory tracer provider, a scripted engine, and a small app wired like the gateway."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from decoding.params import FinishReason, GenerationRequest, RequestStats, StepOutput

# upstream: the raw-socket upstream the remote-path tests script, their fixture itself
from tests.gateway.test_remote_faults import upstream  # noqa: F401

CANARY = "zebra-canary-7f3a"
ROOT = Path(__file__).resolve().parents[2]


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

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        return request

    def submit(self, request: GenerationRequest) -> AsyncGenerator[StepOutput, None]:
        return self._steps(request)

    async def _steps(self, request: GenerationRequest) -> AsyncGenerator[StepOutput, None]:
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


# ---- a real `specgate serve` on tiny random models (integration and dashboard tests) -------------

TINY_MODELS = [
    {"name": "tiny", "source": "tiny-random", "draft": "tiny-draft", "dtype": "float32", "device": "cpu"},
    {"name": "tiny-draft", "source": "tiny-random-draft", "dtype": "float32", "device": "cpu"},
]


@dataclass
class Served:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def serve(tmp: Path, settings: dict[str, object], env: dict[str, str] | None = None) -> Served:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = tmp / "specgate.yaml"
    config.write_text(yaml.safe_dump({"models": TINY_MODELS, **settings}))
    log = tmp / "server.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
            cwd=ROOT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
        )
    served = Served(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{served.output()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(served.url + "/ready", timeout=1).status_code == 200:
                return served
        time.sleep(0.2)
    stop(served)
    raise RuntimeError(f"server not ready in time:\n{served.output()}")


def stop(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.terminate()
        try:
            served.proc.wait(15)
        except subprocess.TimeoutExpired:
            served.proc.kill()
            served.proc.wait(10)
