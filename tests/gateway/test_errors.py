"""Bad requests against the real server: each gets the right 4xx in OpenAI's error shape, never a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import API_KEY, Server

MSGS = [{"role": "user", "content": "hi"}]


def ok_chat(**over: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": MSGS, "max_tokens": 2, **over}


def post(
    server: Server, path: str, content: bytes | Iterator[bytes], headers: dict[str, str]
) -> httpx.Response:
    return httpx.post(
        server.base_url + path,
        content=content,
        headers={**headers, "content-type": "application/json"},
        timeout=30,
    )


def assert_error(
    r: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body
    assert r.headers["x-request-id"]
    return body["error"]  # type: ignore[no-any-return]


CASES: list[tuple[str, bytes, int, str | None]] = [
    ("malformed json", b'{"model": "tiny", "messages": [', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing messages", b'{"model": "tiny"}', 400, "messages"),
    ("messages not a list", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
    ("empty messages", b'{"model": "tiny", "messages": []}', 400, "messages"),
    (
        "unknown role",
        b'{"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}',
        400,
        "messages[0].role",
    ),
    (
        "image part",
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
        400,
        "messages[0].content",
    ),
    (  # OpenAI: "empty array. Expected an array with minimum length 1"; it was read as ""
        "user message with an empty content array",
        b'{"model": "tiny", "messages": [{"role": "user", "content": []}]}',
        400,
        "messages[0].content",
    ),
    (
        "user message without content",
        b'{"model": "tiny", "messages": [{"role": "user"}]}',
        400,
        "messages[0].content",
    ),
    (
        "tool message with null content",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", '
        b'"content": null}]}',
        400,
        "messages[1].content",
    ),
    (
        "max_tokens as string",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}',
        400,
        "max_tokens",
    ),
    (
        "negative max_tokens",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        400,
        "max_tokens",
    ),
    (
        "huge max_tokens",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}',
        400,
        "max_tokens",
    ),
    ("huge n", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 1000}', 400, "n"),
    (
        "NaN temperature",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        None,
    ),
    (
        "temperature too high",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 7}',
        400,
        "temperature",
    ),
    (
        "top_p above 1",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": 1.01}',
        400,
        "top_p",
    ),
    (
        "too many stops",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
        400,
        "stop",
    ),
    (
        "tool without a function",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}',
        400,
        "tools[0].function",
    ),
    (
        "response_format of no known type",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}',
        400,
        "response_format.type",
    ),
    (  # OpenAI's pattern for the name, as for a function's; it was taken
        "json_schema name with a space",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": '
        b'"json_schema", "json_schema": {"name": "my schema", "schema": {"type": "object"}}}}',
        400,
        "response_format.json_schema.name",
    ),
    (
        "logit_bias out of range",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 500}}',
        400,
        "logit_bias",
    ),
    (
        "bad speculative mode",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "speculative": {"mode": "magic"}}',
        400,
        "speculative.mode",
    ),
    (
        "draft confidence of 1",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "speculative": {"draft_confidence": 1}}',
        400,
        "speculative.draft_confidence",
    ),
    (
        "seed beyond 64 bits",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551617}',
        400,
        "seed",
    ),
    (
        "top_k beyond 64 bits",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 1e30}',
        400,
        "top_k",
    ),
    (
        "top_k not integral",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_k": 5.5}',
        400,
        "top_k",
    ),
    (  # str.isdigit admits superscripts and other scripts' digits, which int() refuses or reads
        "logit_bias key of non-ASCII digits",
        '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"\u00b2": 5}}'.encode(),
        400,
        "logit_bias",
    ),
    (
        "logit_bias key of Arabic-Indic digits",
        '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"\u0661\u0662": 5}}'.encode(),
        400,
        "logit_bias",
    ),
    (  # a union's error comes from the branch the value went furthest into: these were "Invalid
        # value for 'messages[0].content': Input should be a valid string (got list)", and the like
        "text part without its text",
        b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text"}]}]}',
        400,
        "messages[0].content[0].text",
    ),
    (
        "stop list of no strings",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stop": [1]}',
        400,
        "stop[0]",
    ),
    (
        "named tool_choice without its function",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}',
        400,
        "tool_choice.function",
    ),
    (  # OpenAI documents that top_logprobs needs logprobs: true, and refuses it without
        "top_logprobs without logprobs",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
        400,
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("name", "body", "status", "param"), CASES, ids=[c[0] for c in CASES])
def test_bad_chat_requests(
    server: Server, headers: dict[str, str], name: str, body: bytes, status: int, param: str | None
) -> None:
    err = assert_error(post(server, "/chat/completions", body, headers), status, param)
    assert err["type"] == "invalid_request_error"


def test_integral_floats_are_integers(server: Server, headers: dict[str, str]) -> None:
    """JSON Schema's `integer` admits 568.0, so schema-driven clients send it."""
    r = httpx.post(
        server.base_url + "/chat/completions",
        json=ok_chat(top_k=568.0, max_tokens=2.0, seed=3.0),
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_degenerate_sampling_parameters_still_generate(server: Server, headers: dict[str, str]) -> None:
    """A temperature or top_p so small that naive arithmetic underflows to NaN is greedy, not a fault."""
    for over in (
        {"temperature": 1e-300},
        {"top_p": 5e-324},
        {"temperature": 1e-45, "top_p": 1e-300},
        {"top_p": 0, "temperature": 2},  # OpenAI's range is [0, 1]: the likeliest token alone
    ):
        body = ok_chat(max_tokens=8, **over)
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, (over, r.text)
        r = httpx.post(
            server.base_url + "/chat/completions", json={**body, "stream": True}, headers=headers, timeout=60
        )
        assert r.status_code == 200 and '"error"' not in r.text and r.text.endswith("data: [DONE]\n\n")


def test_null_is_the_default(server: Server, headers: dict[str, str]) -> None:
    """OpenAI's schemas mark optional fields nullable, and clients that send every field send the
    unset ones as null: each null is the default, on chat and on legacy completions."""
    nulls = dict.fromkeys(
        ("n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "stop", "seed"),
    )
    r = httpx.post(
        server.base_url + "/chat/completions",
        json=ok_chat(temperature=0, stream_options=None, **nulls),
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    plain = httpx.post(
        server.base_url + "/chat/completions", json=ok_chat(temperature=0), headers=headers, timeout=30
    )
    assert body["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    completion = {"model": "tiny", "prompt": "ab", "max_tokens": 2, "temperature": 0}
    r = httpx.post(
        server.base_url + "/completions",
        json={**completion, "echo": None, "n": None, "logprobs": None},
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    plain = httpx.post(server.base_url + "/completions", json=completion, headers=headers, timeout=30)
    assert r.json()["choices"] == plain.json()["choices"]
    # a required field's null is its absence, refused by name
    assert_error(
        post(server, "/chat/completions", b'{"model": "tiny", "messages": null}', headers), 400, "messages"
    )


def test_a_non_text_part_is_named(server: Server, headers: dict[str, str]) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
    body = ok_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
    err = assert_error(r, 400, "messages[0].content")
    assert "'input_audio'" in err["message"] and "not supported" in err["message"]


def test_unknown_fields_are_ignored(server: Server, headers: dict[str, str]) -> None:
    r = httpx.post(
        server.base_url + "/chat/completions",
        json=ok_chat(something_new=1, stream=True, stream_options={"x": 1, "include_usage": None}),
        headers=headers,
        timeout=30,
    )
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n") and '"usage":{' not in r.text


# vLLM's extra body fields that would shape the output, set as a vLLM client sets them
VLLM_SET = {  # its guided decoding is served (tests/gateway/test_structured.py)
    "stop_token_ids": [3],
    "bad_words": ["a"],
    "allowed_token_ids": [3, 4],
    "include_stop_str_in_output": True,
    "prompt_logprobs": 0,
    "use_beam_search": True,
    "truncate_prompt_tokens": 4,
    "chat_template": "{{ messages[0].content }}",  # was served with the model's own template
}


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_vllm_output_extras_are_refused_not_ignored(
    server: Server, headers: dict[str, str], path: str
) -> None:
    """A vLLM client's stop_token_ids (or bad_words ...) dropped as an unknown field would come back
    as unshaped output with a 200: each is a 400 naming it, saying what to send instead; left out,
    null, false or empty they are no-ops and served."""
    base = ok_chat() if path == "/chat/completions" else {"model": "tiny", "prompt": "a", "max_tokens": 2}
    for name, value in VLLM_SET.items():
        r = httpx.post(server.base_url + path, json={**base, name: value}, headers=headers, timeout=30)
        err = assert_error(r, 400, name)
        assert "not supported" in err["message"]
    unset = {
        name: ([] if isinstance(v, list) else False if v is True else None) for name, v in VLLM_SET.items()
    }
    r = httpx.post(server.base_url + path, json={**base, **unset}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text


def test_stream_options_need_a_stream(server: Server, headers: dict[str, str]) -> None:
    """OpenAI (and vLLM) refuse stream_options on a request that does not stream."""
    for stream in (False, None):
        body = ok_chat(stream=stream, stream_options={"include_usage": True})
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
        assert_error(r, 400, "stream_options")
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_error(
        httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=30),
        400,
        "stream_options",
    )


def test_unknown_model(server: Server, headers: dict[str, str]) -> None:
    r = httpx.post(
        server.base_url + "/chat/completions", json=ok_chat(model="gpt-9"), headers=headers, timeout=30
    )
    err = assert_error(r, 404, "model", "model_not_found")
    assert "gpt-9" in err["message"]


def test_overlong_prompt(server: Server, headers: dict[str, str]) -> None:
    long = [{"role": "user", "content": "x" * 600}]  # one byte-level token per character; context 512
    r = httpx.post(
        server.base_url + "/chat/completions", json=ok_chat(messages=long), headers=headers, timeout=30
    )
    assert_error(r, 400, "messages", "context_length_exceeded")
    r = httpx.post(
        server.base_url + "/completions",
        json={"model": "tiny", "prompt": "y" * 600},
        headers=headers,
        timeout=30,
    )
    err = assert_error(r, 400, "prompt", "context_length_exceeded")
    assert "in the prompt" in err["message"] and "messages" not in err["message"]


def test_oversized_body(server: Server, headers: dict[str, str]) -> None:
    big = ok_chat(messages=[{"role": "user", "content": "z" * 70000}])
    r = httpx.post(server.base_url + "/chat/completions", json=big, headers=headers, timeout=30)
    assert_error(r, 413)

    def chunked() -> Iterator[bytes]:  # no Content-Length: the server must count
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(80):
            yield b"z" * 1000
        yield b'"}]}'

    r = post(server, "/chat/completions", chunked(), headers)
    assert_error(r, 413)


def test_completion_errors(server: Server, headers: dict[str, str]) -> None:
    assert_error(post(server, "/completions", b'{"model": "tiny", "prompt": []}', headers), 400, "prompt")
    assert_error(post(server, "/completions", b'{"model": "tiny", "prompt": 5}', headers), 400, "prompt")
    assert_error(
        post(server, "/completions", b'{"model": "tiny", "prompt": "", "max_tokens": 2}', headers),
        400,
        "prompt",
    )
    assert_error(
        post(server, "/completions", b'{"model": "tiny", "prompt": "a", "suffix": "b"}', headers),
        400,
        "suffix",
    )
    # best_of = n selects nothing, so it is served (clients send best_of: 1); a selection is refused
    ok = {"model": "tiny", "prompt": "a", "max_tokens": 2, "temperature": 0}
    # an empty suffix is no suffix: fill-in-the-middle clients send one with every prompt
    r = httpx.post(server.base_url + "/completions", json={**ok, "suffix": ""}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    for best_of, n in ((1, 1), (2, 2), (1.0, 1)):
        r = httpx.post(
            server.base_url + "/completions",
            json={**ok, "best_of": best_of, "n": n},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
    for best_of in (2, True, "1"):
        body = json.dumps({**ok, "best_of": best_of}).encode()
        assert_error(post(server, "/completions", body, headers), 400, "best_of")
    for prompt in ([1, 259, 5], [[3], [100000]], [-1], [2**40]):  # the tiny vocabulary has 259 ids
        for stream in (False, True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": stream}
            r = httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=30)
            assert_error(r, 400, "prompt")  # before the 200, streamed or not


def test_more_generations_than_the_queue_holds_is_a_400(server: Server, headers: dict[str, str]) -> None:
    """prompts x n above limits.max_queued could never be admitted: not a 503 to retry forever."""
    body = {"model": "tiny", "prompt": ["a"] * 9, "n": 4, "max_tokens": 1}  # 36 > the default 32
    err = assert_error(
        httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=30), 400
    )
    assert err["param"] == "prompt" and "max_queued" in err["message"]
    body["prompt"] = ["a"] * 8  # exactly 32
    r = httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 32


def test_unknown_route_and_method(server: Server, headers: dict[str, str]) -> None:
    """As OpenAI answers them: an unknown path is a 404 invalid_request_error naming it."""
    err = assert_error(httpx.get(server.base_url + "/nothing", headers=headers), 404)
    assert err["type"] == "invalid_request_error" and err["message"] == "Invalid URL (GET /v1/nothing)"
    r = httpx.get(server.base_url + "/chat/completions", headers=headers)
    err = assert_error(r, 405)
    assert r.headers["allow"] == "POST"
    # OpenAI's 405, word for word (it said "Method Not Allowed: GET ...")
    assert err["type"] == "invalid_request_error"
    assert err["message"] == "Invalid method for URL (GET /v1/chat/completions)"


@pytest.mark.parametrize("path", ["/chat/completions", "/completions", "/models", "/models/tiny"])
def test_auth_required(server: Server, path: str) -> None:
    method = "POST" if "completions" in path else "GET"
    body = ok_chat() if path == "/chat/completions" else {"model": "tiny", "prompt": "a", "max_tokens": 1}
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"}):
        r = httpx.request(method, server.base_url + path, json=body, headers=auth, timeout=30)
        err = assert_error(r, 401)
        assert err["type"] == "authentication_error"
    r = httpx.request(
        method, server.base_url + path, json=body, headers={"Authorization": "Bearer sk-other"}, timeout=30
    )
    assert r.status_code == 200


def test_probes_and_metrics_need_no_auth_but_the_api_does(server: Server) -> None:
    # kubelet probes and Prometheus scrapers carry no key (auth.public_paths, configurable)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/dashboard").status_code == 200
    assert_error(httpx.get(server.url + "/v1/models"), 401)


def test_sdk_raises_typed_errors(server: Server) -> None:
    # closed: a client left open is a socket the garbage collector reports in some later test
    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[], max_tokens=2)  # type: ignore[arg-type]
        assert e.value.param == "messages"  # type: ignore[attr-defined]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
    with (
        openai.OpenAI(base_url=server.base_url, api_key="bad", max_retries=0) as stranger,
        pytest.raises(openai.AuthenticationError),
    ):
        stranger.models.list()
