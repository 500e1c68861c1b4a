"""The app in process: scripted engine for exact text, the real tiny engine for disconnects.

Disconnect tests drive the ASGI app with hand-made receive/send, as sse-starlette's own tests do.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from gateway.app import create_app, tenant_of
from gateway.local import prediction_found
from gateway.settings import Settings, load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids

MSGS = [{"role": "user", "content": "hi"}]


def settings(**limits: Any) -> Settings:
    """No response cache: these tests are about generation, and a replayed answer would hide it."""
    return load_settings(overrides={"limits": limits, "cache": {"enabled": False}}, env={})


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse_data(raw: str) -> list[str]:
    return [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]


async def test_multibyte_split_across_steps_and_stop_across_tokens() -> None:
    ids = token_ids("héllo wörld € END tail")
    # split mid-character ("é" and "€" are 2 and 3 bytes) and mid-stop-string
    script = [ids[:2], ids[2:3], ids[3:9], ids[9:14], ids[14:16], ids[16:19], ids[19:]]
    engine = ScriptedEngine(script)
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        body = {"model": "fake", "messages": MSGS, "stop": [" END"]}
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        assert whole["choices"][0]["message"]["content"] == "héllo wörld €"
        assert whole["choices"][0]["finish_reason"] == "stop"
        r = await c.post("/v1/chat/completions", json={**body, "stream": True})
        chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
        pieces = [ch["choices"][0]["delta"].get("content", "") for ch in chunks]
        assert "".join(pieces) == "héllo wörld €"
        assert all("\ufffd" not in p and " E" not in p for p in pieces)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_token_granularity_one_chunk_per_token() -> None:
    engine = ScriptedEngine([token_ids("abc"), token_ids("de")])
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        body = {"model": "fake", "prompt": "x", "stream": True, "stream_granularity": "token"}
        chunks = [json.loads(d) for d in sse_data((await c.post("/v1/completions", json=body)).text)[:-1]]
        assert [ch["choices"][0]["text"] for ch in chunks] == ["a", "b", "c", "d", "e", ""]
        body["stream_granularity"] = "step"
        chunks = [json.loads(d) for d in sse_data((await c.post("/v1/completions", json=body)).text)[:-1]]
        assert [ch["choices"][0]["text"] for ch in chunks] == ["abc", "de", ""]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_prediction_tokens_are_counted_on_the_returned_completion_streamed_or_not() -> None:
    """OpenAI's accepted / rejected prediction tokens: the prediction's tokens found in the completion
    (in order) and the rest, the same streamed and unstreamed. The completion's tokens are those
    completion_tokens counts, up to the stop string's last (the text leaves the stop string out, the
    token counts do not), so the prediction's tokens after it count as rejected. No prediction: zeros."""
    engine = ScriptedEngine([token_ids("hello wo"), token_ids("rld STOP more")])
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    body = {
        "model": "fake",
        "messages": MSGS,
        "stop": [" STOP"],
        "prediction": {"type": "content", "content": "hello there world STOP more"},
    }
    async with client(app) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        assert whole["choices"][0]["message"]["content"] == "hello world"
        details = whole["usage"]["completion_tokens_details"]
        # "hello " and "world STOP" (16 bytes) of the prediction's 27 are in the completion's tokens
        assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (16, 11)
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        last = json.loads(sse_data((await c.post("/v1/chat/completions", json=stream)).text)[-2])
        assert last["usage"]["completion_tokens_details"] == details
        plain = {k: v for k, v in body.items() if k != "prediction"}
        zeros = (await c.post("/v1/chat/completions", json=plain)).json()["usage"][
            "completion_tokens_details"
        ]
        assert zeros["accepted_prediction_tokens"] == zeros["rejected_prediction_tokens"] == 0
    # an answer replayed from the response cache reports the counts of the generation it keeps
    cached = create_app(load_settings(env={}), engine=ScriptedEngine(engine.script))  # type: ignore[arg-type]
    greedy = {**body, "temperature": 0}  # the cache keeps deterministic answers
    async with client(cached) as c:
        first = await c.post("/v1/chat/completions", json=greedy)
        await cached.state.gateway.cache.cache.drain()
        again = await c.post("/v1/chat/completions", json=greedy)
        assert again.headers["x-specgate-cache"].startswith("exact")
        assert again.json()["usage"]["completion_tokens_details"] == details
        assert first.json()["usage"]["completion_tokens_details"] == details


