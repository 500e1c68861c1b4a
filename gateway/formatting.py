"""Deltas -> OpenAI response objects, for chat and legacy completions, streamed or whole.

Both paths fold the same ``Delta`` sequence, so a streamed response's pieces concatenate to the
non-streamed text. Chunk shapes follow ../shared/OPENAI-CONTRACT.md: a role chunk per choice first,
content chunks, a finish chunk per choice with an empty delta, and with include_usage ``"usage":null``
on every chunk but a final one whose ``choices`` is ``[]``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from gateway.backends import Delta, Generation, LogprobEntry
from gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TopLogprob,
    Usage,
)

SYSTEM_FINGERPRINT = "specgate-0.1"


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8", errors="replace"))


def chat_logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=e.logprob,
                bytes=_bytes(e.token),
                top_logprobs=[TopLogprob(token=t, logprob=v, bytes=_bytes(t)) for t, v in e.top],
            )
            for e in entries
        ]
    )


class _Formatter:
    """State shared by the chat and completion formats: ids, per-choice text, usage."""

    prefix = ""
    envelope: Any = None  # the chunk model: ChatCompletionChunk or Completion

    def __init__(self, model: str, include_usage: bool, choices: int):
        self.id = f"{self.prefix}{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.texts = [""] * choices
        self.logprobs: list[list[LogprobEntry] | None] = [None] * choices
        self.finish: list[str | None] = [None] * choices
        self.completion_tokens = 0

    def fold(self, d: Delta) -> None:
        self.texts[d.index] += d.text
        self.completion_tokens += d.completion_tokens
        if d.logprobs is not None:
            self.logprobs[d.index] = (self.logprobs[d.index] or []) + d.logprobs
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason

    def usage(self, gen: Generation) -> Usage:
        return Usage(
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=gen.prompt_tokens + self.completion_tokens,
            completion_tokens_details=self.details(gen),
            speculative=gen.speculative,
        )

    def details(self, gen: Generation) -> dict[str, int] | None:
        return None

    def _chunk(self, choices: list[Any], usage: Usage | None = None) -> str:
        """One SSE event: the format's envelope (same id and created on every chunk) around choices."""
        return self._dump(
            self.envelope(
                id=self.id,
                created=self.created,
                model=self.model,
                system_fingerprint=SYSTEM_FINGERPRINT,
                choices=choices,
                usage=usage,
            )
        )

    def _dump(self, obj: Any) -> str:
        return str(obj.model_dump_json(exclude=None if self.include_usage else {"usage"}))


