"""The gateway's side of the cache (``app.state.gateway.cache``): a validated ``Job`` in, and either a
hit replayed as a ``Generation`` or a miss whose finished generation gets stored.

A hit goes through the same formatter as a fresh generation, so it streams as ordinary SSE chunks
(role chunk, content, finish chunk, usage with include_usage) or comes back whole, and the rate
limiter and usage metrics see it like any other response. serving.py calls::

    c = await state.cache.lookup(job, request.headers, raw_body)   # never raises but for a bad `cache` field
    gen = c.replay() or await backend.start(job)                    # x-specgate-cache: c.header
    ...                                                             # after the last delta, not on error/disconnect:
    c.store(fmt, gen)

The app passes its ``Metrics`` and tracer to ``from_settings``; every lookup, skipped ones included, is observed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from opentelemetry import trace

from gateway.backends import Delta, Generation, Job, ToolCallDelta, new_call_id
from gateway.cache.cache import CacheMetrics, ResponseCache
from gateway.cache.query import CacheControlError, CacheQuery
from gateway.cache.response import CachedChoice, CachedResponse, CacheHit, header_value
from gateway.cache.settings import CacheSettings
from gateway.errors import bad_request

log = logging.getLogger("specgate.cache")

# Job fields that are not generation parameters: identity, transport, and the lossless speculation.
_NOT_PARAMS = ("request_id", "kind", "model", "messages", "prompts", "spec", "granularity", "tenant", "user")


def replay_calls(calls: list[dict[str, Any]]) -> list[ToolCallDelta]:
    """A cached choice's tool calls as the deltas that first produced them (each call's opening, then
    its arguments whole), under fresh ids: an id names one call of one response, and a client that
    asks the same question twice in a conversation must not get two calls with one id."""
    out: list[ToolCallDelta] = []
    for i, call in enumerate(calls):
        fn = call["function"]
        out.append(ToolCallDelta(i, "", new_call_id(), fn["name"]))
        out.append(ToolCallDelta(i, fn["arguments"]))
    return out


class _Folded(Protocol):
    """What the formatter accumulated (gateway.formatting._Formatter)."""

    texts: list[str]
    finish: list[str | None]
    completion_tokens: int


def job_body(job: Job) -> dict[str, Any]:
    """The job as a request body for ``build_query``: resolved parameters (defaults filled in)."""
    body = {k: v for k, v in asdict(job).items() if k not in _NOT_PARAMS}
    body["model"] = job.model
    if job.kind == "chat":
        body["messages"] = job.messages
    else:
        prompts = job.prompts or []
        body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
    return body


@dataclass
class CacheLookup:
    cache: ResponseCache
    query: CacheQuery | None  # None: this request bypasses the cache entirely
    hit: CacheHit | None

    @property
    def header(self) -> str:
        return header_value(self.hit)

    def replay(self) -> Generation | None:
        """The hit as a ``Generation`` (one delta per choice), or None on a miss."""
        if self.hit is None:
            return None
        r = self.hit.response
        q = self.query
        prompt_tokens = q.prompt_tokens if q is not None and q.prompt_tokens is not None else r.prompt_tokens

        async def deltas() -> AsyncIterator[Delta]:
            for i, c in enumerate(r.choices):  # per-choice counts are not stored: the total goes first
                tokens = r.completion_tokens if i == 0 else 0
                if c.tool_calls:  # as the backend sends them: text, the calls, then the finish
                    yield Delta(c.index, c.text, None, None, tokens, replay_calls(c.tool_calls))
                    yield Delta(c.index, "", None, c.finish_reason, 0)
                else:
                    yield Delta(c.index, c.text, None, c.finish_reason, tokens)

        gen = Generation(prompt_tokens=prompt_tokens, deltas=deltas())
        gen.prediction_tokens = r.prediction_tokens
        return gen

    def store(self, fmt: _Folded, gen: Generation) -> None:
        """Store a generation that ran to its last delta (callers skip errors and disconnects; the
        cache itself refuses choices without a stop/length finish)."""
        if self.query is None or self.hit is not None:
            return
        calls = getattr(fmt, "calls", None) or [None] * len(fmt.texts)  # a chat formatter's, per choice
        choices = tuple(
            CachedChoice(i, t, f or "", c or None)
            for i, (t, f, c) in enumerate(zip(fmt.texts, fmt.finish, calls, strict=True))
        )
        response = CachedResponse(
            choices, gen.prompt_tokens, fmt.completion_tokens, prediction_tokens=gen.prediction_tokens
        )
        self.cache.store_later(self.query, response)


PromptCounter = Callable[[Job], Awaitable[int | None]]


class GatewayCache:
    def __init__(
        self,
        cache: ResponseCache,
        count_prompt: PromptCounter | None = None,
        default_max_tokens: int | None = None,
        model_sources: Mapping[str, str] | None = None,
    ):
        self.cache = cache
        # a semantic hit answers a paraphrase, whose prompt is not the stored one's: its usage counts
        # this request's prompt (the app sets this to the local backend's count; None or a None
        # count, as for a remote upstream's model: the stored question's count stands)
        self.count_prompt = count_prompt
        # what bounds a request that sets no max_tokens (the app's limits.default_max_tokens, else
        # max_max_tokens): part of such a request's key, so gateways with other defaults sharing a
        # Redis (a rolling deploy of a new one) never replay an answer cut at theirs
        self.default_max_tokens = default_max_tokens
        # what serves each model name (a local model's source, an upstream's URL and model): in the
        # key, so answers stored under a name stop matching once other weights serve it
        self.model_sources: dict[str, str] = dict(model_sources or {})

    @classmethod
    def from_settings(
        cls,
        settings: CacheSettings,
        metrics: CacheMetrics | None = None,
        tracer: trace.Tracer | None = None,
    ) -> GatewayCache | None:
        if not settings.enabled:
            return None
        return cls(ResponseCache(settings, metrics=metrics, tracer=tracer))

    async def start(self) -> None:
        await self.cache.start()

    async def close(self) -> None:
        await self.cache.close()

    async def lookup(self, job: Job, headers: Mapping[str, str], raw_body: bytes) -> CacheLookup:
        """Raises the gateway's 400 for a malformed ``cache`` body field; otherwise never raises."""
        try:
            body = json.loads(raw_body)
        except ValueError:
            body = {}
        extra = {"cache": body.get("cache")} if isinstance(body, dict) else {}
        if job.echo or job.logprobs is not None:
            # echo needs the prompt text and logprobs are not stored: neither can be replayed
            return CacheLookup(self.cache, None, await self.cache.lookup(None))  # counted as skipped
        body = job_body(job)
        if job.max_tokens is None and self.default_max_tokens is not None:
            body["default_max_tokens"] = self.default_max_tokens
        if job.model in self.model_sources:
            body["model_source"] = self.model_sources[job.model]
        try:
            q = self.cache.query(
                {**body, **extra}, tenant=job.tenant, endpoint=_endpoint(job), headers=headers
            )
        except CacheControlError as exc:
            raise bad_request(str(exc), param="cache") from exc
        hit = await self.cache.lookup(q)  # q None: skipped
        if q is not None and hit is not None and hit.tier == "semantic" and self.count_prompt is not None:
            try:
                q.prompt_tokens = await self.count_prompt(job)
            except Exception as exc:  # the hit still serves, with the stored question's count
                log.debug("prompt count for a semantic hit failed: %s", exc)
        return CacheLookup(self.cache, q, hit)


def _endpoint(job: Job) -> Any:
    return "chat" if job.kind == "chat" else "completions"