def test_prediction_found_counts_matching_tokens_in_order() -> None:
    assert prediction_found([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6]) == 4
    assert prediction_found([3, 2, 1], [1, 2, 3]) == 1  # in order: one of them
    assert prediction_found([7, 7], []) == 0 and prediction_found([], [1]) == 0
    assert prediction_found([1, 2, 3] + [9] * 1_000_000, [1, 2, 3]) == 3  # a long one's head, not all of it


async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing() -> None:
    """The legacy API's prompt scoring (lm-eval-harness's loglikelihood requests): the prompt, its
    logprobs, no completion tokens, streamed or not. max_tokens 0 without echo, or on chat, is a 400."""
    engine = ScriptedEngine([token_ids("xyz"), token_ids("more")])
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    body = {"model": "fake", "prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 1}
    async with client(app) as c:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "abc" and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == ["a", "b", "c"]
        assert r.json()["usage"]["completion_tokens"] == 0
        raw = (await c.post("/v1/completions", json={**body, "stream": True})).text
        chunks = [json.loads(d) for d in sse_data(raw)[:-1]]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == "abc"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        for bad, path in (({"echo": False}, "/v1/completions"), ({}, "/v1/chat/completions")):
            req = (
                {**body, **bad}
                if "chat" not in path
                else {"model": "fake", "messages": MSGS, "max_tokens": 0}
            )
            r = await c.post(path, json=req)
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


async def test_engine_fault_mid_stream_is_one_error_event_then_done() -> None:
    engine = ScriptedEngine([token_ids("ab"), token_ids("cd")], fail="CUDA fell over")
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        r = await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS, "stream": True})
        assert r.status_code == 200
        data = sse_data(r.text)
        assert data[-1] == "[DONE]"
        err = json.loads(data[-2])
        assert err["error"]["type"] == "server_error" and set(err["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert sum('"error"' in d for d in data) == 1
        r = await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


async def test_keepalive_ping_during_a_slow_step() -> None:
    """A step slower than the ping interval (a long prefill) shows up as ': ping' comments."""
    engine = ScriptedEngine([token_ids("a"), token_ids("b")], delay=0.5)
    s = load_settings(overrides={"server": {"sse_ping_s": 0.1}, "cache": {"enabled": False}}, env={})
    app = create_app(s, engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        r = await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS, "stream": True})
    assert ": ping" in r.text
    assert (
        "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in sse_data(r.text)[:-1])
        == "ab"
    )


async def test_n_and_seed_reach_the_engine() -> None:
    engine = ScriptedEngine([token_ids("ok")])
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": "fake", "messages": MSGS, "n": 3, "seed": 10, "temperature": 0.5},
        )
        assert [ch["message"]["content"] for ch in r.json()["choices"]] == ["ok"] * 3
        assert r.json()["usage"]["completion_tokens"] == 6
    assert [q.params.seed for q in engine.requests] == [10, 11, 12]
    # the gateway passes the request's choice on; the engine fixes k for seeded sampling itself
    assert all(q.spec.adaptive for q in engine.requests)


async def test_a_completion_without_max_tokens_asks_for_16_as_the_legacy_api_does() -> None:
    """OpenAI's /v1/completions defaults max_tokens to 16 (so does vLLM's); chat has no such
    default, and gets the server's. A script written against OpenAI got 512 tokens here."""
    engine = ScriptedEngine([token_ids("ok")])
    app = create_app(settings(default_max_tokens=100), engine=engine)  # type: ignore[arg-type]
    async with client(app) as c:
        for body in ({}, {"max_tokens": None}, {"max_tokens": 40}):
            r = await c.post("/v1/completions", json={"model": "fake", "prompt": "x", **body})
            assert r.status_code == 200
        assert (
            await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS})
        ).status_code == 200
    assert [q.params.max_tokens for q in engine.requests] == [16, 16, 40, 100]


async def test_a_chat_without_max_tokens_may_fill_the_context_as_openai_and_vllm_allow() -> None:
    """Chat has no default limit at OpenAI, and vLLM's is what remains of the context: an answer
    is not cut short at a server default unless one is configured, and never past max_max_tokens."""
    engine = ScriptedEngine([token_ids("ok")])  # a 4096-token context
    async with client(create_app(settings(), engine=engine)) as c:  # type: ignore[arg-type]
        await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS})
    async with client(create_app(settings(max_max_tokens=1000), engine=engine)) as c:  # type: ignore[arg-type]
        await c.post("/v1/chat/completions", json={"model": "fake", "messages": MSGS})
    context_left, capped = (q.params.max_tokens for q in engine.requests)
    assert 4000 < context_left < 4096 and capped == 1000


