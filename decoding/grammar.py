"""Compiling output grammars with llguidance (no torch here; decoding/constraints.py applies them).

A ``GrammarSpec`` (a JSON schema, or an llguidance Lark grammar, which may embed schemas with
``%json{...}``) compiles against one model's tokenizer into an ``LLMatcher``: the per-request state
that yields the allowed tokens at each position. Why llguidance, and what it costs per token, is in
docs/architecture.md ("Structured outputs").

JSON is generated in the one layout Python's ``json.dumps`` writes (``", "`` between items, ``": "``
after keys, no other whitespace). A random-weight model under flexible whitespace can spend its
whole budget on newlines; a real model loses nothing (JSON's meaning ignores the layout), and the
grammar then forces more tokens, which speculation proposes for free. Qwen2.5's tool-call format
uses the same separators.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import llguidance
import llguidance.hf

from decoding.errors import InvalidParameter
from decoding.params import JSON_LAYOUT, GrammarSpec

_tokenizers: dict[int, llguidance.LLTokenizer] = {}
_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer, built once per tokenizer (about a second for a
    150K vocabulary). ``vocab_size`` is the model's logits width, which may exceed the tokenizer's;
    the masks cover it whole. The grammar's end allows any of the model's end-of-turn tokens."""
    key = id(tokenizer)
    with _lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
            )
        return _tokenizers[key]


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec``; raises ``InvalidParameter`` naming ``spec.param``."""
    param = spec.param
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as exc:
            raise InvalidParameter(f"The JSON schema is not valid JSON: {exc}", param) from exc
        if not isinstance(schema, dict):
            raise InvalidParameter("A JSON schema must be an object.", param)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
        except ValueError as exc:
            raise InvalidParameter(f"Invalid JSON schema: {exc}", param) from exc
    if spec.kind == "regex":  # a bad one is reported by the matcher, as a bad Lark grammar is
        return llguidance.LLMatcher.grammar_from_regex(ascii_classes(spec.text))
    return llguidance.LLMatcher.grammar_from_lark(spec.text)


_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """``regex`` with ``\\d`` and ``\\w`` (and ``\\D``, ``\\W`` outside brackets) as ASCII classes,
    as vLLM's guided_regex backends (xgrammar, outlines) and JSON Schema's patterns read them:
    llguidance's regex reads them as Unicode classes, so ``\\d{3}`` allowed Arabic-Indic digits. By
    hand, a scan of escapes and brackets: llguidance takes the pattern as text, and no parser of
    its dialect is at hand. A negated class inside brackets (``[^\\D]``) is left as written."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            cls = _ASCII_CLASSES.get(e.lower())
            if cls is not None and not in_class:
                out.append(f"[^{cls}]" if e.isupper() else f"[{cls}]")
            elif cls is not None and e.islower():
                out.append(cls)
            else:
                out.append(regex[i : i + 2])
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[" and not in_class:
            in_class = True
            for literal in "^]":  # '[^' negates; a ']' first in a class is itself
                if regex.startswith(literal, i):
                    out.append(literal)
                    i += 1
        elif c == "]" and in_class:
            in_class = False
    return "".join(out)


# a quoted tag in a Lark grammar, e.g. "<tool_call>"
_TAG = re.compile(r'"(</?[A-Za-z_][A-Za-z0-9_]*>)"')


def matcher(spec: GrammarSpec, tokenizer: llguidance.LLTokenizer, hf_tokenizer: Any = None) -> Any:
    """A fresh matcher at the grammar's start; raises ``InvalidParameter`` if it does not compile
    (llguidance reports schema features it cannot honour here, rather than ignoring them).

    A quoted tag in a Lark grammar that the tokenizer holds as one special token (Qwen2.5's
    ``<tool_call>``) becomes that token: llguidance matches special tokens only by name, and the
    model was trained to emit the token, not its spelling. Elsewhere (the tiny models' byte
    tokenizer) the tag stays text."""
    text = spec.text
    if spec.kind == "lark" and hf_tokenizer is not None:
        added = hf_tokenizer.get_added_vocab()
        text = _TAG.sub(lambda m: m.group(1) if m.group(1) in added else m.group(0), text)
        spec = GrammarSpec(spec.kind, text, spec.param)
    m = llguidance.LLMatcher(tokenizer, grammar_text(spec), log_level=0)
    if m.is_error():
        raise InvalidParameter(f"The grammar could not be compiled: {short_error(m.get_error())}", spec.param)
    return m


def short_error(error: str) -> str:
    """llguidance's error as one line: its first, and the regex parser's reason, which it prints on a
    later line under a caret drawing ("regex parse error: unclosed group"). The grammar excerpt it
    quotes is left out: the client has its grammar, and the log should not."""
    lines = error.strip().splitlines()
    if not lines:
        return "unknown error"
    reasons = [
        line.strip().removeprefix("error:").strip() for line in lines[1:] if line.strip().startswith("error:")
    ]
    return " ".join([lines[0], *reasons])[:300]
