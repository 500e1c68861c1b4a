"""The tool-call parser and grammar builder (pure Python): however the text is cut into chunks, the
deltas rebuild the same calls; odd layouts fall back to a whole-body parse or to plain content."""

from __future__ import annotations

import json
import random
from collections.abc import Collection
from typing import Any

import httpx
import openai
import pytest

from decoding.grammar import ll_tokenizer, matcher
from decoding.tiny import byte_tokenizer
from gateway.app import create_app
from gateway.backends import ToolCallDelta
from gateway.grammars import grammar_for, loose_calls, tool_grammar
from gateway.remote import _Calls
from gateway.settings import load_settings
from gateway.tools import ToolCallParser
from tests.gateway.fakes import ScriptedEngine, token_ids

TWO_CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x}\\"{"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "tags": [1, [2]]}}\n</tool_call>'
)


def parse(
    pieces: list[str],
    names: Collection[str] = (),
    parallel: bool = True,
    loose: Collection[str] | None = None,
) -> tuple[str, list[tuple[str, str]], list[ToolCallDelta]]:
    p = ToolCallParser(names, parallel, loose)
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
    assert content == "<tool_call>not json</tool_call>" and calls == []  # as it came, both tags


@pytest.mark.parametrize(
    "value,expected",
    [
        ('"{\\"q\\": 1}"', '{"q": 1}'),  # encoded twice: the object's JSON, not a JSON string
        ("null", "{}"),
        ('{"city": "Zürich"}', '{"city": "Zürich"}'),
    ],
)
def test_tagged_arguments_that_are_not_an_object_literal_are_normalised(value: str, expected: str) -> None:
    text = f'<tool_call>{{"name": "f", "arguments": {value}}}</tool_call>'
    for size in (1, 3, len(text)):
        content, calls, _ = parse([text[i : i + size] for i in range(0, len(text), size)])
        assert content == "" and calls == [("f", expected)], size
        assert isinstance(json.loads(calls[0][1]), dict)
    assert parse(['<tool_call>{"name": "f"}</tool_call>'])[1] == [("f", "{}")]  # no arguments at all
    assert parse(['<tool_call>{"parameters": {"q": 2}, "name": "f"}</tool_call>'])[1] == [("f", '{"q": 2}')]


@pytest.mark.parametrize("value", ["5", "[1, 2]", '"not json"', '"[1]"', "true"])
def test_a_tagged_call_whose_arguments_are_no_object_is_no_call(value: str) -> None:
    """OpenAI's arguments are always an object's JSON; a client parses them as one. A call that
    cannot give one goes out as the text it was, however it was cut."""
    text = f'<tool_call>{{"name": "f", "arguments": {value}}}</tool_call>'
    for size in (1, 2, len(text)):
        content, calls, _ = parse([text[i : i + size] for i in range(0, len(text), size)])
        assert calls == [] and content.startswith('<tool_call>{"name": "f"'), size


def test_a_tagged_call_cut_before_its_name_leaves_no_markup_in_content() -> None:
    """max_tokens cutting a call before its name ends: the cut call goes nowhere (OpenAI never puts
    a call's markup in content), and the calls before it stand; an unclosed tag before prose stays
    the text it was."""
    done = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    for cut in ('<tool_call>\n{"', '<tool_call>\n{"name": "', "<tool_call>\n{"):
        for size in (1, 3, 100):
            text = done + cut
            content, calls, _ = parse([text[i : i + size] for i in range(0, len(text), size)], ["f"])
            assert content == "" and calls == [("f", '{"a": 1}')], (cut, size)
    content, calls, _ = parse(["<tool_call> maybe later"], ["f"])
    assert calls == [] and content == "<tool_call> maybe later"