async def test_a_chat_without_max_tokens_whose_prompt_fills_the_context_is_refused_in_its_words() -> None:
    """Without max_tokens a prompt that fills the context is a 400 context_length_exceeded naming the
    prompt alone, as OpenAI words it, before anything reaches the engine: it said "you requested 4097
    tokens (4096 in the messages, 1 in the completion)", a completion the client never asked for."""
    engine = ScriptedEngine([token_ids("ok")])  # a 4096-token context, which the fake never checks
    long = [{"role": "user", "content": "x" * 4100}]
    async with client(create_app(settings(), engine=engine)) as c:  # type: ignore[arg-type]
        r = await c.post("/v1/chat/completions", json={"model": "fake", "messages": long})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "However, your messages resulted in" in error["message"] and "completion" not in error["message"]
    assert engine.requests == []


async def test_rate_limits_per_key() -> None:
    s = load_settings(
        overrides={"limits": {"rpm": 2}, "auth": {"api_keys": ["k1", "k2"]}, "cache": {"enabled": False}},
        env={},
    )
    app = create_app(s, engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]
    body = {"model": "fake", "messages": MSGS}
    async with client(app) as c:
        k1 = {"Authorization": "Bearer k1"}
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json=body, headers=k1)
            assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "2"
        r = await c.post("/v1/chat/completions", json=body, headers=k1)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
        r = await c.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k2"})
        assert r.status_code == 200  # another key, another bucket


async def test_a_request_the_gateway_could_not_serve_is_not_charged_to_the_key() -> None:
    """A 503 (overloaded) gives back the request admit charged: the client retrying after
    Retry-After gets served, not a 429 for requests that never ran. A 400 keeps its charge."""
    s = load_settings(overrides={"limits": {"rpm": 1}, "cache": {"enabled": False}}, env={})
    app = create_app(s, engine=ScriptedEngine([token_ids("ok")], overloaded=2))  # type: ignore[arg-type]
    body = {"model": "fake", "messages": MSGS}
    async with client(app) as c:
        for _ in range(2):
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 429  # the one served request used the minute's one
    app = create_app(s, engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]
    async with client(app) as c:
        assert (await c.post("/v1/chat/completions", json={"model": "fake"})).status_code == 400
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 429


async def test_token_rate_limit() -> None:
    s = load_settings(overrides={"limits": {"tpm": 30}, "cache": {"enabled": False}}, env={})
    app = create_app(s, engine=ScriptedEngine([token_ids("a" * 40)]))  # type: ignore[arg-type]
    async with client(app) as c:
        assert (await c.post("/v1/completions", json={"model": "fake", "prompt": "x"})).status_code == 200
        r = await c.post("/v1/completions", json={"model": "fake", "prompt": "x"})
        assert r.status_code == 429 and "x-ratelimit-remaining-tokens" in r.headers


async def test_tenant_is_a_hash_of_the_key() -> None:
    assert tenant_of("sk-a") != tenant_of("sk-b") and "sk-a" not in tenant_of("sk-a")


async def test_not_ready_while_loading() -> None:
    app = create_app(settings())
    async with client(app) as c:
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json() == {"ready": False, "reason": "loading"}
        r = await c.post("/v1/chat/completions", json={"model": "x", "messages": MSGS})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "loading"
        assert (await c.get("/health")).status_code == 200
        names = sorted({"auto", *(m.name for m in app.state.gateway.settings.models)})
        r = await c.get("/v1/models")  # the configured models, on their way
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == names
        assert (await c.get(f"/v1/models/{names[0]}")).json()["id"] == names[0]
        assert (await c.get("/v1/models/not-configured")).status_code == 404


# ---- the real engine on tiny models -------------------------------------------------------------


@pytest.fixture
def tiny_engine(tiny_models: Any) -> Any:
    engine = AsyncEngine(Engine(tiny_models), max_active=2, max_queued=4)
    yield engine
    engine.shutdown()


async def test_overload_is_an_immediate_503(tiny_models: Any) -> None:
    # no slot free and nothing may queue (a free slot would take it: max_queued bounds the waiting)
    engine = AsyncEngine(Engine(tiny_models), max_active=0, max_queued=0)
    try:
        app = create_app(settings(), engine=engine)
        async with client(app) as c:
            r = await c.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2}
            )
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
    finally:
        engine.shutdown()


