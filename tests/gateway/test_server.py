"""The real server driven by the official openai client (sync and async) and by raw HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.gateway.conftest import API_KEY, Server

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


@pytest.fixture
async def aclient(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


def test_models(client: openai.OpenAI) -> None:
    # the router's alias is listed as the models are: a model picker offers it
    assert sorted(m.id for m in client.models.list()) == ["auto", "tiny", "tiny-draft"]
    assert client.models.retrieve("tiny").id == "tiny" and client.models.retrieve("auto").id == "auto"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_non_streamed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.usage.model_extra["speculative"]  # type: ignore[index]
    assert spec["drafter"] == "draft" and spec["steps"] >= 1
    assert spec["tokens_per_step"] == round(r.usage.completion_tokens / spec["steps"], 4)
    assert spec["mean_accepted_per_step"] == spec["tokens_per_step"]  # deprecated alias
    per_spec = spec["accepted_tokens"] / spec["spec_steps"] if spec["spec_steps"] else 0.0
    assert spec["accepted_tokens_per_spec_step"] == round(per_spec, 4)


def test_greedy_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


@pytest.mark.parametrize("granularity", ["step", "token"])
def test_stream_include_usage(client: openai.OpenAI, granularity: str) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"stream_granularity": granularity, "speculative": {"mode": "draft", "max_k": 4}},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 16  # max_tokens with random weights: no EOS this early
    assert last.usage.model_extra["speculative"]["steps"] >= 1  # type: ignore[index]
    assert all(c.usage is None for c in body)


def test_seeded_sampling_repeats_and_n_differs(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=1.0, seed=7, n=2)
    a = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    b = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    stream = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    for i in range(2):
        text = "".join(
            c.choices[0].delta.content or "" for c in stream if c.choices and c.choices[0].index == i
        )
        assert text == a.choices[i].message.content
        finishes = [c for c in stream if c.choices and c.choices[0].index == i and c.choices[0].finish_reason]
        assert len(finishes) == 1


def test_stop_string_cuts_and_never_leaks(client: openai.OpenAI) -> None:
    base = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=30, temperature=0)
    text = base.choices[0].message.content or ""
    stop = text[5:8]  # three characters from the middle of the greedy output
    assert len(stop) == 3
    kw = dict(model="tiny", messages=CHAT, max_tokens=30, temperature=0, stop=[stop, "never-there"])
    r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    ]  # type: ignore[call-overload]
    assert "".join(pieces) == text[: text.index(stop)]


def test_completions_echo_logprobs_and_list_prompt(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="tiny", prompt=["abc", "xyz"], max_tokens=5, temperature=0, echo=True, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("abc") and r.choices[1].text.startswith("xyz")
    lp = r.choices[0].logprobs
    # the prompt's 3 byte-level tokens lead the 5 completion tokens; nothing predicts the first
    assert lp is not None and lp.tokens is not None and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3 + 5
    assert (
        lp.tokens[:3] == ["a", "b", "c"] and lp.text_offset is not None and lp.text_offset[:4] == [0, 1, 2, 3]
    )
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])  # type: ignore[arg-type]  # logprobs + 1
    streamed = list(
        client.completions.create(
            model="tiny", prompt="abc", max_tokens=5, temperature=0, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content)


async def test_async_client(aclient: openai.AsyncOpenAI) -> None:
    r = await aclient.chat.completions.create(model="tiny-draft", messages=CHAT, max_tokens=8, temperature=0)
    stream = await aclient.chat.completions.create(
        model="tiny-draft", messages=CHAT, max_tokens=8, temperature=0, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == r.choices[0].message.content
    await aclient.close()


def test_raw_sse_bytes(server: Server, headers: dict[str, str]) -> None:
    body = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json=body, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no" and r.headers["cache-control"] == "no-cache"
        assert r.headers["x-request-id"]
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n") and "\r" not in raw
    events = [e for e in raw.split("\n\n") if e]
    datas = [e for e in events if not e.startswith(":")]  # ": ping" comments are keep-alives
    assert all(e.startswith("data: ") and "\n" not in e for e in datas)
    chunks = [json.loads(e[6:]) for e in datas[:-1]]
    first = chunks[0]
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert set(first) == {"id", "object", "created", "model", "system_fingerprint", "choices", "usage"}
    assert (
        first["object"] == "chat.completion.chunk"
        and first["id"].startswith("chatcmpl-")
        and first["usage"] is None
    )
    finish = chunks[-2]["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_text_with_unicode_line_separators_reads_line_by_line(
    server: Server, headers: dict[str, str]
) -> None:
    """U+2028, U+2029 and U+0085 in a stream's text are JSON escapes, not raw characters: httpx's
    iter_lines (str.splitlines' line ends) cut such an event in two, neither part JSON, so a client
    reading the stream line by line failed on an echoed prompt or a model's text holding one."""
    prompt = "a\u2028b\u2029c\x85d"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    assert all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    offsets = [
        o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert text.startswith(prompt) and len(offsets) == len(prompt.encode()) + 2  # a byte a token


def test_raw_non_streamed_shape(server: Server, headers: dict[str, str]) -> None:
    r = httpx.post(
        server.base_url + "/chat/completions",
        headers={**headers, "x-request-id": "abc-123"},
        json={"model": "tiny", "messages": CHAT, "max_tokens": 3},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    body = r.json()
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": body["choices"][0]["message"]["content"],
        "refusal": None,
    }
    assert body["choices"][0]["logprobs"] is None


def test_health_ready_openapi_metrics(server: Server, headers: dict[str, str]) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready", headers=headers).json() == {"ready": True}
    doc = httpx.get(server.url + "/openapi.json", headers=headers).json()
    assert "/v1/chat/completions" in doc["paths"] and "ChatCompletionRequest" in doc["components"]["schemas"]
    m = httpx.get(server.url + "/metrics", headers=headers)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
