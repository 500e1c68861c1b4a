"""Structured outputs, tools, Predicted Outputs and logit_bias through the real server (tiny random
models) with the unmodified openai SDK, raw HTTP and LangChain's ChatOpenAI."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import pytest

from tests.gateway.conftest import API_KEY, Server, start_roomy_server, stop_server

USER = [{"role": "user", "content": "Give me the record."}]
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["cat", "dog"]},
            "owner": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9},
                    "vip": {"type": "boolean"},
                },
                "required": ["id", "vip"],
                "additionalProperties": False,
            },
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": -1, "maximum": 1},
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "kind", "owner", "scores"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4}
        },
        "required": ["items"],
        "additionalProperties": False,
    },
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_roomy_server(tmp_path_factory.mktemp("structured"))
    yield s
    stop_server(s)


def spec(mode: str) -> dict[str, Any]:
    return {"speculative": {"mode": mode, "max_k": 4, "adaptive": False}}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_validates_and_greedy_is_identical_with_and_without_speculation(client, schema) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": schema, "strict": True}}
    texts = {}
    for mode in ("off", "draft", "ngram"):
        r = client.chat.completions.create(
            model="tiny",
            messages=USER,
            response_format=fmt,
            temperature=0,
            max_tokens=200,
            extra_body=spec(mode),
        )  # type: ignore[call-overload]
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.refusal is None
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
        texts[mode] = choice.message.content
        if mode != "off":
            assert r.usage is not None and r.usage.model_extra["speculative"]["drafted_tokens"] > 0  # type: ignore[index]
    assert texts["off"] == texts["draft"] == texts["ngram"]
    streamed = client.chat.completions.create(
        model="tiny", messages=USER, response_format=fmt, temperature=0, max_tokens=200, stream=True,
        extra_body=spec("draft"),
    )  # type: ignore[call-overload]  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == texts["off"]


def test_json_object_is_an_object(client) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=USER, response_format={"type": "json_object"}, temperature=0, max_tokens=200
    )
    if r.choices[0].finish_reason == "stop":  # a random model may fill the budget with keys
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    else:
        assert (r.choices[0].message.content or "").startswith("{")


def _raw_stream(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@pytest.mark.parametrize("granularity", ["step", "token"])
def test_streamed_tool_calls_have_openais_delta_shape_and_match_non_streamed(
    client, server, granularity
) -> None:
    body = {
        "model": "tiny", "messages": USER, "tools": [WEATHER, ADD], "tool_choice": "required", "temperature": 0,
        "max_tokens": 500, "stream_granularity": granularity, **spec("draft"),
    }  # fmt: skip
    extra = {k: body[k] for k in ("stream_granularity", "speculative")}
    sdk_body = {k: v for k, v in body.items() if k not in extra}
    whole = client.chat.completions.create(**sdk_body, extra_body=extra)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for c in calls:
        schema = {"get_weather": WEATHER, "add": ADD}[c.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(c.function.arguments), schema)

    chunks = _raw_stream(server, body)
    seen: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        for ch in chunk["choices"]:
            finish = ch["finish_reason"] or finish
            for tc in ch["delta"].get("tool_calls", []):
                i = tc["index"]
                if i not in seen:  # the first delta of a call: index, id, type, name, arguments ""
                    assert set(tc) == {"index", "id", "type", "function"} and tc["type"] == "function"
                    assert tc["function"]["arguments"] == "" and tc["function"]["name"]
                    seen[i] = {"name": tc["function"]["name"], "arguments": ""}
                else:  # later: index and an arguments fragment only
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                    seen[i]["arguments"] += tc["function"]["arguments"]
    assert finish == "tool_calls"
    assert [(s["name"], s["arguments"]) for _, s in sorted(seen.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]


def test_a_full_tool_loop_with_named_choice(client) -> None:
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, ADD], temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "add"
    args = json.loads(calls[0].function.arguments)
    assert 0 <= args["a"] <= 99
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": str(args["a"] + args["b"])})
    final = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=[WEATHER, ADD],
        tool_choice="none",
        temperature=0,
        max_tokens=16,
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content is not None
    # the tool turn reached the prompt: the same conversation without it is a different prompt
    without = client.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=1)
    assert final.usage is not None and without.usage is not None
    assert final.usage.prompt_tokens > without.usage.prompt_tokens + 10


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
        ({"prediction": {"content": "x"}}, "prediction.type"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages[0].tool_call_id"),
        # vLLM's guided decoding
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_regex"),  # the first in vLLM's order
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar"),  # GBNF: the grammar is Lark here
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
        ({"guided_regex": "a", "tools": [WEATHER]}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_structured_parameters_are_400s_naming_them(server, extra, param) -> None:
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, **extra}
    r = httpx.post(
        server.base_url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_predicted_outputs_are_lossless_and_reported_in_usage(client) -> None:
    base = client.chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=48)
    text = base.choices[0].message.content or ""
    edited = text[:10] + "EDIT" + text[14:]
    r = client.chat.completions.create(
        model="tiny", messages=USER, temperature=0, max_tokens=48,
        prediction={"type": "content", "content": edited},
    )  # fmt: skip
    assert r.choices[0].message.content == text
    details = r.usage.completion_tokens_details if r.usage else None
    # (random weights emit bytes that are not UTF-8: the text comes back with U+FFFD, which
    # re-encodes differently, so only part of it can match; tests/decoding covers the rate)
    assert (
        details is not None and details.accepted_prediction_tokens and details.accepted_prediction_tokens > 0
    )
    assert details.rejected_prediction_tokens is not None
    # without a prediction the breakdown is OpenAI's zeros, not null
    assert base.usage is not None and base.usage.completion_tokens_details is not None
    assert base.usage.completion_tokens_details.model_dump(exclude_none=True) == dict.fromkeys(
        ("reasoning_tokens", "audio_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"), 0
    )
    assert r.usage is not None and r.usage.model_extra["speculative"]["drafter"] == "prediction"  # type: ignore[index]


def test_logit_bias_bans_a_token_and_speculation_keeps_the_biased_output(client) -> None:
    plain = client.chat.completions.create(
        model="tiny", messages=USER, temperature=0, max_tokens=24, logprobs=True
    )
    lp = plain.choices[0].logprobs
    assert lp is not None and lp.content
    first = lp.content[0].token
    outs = []
    for mode in ("off", "draft", "ngram"):
        r = client.chat.completions.create(
            model="tiny", messages=USER, temperature=0, max_tokens=24, logit_bias={str(_token_id(first)): -100},
            extra_body=spec(mode),
        )  # type: ignore[call-overload]  # fmt: skip
        outs.append(r.choices[0].message.content)
        assert not (r.choices[0].message.content or "").startswith(first)
    assert outs[0] == outs[1] == outs[2] != plain.choices[0].message.content


def _token_id(token: str) -> int:
    """The byte tokenizer's id for a one-character token (ids are the sorted byte-level alphabet)."""
    from decoding import tiny

    return int(tiny.byte_tokenizer().convert_tokens_to_ids(token))