def test_max_queued_zero_serves_what_a_free_slot_takes() -> None:
    """limits.max_queued bounds the requests that wait; with 0 (nothing waits) a request a free slot
    takes is still served: the gateway refused every request with a 400 naming the queue. More
    generations than can run and wait at once are still refused up front."""
    from gateway.errors import APIError
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest

    s = Settings(limits={"max_queued": 0})  # type: ignore[arg-type]
    one = ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS})
    assert to_job(one, "r", "t", s).n == 1
    two = ChatCompletionRequest.model_validate({"model": "m", "messages": MSGS, "n": 2})
    with pytest.raises(APIError) as refused:
        to_job(two, "r", "t", s)
    assert refused.value.status == 400 and "max_queued = 0" in refused.value.message
    s = Settings(limits={"max_queued": 0, "max_active": 2})  # type: ignore[arg-type]
    assert to_job(two, "r", "t", s).n == 2


async def test_prompts_are_tokenised_off_the_event_loop(tiny_engine: AsyncEngine, monkeypatch: Any) -> None:
    tok = tiny_engine.tokenizer("tiny")
    threads: list[int] = []
    real = tok.apply_chat_template

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    async with client(create_app(settings(), engine=tiny_engine)) as c:
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200
    assert threads and threading.get_ident() not in threads  # the loop's thread never ran the template


class Conversation:
    """One HTTP request on a hand-made ASGI channel; ``hang_up`` sends http.disconnect."""

    def __init__(self, body: dict[str, Any]):
        self.body = json.dumps(body).encode()
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.first_body = asyncio.Event()
        self._read = False

    async def receive(self) -> dict[str, Any]:
        if not self._read:
            self._read = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and b"content" in message.get("body", b""):
            self.first_body.set()

    def scope(self) -> dict[str, Any]:
        return {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "root_path": "",
            "query_string": b"",
            "client": ("test", 1),
            "server": ("test", 80),
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(self.body)).encode()),
            ],
        }


async def _steps_stop_moving(engine: AsyncEngine) -> None:
    for _ in range(100):  # the abort lands within one step
        if engine.active == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.active == 0
    before = engine.total_steps
    await asyncio.sleep(0.3)
    assert engine.total_steps == before


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_stops_generation(tiny_engine: AsyncEngine, stream: bool) -> None:
    app = create_app(settings(), engine=tiny_engine)
    conv = Conversation(
        {"model": "tiny", "messages": MSGS, "max_tokens": 400, "temperature": 0, "stream": stream}
    )
    task = asyncio.create_task(app(conv.scope(), conv.receive, conv.send))
    while tiny_engine.total_steps < 3:
        await asyncio.sleep(0.01)
    if stream:
        await asyncio.wait_for(conv.first_body.wait(), 30)
    assert tiny_engine.active == 1  # still generating when the client leaves
    steps_at_hangup = tiny_engine.total_steps
    conv.gone.set()
    await asyncio.wait_for(task, 10)
    await _steps_stop_moving(tiny_engine)
    assert tiny_engine.total_steps - steps_at_hangup < 50  # far from the 400 it was asked for


async def test_a_missing_key_is_told_apart_from_a_wrong_one() -> None:
    """Both are OpenAI's 401 invalid_api_key, in its words for each: a request without a key (or
    without the Bearer scheme) was told its key was incorrect."""
    s = load_settings(overrides={"auth": {"api_keys": ["sk-a"]}, "cache": {"enabled": False}}, env={})
    async with client(create_app(s)) as c:
        none = await c.get("/v1/models")
        bare = await c.get("/v1/models", headers={"authorization": "sk-a"})
        wrong = await c.get("/v1/models", headers={"authorization": "Bearer sk-b"})
    for r in (none, bare, wrong):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["type"] == "authentication_error" and "sk-" not in r.text
    assert none.json()["error"]["message"].startswith("You didn't provide an API key.")
    assert bare.json()["error"]["message"].startswith("You didn't provide an API key.")
    assert wrong.json()["error"]["message"].startswith("Incorrect API key provided.")


async def test_a_browser_client_reads_the_rate_limit_headers() -> None:
    """The OpenAI SDK in a browser decides whether to retry by x-should-retry and Retry-After, and
    rate-limit-aware clients read x-ratelimit-*: CORS exposed only Retry-After and our own headers,
    so a browser's SDK retried a request too large for the key's tpm that it was told not to."""
    s = load_settings(overrides={"limits": {"tpm": 10, "rpm": 5}, "cache": {"enabled": False}}, env={})
    app = create_app(s, engine=ScriptedEngine([token_ids("ok")]))  # type: ignore[arg-type]
    origin = {"origin": "https://chat.example"}
    async with client(app) as c:
        ok = await c.post(
            "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 2}, headers=origin
        )
        big = await c.post(
            "/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 20}, headers=origin
        )
    assert (ok.status_code, big.status_code) == (200, 429)
    for r in (ok, big):
        exposed = {h.strip() for h in r.headers["access-control-expose-headers"].split(",")}
        readable = {h for h in r.headers if h in exposed or h in ("content-type", "content-length")}
        assert {"x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests"} <= readable
    assert "x-should-retry" in {h.strip() for h in big.headers["access-control-expose-headers"].split(",")}


