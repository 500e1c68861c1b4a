"""The remote backend: a `Job` as an OpenAI-compatible upstream call, its SSE events as `Delta`s.

The upstream client (router.upstream.UpstreamClient) does the retries, the breaker and the wait for the
first event; it reports its own calls and gets a CLIENT span each. Upstream exceptions become
`APIError`s in `api_error` and nowhere else; an upstream's in-band `{"error": ...}` event after its
first ends our stream with that same error (a 502 for a request not streamed).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

from gateway.backends import (
    Delta,
    Generation,
    Job,
    LogprobEntry,
    PromptLogprobs,
    ToolCallDelta,
    new_call_id,
)
from gateway.errors import APIError
from gateway.observability.record import note_first_token
from router.faults import UpstreamBadResponse, UpstreamError, is_error
from router.upstream import UpstreamClient, UpstreamStream


def api_error(exc: UpstreamError) -> APIError:
    err = exc.error_body()["error"]
    headers = {"Retry-After": str(max(1, round(exc.retry_after)))} if exc.retry_after is not None else {}
    return APIError(exc.status, err["message"], err["type"], err.get("param"), err.get("code"), headers)


def _body(job: Job) -> dict[str, Any]:
    body: dict[str, Any] = {
        "n": job.n, "temperature": job.temperature, "top_p": job.top_p, "seed": job.seed,
        "presence_penalty": job.presence_penalty, "frequency_penalty": job.frequency_penalty,
        "stream_options": {"include_usage": True},  # usage comes from the upstream's last chunk
    }  # fmt: skip
    if job.max_tokens is not None:
        body[job.max_tokens_field] = job.max_tokens
    if job.stops:
        body["stop"] = list(job.stops)
    # vLLM's extras, only where the client set them: an upstream that does not know them may refuse
    # them, which the client then sees, rather than have them silently dropped
    body |= job.vllm_extras() | (job.guided or {})
    if job.user is not None:
        body["user"] = job.user
    if job.logit_bias:
        body["logit_bias"] = job.logit_bias
    if job.kind == "chat":
        body["messages"] = job.messages
        # structured outputs, tools and Predicted Outputs go upstream as the client sent them
        for name in ("tools", "tool_choice", "parallel_tool_calls", "response_format"):
            if getattr(job, name) is not None:
                body[name] = getattr(job, name)
        if job.prediction is not None:
            body["prediction"] = {"type": "content", "content": job.prediction}
        if job.logprobs is not None:
            body["logprobs"], body["top_logprobs"] = True, job.logprobs
    else:
        body["prompt"], body["echo"] = job.prompts, job.echo
        if job.logprobs is not None:
            body["logprobs"] = job.logprobs
    return {k: v for k, v in body.items() if v is not None}


def _logprobs(choice: dict[str, Any]) -> list[LogprobEntry] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
        return None  # chat logprobs (a completion's: _completion_logprobs)
    return [
        LogprobEntry(
            e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or []]
        )
        for e in lp["content"]
    ]


def _completion_logprobs(choice: dict[str, Any]) -> tuple[list[LogprobEntry] | None, PromptLogprobs | None]:
    """A legacy completion chunk's logprobs ({tokens, token_logprobs, top_logprobs, text_offset}) as
    entries; with echo the choice's first token has a null logprob, which becomes the start of a
    prompt's logprobs (the rest of the chunk's tokens stay entries: an upstream's echo chunk may
    hold the first completion tokens too, and the formatter lists both alike). The upstream's
    offsets are not kept: the formatter counts them as it does for local generations."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list):
        return None, None
    values, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or []
    entries, first = [], None
    for i, token in enumerate(lp["tokens"]):
        value = values[i] if i < len(values) else None
        top = tops[i] if i < len(tops) else None
        if value is None:
            if i == 0:
                first = str(token)
            continue  # nothing predicts it
        entries.append(LogprobEntry(str(token), float(value), list((top or {}).items())))
    return entries, None if first is None else PromptLogprobs(first, [])


def _prediction_tokens(usage: dict[str, Any]) -> tuple[int, int] | None:
    """The upstream's Predicted Outputs counts (usage.completion_tokens_details), or None: without
    them a remote answer to a request with `prediction` reported 0 accepted and 0 rejected tokens
    whatever the upstream said."""
    details = usage.get("completion_tokens_details")
    if not isinstance(details, dict):
        return None
    accepted, rejected = details.get("accepted_prediction_tokens"), details.get("rejected_prediction_tokens")
    if isinstance(accepted, int) and isinstance(rejected, int) and min(accepted, rejected) >= 0:
        return accepted, rejected
    return None


