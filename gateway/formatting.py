"""Deltas -> OpenAI response objects, for chat and legacy completions, streamed or whole.

Both paths fold the same ``Delta`` sequence, so a streamed response's pieces concatenate to the
non-streamed text. Chunk shapes follow ../shared/OPENAI-CONTRACT.md: a role chunk per choice first,
content chunks, a finish chunk per choice with an empty delta, and with include_usage ``"usage":null``
on every chunk but a final one whose ``choices`` is ``[]``.
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from dataclasses import replace
from typing import Any

from gateway.backends import Delta, Generation, LogprobEntry, PromptLogprobs
from gateway.detokenize import logprob_bytes
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
    return list(logprob_bytes(s))


class _Chars:
    """Counts a choice's characters token by token (``text_offset``) as its text decodes them: a token
    holding part of a character (``bytes:\\xNN``) starts where that character does, and one whose
    first byte proves the bytes held before it no character starts after the U+FFFD they become."""

    def __init__(self, at: int = 0) -> None:
        self.at = at  # characters decoded so far
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def start(self, token: str) -> int:
        """Where ``token`` (a logprob token) starts in the text; its characters are counted."""
        piece = logprob_bytes(token)
        held = self.decoder.getstate()[0]
        at = self.at + (1 if held and piece and not _continues(held + piece[:1]) else 0)
        self.at += len(self.decoder.decode(piece))
        return at


def _continues(head: bytes) -> bool:
    """Whether ``head`` is a character or the start of one (a held prefix that the next byte breaks
    becomes one U+FFFD, as Python's decoder and the tokenizers' replace it: its maximal subpart)."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"
    return True


# Characters JSON leaves raw in a string that Python's str.splitlines ends a line at, and so httpx's
# iter_lines (how many clients and tests read an SSE stream): an event whose text held one arrived as
# two lines, neither of them JSON. Escaped as \uXXXX they parse back to themselves in any JSON reader.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_json(text: str) -> str:
    """An event's JSON with no character any common line reader ends a line at (SSE itself ends one
    at CR and LF only, which JSON always escapes)."""
    return text.translate(_LINE_BREAKS)


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
            prompt_tokens_details={"cached_tokens": gen.cached_tokens},
            speculative=gen.speculative,
        )

    def details(self, gen: Generation) -> dict[str, int] | None:
        return None

    # How serving ends what it sends (the Responses API's format ends otherwise: response_events.py)
    async def settle(self, gen: Generation) -> None:
        """Every delta arrived; called before ``closing`` or ``whole``. Nothing to do here."""

    def closing(self, gen: Generation) -> list[Any]:
        """A stream's last chunks: the usage chunk, with include_usage."""
        return [self._chunk([], self.usage(gen))] if self.include_usage else []

    def failure(self, error: dict[str, Any]) -> list[Any]:
        """A fault after the 200: one ``{"error": ...}`` event."""
        return [json.dumps(error)]

    ending: tuple[Any, ...] = ("[DONE]",)  # after everything, a failure's event included

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
        return sse_json(obj.model_dump_json(exclude=None if self.include_usage else {"usage"}))


class ChatFormat(_Formatter):
    prefix = "chatcmpl-"
    envelope = ChatCompletionChunk

    def __init__(
        self,
        model: str,
        include_usage: bool,
        choices: int,
        prediction: bool = False,
        calls_only: bool = False,
        calls_tools: bool = False,
    ):
        super().__init__(model, include_usage, choices)
        self.prediction = prediction
        # tool_choice required or named: the answer is tool calls alone, whose first delta OpenAI
        # sends with content null (the SDK's stream helper then ends with content None, not "")
        self.calls_only = calls_only
        # tool_choice auto: whether a choice is calls alone is known only from its first delta, so
        # its opening waits for it (content null before a call, "" before text, as OpenAI sends
        # them); the choices still to open, None where every opening goes out first
        self.unopened: set[int] | None = set(range(choices)) if calls_tools and not calls_only else None
        self.calls: list[list[dict[str, Any]]] = [[] for _ in range(choices)]  # tool_calls per choice
        # choices opened with content null: a chunk of logprobs alone (a tool call's tokens) carries
        # no content key, or the SDK's stream helper would end with content "" where the whole is null
        self.no_content: set[int] = set()
        self.early: dict[int, list[LogprobEntry]] = {}  # logprobs of an unopened choice's held text

    def fold(self, d: Delta) -> None:
        super().fold(d)
        for piece in d.tool_calls or []:
            calls = self.calls[d.index]
            if piece.id is not None:
                fn = {"name": piece.name or "", "arguments": ""}
                calls.append({"id": piece.id, "type": "function", "function": fn})
            calls[piece.index]["function"]["arguments"] += piece.arguments

    def details(self, gen: Generation) -> dict[str, int] | None:
        """OpenAI's breakdown, sent on every chat completion as OpenAI sends it (zeros where nothing
        applies): no reasoning or audio tokens here; with Predicted Outputs, the prediction's tokens
        that appear in the completion and those that do not (``local.prediction_found``; every
        choice's, summed; a cached answer's as first counted). A remote backend's own figures are not
        passed through: zeros."""
        accepted, rejected = (gen.prediction_tokens or (0, 0)) if self.prediction else (0, 0)
        return {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": rejected,
        }

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

    def _opening(self, index: int, calls: bool) -> str:
        if calls:
            self.no_content.add(index)
        return self._chunk(
            [ChunkChoice(index=index, delta={"role": "assistant", "content": None if calls else ""})]
        )

    def opening(self, gen: Generation) -> list[str]:
        if self.unopened is not None:
            return []  # each choice's, with its first delta (chunks)
        return [self._opening(i, self.calls_only) for i in range(len(self.texts))]

    def chunks(self, d: Delta) -> list[str]:
        """The SSE data for one delta (folding it into the totals as well)."""
        self.fold(d)
        out: list[str] = []
        if self.unopened is not None and d.index in self.unopened:
            if not (d.text or d.tool_calls or d.finish_reason is not None):  # text held back: wait
                if d.logprobs:  # they go out after the opening, once it is known
                    self.early[d.index] = self.early.get(d.index, []) + d.logprobs
                return out
            self.unopened.discard(d.index)
            out.append(self._opening(d.index, bool(d.tool_calls) and not d.text))
            if d.index in self.early:
                d = replace(d, logprobs=self.early.pop(d.index) + (d.logprobs or []))
        if d.text or d.logprobs:
            lp = chat_logprobs(d.logprobs) if d.logprobs is not None else None
            delta = {"content": d.text} if d.text or d.index not in self.no_content else {}
            out.append(self._chunk([ChunkChoice(index=d.index, delta=delta, logprobs=lp)]))
        out += self._tool_chunks(d)
        if d.finish_reason is not None:
            out.append(self._chunk([ChunkChoice(index=d.index, delta={}, finish_reason=d.finish_reason)]))
        return out

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


