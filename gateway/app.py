"""The Starlette application: routes, the gateway middleware, error handlers, model loading.

``create_app(settings, engine)`` serves an already-built ``EngineClient`` (tests); with
``load_engine`` instead it starts answering at once (``/ready`` false) and loads models on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from decoding.client import EngineClient
from decoding.errors import EngineError
from gateway import protocol, responses, serving
from gateway.backends import Job
from gateway.cache.seam import GatewayCache
from gateway.errors import APIError, clip, error_response, to_api_error, unavailable
from gateway.limits import RateLimiter, RedisBuckets, body_deadline
from gateway.local import LocalBackend
from gateway.observability import Observability
from gateway.observability.metrics import Metrics
from gateway.observability.record import MAX_CLIENT_CHARS
from gateway.response_store import response_store
from gateway.responses_protocol import ResponsesRequest
from gateway.routing import RoutingService
from gateway.serving import GatewayState
from gateway.settings import Settings
from router.breaker import CircuitBreaker

log = logging.getLogger("specgate.gateway")

INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# response headers a browser client may read (CORS): ours, Retry-After on 429/503, the rate limits'
# levels, and x-should-retry (the OpenAI SDKs read it to leave a request too large for the tpm alone)
EXPOSED = ", ".join(
    ["x-request-id", "x-specgate-route", "x-specgate-cache", "retry-after", "x-should-retry"]
    + [f"x-ratelimit-{w}-{kind}" for w in ("limit", "remaining", "reset") for kind in ("requests", "tokens")]
)


def tenant_of(key: str) -> str:
    """A tenant id from an API key: stable, and never the key itself (it ends up in logs and cache keys)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def _has_body(headers: dict[bytes, bytes]) -> bool:
    """Whether a request carries a body: a Transfer-Encoding, or a Content-Length other than 0
    (RFC 9112 section 6.3)."""
    length = headers.get(b"content-length", b"0").strip()
    return b"transfer-encoding" in headers or not length.isdigit() or int(length) > 0


