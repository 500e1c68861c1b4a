"""Tool calls on the gateway side (pure Python, no torch): the parser that turns a model's
``<tool_call>`` text (Qwen2.5's, the Hermes format) into OpenAI ``tool_calls`` deltas (the grammar a
request asks for is ``gateway.grammars``).

Two families of layout, each one table: tags around one call anywhere in the text (``TAGS``:
``<tool_call>``, ``<tools>``), and plain JSON calls of declared tools where they open the output,
bare or in a wrapper (``WRAPPERS``: a ``` fence, ``<tools>``, Llama 3.x's ``<|python_tag|>``,
Mistral's ``[TOOL_CALLS]``), one object, several, or a list; ``"parameters"`` counts as
``"arguments"``. Small models (Qwen2.5-Coder-1.5B) often answer so instead of with the tags. A call
names a declared tool (where none is declared, only ``<tool_call>`` text is a call), outside
``<tool_call>`` one no grammar checks (``ToolCallParser``'s ``loose``). Anything else is
content, byte for byte: text is held only while it may still become such a call's head and goes out
as soon as it cannot.

The parser streams: a call's first delta carries its index, id and name once the name is complete;
the ``arguments`` value then streams as fragments of the model's own text, so the fragments of one
call concatenate to exactly the non-streamed ``arguments`` however the text is cut into chunks (one
token or a whole verification step per chunk, a call boundary inside a chunk). vLLM PR 53638 is the
bug this avoids: a parser that re-serialises partial JSON per chunk emitted ``{...}}`` under
speculation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import NamedTuple

from gateway.backends import ToolCallDelta, new_call_id

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Tags around one call, anywhere in the text: Qwen2.5's (Hermes') own, and <tools>, which Qwen2.5
# also writes around a call (seen in a LangChain tool loop, issue 51). Only the first counts where
# no tool is declared; the others' calls must name a tool ToolCallParser reads loosely.
TAGS = {OPEN: CLOSE, "<tools>": "</tools>"}
# Wrappers around plain-JSON calls where they open the output, opener -> closer ("": none): a ```
# fence (a language may follow it), <tools>, Llama 3.x's <|python_tag|> and Mistral's [TOOL_CALLS]
# (special tokens, in the text where the detokenizer keeps them; a list of calls may follow).
WRAPPERS = {"```": "```", "<tools>": "</tools>", "<|python_tag|>": "", "[TOOL_CALLS]": ""}
# `{"name": "<name>", "arguments": ` : the head of a call, name first (as the template and the
# grammar write it)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
MORE, NO = -1, -2  # text so far that may still become a plain-JSON call's head / that cannot
# the longest plain-JSON head held back (after the output's leading whitespace; a pretty-printed one
# with a 64-character name is under 200): past it, content. It bounds the rescans of a held head.
HEAD_MAX = 512
_WS = " \t\r\n"  # JSON's whitespace


class BareHead(NamedTuple):
    """A plain-JSON call's complete head: its arguments start at ``at`` (their ``{``)."""

    at: int
    name: str
    closer: str  # what closes the wrapper opened before the call ("": none opened, or it has none)
    listed: bool  # a [ list opened before the call