class _Calls:
    """An upstream's streamed tool_calls as ours (same ids and fragments). A call opens the first time
    its index shows up in its choice, and indexes are renumbered in that order: servers differ (some
    repeat the name or id on every delta, some open a call before naming it, some count from 1), and
    the formatter keeps a choice's calls as a list. Read by the name alone, a repeated name opened a
    second, empty call, and a first delta without one, or an index 1 first, was a 500."""

    def __init__(self) -> None:
        self.ours: dict[tuple[int, int], int] = {}  # (choice, upstream index) -> our index
        self.opened: dict[int, int] = {}  # choice -> calls opened

    def deltas(self, choice: int, delta: dict[str, Any]) -> list[ToolCallDelta] | None:
        out = []
        for c in delta.get("tool_calls") or []:  # router.faults.malformed checked their types
            fn = c.get("function") or {}
            key = (choice, c.get("index", 0))
            if key in self.ours:
                if fn.get("arguments"):
                    out.append(ToolCallDelta(self.ours[key], fn["arguments"]))
                continue
            index = self.ours[key] = self.opened.get(choice, 0)
            self.opened[choice] = index + 1
            out.append(
                ToolCallDelta(
                    index, fn.get("arguments") or "", c.get("id") or new_call_id(), fn.get("name") or ""
                )
            )
        return out or None


def _trace_headers(job: Job) -> dict[str, str]:
    headers = {"x-request-id": job.request_id}
    try:  # the current span's W3C traceparent, when observability has set one up
        from opentelemetry.propagate import inject

        inject(headers)
    except ImportError:
        pass
    return headers


class RemoteBackend:
    name = "remote"

    def __init__(self, client: UpstreamClient):
        self.client = client

    def model_ids(self) -> list[str]:
        return [self.client.settings.model]

    async def prompt_tokens(self, job: Job) -> int:
        """An estimate of the prompt tokens the upstream will count, without its tokenizer: four
        characters a token, as OpenAI estimates a request's tokens for its rate limits (messages and
        tools as their JSON text, which counts each message's few template tokens too)."""
        if job.kind == "chat":
            text = json.dumps([job.messages, job.tools or []], ensure_ascii=False)
            return math.ceil(len(text) / 4)
        prompts = job.prompts or []
        return sum(len(p) if isinstance(p, list) else math.ceil(len(p) / 4) for p in prompts)

    async def start(self, job: Job) -> Generation:
        """Raises `UpstreamError` untranslated, so that `RoutedBackend` can fall back."""
        path = "chat/completions" if job.kind == "chat" else "completions"
        stream = await self.client.open_stream(path, _body(job), _trace_headers(job))
        gen = Generation(prompt_tokens=0, deltas=_nothing())
        gen.deltas = _deltas(stream, job, gen)
        return gen


async def _nothing() -> AsyncIterator[Delta]:
    return
    yield


async def _deltas(stream: UpstreamStream, job: Job, gen: Generation) -> AsyncIterator[Delta]:
    # Finish deltas are held back until the upstream's usage chunk, so the last one can carry the
    # exact completion token count: chunks are not tokens (a step may hold several, an echoed
    # prompt's chunk none), so the count made from them is corrected either way.
    held: list[Delta] = []
    counted = 0
    first = True  # no token yet (its time is noted once)
    choices = job.choices
    calls = _Calls()
    try:
        async for event in stream:
            if is_error(event):
                # the upstream failed, not the gateway: a 502 (it was a 500) where the status still shows
                err = event["error"]
                raise APIError(502, str(err.get("message")), str(err.get("type") or "server_error"),
                               err.get("param"), err.get("code"))  # fmt: skip
            usage = event.get("usage")
            if isinstance(usage, dict):
                gen.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details")  # its own prefix cache's hits, if it says
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    gen.cached_tokens = details["cached_tokens"]
                reported = usage.get("completion_tokens")
                if held and isinstance(reported, int):
                    held[-1].completion_tokens += reported - counted
                    counted = reported
                gen.prediction_tokens = _prediction_tokens(usage) or gen.prediction_tokens
            for choice in event.get("choices") or []:
                if choice.get("index", 0) >= choices:  # the formatter keeps one slot per choice asked for
                    raise UpstreamBadResponse(
                        stream.upstream, f"a chunk for choice {choice['index']} of {choices} asked for"
                    )
                text = (
                    choice.get("text")
                    if job.kind == "completion"
                    else (choice.get("delta") or {}).get("content")
                )
                d = Delta(int(choice.get("index", 0)), text or "", None, choice.get("finish_reason"))
                if job.kind == "chat":
                    d.logprobs = _logprobs(choice)
                    d.tool_calls = calls.deltas(d.index, choice.get("delta") or {})
                else:  # with echo the text and logprobs begin with the upstream's echoed prompt
                    d.logprobs, d.prompt_logprobs = _completion_logprobs(choice)
                if not (d.text or d.finish_reason or d.tool_calls or d.logprobs or d.prompt_logprobs):
                    continue  # the role chunk: our formatter writes its own
                d.completion_tokens = 1 if d.text else 0
                counted += d.completion_tokens
                if first and (d.text or d.tool_calls):
                    note_first_token()
                    first = False
                if d.finish_reason is not None:
                    held.append(d)
                else:
                    yield d
        for d in held:
            yield d
    except UpstreamError as exc:
        raise api_error(exc) from exc
    finally:
        await stream.aclose()
