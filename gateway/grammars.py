"""What a chat request asks of the model's output, on the gateway side (pure Python, no torch): the
grammar its ``response_format`` / ``tool_choice`` asks for (Qwen2.5's ``<tool_call>`` format for
calls, each call's JSON checked against its function's parameters), and its messages as chat
templates take them. ``gateway.tools`` parses what comes back.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from decoding.params import JSON_LAYOUT, GrammarSpec
from gateway.tools import CLOSE, OPEN


def _call_schema(tool: dict[str, Any], strict_only: bool = False, at: str = "") -> dict[str, Any]:
    """A call of ``tool`` as JSON, the call schema lying at JSON pointer ``at`` in the grammar's;
    ``strict_only``: its arguments any object unless the function is ``strict``."""
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    if strict_only and not fn.get("strict"):
        params = {"type": "object"}
    elif "type" not in params:  # {"properties": ...} alone admits any value; arguments are an object
        params = {**params, "type": "object"}
    params = _rebase_refs(params, f"{at}/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _rebase_refs(schema: Any, at: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/$defs/X``, as pydantic writes them) pointing into it
    where it now lies, at JSON pointer ``at`` of the call schema: they named the parameters' root,
    which inside a call is the call's, and such a tool was refused as a pointer that does not exist."""
    if isinstance(schema, dict):
        return {
            k: f"#{at}{v[1:]}"
            if k == "$ref" and isinstance(v, str) and v.startswith("#")
            else _rebase_refs(v, at)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_rebase_refs(v, at) for v in schema]
    return schema


def tool_grammar(tools: list[dict[str, Any]], parallel: bool, text: bool = False) -> str:
    """Lark for one call (or several, one per line) in Qwen2.5's format, each call's JSON checked
    against its function's parameters. Several calls may end on the newline after the last one:
    Qwen2.5 writes one after ``</tool_call>`` before it ends its turn, and a newline that commits
    to another call drove a small model through calls until max_tokens cut one in half.

    ``text``: tool_choice auto with ``strict`` functions. The answer is free text, or calls after
    text or none, and only a strict function's arguments are checked (as OpenAI's Structured
    Outputs for function calling; a function without it takes any object, so its schema need not
    compile). Text never holds the tag: where the tokenizer has ``<tool_call>`` as a token of its own
    (Qwen2.5's), text may come before a call and ends at that token; where it spells the tag (the
    tiny test models' byte tokenizer), a call must come first, as the text lexeme does not give way
    to the tag mid-text."""
    schema: dict[str, Any] = (
        {"anyOf": [_call_schema(t, text, f"/anyOf/{i}") for i, t in enumerate(tools)]}
        if len(tools) > 1
        else _call_schema(tools[0], text)
    )
    schema["x-guidance"] = JSON_LAYOUT
    more = ' ("\\n" call)* "\\n"?' if parallel else ""
    start = (
        f"start: TEXT | TEXT? call{more}\nTEXT: /(?s:.+)/ & ~/(?s:.*{OPEN}.*)/\n"
        if text
        else f"start: call{more}\n"
    )
    # the tags as literals of their own: the grammar compiler makes each one token where it is one
    return f'{start}call: "{OPEN}" "\\n" %json{json.dumps(schema)} "\\n" "{CLOSE}"\n'


def grammar_for(
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool,
) -> GrammarSpec | None:
    """The grammar a chat request's output must follow, or None (free text)."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if tools and choice != "none" and choice != "auto":
        if isinstance(choice, dict):  # a named function: exactly one call of it, as OpenAI documents
            tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
            parallel = False  # (a small model otherwise repeats the call until max_tokens cuts it)
        return GrammarSpec("lark", tool_grammar(tools, parallel), param="tools")
    fmt = (response_format or {}).get("type", "text")
    if fmt == "text":
        if tools and choice == "auto" and any(t["function"].get("strict") for t in tools):
            return GrammarSpec("lark", tool_grammar(tools, parallel, text=True), param="tools")
        return None
    if fmt == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    else:
        spec = response_format.get("json_schema") or {} if response_format else {}
        schema = spec.get("schema") or {"type": "object"}
    if tools and choice == "auto":  # a call, or the answer in the format asked for
        answer = f"%json{json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
        return GrammarSpec("lark", tool_grammar(tools, parallel).replace("start: ", f"start: {answer} | ", 1))
    return GrammarSpec("json_schema", json.dumps(schema))


def loose_calls(tools: list[dict[str, Any]] | None, response_format: dict[str, Any] | None) -> list[str]:
    """The tools whose calls ``gateway.tools`` also reads outside ``<tool_call>`` (bare JSON, a fence,
    ``<tools>``, ...): those no grammar checks, the functions without ``strict``; none where the
    answer is response_format JSON, which such a call's layout would be read out of."""
    if (response_format or {}).get("type", "text") != "text":
        return []
    return [t["function"]["name"] for t in tools or [] if not t["function"].get("strict")]


def guided_kind(name: str, value: Any) -> tuple[str, Any, str]:
    """One guided field as (kind, its value, the parameter errors name): ``guided_regex`` is
    ("regex", value, "guided_regex"); ``structured_outputs`` holds one kind, set (not null or false),
    named ``structured_outputs.<kind>`` (jobs._guided has checked that it holds exactly one)."""
    if name != "structured_outputs":
        return name.removeprefix("guided_"), value, name
    ((key, inner),) = ((k, v) for k, v in value.items() if v is not None and v is not False)
    return key, inner, f"{name}.{key}"


def guided_grammar(guided: dict[str, Any]) -> GrammarSpec:
    """The grammar of vLLM's guided decoding (``Job.guided``, its types checked by jobs._guided):
    guided_json a JSON schema, guided_regex the whole output, guided_choice one of the strings,
    guided_grammar a Lark grammar (llguidance's dialect, as vLLM's guidance backend takes it), or
    structured_outputs holding one of them."""
    ((name, sent),) = guided.items()
    key, value, param = guided_kind(name, sent)
    if key == "json":
        return GrammarSpec("json_schema", value if isinstance(value, str) else json.dumps(value), param)
    if key == "json_object":
        return GrammarSpec("json_schema", '{"type": "object"}', param)
    if key == "regex":
        return GrammarSpec("regex", value, param)
    if key == "choice":  # Lark strings take JSON's escapes
        # one terminal, compiled by the lexer: as a rule's alternatives each choice was a parser item,
        # and past 2000 of them llguidance's parser failed at the first token (a 500)
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return GrammarSpec("lark", f"start: CHOICE\nCHOICE: {alts}", param)
    return GrammarSpec("lark", value, param)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates expect them: content "" for none, tool-call arguments as
    objects (templates write them with ``tojson``)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c["function"])
                with contextlib.suppress(TypeError, ValueError):
                    fn["arguments"] = json.loads(fn["arguments"])
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out
