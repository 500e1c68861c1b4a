"""Request features and the complexity score, in well under a millisecond.

Cheap on purpose: word sets, phrase searches and two compiled regexes, and cue scanning looks at a bounded window of the last user
message (its head and tail, where instructions live), so a 100 kB pasted file costs the same as a
short prompt. Lengths are counted over the whole conversation.

The score is a clipped weighted sum in [0, 1]; every term that contributes is named in `reasons`,
which the router puts in logs and `x-specgate-route` consumers can explain.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SCAN_CHARS = 1024  # head and tail of the last user message that cue regexes see

# Cues are matched on words and phrases rather than with one big alternation regex per category:
# a set lookup per word and a substring search per phrase cost a fraction of what backtracking over
# dozens of alternatives at every character does (the routing overhead: docs/benchmarks.md, Router).
_WORDS = re.compile(r"[a-z_][a-z0-9_]*")
_ARITH = re.compile(r"\d\s*[-+*/^=]\s*\d")

CODE_WORDS = frozenset(
    [
        "def",
        "class",
        "import",
        "return",
        "function",
        "const",
        "let",
        "var",
        "struct",
        "impl",
        "fn",
        "void",
        "public",
        "async",
        "await",
        "lambda",
        "select",
        "insert",
        "python",
        "javascript",
        "typescript",
        "rust",
        "golang",
        "java",
        "sql",
        "regex",
        "bash",
        "api",
        "compiler",
        "parser",
        "parse",
        "thread",
        "mutex",
        "recursion",
        "recursive",
    ]
)
CODE_SYMBOLS = ("```", "=>", "->", "::", "()", ";\n", "{\n", "}\n")
MATH_WORDS = frozenset(
    [
        "integral",
        "derivative",
        "equation",
        "theorem",
        "lemma",
        "matrix",
        "probability",
        "polynomial",
        "prime",
        "primes",
        "modulo",
        "induction",
        "limit",
        "variance",
        "differential",
        "eigenvalue",
        "eigenvalues",
        "eigenvector",
        "converge",
        "converges",
    ]
)
MATH_SYMBOLS = ("\\frac", "\\int", "\\sum", "\\sqrt", "\\lim", "\\prod", "∫", "∑", "√", "π", "∞", "≤", "≥", "∂", "expected value",
                "o(n", "o(log", "^2")  # fmt: skip
REASONING_WORDS = frozenset(
    [
        "prove",
        "proof",
        "derive",
        "analyze",
        "analyse",
        "compare",
        "design",
        "optimize",
        "optimise",
        "complexity",
        "debug",
        "detailed",
        "rigorous",
        "rigorously",
        "justify",
        "implement",
        "deadlock",
        "distributed",
        "solve",
        "architecture",
        "architect",
        "concurrency",
        "concurrent",
        "scalable",
        "scalability",
        "tradeoffs",
        "tradeoff",
    ]
)
REASONING_PHRASES = (
    "step by step",
    "step-by-step",
    "explain why",
    "why does",
    "why is",
    "why do",
    "why are",
    "why would",
    "reason about",
    "trade-off",
    "think through",
    "think carefully",
    "pros and cons",
    "in depth",
    "race condition",
    "show each step",
    "show every step",
    "show all steps",
    "show your work",
    "operator precedence",
    "with tests",
)
SIMPLE_WORDS_AT_START = frozenset(["hi", "hello", "hey", "thanks", "ok", "okay"])
SIMPLE_PHRASES = ("thank you", "what is", "what's", "who is", "define", "translate", "spell", "capital of",
                  "synonym", "one word", "yes or no", "short answer", "briefly")  # fmt: skip
# Input-grounded requests: the answer copies spans of the prompt, so prompt lookup drafts well.
GROUNDED_WORDS = frozenset(
    [
        "edit",
        "fix",
        "refactor",
        "rename",
        "rewrite",
        "reformat",
        "convert",
        "port",
        "extract",
        "summarize",
        "summarise",
        "quote",
        "correct",
    ]
)
GROUNDED_PHRASES = ("translate this", "add type hints", "add comments", "add docstrings", "add logging",
                    "find all", "find every", "the following", "the above", "the given", "this text", "this code",
                    "this file", "this document", "this passage", "this snippet", "this function", "this class",
                    "this json", "this log", "this table")  # fmt: skip


@dataclass(frozen=True)
class Features:
    prompt_chars: int  # all message text
    turns: int  # messages in the conversation
    code: int  # code signals in the scanned window
    math: int
    reasoning: int  # reasoning cues ("prove", "step by step", ...)
    simple: int  # small-talk and lookup cues ("hi", "what is", ...)
    grounded: bool  # the answer is drawn from the input (edit this code, extract from this text)
    max_tokens: int | None


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a multi-part content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        text = part.get("text") if isinstance(part, Mapping) else getattr(part, "text", None)
        if isinstance(text, str):
            parts.append(text)
    return "\n".join(parts)


def _field(message: Any, key: str) -> Any:
    # Messages arrive as plain dicts (tests, calibration files) or as the gateway's pydantic models.
    return message.get(key) if isinstance(message, Mapping) else getattr(message, key, None)


def _window(text: str) -> str:
    if len(text) <= 2 * SCAN_CHARS:
        return text
    return text[:SCAN_CHARS] + "\n" + text[-SCAN_CHARS:]


def extract(
    messages: Sequence[Any] | None = None, prompt: str | None = None, max_tokens: int | None = None
) -> Features:
    """Features of a chat request (`messages`) or a legacy completion (`prompt`)."""
    if messages:
        texts = [_text(_field(m, "content")) for m in messages]
        last = next(
            (
                t
                for m, t in zip(reversed(messages), reversed(texts), strict=True)
                if _field(m, "role") == "user"
            ),
            texts[-1],
        )
        total, turns = sum(len(t) for t in texts), len(messages)
    else:
        last = prompt or ""
        total, turns = len(last), 1
    window = _window(last).lower()
    words = _WORDS.findall(window)
    head = window[:256]  # small-talk cues only count at the start
    first = _WORDS.match(head.lstrip())
    return Features(
        prompt_chars=total,
        turns=turns,
        code=sum(w in CODE_WORDS for w in words) + sum(window.count(s) for s in CODE_SYMBOLS),
        math=sum(w in MATH_WORDS for w in words)
        + sum(window.count(s) for s in MATH_SYMBOLS)
        + len(_ARITH.findall(window)),
        reasoning=sum(w in REASONING_WORDS for w in words) + sum(p in window for p in REASONING_PHRASES),
        simple=(first is not None and first.group() in SIMPLE_WORDS_AT_START)
        + sum(p in head for p in SIMPLE_PHRASES),
        grounded=any(w in GROUNDED_WORDS for w in words) or any(p in window for p in GROUNDED_PHRASES),
        max_tokens=max_tokens,
    )


@dataclass(frozen=True)
class Weights:
    """How much each feature adds to the score at saturation (hand-set; thresholds are calibrated)."""

    length: float = 0.15  # saturates at `length_chars`
    length_chars: int = 8000
    turns: float = 0.10  # saturates at 9 messages
    code: float = 0.20  # saturates at 4 signals
    math: float = 0.25  # saturates at 3 signals
    reasoning: float = 0.40  # saturates at 2 cues
    max_tokens: float = 0.15  # from 128 tokens (0) to 2048 (full)
    simple: float = -0.20  # per small-talk cue, at most two


DEFAULT_WEIGHTS = Weights()


def complexity(f: Features, w: Weights = DEFAULT_WEIGHTS) -> tuple[float, list[str]]:
    """Score in [0, 1] and the named terms that contributed to it."""
    terms: list[tuple[str, float]] = []
    if f.prompt_chars > 200:
        terms.append(
            (
                f"length={f.prompt_chars}",
                w.length * min(1.0, math.log(f.prompt_chars / 200) / math.log(w.length_chars / 200)),
            )
        )
    if f.turns > 1:
        terms.append((f"turns={f.turns}", w.turns * min(1.0, (f.turns - 1) / 8)))
    if f.code:
        terms.append((f"code={f.code}", w.code * min(1.0, f.code / 4)))
    if f.math:
        terms.append((f"math={f.math}", w.math * min(1.0, f.math / 3)))
    if f.reasoning:
        terms.append((f"reasoning={f.reasoning}", w.reasoning * min(1.0, f.reasoning / 2)))
    if f.max_tokens is not None and f.max_tokens > 128:
        terms.append(
            (f"max_tokens={f.max_tokens}", w.max_tokens * min(1.0, math.log2(f.max_tokens / 128) / 4))
        )
    if f.simple:
        terms.append((f"simple={f.simple}", w.simple * min(2, f.simple)))
    score = min(1.0, max(0.0, sum(v for _, v in terms)))
    return score, [name for name, v in terms if v != 0]