def _append(lp: CompletionLogprobs, e: LogprobEntry, offset: int) -> None:
    """One token of legacy logprobs. Its top_logprobs hold the chosen token too: the legacy API
    "will always return the logprob of the sampled token, so there may be up to logprobs+1
    elements" (vLLM does the same), so a prompt token or a sampled one outside the top k is there."""
    lp.tokens.append(e.token)
    lp.token_logprobs.append(e.logprob)
    top = dict(e.top)
    top.setdefault(e.token, e.logprob)
    lp.top_logprobs.append(top)
    lp.text_offset.append(offset)


class CompletionFormat(_Formatter):
    """Legacy completions. With ``echo`` each choice's text begins with its prompt; with echo and
    logprobs the prompt's tokens lead the choice's logprobs too (the first one's logprob and
    alternatives null), and a stream's echo chunk, which carries them, waits for the choice's first
    delta (``Generation.echo_logprobs``: the backend scores the prompt)."""

    prefix = "cmpl-"
    envelope = Completion

    def __init__(self, model: str, include_usage: bool, choices: int, n: int, echo: bool):
        super().__init__(model, include_usage, choices)
        self.n = n
        self.echo = echo
        self.chars = [_Chars() for _ in range(choices)]  # each choice's text_offset, in characters
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * choices
        self.held: list[str | None] = [None] * choices  # a streamed echo waiting for its logprobs
        self.carried = False  # the generation's text carries its own echo (set with the generation)

    def _prompt_text(self, gen: Generation, index: int) -> str:
        """The echo this format adds: none where the generation's text carries its own (a remote
        upstream's: it was sent ``echo``, and ``prompt_texts`` is empty)."""
        return gen.prompt_texts[index // self.n] if self.echo and gen.prompt_texts else ""

    def fold(self, d: Delta) -> None:
        super().fold(d)
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[d.index] = d.prompt_logprobs

    def _lp(
        self, index: int, entries: list[LogprobEntry] | None, prompt: PromptLogprobs | None = None
    ) -> CompletionLogprobs | None:
        """The choice's logprobs object: ``prompt``'s tokens, then ``entries``. Offsets are where each
        token starts in the choice's text, in characters: the prompt's from 0, by the characters
        each token completes (they add up to the echo; a token holding part of a character starts
        where that character does), the completion's from the end of the echo, or, where the text
        carries its own echo (a remote upstream's), on from the prompt's tokens."""
        if entries is None and prompt is None:
            return None
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if prompt is not None:
            lp.tokens.append(prompt.first)
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            prompt_chars = _Chars()
            lp.text_offset.append(prompt_chars.start(prompt.first))
            for e in prompt.rest:
                _append(lp, e, prompt_chars.start(e.token))
            if self.carried:
                self.chars[index] = prompt_chars
        for e in entries or []:
            _append(lp, e, self.chars[index].start(e.token))
        return lp

    def opening(self, gen: Generation) -> list[str]:
        self.carried = self.echo and not gen.prompt_texts
        out = []
        for i in range(len(self.texts)):
            echo = self._prompt_text(gen, i)
            self.chars[i] = _Chars(len(echo))
            if self.echo and gen.echo_logprobs:
                self.held[i] = echo  # sent with its prompt's logprobs, by the choice's first delta
            elif echo:
                out.append(self._chunk([CompletionChoice(text=echo, index=i)]))
        return out

    def chunks(self, d: Delta) -> list[str]:
        self.fold(d)
        out = []
        echo, self.held[d.index] = self.held[d.index], None
        if echo is not None or d.text or d.logprobs or d.prompt_logprobs:
            lp = self._lp(d.index, d.logprobs, d.prompt_logprobs)
            text = (echo or "") + d.text
            out.append(self._chunk([CompletionChoice(text=text, index=d.index, logprobs=lp)]))
        if d.finish_reason is not None:
            out.append(self._chunk([CompletionChoice(text="", index=d.index, finish_reason=d.finish_reason)]))
        return out

    def whole(self, gen: Generation) -> dict[str, Any]:
        self.carried = self.echo and not gen.prompt_texts
        choices = []
        for i, (text, lp) in enumerate(zip(self.texts, self.logprobs, strict=True)):
            echo = self._prompt_text(gen, i)
            self.chars[i] = _Chars(len(echo))
            choices.append(
                CompletionChoice(
                    text=echo + text,
                    index=i,
                    logprobs=self._lp(i, lp, self.prompt_logprobs[i]),
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