class GatewayMiddleware:
    """Pure ASGI (so it also wraps streaming responses): x-request-id on every response, bearer
    auth, the in-flight count the drain waits on, 503 while draining, a 500 in OpenAI shape
    for any fault that escapes a handler before its response started, and ``Connection: close``
    on an answer given before the request's body was read (a 401, 404, 413): the rest of the body
    is never read, so the connection cannot carry another request (issue 48)."""

    def __init__(self, app: ASGIApp, state: GatewayState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or [])
        given = sent.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.match(given) else f"req_{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        started = False
        unread = _has_body(sent)  # until the app has received the body's last part

        async def receive_noting_the_end() -> Message:
            nonlocal unread
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                unread = False
            return message

        origin = sent.get(b"origin", b"").decode("latin-1")
        allowed = self.state.settings.server.cors_allow_origins
        cors = bool(origin) and ("*" in allowed or origin in allowed)

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = rid
                if unread:  # uvicorn closes the connection after an answer that says so
                    headers["connection"] = "close"
                if cors and "access-control-allow-origin" not in headers:
                    # this middleware's own answers (401, 503 draining, 500) pass no CORSMiddleware:
                    # a browser client may read them too
                    headers["access-control-allow-origin"] = "*" if "*" in allowed else origin
                    headers["access-control-expose-headers"] = EXPOSED
                    if "*" not in allowed:  # the answer names the origin: caches must key on it
                        headers.add_vary_header("Origin")
            await send(message)

        path = scope["path"]
        # a browser's CORS preflight carries no key: CORSMiddleware (inside this one) answers it
        preflight = (
            scope["method"] == "OPTIONS"
            and b"origin" in sent
            and b"access-control-request-method" in sent
            and bool(allowed)
        )
        inference = path in INFERENCE_PATHS and not preflight
        try:
            if preflight:
                scope["state"]["tenant"] = "anonymous"
            else:
                given_keys = [v for k, v in scope.get("headers") or [] if k == b"authorization"]
                scope["state"]["tenant"] = self._tenant(path, given_keys)
            if inference and self.state.draining:
                raise unavailable(
                    "The server is shutting down; retry on another replica.",
                    self.state.settings.limits.retry_after_s,
                )
            if inference:
                self.state.inflight += 1
            app_receive: Receive = receive_noting_the_end
            if scope["method"] in ("POST", "PUT", "PATCH"):
                app_receive = body_deadline(
                    app_receive,
                    self.state.settings.server.body_timeout_s,
                    self.state.drain_started,
                    self.state.settings.limits.retry_after_s,
                )
            try:
                await self.app(scope, app_receive, send_with_id)
            finally:
                if inference:
                    self.state.inflight -= 1
        except Exception as exc:
            if started:
                raise
            await error_response(to_api_error(exc))(scope, receive, send_with_id)

    def _tenant(self, path: str, authorization: list[bytes]) -> str:
        """The tenant of a request's ``Authorization`` headers (every one the request carries)."""
        keys = self.state.settings.auth.api_keys
        if not keys or path in self.state.settings.auth.public_paths:
            # no key is read here, so a proxy in front cannot judge one differently: two headers
            # pass, as a health probe through a proxy that adds its own header must
            return "anonymous"
        if len(authorization) > 1:
            # the last one won here: a proxy in front that reads the first judged another key
            # than the gateway (issue 48); refused, as several proxies refuse it
            raise APIError(
                400,
                "The request carries more than one Authorization header; send exactly one.",
                code="duplicate_authorization_header",
            )
        scheme, _, token = (authorization[0] if authorization else b"").decode("latin-1").partition(" ")
        token = token.strip()
        if scheme.lower() == "bearer" and token:
            # compare with every key (no early exit), each in constant time
            matches = [hmac.compare_digest(token.encode(), k.encode()) for k in keys]
            if any(matches):
                return tenant_of(token)
            said = "Incorrect API key provided."
        else:  # OpenAI's words for no key: "Incorrect" sent a client that forgot the header hunting a typo
            said = "You didn't provide an API key."
        raise APIError(
            401,
            f"{said} Send it as 'Authorization: Bearer <key>'.",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


# ---- small routes --------------------------------------------------------------------------------


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway  # Starlette's State holds untyped attributes
    return state


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state = _state(request)
    reason = "draining" if state.draining else ("loading" if state.backend is None else None)
    if reason is not None:
        return JSONResponse({"ready": False, "reason": reason}, status_code=503)
    return JSONResponse({"ready": True})


def _model_ids(state: GatewayState) -> list[str]:
    """The served models, and the names the router serves (``auto``, upstream models); while the
    local ones load, the configured ones (what loading gives, or the process stops): a client
    listing or retrieving a model at start-up sees it, and its requests get 503 "loading" with
    Retry-After, not a 404 "does not exist" for a model that is on its way."""
    local = (
        state.backend.model_ids() if state.backend is not None else [m.name for m in state.settings.models]
    )
    return sorted({*local, *state.router.router.names()})


async def list_models(request: Request) -> Response:
    created = request.app.state.started
    cards = [protocol.ModelCard(id=m, created=created) for m in _model_ids(_state(request))]
    return JSONResponse(protocol.ModelList(data=cards).model_dump())


async def get_model(request: Request) -> Response:
    model_id = request.path_params["model_id"]
    if model_id not in _model_ids(_state(request)):
        message = f"The model '{clip(model_id)}' does not exist."
        raise APIError(404, message, param="model", code="model_not_found")
    return JSONResponse(protocol.ModelCard(id=model_id, created=request.app.state.started).model_dump())


def openapi_document(metrics: bool = True) -> dict[str, Any]:
    """``metrics``: /metrics is served (``observability.metrics``, the route observability installs)."""
    models = [
        protocol.ChatCompletionRequest,
        protocol.CompletionRequest,
        protocol.ChatCompletion,
        protocol.ChatCompletionChunk,
        protocol.Completion,
        protocol.ModelList,
        protocol.ModelCard,
        protocol.ErrorBody,
        ResponsesRequest,
    ]
    _, schemas = models_json_schema(
        [(m, "validation") for m in models],  # type: ignore[misc]  # pydantic's stubs: ModelMetaclass vs type
        ref_template="#/components/schemas/{model}",
    )

    def ref(name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}

    def op(summary: str, body: str | None, ok: str, stream: bool = False) -> dict[str, Any]:
        content: dict[str, Any] = {"application/json": {"schema": ref(ok)}}
        if stream:
            content["text/event-stream"] = {
                "schema": {"type": "string", "description": "SSE chunks, then [DONE]"}
            }
        out: dict[str, Any] = {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", "content": content},
                "default": {
                    "description": "Error",
                    "content": {"application/json": {"schema": ref("ErrorBody")}},
                },
            },
        }
        if body:
            out["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
        return out

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "specgate",
            "version": "0.1.0",
            "description": "OpenAI-compatible gateway with speculative decoding",
        },
        "paths": {
            "/v1/chat/completions": {
                "post": op("Chat completion", "ChatCompletionRequest", "ChatCompletion", True)
            },
            "/v1/completions": {"post": op("Legacy completion", "CompletionRequest", "Completion", True)},
            "/v1/responses": {"post": _responses_op(op)},
            "/v1/responses/{response_id}": {
                "get": op("A stored response", None, "Response"),
                "delete": op("Delete a stored response", None, "ResponseDeleted"),
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
            },
            "/v1/responses/{response_id}/input_items": {
                "get": op("The input items a stored response answered", None, "ResponseItemList"),
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                    {
                        "name": "limit",
                        "in": "query",
                        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    {"name": "after", "in": "query", "schema": {"type": "string"}},
                ],
            },
            "/v1/models": {"get": op("List models", None, "ModelList")},
            "/v1/models/{model_id}": {
                "get": op("One model", None, "ModelCard")
                | {
                    "parameters": [
                        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ]
                }
            },
            "/health": {"get": {"summary": "Liveness", "responses": {"200": {"description": "alive"}}}},
            "/ready": {
                "get": {
                    "summary": "Readiness",
                    "responses": {
                        "200": {"description": "ready"},
                        "503": {"description": "loading or draining"},
                    },
                }
            },
        }
        | (
            {
                "/metrics": {
                    "get": {
                        "summary": "Prometheus metrics",
                        "responses": {"200": {"description": "text exposition"}},
                    }
                }
            }
            if metrics
            else {}
        ),
        "components": {"schemas": schemas.get("$defs", {}) | RESPONSE_SCHEMAS},
    }