def test_langchain_bind_tools_and_with_structured_output(server) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    llm = ChatOpenAI(
        model="tiny", base_url=server.base_url, api_key=API_KEY, temperature=0, max_tokens=500, max_retries=0
    )

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30)

    msg = llm.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False).invoke(
        "Weather in Oslo?"
    )
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}
    streamed = None
    for chunk in llm.bind_tools([WEATHER], tool_choice="get_weather", parallel_tool_calls=False).stream(
        "Weather in Oslo?"
    ):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (c["name"], c["args"]) for c in msg.tool_calls
    ]
    pet = llm.with_structured_output(Pet, method="json_schema").invoke("A pet, please.")
    assert isinstance(pet, Pet)
    pet2 = llm.with_structured_output(Pet, method="function_calling", strict=True).invoke("A pet, please.")
    assert isinstance(pet2, Pet)


GUIDED_CHOICES = ["yes", 'no "way"', "maybe\nlater", "ça va"]  # quotes, a newline, non-ASCII


def _guided_body(path: str, mode: str, **guided: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_tokens": 40, **spec(mode), **guided}
    if path == "/chat/completions":
        return {**base, "messages": USER}
    return {**base, "prompt": "Answer: "}


def _text(r: httpx.Response, path: str) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    return choice["message"]["content"] if path == "/chat/completions" else choice["text"]


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_vllms_guided_decoding_constrains_the_output(server, path) -> None:
    """vLLM's guided_choice, guided_regex, guided_json (an object or its JSON text), guided_grammar
    (Lark) and structured_outputs shape the output on both endpoints, the same with speculation as
    without. They were dropped as unknown fields (an unconstrained 200), then refused."""
    import re

    schema = SCHEMAS[1]
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_choice": GUIDED_CHOICES}, lambda t: t in GUIDED_CHOICES),
        ({"structured_outputs": {"choice": GUIDED_CHOICES}}, lambda t: t in GUIDED_CHOICES),
        ({"guided_regex": r"[a-c]{2,5}-[0-9]+/x"}, lambda t: re.fullmatch(r"[a-c]{2,5}-[0-9]+/x", t)),
        ({"structured_outputs": {"regex": "(ab|cd)+"}}, lambda t: re.fullmatch("(ab|cd)+", t)),
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"guided_json": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema) is None),
        ({"guided_grammar": 'start: "x" ("," "y")*'}, lambda t: re.fullmatch("x(,y)*", t)),
    ]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
        for guided, ok in cases:
            off = _text(c.post(path, json=_guided_body(path, "off", **guided)), path)
            assert ok(off), (guided, off)
            assert _text(c.post(path, json=_guided_body(path, "draft", **guided)), path) == off, guided


def test_a_guided_choice_of_thousands_is_served(server) -> None:
    """2,500 choices: as one rule's alternatives each was a parser item, and past llguidance's 2,000 a
    row the first token failed the request (a 500); as one terminal the lexer compiles them."""
    words = [f"w{i}x" for i in range(2500)]
    r = httpx.post(
        server.base_url + "/chat/completions",
        json={"model": "tiny", "messages": USER, "max_tokens": 30, "temperature": 0, "guided_choice": words},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] in words and choice["finish_reason"] == "stop"


def test_a_grammar_past_llguidances_limits_fails_its_request_alone(server) -> None:
    """A regex that compiles but outgrows llguidance's lexer at the first token is a 400 naming
    guided_regex, streamed or not, and a request decoding beside it is unharmed: the failure was
    once the whole batch step's, every request in it a 500."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    bad = {"model": "tiny", "messages": USER, "max_tokens": 8, "guided_regex": "(a|aa){5000}"}
    good = {"model": "tiny", "messages": USER, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
        with c.stream("POST", "/chat/completions", json={**good, "stream": True}) as s:
            lines = s.iter_lines()
            first = next(x for x in lines if x.startswith("data: {") and '"content":"' in x)
            r = c.post("/chat/completions", json=bad)  # while the good stream is decoding
            rest = [x for x in lines if x.startswith("data: ")]
        assert first and rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest)
        assert any('"finish_reason":"length"' in x for x in rest)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "guided_regex"
        # found while compiling (decoding.grammar.dead_end), so a stream is refused before it begins
        streamed = c.post("/chat/completions", json={**bad, "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "guided_regex"
