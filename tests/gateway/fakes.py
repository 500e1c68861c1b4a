"""A scripted engine with the AsyncEngine surface the gateway uses, on the tiny byte-level tokenizer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from decoding.errors import UnknownModel
from decoding.params import FinishReason, GenerationRequest, RequestStats, StepOutput
from decoding.tiny import byte_tokenizer


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

    def check(self, request: GenerationRequest) -> FakeModel:
        return self.model(request.model)


@dataclass
class ScriptedEngine:
    """Every request gets the scripted steps (token ids per step); ``fail`` ends with an engine error."""

    script: list[list[int]]
    fail: str | None = None
    delay: float = 0.0
    requests: list[GenerationRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = FakeCore({"fake": FakeModel(byte_tokenizer())})

    @property
    def model_names(self) -> list[str]:
        return sorted(self.engine.models)

    @property
    def queue_depth(self) -> int:  # the engine gauges /metrics reads
        return 0

    @property
    def active(self) -> int:
        return 0

    @property
    def tokenizer(self) -> Any:
        return self.engine.models["fake"].tokenizer

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        self.engine.check(request)
        self.requests.append(request)
        stats = RequestStats(prompt_tokens=len(request.prompt_token_ids), drafter="scripted")
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
                finish_reason=FinishReason.LENGTH if last else None,
                stats=stats if last else None,
            )


def token_ids(text: str) -> list[int]:
    """Byte-level ids of ``text``: one id per UTF-8 byte."""
    return list(byte_tokenizer()(text)["input_ids"])