def test_grammars() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert grammar_for(None, tools, "none", True) is None
    assert grammar_for({"type": "text"}, None, None, True) is None
    assert grammar_for({"type": "json_object"}, None, None, True).kind == "json_schema"  # type: ignore[union-attr]
    g = grammar_for(None, tools, "required", False)
    assert g is not None and g.kind == "lark" and g.param == "tools" and "call)*" not in g.text
    assert "call)*" in tool_grammar(tools, True)
    named = grammar_for(None, tools, {"type": "function", "function": {"name": "f"}}, True)
    assert named is not None and "call)*" not in named.text  # a named function: exactly one call
    assert "call)*" in grammar_for(None, tools, "required", True).text  # type: ignore[union-attr]
    auto = grammar_for({"type": "json_object"}, tools, "auto", True)
    assert auto is not None and auto.text.startswith("start: %json")


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_several_calls_may_end_after_the_newline_that_follows_a_call(choice: str) -> None:
    """Qwen2.5 writes a newline after ``</tool_call>`` and then ends its turn. Where that newline
    committed to one more call, tool_choice "required" drove the real 0.5B through call after call
    until max_tokens cut the last one in half (finish_reason "length", arguments not JSON)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fmt = {"type": "json_object"} if choice == "auto" else None  # "auto" is constrained with a format
    spec = grammar_for(fmt, tools, choice, True)
    assert spec is not None
    tok = byte_tokenizer()
    m = matcher(spec, ll_tokenizer(tok, len(tok), (tok.eos_token_id,)), tok)
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for text, ends in (
        (call, True),
        (call + "\n", True),
        (f"{call}\n{call}\n", True),
        (call + "\n\n", False),
    ):
        m.reset()
        ids = tok(text)["input_ids"]
        assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) == ends, text


STRICT = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}  # fmt: skip
LOOSE = {
    "type": "function",
    "function": {"name": "note", "parameters": {"type": "object", "required": ["x"]}},
}


def _accepts(spec: Any, tok: Any, text: str) -> bool:
    m = matcher(spec, ll_tokenizer(tok, len(tok), (tok.eos_token_id,)), tok)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return bool(m.try_consume_tokens(ids) == len(ids) and m.is_accepting())


def test_strict_functions_are_checked_under_tool_choice_auto() -> None:
    """A strict function's arguments follow its schema under tool_choice auto as well (OpenAI's
    Structured Outputs for function calling); the answer may still be text, and a function without
    ``strict`` takes any object. With no strict function, auto stays free text (no grammar)."""
    assert grammar_for(None, [LOOSE], "auto", True) is None
    assert grammar_for(None, [LOOSE], None, True) is None
    spec = grammar_for(None, [STRICT, LOOSE], None, True)  # tools and no choice: auto
    assert spec is not None and spec.param == "tools"
    tok = byte_tokenizer()
    call = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
    assert _accepts(spec, tok, "It is 3, no tool needed.")
    assert _accepts(spec, tok, call.format("add", '{"a": 3}'))
    assert _accepts(spec, tok, call.format("add", '{"a": 3}') + "\n" + call.format("note", '{"y": [1]}'))
    assert not _accepts(spec, tok, call.format("add", '{"a": "3"}'))
    assert not _accepts(spec, tok, call.format("add", '{"a": 3, "b": 4}'))
    assert not _accepts(spec, tok, call.format("sub", '{"a": 3}'))


def test_strict_calls_may_follow_text_with_qwens_tokenizer() -> None:
    """With Qwen2.5's tokenizer, where ``<tool_call>`` is a token of its own, text may come before a
    strict call, whose arguments are still checked (the byte tokenizer of the tiny models spells the
    tag, which free text may hold)."""
    from transformers import AutoTokenizer

    from decoding import store

    if not store.is_cached("qwen2.5-coder-0.5b"):
        pytest.skip("qwen2.5-coder-0.5b not pulled (run `specgate models pull`)")
    tok = AutoTokenizer.from_pretrained(store.model_dir("qwen2.5-coder-0.5b"))
    spec = grammar_for(None, [STRICT], "auto", False)
    call = '<tool_call>\n{{"name": "add", "arguments": {}}}\n</tool_call>'
    assert _accepts(spec, tok, "Let me add them. " + call.format('{"a": 3}'))
    assert not _accepts(spec, tok, "Let me add them. " + call.format('{"a": 3.5}'))
    assert _accepts(spec, tok, "Three.")


@pytest.mark.parametrize("repeat_id", [False, True])
def test_upstream_tool_call_deltas_pass_through(repeat_id: bool) -> None:
    calls = _Calls()
    first = calls.deltas(0, {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                             "function": {"name": "f", "arguments": ""}}]})  # fmt: skip
    later = calls.deltas(0, {"tool_calls": [{"index": 0, **({"id": "c1"} if repeat_id else {}),
                                             "function": {"arguments": '{"a"'}}]})  # fmt: skip
    assert first == [ToolCallDelta(0, "", "c1", "f")]
    assert later == [ToolCallDelta(0, '{"a"', None, None)]


# ---- plain JSON calls (no tags) at the start of free text ---------------------------------------

NAMES = ("get_weather", "add")
W = '{"name": "get_weather", "arguments": {"city": "Paris", "note": "} ``` \\" ["}}'
A = '{"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}'
W_CALL = ("get_weather", '{"city": "Paris", "note": "} ``` \\" ["}')
A_CALL = ("add", '{"a": 1, "b": [2, {"c": 3}]}')

PLAIN_CALLS: dict[str, tuple[str, list[tuple[str, str]]]] = {  # text -> (content, calls)
    f"```json\n{W}\n```": ("", [W_CALL]),
    f"\n  ```\n{W}\n```\n": ("", [W_CALL]),  # no fence language, whitespace around
    f"```JSON\n{W}\n```": ("", [W_CALL]),
    W: ("", [W_CALL]),
    f"{W}\n{A}": ("", [W_CALL, A_CALL]),
    f"```json\n{W}\n{A}\n```": ("", [W_CALL, A_CALL]),
    f"```json\n[{W}, {A}]\n```": ("", [W_CALL, A_CALL]),
    f"[\n  {W},\n  {A}\n]": ("", [W_CALL, A_CALL]),
    f"```json\n{W}\n```\n\n```json\n{A}\n```": ("", [W_CALL, A_CALL]),
    '{"name": "add", "parameters": {"a": 1}}': ("", [("add", '{"a": 1}')]),
    '{"name":"add","arguments":{"a":1},"id":"x}"}': ("", [("add", '{"a":1}')]),  # later keys: dropped
    f"```json\n{W}\n```\nThis looks up the weather.\n": ("This looks up the weather.\n", [W_CALL]),
    f"{W}\n<tool_call>\n{A}\n</tool_call>": ("", [W_CALL, A_CALL]),
    f"{W}\n```python\nx = 1\n```": ("```python\nx = 1\n```", [W_CALL]),  # code after the call: content
    # the wrappers models write (issue 51): <tools> (Qwen2.5 in a LangChain tool loop), Llama 3.x's
    # <|python_tag|> with "parameters", Mistral's [TOOL_CALLS] list
    '<tools>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tools>': (
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    f"<tools>\n{W}\n{A}\n</tools>": ("", [W_CALL, A_CALL]),
    f"<tools>[{W}, {A}]</tools>\nDone.": ("Done.", [W_CALL, A_CALL]),
    f"<tools>\n{W}\n</tools>\n<tools>\n{A}\n</tools>": ("", [W_CALL, A_CALL]),
    '<|python_tag|>{"name": "add", "parameters": {"a": 1}}': ("", [("add", '{"a": 1}')]),
    f"<|python_tag|>{A}\n<|python_tag|>{W}": ("", [A_CALL, W_CALL]),
    f"[TOOL_CALLS] [{W}, {A}]": ("", [W_CALL, A_CALL]),
    f"[TOOL_CALLS][{A}]\nThat adds them.": ("That adds them.", [A_CALL]),
}

NOT_CALLS = [  # content, byte for byte
    'To call it, write {"name": "get_weather", "arguments": {}} in a fence.',
    '```json\n{"name": "get_time", "arguments": {}}\n```',  # not a declared tool
    '{"name": "get_w", "arguments": {}}',  # a prefix of a declared name
    '{"name": "get_weathers", "arguments": {}}',
    '```json\n{"name": "get_weather", "city": "Paris"}\n```',  # no arguments
    '{"name": "get_weather"}',
    '```json\n{"city": "Paris", "temperature": 21}\n```',  # JSON, no call
    '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # arguments first: not decidable at the head
    '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',  # arguments not an object
    '{"name": "get_weather", "arguments": 5}',
    '```python\nprint({"name": "get_weather", "arguments": {}})\n```',
    '```js\n{"name": "get_weather", "arguments": {}}\n```',  # "js" begins "json"
    "`get_weather` takes a city.",
    "\n\n  [1, 2, 3]",
    '[{"name": "Ada"}]',
    '```json\n{"name": "get_we',  # the output ends inside a head
    "``",
    "   ",
    "",
    "{" + " " * 600 + '"name": "add", "arguments": {}}',  # past the longest head held back
    '<tools>\n{"name": "get_time", "arguments": {}}\n</tools>',  # wrapped, but not a declared tool
    '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
    '<|python_tag|>print("hi")',
    "<tools> is where the tool list goes.",
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',  # tagged, undeclared
    "[TOOL_CALL",
    "<tools",
]

TAGGED = [
    TWO_CALLS,
    f"Let me check.\n{TWO_CALLS}\n\nDone.\n\nBye",
    "<tool_call>not json</tool_call> \n x",
    f"Let me check.\n<tools>\n{A}\n</tools>\nDone.",
    'See <tools>{"name": "get_time", "arguments": {}}</tools> ok <tools> and <tool_call> x',
]


def test_tags_after_content_read_as_qwens_own_and_name_declared_tools() -> None:
    content, calls, _ = parse([f"Let me check.\n<tools>\n{A}\n</tools>\nDone."], NAMES)
    assert content == "Let me check.\nDone." and calls == [A_CALL]
    # where no tool is declared, only Qwen2.5's own tag is a call
    text = f"Let me check.\n<tools>\n{A}\n</tools>"
    assert parse([text])[:2] == (text, [])
    # a tagged call of a tool the request did not declare is the text it was, tags included
    text = 'See <tools>{"name": "get_time", "arguments": {}}</tools> ok'
    assert parse([text], NAMES)[:2] == (text, [])
    assert parse(['<tool_call>{"name": "get_time"}</tool_call>'], NAMES)[1] == []
    assert parse(['<tool_call>{"name": "get_time"}</tool_call>'])[1] == [("get_time", "{}")]


def cuttings(text: str) -> list[list[str]]:
    """``text`` cut in two at every position, a character a piece, and in 50 random ways."""
    rng = random.Random(text)
    bounds = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for _ in range(50 if len(text) > 1 else 0):
        bounds.append(sorted(rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1)))))
    return [[text[a:b] for a, b in zip([0, *bs], [*bs, len(text)], strict=True)] for bs in bounds]


@pytest.mark.parametrize("text", list(PLAIN_CALLS))
def test_plain_json_calls_of_declared_tools_at_the_start_are_calls(text: str) -> None:
    assert parse([text], NAMES)[:2] == PLAIN_CALLS[text]
    if "<tool_call>" not in text:  # without declared tools, the same text is content
        assert parse([text])[:2] == (text, [])


@pytest.mark.parametrize("text", NOT_CALLS)
def test_anything_else_stays_content_byte_for_byte(text: str) -> None:
    assert parse([text], NAMES)[:2] == (text, [])


@pytest.mark.parametrize("text", [*PLAIN_CALLS, *NOT_CALLS, *TAGGED])
def test_streamed_equals_unstreamed_however_the_text_is_cut(text: str) -> None:
    for names in (NAMES, ()):
        whole = parse([text], names)[:2]
        for pieces in cuttings(text):
            assert parse(pieces, names)[:2] == whole, pieces


def test_text_is_held_only_while_it_may_still_open_a_call() -> None:
    p = ToolCallParser(NAMES)
    for piece in ("\n`", "``", "json", "\n{", '"name": "get_w'):
        assert p.feed(piece) == ("", [])
    assert p.feed("x") == ('\n```json\n{"name": "get_wx', [])  # no declared name begins so: out at once
    assert ToolCallParser(NAMES).feed("Sure") == ("Sure", [])
    assert ToolCallParser(NAMES).feed("```py") == ("```py", [])
    p = ToolCallParser(NAMES)
    _, first = p.feed('```json\n{"name": "add", "arguments": {"a": ')
    # the call opens and its arguments stream before its object closes
    assert [(d.index, d.name, d.arguments) for d in first] == [(0, "add", ""), (0, None, '{"a": ')]
    assert p.feed("1}}\n```") == ("", [ToolCallDelta(0, "1}")])
    assert p.flush() == ("", []) and p.calls == 1
    # the output's leading whitespace is not held as part of a head (nor rescanned)
    assert parse(["\n" * 5000, A], NAMES)[:2] == ("", [A_CALL])
    assert parse(["\n" * 5000, "Hi"], NAMES)[:2] == ("\n" * 5000 + "Hi", [])


def test_one_call_only_when_parallel_calls_are_off() -> None:
    assert parse([f"{W}\n{A}"], NAMES, parallel=False)[:2] == (A, [W_CALL])
    content, calls, _ = parse([f"```json\n[{W}, {A}]\n```"], NAMES, parallel=False)
    assert calls == [W_CALL] and content == f", {A}]\n```"
    # tagged calls too (tool_choice auto, where no grammar caps them): the second stays text
    for pieces in ([TWO_CALLS], list(TWO_CALLS)):
        content, calls, _ = parse(pieces, NAMES, parallel=False)
        assert [n for n, _ in calls] == ["add"] and content == TWO_CALLS[TWO_CALLS.index("<tool_call>", 1) :]


def test_whitespace_next_to_tagged_calls_does_not_depend_on_the_cuts() -> None:
    text = f"Let me check.\n{TWO_CALLS}\n\nDone.\n\nBye"
    assert parse([text])[0] == "Let me check.\nDone.\n\nBye"
    assert parse(list(text))[0] == "Let me check.\nDone.\n\nBye"  # was "Let me check.Done.Bye"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def scripted_app(text: str, step: int = 5, **settings: Any) -> Any:
    """An app whose fake engine writes ``text`` ``step`` tokens a step (the cache off by default)."""
    ids = token_ids(text)
    engine = ScriptedEngine([ids[i : i + step] for i in range(0, len(ids), step)])
    overrides = {"cache": {"enabled": False}} | settings
    return create_app(load_settings(overrides=overrides, env={}), engine=engine)  # type: ignore[arg-type]


WRAPPED = {  # how models wrap a call (issue 51), {} for the call's JSON
    "fence": "```json\n{}\n```",
    "tools": "<tools>\n{}\n</tools>",
    "mistral": "[TOOL_CALLS] [{}]",
    "llama": "<|python_tag|>{}",
}


@pytest.mark.parametrize("wrap", list(WRAPPED))
@pytest.mark.parametrize("name", ["get_weather", "get_time"])
async def test_a_wrapped_call_through_the_gateway_streamed_and_not(name: str, wrap: str) -> None:
    key = "parameters" if wrap == "llama" else "arguments"
    text = WRAPPED[wrap].format(f'{{"name": "{name}", "{key}": {{"city": "Paris"}}}}')
    app = scripted_app(f"{text}<END>", 3)
    body: dict[str, Any] = {"model": "fake", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "tools": [WEATHER], "stop": ["<END>"]}  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        raw = (await c.post("/v1/chat/completions", json={**body, "stream": True})).text
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
    names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    finish = chunks[-1]["choices"][0]["finish_reason"]
    if name == "get_weather":
        [call] = whole["message"]["tool_calls"]
        assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert (content, names, args, finish) == ("", ["get_weather"], '{"city": "Paris"}', "tool_calls")
    else:
        assert whole["message"]["content"] == text and whole["finish_reason"] == "stop"
        assert "tool_calls" not in whole["message"]
        assert (content, names, finish) == (text, [], "stop")


async def test_a_cached_answer_replays_its_tool_calls_under_new_ids() -> None:
    """The response cache kept only the text: a repeated tool-calling request came back with no
    tool_calls (finish_reason tool_calls and nothing to call), streamed or not."""
    ids = token_ids(f"{TWO_CALLS}<END>")
    engine = ScriptedEngine([ids[i : i + 5] for i in range(0, len(ids), 5)])
    app = create_app(load_settings(env={}), engine=engine)  # type: ignore[arg-type]
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    body: dict[str, Any] = {"model": "fake", "messages": [{"role": "user", "content": "Two calls?"}],
                            "tools": [add, WEATHER], "temperature": 0, "stop": ["<END>"]}  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        fresh = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        await app.state.gateway.cache.cache.drain()
        r = await c.post("/v1/chat/completions", json=body)
        raw = (await c.post("/v1/chat/completions", json={**body, "stream": True})).text
    assert r.headers["x-specgate-cache"].startswith("exact")
    cached = r.json()["choices"][0]
    assert len(engine.requests) == 1  # both answers came from the cache
    assert [tc["function"] for tc in cached["message"]["tool_calls"]] == [
        tc["function"] for tc in fresh["message"]["tool_calls"]
    ]
    assert len(fresh["message"]["tool_calls"]) == 2 and cached["finish_reason"] == "tool_calls"
    assert cached["message"]["content"] is None
    assert not {tc["id"] for tc in cached["message"]["tool_calls"]} & {
        tc["id"] for tc in fresh["message"]["tool_calls"]
    }
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    pieces = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    streamed = {}
    for tc in pieces:
        if "id" in tc:
            streamed[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
        streamed[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert list(streamed.values()) == [tc["function"] for tc in fresh["message"]["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("choice", "text", "content", "finish"),
    [
        ("required", CALL, None, "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, CALL, None, "tool_calls"),
        ("auto", CALL, None, "tool_calls"),
        ("auto", "It is sunny in Paris.", "", "stop"),
        ("auto", f"Let me look.{CALL}", "", "tool_calls"),
    ],
)
async def test_a_stream_of_calls_alone_opens_with_content_null(
    choice: Any, text: str, content: str | None, finish: str
) -> None:
    """An answer of tool calls alone streams its first delta (role assistant) with content null, as
    OpenAI's does (the SDK's stream helper then ends with content None), one with text with content
    "". Forced calls (tool_choice required or named) are known to be calls alone from the start;
    under auto the opening waits for the choice's first delta, and a call with text before it opens
    as text."""
    app = scripted_app(f"{text}<END>")
    body: dict[str, Any] = {"model": "fake", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "tools": [WEATHER], "tool_choice": choice, "stop": ["<END>"], "stream": True}  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        raw = (await c.post("/v1/chat/completions", json=body)).text
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    first = chunks[0]["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": content}
    assert sum("role" in ch["choices"][0]["delta"] for ch in chunks if ch["choices"]) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == finish


@pytest.mark.parametrize(
    "choice, text, content",
    [("required", CALL, None), ("auto", CALL, None), ("auto", "It is sunny.", "It is sunny.")],
)
async def test_logprobs_keep_a_streamed_answer_of_calls_alone_content_null(
    choice: str, text: str, content: str | None
) -> None:
    """With logprobs, a call's tokens still have their logprobs streamed, on chunks with no content
    key where the answer is calls alone: they went as {"content": ""}, so the SDK's stream helper
    ended with content "" where the whole answer's is null, and under auto the logprobs of the text
    held while it might open a call opened the choice as text."""
    app = scripted_app(f"{text}<END>")
    body: dict[str, Any] = {"model": "fake", "messages": [{"role": "user", "content": "Weather in Paris?"}],
                            "tools": [WEATHER], "tool_choice": choice, "stop": ["<END>"], "logprobs": True}  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]
        raw = (await c.post("/v1/chat/completions", json={**body, "stream": True})).text
    deltas = [
        ch["choices"][0] for ch in (json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {"))
    ]
    streamed = [d["delta"]["content"] for d in deltas if d["delta"].get("content") is not None]
    assert whole["message"]["content"] == content
    assert ("".join(streamed) if streamed else None) == content
    assert deltas[0]["delta"] == {"role": "assistant", "content": "" if content else None}
    entries = [e for d in deltas if d["logprobs"] for e in d["logprobs"]["content"]]
    assert [e["token"] for e in entries] == [e["token"] for e in whole["logprobs"]["content"]]


def test_a_function_whose_schema_has_no_type_is_still_called_with_an_object() -> None:
    """A ``parameters`` schema without ``type`` (``{"properties": ...}``) admits any JSON value: the
    tiny model wrote ``"arguments": [568]``, which is no call, and the markup came back as content
    under tool_choice required. Arguments are an object, as OpenAI's always are."""
    untyped = {
        "type": "function",
        "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}},
    }
    tok = byte_tokenizer()
    call = '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>'
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        spec = grammar_for(None, [untyped], choice, True)
        assert _accepts(spec, tok, call.format('{"a": 1}'))
        for value in ("[568]", "8772", '"x"', "null"):
            assert not _accepts(spec, tok, call.format(value)), (choice, value)