class ChatFormat(_Formatter):
    prefix = "chatcmpl-"
    envelope = ChatCompletionChunk

    def __init__(self, model: str, include_usage: bool, choices: int, prediction: bool = False):
        super().__init__(model, include_usage, choices)
        self.prediction = prediction
        self.calls: list[list[dict[str, Any]]] = [[] for _ in range(choices)]  # tool_calls per choice

    def fold(self, d: Delta) -> None:
        super().fold(d)
        for piece in d.tool_calls or []:
            calls = self.calls[d.index]
            if piece.id is not None:
                fn = {"name": piece.name or "", "arguments": ""}
                calls.append({"id": piece.id, "type": "function", "function": fn})
            calls[piece.index]["function"]["arguments"] += piece.arguments

    def details(self, gen: Generation) -> dict[str, int] | None:
        """Predicted Outputs: prediction tokens verification accepted, and those it rejected (drafted
        and not kept: the target computed them in vain, which is what OpenAI bills them for)."""
        if not self.prediction:
            return None
        spec = gen.speculative or {}
        used = spec.get("drafter") == "prediction"
        accepted = int(spec.get("accepted_tokens", 0)) if used else 0
        drafted = int(spec.get("drafted_tokens", 0)) if used else 0
        return {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": drafted - accepted}

    def _tool_chunks(self, d: Delta) -> list[str]:
        """One chunk per call opening (index, id, type, name, arguments "") and one per run of a
        call's argument fragments: never two calls' pieces in one entry, never a fragment first."""
        out: list[dict[str, Any]] = []
        for piece in d.tool_calls or []:
            if piece.id is not None:
                fn = {"name": piece.name, "arguments": ""}
                out.append({"index": piece.index, "id": piece.id, "type": "function", "function": fn})
                if piece.arguments:
                    out.append({"index": piece.index, "function": {"arguments": piece.arguments}})
            elif out and "id" not in out[-1] and out[-1]["index"] == piece.index:
                out[-1]["function"]["arguments"] += piece.arguments
            elif piece.arguments:
                out.append({"index": piece.index, "function": {"arguments": piece.arguments}})
        return [self._chunk([ChunkChoice(index=d.index, delta={"tool_calls": [c]})]) for c in out]

    def opening(self, gen: Generation) -> list[str]:
        return [
            self._chunk([ChunkChoice(index=i, delta={"role": "assistant", "content": ""})])
            for i in range(len(self.texts))
        ]

    def chunks(self, d: Delta) -> list[str]:
        """The SSE data for one delta (folding it into the totals as well)."""
        self.fold(d)
        out = []
        if d.text or d.logprobs:
            lp = chat_logprobs(d.logprobs) if d.logprobs is not None else None
            out.append(self._chunk([ChunkChoice(index=d.index, delta={"content": d.text}, logprobs=lp)]))
        out += self._tool_chunks(d)
        if d.finish_reason is not None:
            out.append(self._chunk([ChunkChoice(index=d.index, delta={}, finish_reason=d.finish_reason)]))
        return out

    def usage_chunk(self, gen: Generation) -> str:
        return self._chunk([], self.usage(gen))

    def whole(self, gen: Generation) -> dict[str, Any]:
        choices = [
            ChatChoice(
                index=i,
                # content is null when the turn is tool calls alone, as OpenAI sends it
                message=AssistantMessage(content=text or (None if calls else text), tool_calls=calls or None),
                logprobs=None if lp is None else chat_logprobs(lp),
                finish_reason=self.finish[i] or "stop",
            )
            for i, (text, lp, calls) in enumerate(zip(self.texts, self.logprobs, self.calls, strict=True))
        ]
        body = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=self.usage(gen),
        )
        whole = body.model_dump(mode="json")
        for choice in whole["choices"]:
            if choice["message"]["tool_calls"] is None:
                del choice["message"]["tool_calls"]
        return whole


class CompletionFormat(_Formatter):
    prefix = "cmpl-"
    envelope = Completion

    def __init__(self, model: str, include_usage: bool, choices: int, n: int, echo: bool):
        super().__init__(model, include_usage, choices)
        self.n = n
        self.echo = echo
        self.offsets = [0] * choices  # text_offset of the next token, per choice

    def _prompt_text(self, gen: Generation, index: int) -> str:
        return gen.prompt_texts[index // self.n] if self.echo else ""

    def _lp(self, index: int, entries: list[LogprobEntry] | None) -> CompletionLogprobs | None:
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(e.token)
        return CompletionLogprobs(
            tokens=[e.token for e in entries],
            token_logprobs=[e.logprob for e in entries],
            top_logprobs=[dict(e.top) for e in entries],
            text_offset=offsets,
        )

    def opening(self, gen: Generation) -> list[str]:
        out = []
        for i in range(len(self.texts)):
            echo = self._prompt_text(gen, i)
            self.offsets[i] = len(echo)
            if echo:
                out.append(self._chunk([CompletionChoice(text=echo, index=i)]))
        return out

    def chunks(self, d: Delta) -> list[str]:
        self.fold(d)
        out = []
        if d.text or d.logprobs:
            out.append(
                self._chunk(
                    [CompletionChoice(text=d.text, index=d.index, logprobs=self._lp(d.index, d.logprobs))]
                )
            )
        if d.finish_reason is not None:
            out.append(self._chunk([CompletionChoice(text="", index=d.index, finish_reason=d.finish_reason)]))
        return out

    def usage_chunk(self, gen: Generation) -> str:
        return self._chunk([], self.usage(gen))

    def whole(self, gen: Generation) -> dict[str, Any]:
        choices = []
        for i, (text, lp) in enumerate(zip(self.texts, self.logprobs, strict=True)):
            echo = self._prompt_text(gen, i)
            self.offsets[i] = len(echo)
            choices.append(
                CompletionChoice(
                    text=echo + text,
                    index=i,
                    logprobs=self._lp(i, lp),
                    finish_reason=self.finish[i] or "stop",
                )
            )
        body = Completion(
            id=self.id,
            created=self.created,
            model=self.model,
            system_fingerprint=SYSTEM_FINGERPRINT,
            choices=choices,
            usage=self.usage(gen),
        )
        return body.model_dump(mode="json")
