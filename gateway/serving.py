"""The inference handlers: body -> validated ``Job`` (gateway/jobs.py) -> route -> backend -> response.

``serve`` is every inference route's one path; an endpoint brings its ``Parse`` (body -> job and
answer format: chat and legacy completions here, the Responses API in gateway/responses.py).
Everything that can refuse a request (body size, schema, limits, rate, unknown model, prompt
length, overload) happens before a 200 goes out; after it, a fault becomes the format's error event
(chat's: one ``{"error"}`` event and ``[DONE]``). ``state.router`` (gateway/routing.py) picks the
backend and its fallbacks; ``state.cache`` answers a request or stores its finished generation,
streamed or not (gateway/backends.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import anyio
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.backends import Backend, Delta, Generation, Job, ServingCache
from gateway.errors import (
    APIError,
    bad_request,
    clip,
    error_event,
    error_response,
    to_api_error,
    unavailable,
)
from gateway.formatting import ChatFormat, CompletionFormat
from gateway.jobs import to_job
from gateway.limits import RateLimiter, read_body
from gateway.observability import (
    note_completion,
    note_phase,
    note_response_id,
    note_served,
    note_stream_error,
    note_usage,
    observe_job,
)
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.routing import Route, RoutingService
from gateway.settings import Settings
from router.faults import UpstreamUnavailable

T = TypeVar("T")


@dataclass
class GatewayState:
    """``app.state.gateway``: what handlers share. Optional seams stay None until their owner sets them."""

    settings: Settings
    limiter: RateLimiter
    registry: CollectorRegistry  # /metrics renders this; observability registers into it
    router: RoutingService
    backend: Backend | None = None  # the local backend; None while models load
    cache: ServingCache | None = None
    metrics: Any = None
    draining: bool = False
    inflight: int = 0  # inference requests being served (the SIGTERM drain waits for 0)
    drain_started: asyncio.Event = field(default_factory=asyncio.Event)  # body reads stop waiting
    cut: asyncio.Event = field(default_factory=asyncio.Event)  # drain timeout: end what still runs
    extra: dict[str, Any] = field(default_factory=dict)


class Format(Protocol):
    """What serving needs of a response format (gateway/formatting.py's chat and completion
    formats, gateway/response_events.py's Responses API one)."""

    id: str
    model: str
    texts: list[str]
    completion_tokens: int

    def fold(self, d: Delta) -> None: ...

    def opening(self, gen: Generation) -> list[Any]: ...

    def chunks(self, d: Delta) -> list[Any]: ...

    async def settle(self, gen: Generation) -> None: ...

    def closing(self, gen: Generation) -> list[Any]: ...

    def failure(self, error: dict[str, Any]) -> list[Any]: ...

    @property
    def ending(self) -> tuple[Any, ...]: ...

    def whole(self, gen: Generation) -> dict[str, Any]: ...


@dataclass
class Parsed:
    """A request body as the shared path serves it: the job, whether to stream, and its format."""

    job: Job
    stream: bool
    format: Callable[[str], Format]  # the serving model's name -> the answer's format
    # an error from the shared path in the endpoint's words (chat's "messages" is the Responses API's "input")
    words: Callable[[APIError], APIError] = lambda error: error


Parse = Callable[[Request, bytes, GatewayState], Awaitable[Parsed]]


async def chat_completions(request: Request) -> Response:
    return await serve(request, _parser(ChatCompletionRequest), "messages")


async def completions(request: Request) -> Response:
    return await serve(request, _parser(CompletionRequest), "prompt")


def _parser(schema: type[ChatCompletionRequest] | type[CompletionRequest]) -> Parse:
    async def parse(request: Request, body: bytes, state: GatewayState) -> Parsed:
        try:
            req = schema.model_validate_json(body)
        except ValidationError as exc:
            raise to_api_error(exc) from exc
        job = to_job(req, request.state.request_id, request.state.tenant, state.settings)

        def fmt(served: str) -> Format:
            if isinstance(req, ChatCompletionRequest):
                return ChatFormat(
                    served,
                    req.include_usage,
                    job.choices,
                    prediction=job.prediction is not None,
                    calls_only=job.calls_only,
                    calls_tools=job.calls_tools,
                )
            return CompletionFormat(served, req.include_usage, job.choices, job.n, job.echo)

        return Parsed(job, req.stream, fmt)

    return parse


async def serve(request: Request, parse: Parse, prompt_param: str) -> Response:
    """One inference request through the shared path; ``parse`` turns the endpoint's body into a job."""
    state: GatewayState = request.app.state.gateway
    settings = state.settings
    retry = settings.limits.retry_after_s
    admitted = False
    parsed: Parsed | None = None
    reserved = 0  # tokens of the key's tpm held for this request until it is settled
    try:
        headers = await state.limiter.admit(request.state.tenant) if state.limiter.enabled else {}
        admitted = state.limiter.enabled
        _json_content_type(request.headers.get("content-type"))
        body = await read_body(request, settings.limits.max_body_bytes)
        parsed = await parse(request, body, state)
        job = parsed.job
        observe_job(job)
        route = await state.router.route(job, state.backend)
        headers["x-specgate-route"] = route.label
        if state.limiter.tpm is not None:
            reserved = await _reserve(state.limiter, route, headers)
        # the response names the model that serves it (`auto` resolves to a real one), as OpenAI does
        fmt = parsed.format(route.job.model)
        note_response_id(fmt.id)
        cached = await state.cache.lookup(route.job, request.headers, body) if state.cache else None
        if cached is not None:
            headers["x-specgate-cache"] = cached.header
        # a hit replays as a Generation, so it streams/formats/charges like a fresh one
        gen = cached.replay() if cached else None
        if gen is not None:
            note_phase("cache")
        else:
            if route.attempts[0][0].upstream is not None:
                note_phase("upstream")  # a local fallback's engine wrapper sets its own phases
            # An upstream's first event waits for its queue and prefill (timeout_s between bytes, 60 s
            # by default), and Starlette notices a client that left only once a stream has begun:
            # until then this listens itself, so the upstream's call ends with the client's
            started = await _unless_disconnected(request, route.start(), state.cut, retry)
            if started is None:
                state.limiter.charge_tokens(request.state.tenant, -reserved)
                return Response(status_code=499)
            decision, gen = started
            note_served(decision.model, decision.upstream)
            headers["x-specgate-route"] = decision.header_value()  # after any fallback
            fmt.model = decision.model  # a fallback's answer names the model that gave it, not the pick
            if decision is not route.attempts[0][0]:
                # the cache key names the pick's model: a fallback's answer stored under it would be
                # served as the pick's for the whole ttl after the pick recovers
                cached = None
    except Exception as exc:
        error = to_api_error(exc, prompt_param, retry)
        if parsed is not None:
            error = parsed.words(error)
        state.limiter.charge_tokens(request.state.tenant, -reserved)  # nothing was generated
        # not served, through no fault of the client's: the gateway's failure (5xx), or an upstream
        # that turned it away (its 429 too; Route.start raises it as the APIError it becomes, from
        # it): the request is not the client's to pay
        if admitted and (error.status >= 500 or isinstance(exc.__cause__, UpstreamUnavailable)):
            await state.limiter.refund(request.state.tenant)
        return error_response(error)

    def charge() -> None:
        note_usage(gen.prompt_tokens, fmt.completion_tokens)
        note_completion(fmt.texts)  # for the log line and span, with observability.log_content
        state.limiter.charge_tokens(job.tenant, gen.prompt_tokens + fmt.completion_tokens - reserved)

    def finished() -> None:  # every delta arrived (no error, no disconnect): cache it
        if cached is not None:
            cached.store(fmt, gen)

    if parsed.stream:
        return EventSourceResponse(
            _events(gen, fmt, charge, finished, state.cut, retry),
            sep="\n",
            ping=settings.server.sse_ping_s,
            headers=headers | {"Cache-Control": "no-cache"},
        )
    try:
        whole = await _unless_disconnected(request, _collect(gen, fmt), state.cut, retry)
    except Exception as exc:
        return error_response(to_api_error(exc, prompt_param, retry))
    finally:
        charge()
    if whole is None:  # the client left; nobody will read this
        return Response(status_code=499)
    finished()
    return JSONResponse(whole, headers=headers)


async def _reserve(limiter: RateLimiter, route: Route, headers: dict[str, str]) -> int:
    """Hold the request's tokens of the key's tpm (RateLimiter.reserve), counted as the router's
    pick will count them, with max_tokens for every choice (none given: the prompt alone; whatever
    it generates is charged when it is done, as every response is). Returns the tokens held."""
    _, backend, job = route.attempts[0]
    if backend is None:
        return 0  # still loading: Route.start says so
    requested = await backend.prompt_tokens(job) + job.choices * (job.max_tokens or 0)
    return await limiter.reserve(job.tenant, requested, job.model, headers)


def _json_content_type(header: str | None) -> None:
    """A body declared as something other than JSON is refused, as OpenAI and vLLM refuse it (curl's
    ``-d`` sends a form type: OpenAI then finds no model): read as JSON anyway, it worked here and
    nowhere else. A body with no Content-Type is read as JSON, as vLLM (FastAPI) reads one."""
    if header is None:
        return
    media = header.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise bad_request(
        f"Unsupported Content-Type '{clip(media, 64)}': send the body as JSON, with "
        "'Content-Type: application/json'."
    )


async def _collect(gen: Generation, fmt: Format) -> dict[str, Any]:
    try:
        async for delta in gen:
            fmt.fold(delta)
    finally:
        await gen.aclose()
    await fmt.settle(gen)
    return fmt.whole(gen)


def _cut_off(retry_after: int) -> APIError:
    """What a request still running at the drain timeout is told (then the server exits)."""
    return unavailable(
        "The server is shutting down and could not finish this request; retry on another replica.",
        retry_after,
    )


async def _unless_disconnected(
    request: Request, work: Coroutine[Any, Any, T], cut: asyncio.Event, retry_after: int
) -> T | None:
    """Run ``work`` unless the client disconnects first; then cancel it (which aborts generation).
    At the drain timeout (``cut``) the work is cancelled too, and the client gets a 503.

    Starlette cancels only streaming responses on disconnect; a plain handler must listen itself.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    stop = asyncio.ensure_future(cut.wait())
    try:
        await asyncio.wait({task, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        if cut.is_set():
            raise _cut_off(retry_after)
        return None
    return task.result()


async def _until_cut(gen: Generation, cut: asyncio.Event, retry_after: int) -> AsyncIterator[Delta]:
    """``gen``'s deltas, unless the drain timeout comes first: then the pending wait is cancelled
    (which closes the generation) and the cut-off error raised, for ``_events`` to send."""
    deltas = aiter(gen)
    stop = asyncio.ensure_future(cut.wait())
    step: asyncio.Future[Delta] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(deltas))
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise _cut_off(retry_after)
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        stop.cancel()
        if step is not None and not step.done():  # cut off, or we were cancelled (disconnect)
            step.cancel()
            # shielded: sse-starlette's anyio scope cancels again at every await once cancelled,
            # and the generation must be out of its step before anyone closes it
            with anyio.CancelScope(shield=True):
                await asyncio.wait({step})


async def _disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _events(
    gen: Generation,
    fmt: Format,
    done: Callable[[], None],
    finished: Callable[[], None] = lambda: None,
    cut: asyncio.Event | None = None,
    retry_after: int = 1,
) -> AsyncIterator[str]:
    deltas = gen if cut is None else _until_cut(gen, cut, retry_after)
    try:
        for data in fmt.opening(gen):
            yield data
        async for delta in deltas:
            for data in fmt.chunks(delta):
                yield data
        finished()  # not reached on a fault or a disconnect (the task is cancelled at a yield)
        await fmt.settle(gen)
        for data in fmt.closing(gen):
            yield data
    except Exception as exc:  # after the 200: the format's error event (chat's: then [DONE])
        event = error_event(exc)
        note_stream_error(event)  # a failure the 200 hides, for the span, the log line and metrics
        for data in fmt.failure(event):
            yield data
    finally:
        # shielded: on a disconnect sse-starlette cancels this body's task group, and anyio then
        # cancels again at every await, so a close that waits (the local backend gathering its
        # choices' tasks, an upstream's connection) ended this block there: the stream was not
        # charged to the key, and half the streams cut by their client logged prompt_tokens=0
        with anyio.CancelScope(shield=True):
            try:
                if isinstance(deltas, AsyncGenerator):
                    await deltas.aclose()
                await gen.aclose()
            finally:
                done()
    for data in fmt.ending:
        yield data
