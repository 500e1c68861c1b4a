"""A small Starlette app wired like the gateway: ``obs.install``, ``obs.observe_engine`` and
handlers that fill ``current_request()``; with an upstream call through an instrumented client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from decoding.params import GenerationRequest, SamplingParams
from gateway.observability import Observability, current_request


def make_app(obs: Observability, engine: object, upstream: httpx.AsyncClient | None = None) -> Starlette:
    observed = obs.observe_engine(engine)  # type: ignore[arg-type]
    if upstream is not None:
        obs.tracing.instrument_httpx(upstream)

    def start(body: dict[str, object], rid: str) -> GenerationRequest:
        rec = current_request()
        assert rec is not None
        rec.request_model = str(body["model"])
        prompt = str(body["messages"][0]["content"])  # type: ignore[index]
        rec.set_content(prompt=prompt)
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)), temperature=0.0)  # type: ignore[call-overload]
        return GenerationRequest(rid, str(body["model"]), [ord(c) % 64 for c in prompt], params)

    async def chat(request: Request) -> Response:
        body = await request.json()
        rid = request.headers.get("x-request-id", "req-1")
        gen = start(body, rid)
        if body.get("stream"):
            return StreamingResponse(
                _sse(observed, gen), media_type="text/event-stream", headers={"x-request-id": rid}
            )
        tokens: list[int] = []
        with obs.tracing.span("specgate.cache.lookup", {"specgate.cache.tier": "exact"}):
            obs.metrics.observe_cache("exact", "miss", 0.0001)
        with obs.tracing.span("specgate.route", {"specgate.route.tier": "large"}):
            obs.metrics.observe_route("large", "draft", 0.0001)
        steps = observed.submit(gen)
        try:
            async for step in steps:
                tokens.extend(step.token_ids)
        finally:
            await steps.aclose()
        completion = body.get("completion_text", "")
        current_request().set_content(completion=completion)  # type: ignore[union-attr]
        if upstream is not None:
            await upstream.post("http://upstream.test/v1/chat/completions", json={"model": "remote"})
        return JSONResponse(
            {"choices": [{"message": {"content": completion}}], "usage": {"completion_tokens": len(tokens)}},
            headers={
                "x-request-id": rid,
                "x-specgate-route": "tier=large; model=tiny; strategy=draft; score=0.7",
            },
        )

    async def bad(request: Request) -> Response:
        return JSONResponse(
            {"error": {"message": "secret text", "type": "invalid_request_error", "code": None}}, 400
        )

    return _install(
        obs,
        [
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", bad, methods=["POST"]),
        ],
    )


def _install(obs: Observability, routes: list[Route]) -> Starlette:
    app = Starlette(routes=routes)
    obs.install(app)
    return app


async def _sse(observed: object, gen: GenerationRequest) -> AsyncIterator[bytes]:
    steps = observed.submit(gen)  # type: ignore[attr-defined]
    try:
        async for step in steps:
            yield f"data: {json.dumps({'tokens': step.token_ids})}\n\n".encode()
    finally:
        await steps.aclose()
    yield b"data: [DONE]\n\n"
