"""A real OpenAI-compatible upstream for the router's tests: `python fake_upstream.py PORT`.

A small Starlette app served by uvicorn in its own process, so tests talk to it over loopback and
can kill it. Each completion request takes the next action from a script posted to `/_script`
(default: a normal answer; `"hold": true` stops a stream after its first content event until a POST
to `/_release`). Streams are written in our exact wire format, each event in several
pieces split inside a multi-byte character and between the two newlines, to exercise the parser.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CHUNK_ID = "chatcmpl-upstream"
CREATED = 1700000000
TEXTS = ["Hello", ", wörld", " ✓ ", "日本語", "!"]

script: list[dict[str, Any]] = []
seen: list[dict[str, Any]] = []  # requests received: headers, body, and every traceparent sent


def encode(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def chunk(model: str, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": CHUNK_ID, "object": "chat.completion.chunk", "created": CREATED, "model": model,
            "system_fingerprint": "fp_fake", "choices": [{"index": 0, "delta": delta, "logprobs": None,
            "finish_reason": finish}]}  # fmt: skip


def events(model: str, texts: list[str], error_after: int | None) -> list[bytes]:
    out = [encode(chunk(model, {"role": "assistant", "content": ""}))]
    for i, text in enumerate(texts):
        if error_after is not None and i == error_after:
            out.append(encode({"error": {"message": "upstream exploded", "type": "server_error", "param": None,
                                         "code": "boom"}}))  # fmt: skip
            break
        out.append(encode(chunk(model, {"content": text})))
    else:
        out.append(encode(chunk(model, {}, "stop")))
    out.append(b"data: [DONE]\n\n")
    return out


released = asyncio.Event()  # set by POST /_release: a held stream goes on


async def pieces(evs: list[bytes], delay: float, hold: bool = False) -> AsyncIterator[bytes]:
    yield b": keep-alive\n\n"
    for i, ev in enumerate(evs):
        if hold and i == 2:  # after the role and the first content event: stay in flight until released
            await released.wait()
        # Split inside the event: 1 byte into a multi-byte character when there is one, and between "\n\n".
        cut = next((i + 1 for i, b in enumerate(ev) if b >= 0x80), len(ev) // 2)
        for part in (ev[:cut], ev[cut:-1], ev[-1:]):
            yield part
            await asyncio.sleep(0.002)
        await asyncio.sleep(delay)


async def completions(request: Request) -> Response:
    body = await request.json()
    peer = f"{request.client.host}:{request.client.port}" if request.client else None  # the connection
    seen.append({"headers": dict(request.headers), "body": body,
                 "traceparents": request.headers.getlist("traceparent"), "peer": peer})  # fmt: skip
    action = script.pop(0) if script else {"kind": "ok"}
    kind = action.get("kind", "ok")
    if kind == "hang":
        await asyncio.sleep(action.get("seconds", 30))
    if kind == "status":
        headers = {"retry-after": str(action["retry_after"])} if "retry_after" in action else {}
        err = action.get("body") or {"error": {"message": f"scripted {action['status']}", "type": "server_error",
                                               "param": None, "code": None}}  # fmt: skip
        return JSONResponse(err, status_code=action["status"], headers=headers)
    texts = action.get("texts", TEXTS)
    if not body.get("stream"):
        return JSONResponse({"id": CHUNK_ID, "object": "chat.completion", "created": CREATED, "model": body["model"],
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(texts)},
                                          "logprobs": None, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}})  # fmt: skip
    evs = events(body["model"], texts, action.get("error_after"))
    body_iter = pieces(evs, action.get("delay", 0.0), action.get("hold", False))
    return StreamingResponse(body_iter, media_type="text/event-stream")


async def raw(request: Request) -> Response:
    """The exact bytes a default stream carries, for byte-for-byte comparison."""
    return Response(
        b"".join(events(request.query_params["model"], TEXTS, None)), media_type="text/event-stream"
    )


async def set_script(request: Request) -> Response:
    script[:] = await request.json()
    seen.clear()
    released.clear()
    return JSONResponse({"ok": True})


async def release(request: Request) -> Response:
    released.set()
    return JSONResponse({"ok": True})


async def get_seen(request: Request) -> Response:
    return JSONResponse(seen)


async def health(request: Request) -> Response:
    return JSONResponse({"ok": True})


app = Starlette(routes=[
    Route("/v1/chat/completions", completions, methods=["POST"]),
    Route("/_raw", raw),
    Route("/_script", set_script, methods=["POST"]),
    Route("/_release", release, methods=["POST"]),
    Route("/_seen", get_seen),
    Route("/health", health),
])  # fmt: skip

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