def _held(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag`` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _lit(text: str, i: int, *lits: str) -> int:
    """The index past whichever of ``lits`` stands at ``text[i:]``; MORE if text ends inside one."""
    for lit in lits:
        if text.startswith(lit, i):
            return i + len(lit)
    return MORE if any(lit.startswith(text[i:]) for lit in lits) else NO


def _opener(text: str, i: int) -> str | int:
    """The wrapper (``WRAPPERS``) opening at ``text[i:]``, MORE if text ends inside one, else NO."""
    for opener in WRAPPERS:
        if text.startswith(opener, i):
            return opener
    return MORE if any(o.startswith(text[i:]) for o in WRAPPERS) else NO


def bare_head(text: str, names: Collection[str], wrapped: bool, listed: bool) -> BareHead | int:
    """The head of a call written as plain JSON at the start of ``text``: a BareHead, MORE or NO.

    ``[wrapper] [[] {"name": "<declared>", "arguments": {`` with whitespace between (in a list
    already open ``, {...``; in a wrapper already open, no new one). The arguments stream from the
    head on, so the head alone decides: the name first and declared, the arguments an object (as
    OpenAI's always are). ``"parameters"`` counts as ``"arguments"``, as in vLLM's llama3_json
    parser (Llama 3.1 writes it): one more alternative here, and safe after a declared name.
    Hand-written: every prefix must be judged, and Python's ``re`` has no partial matching (the
    ``regex`` module's ``partial=True`` would be a new dependency for a dozen tokens).
    """
    i = _ws(text, 0)
    closer, opened_list = "", False
    if listed:
        i = _lit(text, i, ",")
        if i < 0:
            return i
    elif not wrapped and i < len(text):
        opener = _opener(text, i)
        if opener == MORE:
            return MORE
        if isinstance(opener, str):
            i, closer = i + len(opener), WRAPPERS[opener]
        if opener == "```":
            j = i
            while j < len(text) and text[j].isalnum():
                j += 1
            lang = text[i:j].lower()
            if j == len(text):
                return MORE if "json".startswith(lang) else NO
            if lang not in ("", "json"):
                return NO
            i = j
    i = _ws(text, i)
    if not listed and text.startswith("[", i):
        i, opened_list = i + 1, True
    for lit in ("{", '"name"', ":", '"'):
        i = _lit(text, _ws(text, i), lit)
        if i < 0:
            return i
    end = text.find('"', i)
    if end < 0:  # names are [a-zA-Z0-9_-]{1,64} (OpenAI's rule): no escapes to decode
        return MORE if any(n.startswith(text[i:]) for n in names) else NO
    name = text[i:end]
    if name not in names:
        return NO
    i = end + 1
    for lits in ((",",), ('"arguments"', '"parameters"'), (":",)):
        i = _lit(text, _ws(text, i), *lits)
        if i < 0:
            return i
    i = _ws(text, i)
    if i == len(text):
        return MORE
    return BareHead(i, name, closer, opened_list) if text[i] == "{" else NO


def _arguments(value: object) -> str | None:
    """A whole-parsed call's ``arguments`` as OpenAI's always are, the JSON text of an object; None
    where the model's value is no object (the call is then no call). Missing or null: ``{}``. A
    string holding an object's JSON (a model that encoded the arguments twice): that JSON, not a
    JSON string, which a client's ``json.loads(arguments)`` would hand on as a str."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


class ToolCallParser:
    """Feed output text in any cuts; get back (content text, call deltas) for each piece.

    ``names``: the request's declared tools, without which only ``<tool_call>`` text is a call;
    ``parallel``: whether the output may hold more calls than the first (False: the request's
    ``parallel_tool_calls`` is false, and text after the first call is content, tagged or not);
    ``loose``: the tools whose calls are read in the other layouts too (default: all of ``names``).
    A grammar checks calls only in its own ``<tool_call>`` layout (``gateway.grammars``), so a strict
    function's call elsewhere, or an answer in a response_format's JSON, would skip its checks.
    """

    def __init__(
        self, names: Collection[str] = (), parallel: bool = True, loose: Collection[str] | None = None
    ) -> None:
        self.names = frozenset(names)
        self.loose = self.names if loose is None else frozenset(loose) & self.names
        self.parallel = parallel
        # lead (a plain-JSON call may still open the output, or follow one) | content | head | args
        # | tail (a tagged call's end) | after (a plain-JSON call's end)
        self.state = "lead" if self.loose else "content"
        self.buf = ""  # text not yet decided on
        self.spaces = ""  # whitespace the output opens with: kept before content, dropped before a call
        self.spoken = False  # content other than whitespace since the last call (or the start)
        self.calls = 0
        self.bare = False  # the call in progress is plain JSON: it ends with its object, not a tag
        self.closer = ""  # plain-JSON calls: what closes the wrapper they are in ("": none)
        self.tags = TAGS if self.loose else {OPEN: CLOSE}
        self.open, self.close = OPEN, CLOSE  # the tags of the tagged call in progress
        self.listed = False  # plain-JSON calls: inside a [ list
        self.depth = 0  # arguments: JSON nesting depth
        self.in_string = False
        self.escaped = False
        self.started = False  # arguments: first non-space character seen

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        self._run(content, calls)
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: a plain-JSON head that never completed is content; a tagged call whose
        head never completed falls back to a whole-body parse, and where that finds no call and the
        body is the start of a JSON object, it was a call cut short (max_tokens, a stop string),
        which goes nowhere: OpenAI never puts a call's markup in content."""
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self.state == "lead":
            self.state = "content"
            self._run(content, calls)
        if self.state == "head":
            self._fallback(self.buf, content, calls, cut=self.buf.lstrip(_WS).startswith("{"))
        elif self.state == "content":
            self._content_text(self.buf, content)
            content.append(self.spaces)
        self.buf, self.spaces = "", ""
        return "".join(content), calls

    def _run(self, content: list[str], calls: list[ToolCallDelta]) -> None:
        while getattr(self, f"_{self.state}")(content, calls):
            pass

    # ---- states: each consumes what it can from buf; True when it changed state --------------

    def _content_text(self, text: str, out: list[str]) -> None:
        """Content as it came, but for whitespace next to calls: after a call it is dropped, and
        what the output opens with waits to see content (kept) or a call (dropped). Decided per
        character, so the same however the text is cut."""
        if not self.spoken:
            stripped = text.lstrip()
            if not self.calls:
                self.spaces += text[: len(text) - len(stripped)]
            if not stripped:
                return
            text, self.spaces, self.spoken = self.spaces + stripped, "", True
        if text:
            out.append(text)

    def _lead(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        stripped = self.buf.lstrip(_WS)  # whitespace next to calls: as _content_text treats it
        if not self.calls:
            self.spaces += self.buf[: len(self.buf) - len(stripped)]
        self.buf = stripped
        head = bare_head(self.buf[:HEAD_MAX], self.loose, bool(self.closer), self.listed)
        if head == MORE and len(self.buf) < HEAD_MAX:
            return False
        if not isinstance(head, BareHead):  # not a call: the text held goes out as it came
            self.state = "content"
            return True
        self.closer, self.listed = self.closer or head.closer, self.listed or head.listed
        self.buf = self.buf[head.at :]
        self._open(head.name, calls, bare=True)
        return True

    def _content(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        if self.calls and not self.parallel:  # parallel_tool_calls false: one call, then only text
            self._content_text(self.buf, content)
            self.buf = ""
            return False
        found = [(at, tag) for tag in self.tags if (at := self.buf.find(tag)) >= 0]
        if not found:
            keep = max(_held(self.buf, tag) for tag in self.tags)
            self._content_text(self.buf[: len(self.buf) - keep], content)
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        at, tag = min(found)
        self._content_text(self.buf[:at], content)
        self.spaces = ""
        self.buf = self.buf[at + len(tag) :]
        self.open, self.close = tag, self.tags[tag]
        self.state = "head"
        return True

    def _head(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        stripped = self.buf.lstrip(_WS)
        if stripped and stripped[0] != "{":  # no object follows the tag: no call, none to wait for
            self._content_text(self.open + self.buf[: len(self.buf) - len(stripped)], content)
            self.buf, self.state = stripped, "content"
            return True
        m = _HEAD.match(self.buf)
        close = self.buf.find(self.close)
        if m is not None and (close < 0 or m.end() <= close):
            # the arguments stream from here only as an object of a declared tool; anything else (a
            # string holding the object's JSON, null, a number, another name) is judged whole at
            # the close (_fallback)
            value = self.buf[m.end() :].lstrip(_WS)
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                name = m.group(1)
            if value.startswith("{") and self._declared(name):
                self.buf = self.buf[m.end() :]
                self._open(name, calls, bare=False)
                return True
            if not value or close < 0:
                return False
        if close >= 0:  # a call in another layout (arguments first, ...): parse it whole
            self._fallback(self.buf[:close], content, calls, closed=True)
            self.buf = self.buf[close + len(self.close) :]
            self.state = "content"
            return True
        return False

    def _declared(self, name: str) -> bool:
        """Whether the tagged call in progress, of ``name``, is one: in ``<tool_call>``, any name
        where no tool is declared, else a declared one (issue 51: nothing naming no declared tool
        becomes a call); in the other tags, a ``loose`` one."""
        if self.open != OPEN:
            return name in self.loose
        return not self.names or name in self.names

    def _open(self, name: str, calls: list[ToolCallDelta], bare: bool) -> None:
        calls.append(ToolCallDelta(self.calls, "", new_call_id(), name))
        self.spaces = ""
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False
        self.bare = bare
        self.state = "args"

    def _args(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        start, text = 0, self.buf
        if not self.started:
            stripped = text.lstrip()
            start = len(text) - len(stripped)
            if not stripped:
                self.buf = ""
                return False
            self.started = True
        end = self._walk(text, start)
        stop = len(text) if end < 0 else end
        if stop > start:
            calls.append(ToolCallDelta(self.calls, text[start:stop]))
        self.buf = text[stop:]
        if end < 0:
            return False
        self.calls += 1
        self.spoken = False
        self.depth, self.state = (1, "after") if self.bare else (0, "tail")  # after: still in its object
        return True

    def _walk(self, text: str, i: int) -> int:
        """Scan JSON from ``text[i]`` on (the scan's state kept across pieces): the index just past
        the character that closes the value (from depth 1: the object the scan is in), -1 if
        ``text`` ends first."""
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
            if self.depth <= 0 and not self.in_string and ch in '}]"':
                return i  # the value closed (an object, an array, or a string)
        return -1

    def _tail(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        close = self.buf.find(self.close)
        if close < 0:
            keep = max(_held(self.buf, self.close), 0)
            self.buf = self.buf[len(self.buf) - keep :] if keep else ""
            return False
        self.buf = self.buf[close + len(self.close) :]
        self.state = "content"
        return True

    def _after(self, content: list[str], calls: list[ToolCallDelta]) -> bool:
        """A plain-JSON call's end: the rest of its object (keys after the arguments are dropped),
        the ``]`` and the wrapper's closer that close it; then another call (if parallel calls are
        allowed and the text may be one) or content."""
        if self.depth > 0:
            end = self._walk(self.buf, 0)
            self.buf = "" if end < 0 else self.buf[end:]
            if end < 0:
                return False
        while True:
            self.buf = self.buf.lstrip(_WS)
            if self.listed and self.buf.startswith("]"):
                self.buf, self.listed = self.buf[1:], False
            elif not self.listed and self.closer and self.buf.startswith(self.closer):
                self.buf, self.closer = self.buf[len(self.closer) :], ""
            elif not self.buf or (not self.listed and self.closer and self.closer.startswith(self.buf)):
                return False
            else:
                break
        if (
            not self.closer
            and not self.listed
            and "```".startswith(self.buf[:3])
            and not self.buf[3:].strip(_WS)
        ):
            # a fence closing a call it never opened (Qwen2.5-Coder-1.5B wrote ``{call}\n```\n``
            # answering a tool result): held while nothing else follows it, and dropped at the end
            return False
        # may the text be another call: a list's next item, a fence's next object, anything after
        another = self.buf[0] == "," if self.listed else not self.closer or self.buf[0] in "{["
        self.state = "lead" if another and self.parallel else "content"
        return True

    def _fallback(
        self,
        body: str,
        content: list[str],
        calls: list[ToolCallDelta],
        cut: bool = False,
        closed: bool = False,
    ) -> None:
        """A tagged call's whole ``body`` (``closed``: its closing tag followed it) as a call, or
        where it is none, as the text it came as, tags included; ``cut``: see ``flush``."""
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        args = None
        if isinstance(call, dict) and isinstance(call.get("name"), str) and self._declared(call["name"]):
            args = _arguments(call.get("arguments", call.get("parameters")))
        if args is not None:
            calls.append(ToolCallDelta(self.calls, "", new_call_id(), call["name"]))
            calls.append(ToolCallDelta(self.calls, args))
            self.calls += 1
            self.spoken = False
        elif not cut:  # not a call after all: the text goes out as it came
            self._content_text(self.open + body + (self.close if closed else ""), content)