# the Responses API's answers, built as dicts (gateway/response_events.py): their outline, for clients
RESPONSE_SCHEMAS: dict[str, Any] = {
    "Response": {
        "type": "object",
        "description": "OpenAI's response object (id resp_..., object 'response', status, output items, usage)",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
            "output": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["id", "object", "status", "output"],
    },
    "ResponseItemList": {
        "type": "object",
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"type": "object"}},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
            "has_more": {"type": "boolean"},
        },
        "required": ["object", "data", "first_id", "last_id", "has_more"],
    },
    "ResponseDeleted": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response.deleted"},
            "deleted": {"const": True},
        },
        "required": ["id", "object", "deleted"],
    },
}


def _responses_op(op: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    out = op("Create a response (OpenAI's Responses API)", "ResponsesRequest", "Response")
    out["responses"]["200"]["content"]["text/event-stream"] = {
        "schema": {
            "type": "string",
            "description": "typed events (event: <type>, data: {type, sequence_number, ...}); no [DONE]",
        }
    }
    return out


async def openapi(request: Request) -> Response:
    return JSONResponse(request.app.state.openapi)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path[:MAX_CLIENT_CHARS]
    # OpenAI's words for a path it does not serve, "Invalid URL (POST /v1/nothing)", and for a method
    # a path does not take, "Invalid method for URL (GET /v1/chat/completions)": invalid_request_errors
    # (clients branch on the type)
    words = {404: "Invalid URL", 405: "Invalid method for URL"}.get(exc.status_code)
    message = f"{words} ({request.method} {path})" if words else f"{exc.detail}: {request.method} {path}"
    # exc.headers carries 405's Allow, which the response must keep
    err = APIError(exc.status_code, message, "invalid_request_error", headers=dict(exc.headers or {}))
    return error_response(err)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


def rate_limiter(settings: Settings, metrics: Metrics) -> RateLimiter:
    """Per-key buckets in this process, or in the cache's Redis (one limit across replicas)."""
    limits, cache = settings.limits, settings.cache
    shared = None
    use_redis = limits.shared if limits.shared is not None else cache.redis_url is not None
    if use_redis and cache.redis_url is not None and (limits.rpm is not None or limits.tpm is not None):
        breaker = CircuitBreaker(
            cache.breaker_failures,
            cache.breaker_cooldown_s,
            on_change=lambda state: metrics.set_circuit_state("rate_limits", state),
            name="rate limits: Redis",
        )
        metrics.set_circuit_state("rate_limits", breaker.state)
        shared = RedisBuckets(cache.redis_url, cache.key_prefix, cache.timeout_ms / 1000, breaker)
    return RateLimiter(limits.rpm, limits.tpm, shared)


def _default_max_tokens(settings: Settings) -> int:
    """A chat request's limit when it gives none; the context bounds it too (LocalBackend)."""
    return settings.limits.default_max_tokens or settings.limits.max_max_tokens


def create_app(
    settings: Settings,
    engine: EngineClient | None = None,
    load_engine: Callable[[], EngineClient] | None = None,
    observability: Observability | None = None,
) -> Starlette:
    """The app serving ``engine``, or the one ``load_engine`` builds (on a thread, after start).
    ``observability``: tests pass one built with an in-memory tracer provider."""
    owned = observability is None
    obs = observability or Observability(settings.observability, models=[m.name for m in settings.models])
    # every name a client may send in `model` gets a label of its own; other names are "unknown"
    obs.metrics.know_models(
        [m.name for m in settings.models]
        + ["auto", settings.router.default_alias]
        + [name for u in settings.upstreams for name in (u.name, u.model)]
    )
    routing = RoutingService(settings, obs)  # router/: tiers, strategy, upstreams; raises on bad config
    state = GatewayState(
        settings=settings,
        limiter=rate_limiter(settings, obs.metrics),
        registry=obs.metrics.registry,
        router=routing,
        metrics=obs.metrics,
    )
    state.cache = GatewayCache.from_settings(  # in-process, or Redis when configured
        settings.cache, metrics=obs.metrics, tracer=obs.tracing.tracer
    )
    if state.cache is not None:
        state.cache.count_prompt = lambda job: _count_prompt(state, job)
        state.cache.default_max_tokens = _default_max_tokens(settings)
        state.cache.model_sources = {u.model: f"{u.base_url} {u.model}" for u in settings.upstreams} | {
            m.name: m.source for m in settings.models
        }
    # stored Responses API responses: in the cache's Redis where one is set
    state.extra["responses"] = response_store(
        settings.responses, settings.cache.redis_url, settings.cache.key_prefix
    )
    if engine is not None:
        state.backend = LocalBackend(obs.observe_engine(engine), _default_max_tokens(settings))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = None
        if state.backend is None and load_engine is not None:
            task = asyncio.ensure_future(_load(app, state, load_engine))
        if state.cache is not None:
            await state.cache.start()  # the embedder loads in the background; exact-only meanwhile
        if owned and settings.observability.metrics_port:
            obs.start_metrics_server(settings.server.host)
        yield
        if task is not None:
            task.cancel()
        if owned:
            obs.shutdown()  # flushes batched spans
        await routing.aclose()
        await state.limiter.aclose()
        if state.cache is not None:
            await state.cache.close()
        await state.extra["responses"].close()

    routes = [
        Route("/v1/chat/completions", serving.chat_completions, methods=["POST"]),
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _http_error, APIError: _api_error},
    )
    if settings.server.cors_allow_origins:  # inside GatewayMiddleware: its answers get x-request-id
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.server.cors_allow_origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["*"],
            expose_headers=EXPOSED.split(", "),
        )
    app.add_middleware(GatewayMiddleware, state=state)
    obs.install(app)  # outermost: sees every response, auth failures and x-request-id included
    app.state.gateway = state
    app.state.metrics = obs.metrics
    app.state.observability = obs
    app.state.started = int(time.time())
    app.state.openapi = openapi_document(metrics=settings.observability.metrics)
    app.state.on_load_failure = None  # server.py sets this to stop the process
    return app


async def _count_prompt(state: GatewayState, job: Job) -> int | None:
    """The prompt tokens of a job the local backend serves; None for a remote upstream's model."""
    backend = state.backend
    if isinstance(backend, LocalBackend) and job.model in backend.model_ids():
        return await backend.prompt_tokens(job)
    return None


async def _load(app: Starlette, state: GatewayState, load_engine: Callable[[], EngineClient]) -> None:
    try:
        engine = await asyncio.to_thread(load_engine)
    except EngineError as exc:  # a model missing, damaged or unreadable: its message says which and why
        log.debug("could not load the models", exc_info=True)  # `specgate -v serve`: the traceback
        log.error("could not load the models: %s", exc)
        if app.state.on_load_failure is not None:
            app.state.on_load_failure()
        return
    except Exception:
        log.exception("could not load the models")
        if app.state.on_load_failure is not None:
            app.state.on_load_failure()
        return
    observed = app.state.observability.observe_engine(engine)
    state.backend = LocalBackend(observed, _default_max_tokens(state.settings))
    state.extra["engine"] = engine
    log.info("models loaded: %s", ", ".join(engine.model_names))