async def test_cors_lets_a_browser_call_the_api() -> None:
    """A preflight needs no key and gets x-request-id; the API's answers, its 401 included, carry
    Access-Control-Allow-Origin; ``server.cors_allow_origins: []`` turns it off."""
    on = load_settings(overrides={"auth": {"api_keys": ["sk-a"]}, "cache": {"enabled": False}}, env={})
    origin = {"origin": "https://chat.example"}
    preflight = {**origin, "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    async with client(create_app(on)) as c:
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"] and r.headers["x-request-id"]
        r = await c.get("/v1/models", headers={**origin, "authorization": "Bearer sk-a"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        r = await c.get("/v1/models", headers=origin)  # no key: the 401 is readable too
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = await c.get("/v1/models", headers={"authorization": "Bearer sk-a"})  # no Origin: no CORS
        assert "access-control-allow-origin" not in r.headers
    off = load_settings(overrides={"server": {"cors_allow_origins": []}, "cache": {"enabled": False}}, env={})
    async with client(create_app(off)) as c:
        r = await c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        r = await c.get("/v1/models", headers=origin)
        assert "access-control-allow-origin" not in r.headers
    listed = load_settings(
        overrides={
            "server": {"cors_allow_origins": ["https://chat.example"]},
            "auth": {"api_keys": ["sk-a"]},  # the gateway's own 401 names the origin, and Vary says so
            "cache": {"enabled": False},
        },
        env={},
    )
    async with client(create_app(listed)) as c:
        ok = await c.options("/v1/chat/completions", headers=preflight)
        other = await c.options(
            "/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"}
        )
        assert ok.headers["access-control-allow-origin"] == "https://chat.example"
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = await c.get("/v1/models", headers={"origin": "https://chat.example", "authorization": "Bearer x"})
        assert (
            r.headers["access-control-allow-origin"] == "https://chat.example"
            and "Origin" in r.headers["vary"]
        )


async def test_a_stop_spanning_the_end_of_min_tokens_ends_the_output_streamed_or_not() -> None:
    """A stop string that begins within the first min_tokens tokens and ends after them ends the
    output, as vLLM finds it, streamed and whole alike: the streamed text had already gone out and
    the output ran on with the stop in it."""
    engine = ScriptedEngine([token_ids("xyz"), token_ids("END!more")])
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    body = {"model": "fake", "messages": MSGS, "stop": ["zEN"], "min_tokens": 3}
    async with client(app) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        raw = (await c.post("/v1/chat/completions", json={**body, "stream": True})).text
    assert whole["choices"][0]["message"]["content"] == "xy"
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == 5  # x y z E N: the last one completes the stop
    chunks = [json.loads(d) for d in sse_data(raw) if d != "[DONE]"]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == "xy"


async def test_vllms_sampling_extras_reach_the_engine_and_hold_back_stop_strings() -> None:
    """min_tokens, ignore_eos, min_p and repetition_penalty (vLLM's extra body fields, which its
    users and benchmark clients send) reach the engine's SamplingParams; they were dropped. A stop
    string is not looked for in the first min_tokens tokens (vLLM's min_tokens holds back every
    stop); out-of-range values are a 400 naming the field; they split the response cache's key."""
    from gateway.cache.query import output_params

    engine = ScriptedEngine([token_ids("ab"), token_ids("cabd")])
    app = create_app(settings(), engine=engine)  # type: ignore[arg-type]
    extras = {"min_tokens": 3, "ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.2}
    async with client(app) as c:
        body = {"model": "fake", "messages": MSGS, "stop": ["b"], **extras}
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        assert whole["choices"][0]["message"]["content"] == "abca"  # "b" ends it from the 4th token
        p = engine.requests[-1].params
        assert (p.min_tokens, p.ignore_eos, p.min_p, p.repetition_penalty) == (3, True, 0.05, 1.2)
        plain = (await c.post("/v1/chat/completions", json={**body, "min_tokens": 0})).json()
        assert plain["choices"][0]["message"]["content"] == "a"
        for field, value in (("min_p", 1.5), ("repetition_penalty", 5e-324), ("min_tokens", -1)):
            r = await c.post("/v1/chat/completions", json={**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    assert output_params({"min_tokens": 3}) != output_params({})
    assert output_params({"min_tokens": 0, "ignore_eos": False, "min_p": 0, "repetition_penalty": 1}) == {}
