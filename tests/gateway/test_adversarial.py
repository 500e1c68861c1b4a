"""Issue 48's reproductions against a real server: requests that once killed or froze it get a clean
answer, and it serves on."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.decoding.test_grammar_limits import defs_chain, lark_chain
from tests.gateway.conftest import TINY_MODELS, Server, start_server, stop_server

BASE = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(
        tmp_path_factory.mktemp("adversarial"),
        {
            "models": [{**m, "max_context": 2048} for m in TINY_MODELS],  # room for a tool's prompt
            "limits": {"max_body_bytes": 2_000_000, "max_n": 8},
            "cache": {"enabled": False},
        },
    )
    yield s
    stop_server(s)


def post(server: Server, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + "/chat/completions", json={**BASE, **body}, timeout=120)


def alive(server: Server) -> bool:
    return server.proc.poll() is None and httpx.get(server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": json.loads(defs_chain(1000))},
            }
        },
        {"guided_json": json.loads(defs_chain(1000)), "n": 8},
        {"guided_grammar": lark_chain(4000)},
    ],
    ids=["response_format", "guided_json-n8", "guided_grammar"],
)
def test_grammars_that_crashed_the_process_are_served(served: Server, body: dict[str, Any]) -> None:
    r = post(served, body)
    assert r.status_code == 200, r.text[:300]
    assert alive(served)


def test_a_schema_past_the_size_limit_is_a_400_naming_its_field(served: Server) -> None:
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(16_000)},
        "required": [f"p{i}" for i in range(16_000)],
    }
    r = post(
        served, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    )
    assert r.status_code == 400, r.text[:300]
    assert (
        r.json()["error"]["param"] == "response_format"
        and "max_grammar_bytes" in r.json()["error"]["message"]
    )
    assert alive(served)


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"a[^\s\S]"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_unsatisfiable_regex_is_a_400(served: Server, regex: str, stream: bool) -> None:
    r = post(served, {"guided_regex": regex, "stream": stream})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "guided_regex"


def test_a_dead_end_found_while_generating_is_a_400(served: Server) -> None:
    r = post(served, {"guided_grammar": "start: /[a-z]/ /[^\\s\\S]/"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "guided_grammar"


def test_a_large_prediction_is_served(served: Server) -> None:
    prediction = ("def f(x):\n    return x * 2\n" * 40_000)[:950_000]
    r = post(served, {"prediction": {"type": "content", "content": prediction}})
    assert r.status_code == 200, r.text[:300]
    assert alive(served)


def test_tool_parameters_with_local_refs_are_called(served: Server) -> None:
    """Parameters as pydantic writes them (``$defs`` and ``#/$defs/...``): the refs named the
    parameters' root, which inside the call grammar is the call's, and every such tool was a 400."""
    params = {
        "$defs": {"U": {"enum": ["c", "f"]}, "P": {"type": "object", "additionalProperties": False}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}, "u": {"$ref": "#/$defs/U"}},
        "required": ["p", "u"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": n, "parameters": params}} for n in ("a",)]
    for choice in ("required", {"type": "function", "function": {"name": "a"}}):
        r = post(served, {"tools": tools, "tool_choice": choice, "max_tokens": 200})
        assert r.status_code == 200, r.text[:300]
        call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text[:600]
        args = json.loads(call["arguments"])
        assert args["u"] in ("c", "f") and isinstance(args["p"], dict)


def test_a_long_prediction_is_encoded_in_pieces_cut_after_newlines() -> None:
    from decoding.tiny import byte_tokenizer
    from gateway.local import PIECE_CHARS, encode_in_pieces

    tok = byte_tokenizer()
    text = "x = f(y) * 2\n" * (3 * PIECE_CHARS // 13) + "tail without a newline" * 2000
    calls: list[str] = []
    encode = tok.encode
    tok.encode = lambda t, **kw: calls.append(t) or encode(t, **kw)  # type: ignore[method-assign]
    ids = encode_in_pieces(tok, text)
    assert ids == encode(text, add_special_tokens=False)  # a byte tokenizer: no edge effects at all
    assert len(calls) > 3 and all(len(c) <= PIECE_CHARS for c in calls)
    assert all(c.endswith("\n") for c in calls[:2])
