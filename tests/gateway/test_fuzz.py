"""Schemathesis over the gateway's own /openapi.json, against a real server on the tiny models.

Every response must be below 500, every 4xx must carry OpenAI's error object, every response an
x-request-id, and a stream that began with a 200 must end in [DONE] with no error event (an error
after the 200 is a fault the client cannot act on).

The schema is the served one, narrowed so that valid requests reach generation quickly: the
served model names, small max_tokens and n, short texts, token ids around the tiny vocabulary's
edge (259 ids) and the parameters refused by name left out of valid requests (tools,
response_format, prediction and logit_bias are fuzzed as the schema declares them). Invalid requests (the
negative mode) come from the same schema. ``make test`` runs 500 fixed (derandomized) cases, about
a minute on a 2-core CPU; ``SPECGATE_FUZZ_EXAMPLES=5000`` (or any number) runs a longer campaign of
fresh random cases (1,500 took 2.2 minutes here).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests

from gateway.protocol import CHAT_ONLY, UNSUPPORTED
from gateway.responses_protocol import UNSUPPORTED as RESPONSES_UNSUPPORTED
from tests.gateway.conftest import Server, start_server, stop_server

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

# make test: 300 derandomized cases (~75 s on a 2-core CPU); SPECGATE_FUZZ_EXAMPLES for a longer, random run
EXAMPLES = int(os.environ.get("SPECGATE_FUZZ_EXAMPLES", "300"))
MODELS = ["tiny", "tiny-draft", "auto"]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("fuzz"),
        {
            "limits": {"max_n": 2, "max_max_tokens": 16, "max_queued": 8, "drain_timeout_s": 1},
            "cache": {"enabled": False},
            "server": {"sse_ping_s": 1},
        },
    )
    yield s
    stop_server(s)


def _narrow(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]

    def integer_branch(prop: dict[str, Any]) -> dict[str, Any]:
        return next(b for b in prop.get("anyOf", [prop]) if b.get("type") == "integer")

    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": MODELS}
        for limit in ("max_tokens", "max_completion_tokens"):
            if limit in props:
                integer_branch(props[limit])["maximum"] = 8
        integer_branch(props["n"])["maximum"] = 2
        integer_branch(props["top_k"])["maximum"] = 300
        props["min_tokens"]["maximum"] = 8
        props["stop"] = {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}
        props["user"] = {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}
        # refused by name whatever they hold: valid requests leave them out
        for unsupported in (*UNSUPPORTED, *(CHAT_ONLY if name == "CompletionRequest" else ())):
            props.pop(unsupported, None)
    chat = schemas["ChatCompletionRequest"]["properties"]
    chat["messages"]["maxItems"] = 3
    message = schemas["ChatMessage"]["properties"]
    message["content"] = {
        "anyOf": [
            {"type": "string", "maxLength": 40},
            {"type": "array", "items": {"$ref": "#/components/schemas/TextPart"}, "maxItems": 2},
        ]
    }
    schemas["TextPart"]["properties"]["text"] = {"type": "string", "maxLength": 20}
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 270}, "maxItems": 6}
    schemas["CompletionRequest"]["properties"]["prompt"] = {
        "anyOf": [
            {"type": "string", "maxLength": 40},
            {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
            token_ids,
            {"type": "array", "items": token_ids, "maxItems": 3},
        ]
    }
    responses = schemas["ResponsesRequest"]["properties"]
    responses["model"] = {"type": "string", "enum": MODELS}
    integer_branch(responses["max_output_tokens"])["maximum"] = 8
    integer_branch(responses["top_k"])["maximum"] = 300
    short = {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}
    responses["instructions"] = responses["user"] = short
    responses["input"] = {
        "anyOf": [
            {"type": "string", "maxLength": 40},
            {
                "type": "array",
                "items": {"$ref": "#/components/schemas/MessageItem"},
                "minItems": 1,
                "maxItems": 3,
            },
        ]
    }
    schemas["MessageItem"]["properties"]["content"] = {"type": "string", "maxLength": 40}
    # an id the fuzzer makes up finds nothing: those paths only dilute the cases that reach generation
    for path in [p for p in doc["paths"] if p.startswith("/v1/responses/")]:
        del doc["paths"][path]
    # refused by name whatever they hold, and an unknown previous_response_id is a 400 whatever it is
    for refused in (*RESPONSES_UNSUPPORTED, "previous_response_id"):
        responses.pop(refused, None)
    return doc


def _check(response: requests.Response, case: Any) -> None:
    body = case.body if isinstance(case.body, dict | list | str | int | float | bool) else None
    what = f"{case.method} {case.formatted_path} {json.dumps(body)[:400]}"
    assert response.status_code < 500, f"{response.status_code} for {what}: {response.text[:300]}"
    assert response.headers.get("x-request-id"), what
    if 400 <= response.status_code < 500:
        assert response.headers["content-type"].startswith("application/json"), what
        body = response.json()
        assert set(body) == {"error"}, what
        assert set(body["error"]) == {"message", "type", "param", "code"}, what
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], what
    elif (
        response.headers.get("content-type", "").startswith("text/event-stream")
        and case.formatted_path == "/v1/responses"
    ):
        # the Responses API's typed events end with the response's own, never an error or [DONE]
        data = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        kinds = [json.loads(d)["type"] for d in data]
        assert kinds and kinds[-1] in ("response.completed", "response.incomplete"), f"{what}: {kinds}"
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        data = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", what
        assert not any('"error"' in d and json.loads(d).get("error") for d in data[:-1]), f"{what}: {data}"


def test_fuzz_the_openapi_schema(fuzzed: Server) -> None:
    doc = httpx.get(fuzzed.url + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(_narrow(doc))
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)
    )
    session = requests.Session()
    seen: dict[int, int] = {}

    @hypothesis.settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,  # no .hypothesis directory in the tree
        derandomize="SPECGATE_FUZZ_EXAMPLES" not in os.environ,  # make test: the same cases each run
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate],  # no shrinking: a failure prints the request as sent
    )
    @hypothesis.given(case=cases)
    def run(case: Any) -> None:
        # sent with requests directly: schemathesis' own call reads only the first 20 SSE events
        response = session.request(**case.as_transport_kwargs(base_url=fuzzed.url), timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        _check(response, case)

    run()
    assert seen.get(200, 0) > EXAMPLES // 10, seen  # the narrowing lets a share reach generation
    assert "Exception in ASGI application" not in fuzzed.output()
    assert "unhandled error" not in fuzzed.output()


# Adversarial grammars (issue 48): deep and recursive JSON schemas, long $defs and Lark rule chains,
# empty and explosive regexes, through every field that takes one. Each must get a 200 or an OpenAI
# 4xx, and the server must live through all of them (a grammar once segfaulted it).
GRAMMAR_EXAMPLES = int(os.environ.get("SPECGATE_FUZZ_GRAMMARS", "40"))


def _chain(n: int, link: str) -> dict[str, Any]:
    def step(i: int) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/d{i + 1}"}
        return {
            "object": {"type": "object", "properties": {"a": ref}, "required": ["a"]},
            "array": {"type": "array", "items": ref, "maxItems": 2},
            "anyOf": {"anyOf": [ref, {"type": "null"}]},
            "allOf": {"allOf": [ref]},
        }[link]

    defs = {f"d{i}": step(i) for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 3}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


_leaf = st.sampled_from(
    [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"enum": ["a", "b"]}, {"$ref": "#"}, {}]
)
_recursive_schemas = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.builds(
            lambda p: {"type": "object", "properties": p}, st.dictionaries(st.sampled_from("abc"), inner)
        ),
        st.builds(lambda i: {"type": "array", "items": i, "maxItems": 3}, inner),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
    ),
    max_leaves=30,
)
_schemas = st.one_of(
    st.builds(_chain, st.integers(1, 3000), st.sampled_from(["object", "array", "anyOf", "allOf"])),
    _recursive_schemas,
    st.builds(
        lambda n: {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}},
        st.integers(1, 3000),
    ),
)


def _lark(n: int, shape: str) -> str:
    rule = {"right": 'r{i}: "a" r{j}', "left": 'r{i}: r{j} "a"', "nest": 'r{i}: "(" r{j} ")" | "x"'}[shape]
    return "start: r0\n" + "".join(rule.format(i=i, j=i + 1) + "\n" for i in range(n)) + f'r{n}: "b"\n'


_grammars = st.builds(_lark, st.integers(1, 8000), st.sampled_from(["right", "left", "nest"]))
_regexes = st.one_of(
    st.sampled_from(
        [r"[^\s\S]", r"a[^\s\S]", r"[a-z]{2}[^\s\S]", "(a{1,200}){1,200}", "(" * 3000 + "a" + ")" * 3000]
    ),
    st.from_regex(r"[a-c()|*+?\[\]^\\sS{}0-9,]{1,24}", fullmatch=True),
)


def _grammar_body(field: str, schema: dict[str, Any], lark: str, regex: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    if field == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    elif field == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        body["tool_choice"] = "required"
    elif field == "guided_json":
        body["guided_json"] = schema
    elif field == "guided_grammar":
        body["guided_grammar"] = lark
    else:
        body["guided_regex"] = regex
    return body


def test_fuzz_adversarial_grammars(fuzzed: Server) -> None:
    session = requests.Session()
    seen: dict[int, int] = {}

    @hypothesis.settings(
        max_examples=GRAMMAR_EXAMPLES,
        deadline=None,
        database=None,
        derandomize="SPECGATE_FUZZ_GRAMMARS" not in os.environ,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(
        field=st.sampled_from(["response_format", "tools", "guided_json", "guided_grammar", "guided_regex"]),
        schema=_schemas,
        lark=_grammars,
        regex=_regexes,
        stream=st.booleans(),
    )
    def run(field: str, schema: dict[str, Any], lark: str, regex: str, stream: bool) -> None:
        body = {**_grammar_body(field, schema, lark, regex), "stream": stream}
        response = session.post(fuzzed.url + "/v1/chat/completions", json=body, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert fuzzed.proc.poll() is None, f"the server died on {field}: {fuzzed.output()[-2000:]}"
        what = f"{field} {json.dumps(body)[:300]}"
        assert response.status_code in (200, 400, 413), (
            f"{response.status_code} for {what}: {response.text[:300]}"
        )
        if response.status_code != 200:
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], what

    run()
    assert seen.get(200, 0) and seen.get(400, 0), seen  # both reached: generation, and refusals
    assert httpx.get(fuzzed.url + "/health", timeout=10).status_code == 200
    assert "Exception in ASGI application" not in fuzzed.output()
