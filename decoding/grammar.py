"""Compiling output grammars with llguidance (no torch here; decoding/constraints.py applies them).

A ``GrammarSpec`` (a JSON schema, or an llguidance Lark grammar, which may embed schemas with
``%json{...}``) compiles against one model's tokenizer into an ``LLMatcher``: the per-request state
that yields the allowed tokens at each position. Why llguidance, and what it costs per token, is in
docs/architecture.md ("Structured outputs").

Compiling is the one thing here a client can make arbitrarily expensive: llguidance recurses on the
native stack as deep as a grammar's rules chain (a 1,000-deep ``$defs`` chain overflowed the event
loop's 8 MB stack and killed the process), and a large schema takes seconds. So a grammar is compiled
once per request (its n choices copy one matcher), off the event loop and the engine's thread, on
a worker thread whose stack is large enough for any grammar llguidance's own size limits admit
(``GrammarCompiler``), within ``GrammarLimits``; a compile that fails or outlasts them is a 400
naming the parameter.

JSON is generated in the one layout Python's ``json.dumps`` writes (``", "`` between items, ``": "``
after keys, no other whitespace). A random-weight model under flexible whitespace can spend its
whole budget on newlines; a real model loses nothing (JSON's meaning ignores the layout), and the
grammar then forces more tokens, which speculation proposes for free. Qwen2.5's tool-call format
uses the same separators.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf

from decoding.errors import InvalidParameter
from decoding.params import JSON_LAYOUT, GrammarSpec

log = logging.getLogger("specgate.grammar")

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
    (llguidance reports schema features it cannot honour here, rather than ignoring them), or if it
    admits no output. Runs on the calling thread: ``GrammarCompiler`` is what calls it in serving.

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
    if spec.kind == "regex" and _regex_is_empty(spec.text):
        raise InvalidParameter("The regex matches no string: no output can satisfy it.", spec.param)
    reason = dead_end(m, tokenizer)
    if reason is not None:
        raise InvalidParameter(reason, spec.param)
    return m


def _regex_is_empty(regex: str) -> bool:
    """llguidance proves a JSON schema's ``pattern`` empty when it compiles one, which it does not do
    for a bare regex grammar. A string's JSON escaping is one-to-one, so the pattern's language is
    empty exactly when the regex's is."""
    schema = {"type": "string", "pattern": f"^(?:{ascii_classes(regex)})$"}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)  # type: ignore[arg-type]
    except ValueError:
        return False
    return "Regex is empty" in llguidance.LLMatcher.validate_grammar(grammar)


# dead_end's search: at most this many grammar states, none with more choices than this
_SEARCH_STATES = 32
_SEARCH_FANOUT = 4


def dead_end(prototype: Any, tokenizer: llguidance.LLTokenizer) -> str | None:
    """Why no output can satisfy the grammar at ``prototype``'s state, or None where some can, or
    where this cannot tell. An exhaustive search of the few states a nearly-forced grammar has
    (``a[^\\s\\S]``, ``start: "x" y``...): every path dead-ends (only an end-of-turn token allowed,
    the grammar not accepting: llguidance then allows the end token alone), or llguidance's parser
    hits a limit of its own within a few tokens (a schema with hundreds of optional properties), which
    would otherwise end the request mid-output. Past its budget, or where a state offers many tokens,
    the grammar is taken to admit output: llguidance does not prove a Lark grammar's language empty,
    and a dead end met during generation ends the request with a 400 (``Shaping.commit``)."""
    m = prototype.deep_copy()  # a parser error is for good: never on the matcher requests copy
    eos = tokenizer.eos_token
    budget = [_SEARCH_STATES]

    def dead() -> bool | None:  # None: cannot tell within the budget
        budget[0] -= 1
        if budget[0] < 0:
            return None
        if m.is_stopped() or m.is_accepting():
            return False
        allowed = [t for t in allowed_tokens(m) if t != eos]
        if len(allowed) > _SEARCH_FANOUT:
            return None
        for t in allowed:
            m.consume_token(t)
            if m.is_error():
                raise _ParserLimit(short_error(m.get_error()))
            try:
                found = dead()
            finally:
                m.rollback(1)
            if found is not True:
                return found
        return True

    try:
        return "The grammar admits no output: no sequence of tokens satisfies it." if dead() else None
    except _ParserLimit as exc:
        return f"The grammar cannot be generated: {exc}"


class _ParserLimit(Exception):
    pass


def allowed_tokens(m: Any) -> list[int]:
    """The token ids ``m`` allows next (from its packed bitmask)."""
    mask = int.from_bytes(m.compute_bitmask(), "little")
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
        if len(out) > _SEARCH_FANOUT + 1:  # the caller only needs to know there are many
            break
    return out


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


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (limits.max_grammar_bytes, limits.grammar_timeout_s)."""

    max_bytes: int = 256 * 1024  # the grammar or schema as sent; a larger one is a 400 before any work
    max_depth: int = 64  # nesting of a JSON schema document (objects and arrays within each other)
    timeout_s: float = 10.0  # waiting for a compile; past it a 400 (the compile ends on its own)


def check_size(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """The grammar's size within the limits, or ``InvalidParameter``: checked where the request
    arrives (one C-speed pass over its text)."""
    size = len(spec.text.encode("utf-8"))
    if size > limits.max_bytes:
        raise InvalidParameter(
            f"The grammar is {size} bytes; the most this server compiles is {limits.max_bytes} "
            "(limits.max_grammar_bytes).",
            spec.param,
        )


def check_depth(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """A JSON schema's nesting within the limits, or ``InvalidParameter``: checked on the compile
    thread, as its scan is Python's (~20 ms for the largest grammar allowed)."""
    if spec.kind == "json_schema":  # parsed by Python's recursive parser (Lark's %json on the deep stack)
        depth = json_depth(spec.text)
        if depth > limits.max_depth:
            raise InvalidParameter(
                f"The JSON schema nests {depth} levels deep; the most this server compiles is "
                f"{limits.max_depth}.",
                spec.param,
            )


