"""The router's seam into serving: run a `router.policy.RouteDecision` on the local engine or an upstream.

    serving._route ─▶ RoutingService.route(job, local) ─▶ Route(RoutedBackend, job, x-specgate-route)
                      RoutedBackend.start: primary, then fallbacks, until one starts
                        ├── LocalBackend   (job.model and job.spec set from the decision)
                        └── RemoteBackend  (router.upstream.UpstreamClient: retries, breaker, first event)

Fallback happens only inside `start`, before serving sends a byte; the `x-specgate-route` header
then names the route that actually served. Upstream exceptions become `APIError`s in `api_error`
and nowhere else; an upstream's in-band `{"error": ...}` event ends our stream with that same error.

Observed (with the app's `Observability`): `observe_route` once per decision (the router's pick,
before any fallback), `observe_fallback` per step down the chain; the upstream clients report their
own calls and get a CLIENT span each (see router/upstream.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from decoding.errors import EngineOverloaded, EngineStopped
from gateway.backends import Backend, Delta, Generation, Job, LogprobEntry, Route, ToolCallDelta
from gateway.errors import APIError, unavailable
from gateway.settings import Settings
from router.config import RouterSettings, TierSettings
from router.policy import BackendKind, RouteDecision, Router
from router.pool import UpstreamPool, first_available
from router.upstream import UpstreamClient, UpstreamError, UpstreamStream, UpstreamUnavailable

if TYPE_CHECKING:
    from gateway.observability import Metrics, Observability

log = logging.getLogger("specgate.router")


class _Loading(Exception):
    """The local engine is not loaded yet (a remote fallback may still serve)."""


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
        body["max_tokens"] = job.max_tokens
    if job.stops:
        body["stop"] = list(job.stops)
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
        return None  # chat logprobs only; completion logprobs from upstreams are dropped
    return [
        LogprobEntry(
            e["token"], e["logprob"], [(t["token"], t["logprob"]) for t in e.get("top_logprobs") or []]
        )
        for e in lp["content"]
    ]


def _tool_calls(delta: dict[str, Any]) -> list[ToolCallDelta] | None:
    """An upstream's streamed tool_calls, passed on piece by piece (same indexes, ids, fragments)."""
    out = []
    for c in delta.get("tool_calls") or []:
        if not isinstance(c, dict):
            continue
        fn = c.get("function") or {}
        out.append(
            ToolCallDelta(int(c.get("index", 0)), fn.get("arguments") or "", c.get("id"), fn.get("name"))
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
    # exact completion token count (chunks are not tokens: a step may hold several).
    held: list[Delta] = []
    counted = 0
    try:
        async for event in stream:
            if "error" in event and "choices" not in event:
                err = event["error"]
                raise APIError(500, str(err.get("message")), str(err.get("type") or "server_error"),
                               err.get("param"), err.get("code"))  # fmt: skip
            usage = event.get("usage")
            if isinstance(usage, dict):
                gen.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                if held:
                    held[-1].completion_tokens += max(0, int(usage.get("completion_tokens") or 0) - counted)
            for choice in event.get("choices") or []:
                text = (
                    choice.get("text")
                    if job.kind == "completion"
                    else (choice.get("delta") or {}).get("content")
                )
                d = Delta(
                    int(choice.get("index", 0)), text or "", _logprobs(choice), choice.get("finish_reason")
                )
                if job.kind == "chat":
                    d.tool_calls = _tool_calls(choice.get("delta") or {})
                if not d.text and d.finish_reason is None and not d.tool_calls:
                    continue  # the role chunk: our formatter writes its own
                d.completion_tokens = 1 if d.text else 0
                counted += d.completion_tokens
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


class RoutedBackend:
    """One request's route: the decision's primary target, then its fallbacks."""

    name = "routed"

    def __init__(
        self, attempts: list[tuple[RouteDecision, Backend | None, Job]], metrics: Metrics | None = None
    ):
        self.attempts = attempts
        self.metrics = metrics
        self.route: Route | None = None  # set by RoutingService; its label is rewritten on fallback

    def model_ids(self) -> list[str]:
        return [d.model for d, _, _ in self.attempts]

    async def start(self, job: Job) -> Generation:
        def opener(i: int, backend: Backend | None, j: Job) -> Any:
            async def open_() -> Generation:
                if i > 0 and self.metrics is not None:  # attempt i-1 failed before the first byte
                    self.metrics.observe_fallback(self.attempts[i - 1][0].tier, self.attempts[i][0].tier)
                if backend is None:
                    raise _Loading("The models are still loading; retry shortly.")
                return await backend.start(j)

            return open_

        try:
            decision, gen = await first_available(
                [(d, opener(i, b, j)) for i, (d, b, j) in enumerate(self.attempts)],
                fallback_on=(UpstreamUnavailable, EngineOverloaded, EngineStopped, _Loading),
            )
        except UpstreamError as exc:
            raise api_error(exc) from exc
        except _Loading as exc:
            raise unavailable(str(exc), 1, code="loading") from exc
        if self.route is not None:
            self.route.label = decision.header_value()  # the route that serves, after any fallback
        return gen


class RoutingService:
    """`state.router`: built once at start from the gateway's settings."""

    def __init__(self, settings: Settings, obs: Observability | None = None):
        models = {m.name: m.draft for m in settings.models}
        rs = settings.router
        try:
            self.router = Router(rs, upstreams=settings.upstreams, models=models)
        except ValueError:
            if "tiers" in rs.model_fields_set:
                raise  # configured tiers that name unknown models or upstreams: refuse to start
            # The default tiers name the default pair; with other models, `auto` serves the first one.
            first = settings.models[0].name
            log.info("router: default tiers need %s; routing `auto` to %s", sorted(models), first)
            rs = rs.model_copy(update={"tiers": [TierSettings(name="default", model=first)]})
            self.router = Router(RouterSettings.model_validate(rs.model_dump()), settings.upstreams, models)
        self.metrics = obs.metrics if obs is not None else None
        instrument = obs.tracing.instrument_httpx if obs is not None else None
        self.pool = UpstreamPool(self.router.upstreams.values(), metrics=self.metrics, instrument=instrument)
        self.remotes = {name: RemoteBackend(client) for name, client in self.pool.clients.items()}

    async def aclose(self) -> None:
        await self.pool.aclose()

    def _job(self, job: Job, d: RouteDecision) -> Job:
        if d.backend == BackendKind.REMOTE:
            return dataclasses.replace(job, model=d.model)
        # replace() keeps what the gateway decided about the spec (adaptive=False for seeded sampling)
        return dataclasses.replace(
            job, model=d.model, spec=dataclasses.replace(job.spec, mode=d.strategy, max_k=d.max_k)
        )

    async def route(self, job: Job, local: Backend | None) -> Route:
        messages = job.messages if job.kind == "chat" else None
        prompt = None if job.kind == "chat" else " ".join(p for p in job.prompts or [] if isinstance(p, str))
        override = {"mode": job.spec.mode.value, "max_k": job.spec.max_k}  # AUTO: the router's pick
        d = self.router.route(job.model, messages, prompt, job.max_tokens, job.temperature, override)
        if self.metrics is not None:
            self.metrics.observe_route(d.tier, d.strategy.value, d.elapsed_us / 1e6)
        attempts: list[tuple[RouteDecision, Backend | None, Job]] = [
            (x, self.remotes[x.upstream] if x.upstream is not None else local, self._job(job, x))
            for x in (d, *d.fallbacks)
        ]
        backend = RoutedBackend(attempts, self.metrics)
        backend.route = Route(backend, attempts[0][2], d.header_value())
        return backend.route