@pytest.mark.parametrize("kind", ["string", "array", ["string", "null"]])
async def test_a_function_whose_parameters_are_no_object_is_refused_as_openai_refuses_it(kind: Any) -> None:
    """OpenAI's 400 for a function whose parameters are not an object schema. It was served, and
    no call could come of it: the arguments a call must carry are an object."""
    engine = ScriptedEngine([token_ids("x<END>")])
    app = create_app(load_settings(overrides={"cache": {"enabled": False}}, env={}), engine=engine)  # type: ignore[arg-type]
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": kind}}}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
        client = openai.AsyncOpenAI(
            api_key="unused", base_url="http://test/v1", http_client=http, max_retries=0
        )
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "x"}], tools=[WEATHER, fn]
            )
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "tools[1].function.parameters"
    assert body["code"] == "invalid_function_parameters" and "'f'" in body["message"]
    assert engine.requests == []


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tail", ["\n```", "\n```\n", "```  \n"])
def test_a_fence_closing_an_unfenced_call_is_no_content(parallel: bool, tail: str) -> None:
    """Qwen2.5-Coder-1.5B, answering a tool result, wrote an unfenced call and then the fence that
    closes one, ``{call}\\n```\\n``: the call came back with content "```". A fence that opens
    something after it is still read as it was."""
    for pieces in cuttings(W + tail):
        assert parse(pieces, NAMES, parallel)[:2] == ("", [W_CALL]), pieces
    assert parse([f"{W}\n```py\nx\n```"], NAMES, parallel)[:2] == ("```py\nx\n```", [W_CALL])
    if parallel:
        assert parse([f"{W}\n```json\n{A}\n```"], NAMES)[:2] == ("", [W_CALL, A_CALL])


def test_calls_a_grammar_checks_are_read_only_in_its_tags() -> None:
    for text in (W, f"```json\n{W}\n```", f"<tools>\n{W}\n</tools>", f"[TOOL_CALLS] [{W}]"):
        assert parse([text], NAMES, loose=["add"])[:2] == (text, [])  # get_weather: strict, say
        assert parse([text.replace(W, A)], NAMES, loose=["add"])[1] == [A_CALL]
    assert parse([f"<tool_call>\n{W}\n</tool_call>"], NAMES, loose=[])[1] == [W_CALL]
    text = f"<tools>\n{W}\n</tools>\n<tools>\n{A}\n</tools>"
    whole = parse([text], NAMES, loose=["add"])[:2]
    assert whole == (f"<tools>\n{W}\n</tools>\n", [A_CALL])
    assert all(parse(pieces, NAMES, loose=["add"])[:2] == whole for pieces in cuttings(text))
    strict = {"type": "function", "function": {"name": "get_weather", "strict": True}}
    loose = {"type": "function", "function": {"name": "add"}}
    assert loose_calls([strict, loose], None) == ["add"]
    assert loose_calls([strict, loose], {"type": "text"}) == ["add"]
    assert loose_calls([loose], {"type": "json_object"}) == []  # the answer is JSON: only tags are calls


@pytest.mark.parametrize("strict", [False, True])
async def test_text_a_strict_functions_grammar_let_through_is_no_call(strict: bool) -> None:
    """tool_choice auto with a strict function: the grammar checks calls in its own ``<tool_call>``
    layout and lets other text through unchecked, so a plain-JSON call there (arguments against the
    schema) stays content; without strict there is no grammar and it is read as a call."""
    text = '{"name": "get_weather", "arguments": {"city": 5}}'
    tool = {"type": "function", "function": {**WEATHER["function"], "strict": strict}}
    app = scripted_app(f"{text}<END>", 3)
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
        "stop": ["<END>"],
    }
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        message = (await c.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    if strict:
        assert message["content"] == text and "tool_calls" not in message
    else:
        assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_weather"
