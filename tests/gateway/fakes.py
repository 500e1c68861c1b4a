"""A scripted ``EngineClient`` on the tiny byte-level tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from decoding.errors import EngineOverloaded, UnknownModel
from decoding.params import FinishReason, GenerationRequest, RequestStats, StepOutput, TokenLogprob
from decoding.tiny import byte_tokenizer
from gateway.app import create_app
from gateway.settings import load_settings
from tests.servers import serve_in_loop


@dataclass
class FakeModel:
    tokenizer: Any
    max_context: int = 4096


@dataclass
class FakeCore:
    models: dict[str, FakeModel]
    total_steps: int = 0

    def model(self, name: str) -> FakeModel:
        if name not in self.models:
            raise UnknownModel(name, sorted(self.models))
        return self.models[name]


@dataclass
class ScriptedEngine:
    """Every request gets the scripted steps (token ids per step); ``fail`` ends with an engine error.
    A request that asks for logprobs gets made-up ones (each token at -1.0), its prompt's on its first
    step."""

    script: list[list[int]]
    fail: str | None = None
    delay: float = 0.0
    overloaded: int = 0  # the first this many submits are refused as the real engine's full queue is
    finish: FinishReason = FinishReason.LENGTH  # how the last step ends (STOP: as at an end-of-turn token)
    cached: int = 0  # prompt tokens every request reports reused from the prefix cache
    requests: list[GenerationRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = FakeCore({"fake": FakeModel(byte_tokenizer())})

    @property
    def model_names(self) -> list[str]:
        return sorted(self.engine.models)

    def tokenizer(self, model: str) -> Any:
        return self.engine.model(model).tokenizer

    def max_context(self, model: str) -> int:
        return self.engine.model(model).max_context

    @property
    def queue_depth(self) -> int:
        return 0

    @property
    def active(self) -> int:
        return 0

    def shutdown(self, timeout: float = 5.0) -> None:
        pass

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        return request

    def submit(self, request: GenerationRequest) -> AsyncGenerator[StepOutput, None]:
        self.engine.model(request.model)  # the refusal comes from submit itself
        if self.overloaded:
            self.overloaded -= 1
            raise EngineOverloaded(0)
        self.requests.append(request)
        return self._steps(request)

    async def _steps(self, request: GenerationRequest) -> AsyncGenerator[StepOutput, None]:
        stats = RequestStats(
            prompt_tokens=len(request.prompt_token_ids), cached_tokens=self.cached, drafter="scripted"
        )
        for i, ids in enumerate(self.script):
            await asyncio.sleep(self.delay)
            self.engine.total_steps += 1
            stats.steps += 1
            stats.completion_tokens += len(ids)
            last = i == len(self.script) - 1
            if last and self.fail:
                yield StepOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error=self.fail)
                return
            yield StepOutput(
                request.request_id,
                ids,
                logprobs=None
                if request.params.logprobs is None
                else [TokenLogprob(t, -1.0, ()) for t in ids],
                prompt_logprobs=_scored(request) if i == 0 else None,
                finish_reason=self.finish if last else None,
                stats=stats if last else None,
                cached_tokens=self.cached,
            )


def _scored(request: GenerationRequest) -> list[TokenLogprob | None] | None:
    n = request.params.prompt_logprobs
    if n is None:
        return None
    return [None] + [TokenLogprob(t, -1.0, ((t, -1.0),)[:n]) for t in request.prompt_token_ids[1:]]


def token_ids(text: str) -> list[int]:
    """Byte-level ids of ``text``: one id per UTF-8 byte."""
    return list(byte_tokenizer()(text)["input_ids"])


class Turns(ScriptedEngine):
    """Each request gets the next of ``turns`` (texts), 4 tokens a step, and ends as at end of turn."""

    def __init__(self, turns: list[str]):
        super().__init__([], finish=FinishReason.STOP)
        self.turns = list(turns)

    def submit(self, request: GenerationRequest) -> AsyncGenerator[StepOutput, None]:
        ids = token_ids(self.turns.pop(0))
        self.script = [ids[i : i + 4] for i in range(0, len(ids), 4)]
        return super().submit(request)


@contextlib.asynccontextmanager
async def serve_turns(turns: list[str]) -> AsyncIterator[tuple[str, Turns]]:
    """A real server (uvicorn, in this loop) on a ``Turns`` engine: its URL and the engine."""
    engine = Turns(turns)
    app = create_app(load_settings(overrides={"cache": {"enabled": False}}, env={}), engine=engine)  # type: ignore[arg-type]
    url, server, task = await serve_in_loop(app)
    try:
        yield url, engine
    finally:
        server.should_exit = True
        await task