def json_depth(text: str) -> int:
    """The deepest nesting of brackets and braces outside strings in ``text`` (a JSON document, or a
    Lark grammar's embedded ones), by a scan rather than a parse: Python's parser recurses, and a
    deep enough document is what this guards against."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
    return deepest


class CompiledGrammar:
    """A grammar compiled for one model: each request's matcher is a copy of its start state."""

    def __init__(self, spec: GrammarSpec, prototype: Any):
        self.spec = spec
        self._prototype = prototype

    def matcher(self) -> Any:
        return self._prototype.deep_copy()


# The compile thread's stack. llguidance recurses once per level of a grammar's rule chain, a few KB
# a level: 8 MB overflowed at 1,000 chained $defs and at 4,000 chained Lark rules. Grammars too big
# for its symbol table (~65,000 symbols) are refused before they get that deep, and 512 MB covers
# that depth with room to spare. It is address space: pages are touched only as deep as one recursion
# goes.
COMPILE_STACK_BYTES = 512 * 1024 * 1024
_FALLBACK_STACK_BYTES = 64 * 1024 * 1024  # where the system refuses the above (a strict overcommit)


class _CompileThreads:
    """The process's compile threads, started on first use and shared by every ``GrammarCompiler``
    (an engine has one; tests build hundreds), with the deep stack above."""

    def __init__(self, n: int):
        self.n = n
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            while len(self._threads) < self.n:
                self._threads.append(self._start(len(self._threads)))
        self._jobs.put(job)

    def _start(self, i: int) -> threading.Thread:
        for size in (COMPILE_STACK_BYTES, _FALLBACK_STACK_BYTES, 0):
            try:  # threading.stack_size is process-wide: set for this thread's start alone
                threading.stack_size(size)
                t = threading.Thread(target=self._work, name=f"specgate-grammar-{i}", daemon=True)
                t.start()
                return t
            except (RuntimeError, ValueError, MemoryError):
                log.warning("could not start a grammar thread with a %d-byte stack", size)
            finally:
                threading.stack_size(0)
        raise RuntimeError("could not start a grammar compile thread")

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a job settles its own future; this thread must outlive any fault
                log.exception("a grammar compile job failed")
            del job  # not kept alive (with the tokenizer its closure holds) until the next one


_THREADS = _CompileThreads(2)


class GrammarCompiler:
    """Compiles grammars on the process's compile threads, whose stack is deep (llguidance drops the
    GIL while it compiles, so streams keep their pace meanwhile). Identical grammars for one model
    are compiled once: concurrent requests share the compile in flight, later ones the last
    ``cache_size`` results (an agent sends the same tools every turn)."""

    def __init__(self, limits: GrammarLimits | None = None, cache_size: int = 64):
        self.limits = limits or GrammarLimits()
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._done: collections.OrderedDict[tuple[str, GrammarSpec], CompiledGrammar] = (
            collections.OrderedDict()
        )
        self._running: dict[tuple[str, GrammarSpec], concurrent.futures.Future[CompiledGrammar]] = {}

    def compile(
        self, key: str, spec: GrammarSpec, build: Callable[[GrammarSpec], Any]
    ) -> concurrent.futures.Future[CompiledGrammar]:
        """The compiled grammar for ``spec`` under ``key`` (the model), as a future: ``build`` makes
        the matcher (``matcher`` with the model's tokenizer). The size limit is checked here, at once;
        the depth limit on the compile thread, before the compile."""
        check_size(spec, self.limits)
        k = (key, spec)
        with self._lock:
            done = self._done.get(k)
            if done is not None:
                self._done.move_to_end(k)
                future: concurrent.futures.Future[CompiledGrammar] = concurrent.futures.Future()
                future.set_result(done)
                return future
            running = self._running.get(k)
            if running is not None:
                return running
            future = self._running[k] = concurrent.futures.Future()

        def job() -> None:
            try:
                check_depth(spec, self.limits)
                compiled = CompiledGrammar(spec, build(spec))
            except BaseException as exc:
                with self._lock:
                    self._running.pop(k, None)
                future.set_exception(exc)
                return
            with self._lock:
                self._running.pop(k, None)
                self._done[k] = compiled
                while len(self._done) > self.cache_size:
                    self._done.popitem(last=False)
            future.set_result(compiled)

        _THREADS.submit(job)
        return future

    def wait(self, spec: GrammarSpec, future: concurrent.futures.Future[CompiledGrammar]) -> CompiledGrammar:
        """``future``'s grammar, waited for on this thread within the limits."""
        try:
            return future.result(self.limits.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self.timed_out(spec) from None

    def timed_out(self, spec: GrammarSpec) -> InvalidParameter:
        return InvalidParameter(
            f"The grammar did not compile within {self.limits.timeout_s:g}s (limits.grammar_timeout_s).",
            spec.param,
        )
