"""Tool calls and structured outputs on the gateway side (pure Python, no torch): the grammar a
request's ``response_format`` / ``tool_choice`` asks for, and the parser that turns a model's
``<tool_call>`` text (Qwen2.5's, the Hermes format) into OpenAI ``tool_calls`` deltas.

The parser streams: a call's first delta carries its index, id and name once the name is complete;
the ``arguments`` value then streams as fragments of the model's own text, so the fragments of one
call concatenate to exactly the non-streamed ``arguments`` however the text is cut into chunks (one
token or a whole verification step per chunk, a call boundary inside a chunk). vLLM PR 53638 is the
bug this avoids: a parser that re-serialises partial JSON per chunk emitted ``{...}}`` under
speculation.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from typing import Any

from decoding.params import JSON_LAYOUT, GrammarSpec
from gateway.backends import ToolCallDelta

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# `{"name": "<name>", "arguments": ` : the head of a call, name first (as the template and the
# grammar write it)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag`` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Feed output text in any cuts; get back (content text, call deltas) for each piece."""

    def __init__(self) -> None:
        self.state = "content"  # content | head | args | tail
        self.buf = ""  # text not yet decided on
        self.spaces = ""  # whitespace-only content held until something else shows (dropped around calls)
        self.calls = 0
        self.depth = 0  # arguments: JSON nesting depth
        self.in_string = False
        self.escaped = False
        self.started = False  # arguments: first non-space character seen

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            progressed = getattr(self, f"_{self.state}")(content, calls)
            if not progressed:
                return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: a call whose head never completed falls back to a whole-body parse."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self.state == "head":
            self._fallback(self.buf, content, calls)
        elif self.state == "content":
            self._content_text(self.buf, content)
            if self.calls == 0 and self.spaces:
                content.append(self.spaces)
        self.buf, self.spaces = "", ""
        return "".join(content), calls

    # ---- states: each consumes what it can from buf; True when it changed state --------------

    def _content_text(self, text: str, out: list[str]) -> None:
        if not text:
            return
        if text.strip():
            out.append(("" if self.calls else self.spaces) + text)
            self.spaces = ""
        else:
            self.spaces += text

    def _content(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        at = self.buf.find(OPEN)
        if at < 0:
            keep = _held(self.buf, OPEN)
            self._content_text(self.buf[: len(self.buf) - keep], content)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self._content_text(self.buf[:at], content)
        self.spaces = ""
        self.buf = self.buf[at + len(OPEN) :]
        self.state = "head"
        return True

    def _head(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        m = _HEAD.match(self.buf)
        close = self.buf.find(CLOSE)
        if m is not None and (close < 0 or m.end() <= close):
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                name = m.group(1)
            calls.append(ToolCallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", name))
            self.buf = self.buf[m.end() :]
            self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
            self.state = "args"
            return True
        if close >= 0:  # a call in another layout (arguments first, ...): parse it whole
            self._fallback(self.buf[:close], content, calls)
            self.buf = self.buf[close + len(CLOSE) :]
            self.state = "content"
            return True
        return False

    def _args(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        i, text = 0, self.buf
        done = False
        if not self.started:
            stripped = text.lstrip()
            i = len(text) - len(stripped)
            if not stripped:
                self.buf = ""
                return False
            self.started = True
        start = i
        while i < len(text):
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            if self.depth <= 0 and not self.in_string and ch in '}]"' and i > start:
                done = True  # the value closed (an object, an array, or a string)
                break
        if i > start:
            calls.append(ToolCallDelta(self.calls, text[start:i]))
        self.buf = text[i:]
        if done:
            self.calls += 1
            self.state = "tail"
            return True
        return False

    def _tail(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        close = self.buf.find(CLOSE)
        if close < 0:
            keep = max(_held(self.buf, CLOSE), 0)
            self.buf = self.buf[len(self.buf) - keep :] if keep else ""
            return False
        self.buf = self.buf[close + len(CLOSE) :]
        self.state = "content"
        return True

    def _fallback(self, body: str, content: list[str], calls: list[ToolCallDelta]) -> None:
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            args = call.get("arguments", {})
            calls.append(ToolCallDelta(self.calls, "", f"call_{uuid.uuid4().hex[:24]}", call["name"]))
            calls.append(ToolCallDelta(self.calls, args if isinstance(args, str) else json.dumps(args)))
            self.calls += 1
        else:  # not a call after all: the text goes out as it came
            content.append(self.spaces + OPEN + body)
            self.spaces = ""


# ---- grammars -----------------------------------------------------------------------------------


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark for one call (or several, one per line) in Qwen2.5's format, each call's JSON checked
    against its function's parameters."""
    schema: dict[str, Any] = (
        {"anyOf": [_call_schema(t) for t in tools]} if len(tools) > 1 else _call_schema(tools[0])
    )
    schema["x-guidance"] = JSON_LAYOUT
    more = ' ("\\n" call)*' if parallel else ""
    # the tags as literals of their own: the grammar compiler makes each one token where it is one
    return f'start: call{more}\ncall: "{OPEN}" "\\n" %json{json.dumps(schema)} "\\n" "{CLOSE}"\n'


def grammar_for(
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool,
) -> GrammarSpec | None:
    """The grammar a chat request's output must follow, or None (free text)."""
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if tools and choice != "none" and choice != "auto":
        if isinstance(choice, dict):
            tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        return GrammarSpec("lark", tool_grammar(tools, parallel), param="tools")
    fmt = (response_format or {}).get("type", "text")
    if fmt == "text":
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
