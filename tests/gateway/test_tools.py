"""The tool-call parser and grammar builder (pure Python): however the text is cut into chunks, the
deltas rebuild the same calls; odd layouts fall back to a whole-body parse or to plain content."""

from __future__ import annotations

import json

import pytest

from gateway.backends import ToolCallDelta
from gateway.remote import _tool_calls
from gateway.tools import ToolCallParser, grammar_for, tool_grammar

TWO_CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x}\\"{"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "tags": [1, [2]]}}\n</tool_call>'
)


def parse(pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[ToolCallDelta]]:
    p = ToolCallParser()
    content, deltas = "", []
    for piece in [*pieces, None]:
        text, calls = p.flush() if piece is None else p.feed(piece)
        content += text
        deltas += calls
    calls_out: list[tuple[str, str]] = []
    for d in deltas:
        if d.id is not None:
            assert d.name and d.arguments == "" and d.index == len(calls_out)
            calls_out.append((d.name, ""))
        else:
            name, args = calls_out[d.index]
            calls_out[d.index] = (name, args + d.arguments)
    return content, calls_out, deltas


def test_every_cut_of_the_text_gives_the_same_calls() -> None:
    expected = [("add", '{"a": 1, "b": "x}\\"{"}'), ("get_weather", '{"city": "Paris", "tags": [1, [2]]}')]
    for size in (1, 2, 3, 7, 50, len(TWO_CALLS)):
        content, calls, _ = parse([TWO_CALLS[i : i + size] for i in range(0, len(TWO_CALLS), size)])
        assert content == "" and calls == expected, size
        assert next(json.loads(a) for _, a in calls)["b"] == 'x}"{'
    for cut in range(len(TWO_CALLS)):  # a boundary at every position, call boundaries included
        assert parse([TWO_CALLS[:cut], TWO_CALLS[cut:]])[1] == expected


def test_content_around_calls_and_text_that_only_looks_like_a_tag() -> None:
    content, calls, _ = parse(["Let me check.\n", TWO_CALLS[:40], TWO_CALLS[40:]])
    assert content == "Let me check.\n" and [n for n, _ in calls] == ["add", "get_weather"]
    # a call body that never closes and is no JSON: the text, as it came
    assert parse(["a <tool_c", "all> is not closed"])[0] == "a <tool_call> is not closed"
    content, calls, _ = parse(["x <tool_", "cal"])  # the held tail of a tag comes back at the end
    assert content == "x <tool_cal" and calls == []
    assert parse(["plain answer"]) == ("plain answer", [], [])


def test_arguments_first_layout_falls_back_to_a_whole_parse_and_garbage_stays_text() -> None:
    _, calls, _ = parse(['<tool_call>{"arguments": {"q": 1}, "name": "f"}</tool_call>'])
    assert calls == [("f", '{"q": 1}')]
    content, calls, _ = parse(["<tool_call>not json</tool_call>"])
    assert content == "<tool_call>not json" and calls == []


def test_grammars() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert grammar_for(None, tools, "none", True) is None
    assert grammar_for({"type": "text"}, None, None, True) is None
    assert grammar_for({"type": "json_object"}, None, None, True).kind == "json_schema"  # type: ignore[union-attr]
    g = grammar_for(None, tools, "required", False)
    assert g is not None and g.kind == "lark" and g.param == "tools" and "call)*" not in g.text
    assert "call)*" in tool_grammar(tools, True)
    auto = grammar_for({"type": "json_object"}, tools, "auto", True)
    assert auto is not None and auto.text.startswith("start: %json")


@pytest.mark.parametrize("repeat_id", [False, True])
def test_upstream_tool_call_deltas_pass_through(repeat_id: bool) -> None:
    first = _tool_calls({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                         "function": {"name": "f", "arguments": ""}}]})  # fmt: skip
    later = _tool_calls({"tool_calls": [{"index": 0, **({"id": "c1"} if repeat_id else {}),
                                         "function": {"arguments": '{"a"'}}]})  # fmt: skip
    assert first == [ToolCallDelta(0, "", "c1", "f")]
    assert later == [ToolCallDelta(0, '{"a"', None, None)]
