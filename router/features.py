"""Request features and the complexity score, in well under a millisecond.

Cheap on purpose: regexes compiled once, and cue scanning looks at a bounded window of the last user
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

SCAN_CHARS = 2048  # head and tail of the last user message that cue regexes see

_CODE = re.compile(
    r"```|\b(?:def|class|import|return|function|const|let|var|struct|impl|fn|void|public|"
    r"async|await|lambda|SELECT|INSERT|python|javascript|typescript|rust|golang|java|sql|regex|bash|"
    r"api|compiler|parser|parse|thread|mutex|recursion|recursive)\b|=>|->|::|[{};]\s*$|\w\(\)",
    re.MULTILINE,
)
_MATH = re.compile(
    r"\\(?:frac|int|sum|sqrt|lim|prod)|[∫∑√π∞≤≥∂]|\b(?:integral|derivative|equation|theorem|lemma|"
    r"matrix|eigen\w*|probability|polynomial|primes?|modulo|induction|limit|converge\w*|"
    r"expected value|variance|differential)\b|\d\s*[-+*/^=]\s*\d",
    re.IGNORECASE,
)
_REASONING = re.compile(
    r"\b(?:prove|proof|step[- ]by[- ]step|explain why|why (?:does|is|do|are|would)|derive|reason(?:ing)? "
    r"about|analy[sz]e|compare|trade-?offs?|design|architect\w*|optimi[sz]e|complexity|debug|"
    r"think (?:through|carefully)|pros and cons|in depth|detailed|rigorous\w*|justify|implement|"
    r"concurren\w+|race condition|deadlock|scalab\w+|distributed|solve|show (?:each|every|all|your) (?:steps?|work)|"
    r"operator precedence|with tests)\b",
    re.IGNORECASE,
)
_SIMPLE = re.compile(
    r"^\s*(?:hi|hello|hey|thanks|thank you|ok|okay)\b|\b(?:what is|what's|who is|define|"
    r"translate|spell|capital of|synonym|one word|yes or no|short answer|briefly)\b",
    re.IGNORECASE,
)
# Input-grounded requests: the answer copies spans of the prompt, so prompt lookup drafts well.
_GROUNDED = re.compile(
    r"\b(?:edit|fix|refactor|rename|rewrite|reformat|convert|port|translate this|add (?:type hints|"
    r"comments|docstrings|logging)|extract|summari[sz]e|quote|find (?:all|every)|correct|"
    r"(?:from|in|of) (?:this|the following|the above|the given) (?:text|code|file|document|"
    r"passage|snippet|function|class|json|log|table))\b",
    re.IGNORECASE,
)


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
        last = next((t for m, t in zip(reversed(messages), reversed(texts), strict=True) if _field(m, "role") == "user"), texts[-1])
        total, turns = sum(len(t) for t in texts), len(messages)
    else:
        last = prompt or ""
        total, turns = len(last), 1
    window = _window(last)
    return Features(
        prompt_chars=total,
        turns=turns,
        code=len(_CODE.findall(window)),
        math=len(_MATH.findall(window)),
        reasoning=len(_REASONING.findall(window)),
        simple=len(_SIMPLE.findall(window[:256])),  # small-talk cues only count at the start
        grounded=_GROUNDED.search(window) is not None,
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
        terms.append((f"length={f.prompt_chars}", w.length * min(1.0, math.log(f.prompt_chars / 200) / math.log(w.length_chars / 200))))
    if f.turns > 1:
        terms.append((f"turns={f.turns}", w.turns * min(1.0, (f.turns - 1) / 8)))
    if f.code:
        terms.append((f"code={f.code}", w.code * min(1.0, f.code / 4)))
    if f.math:
        terms.append((f"math={f.math}", w.math * min(1.0, f.math / 3)))
    if f.reasoning:
        terms.append((f"reasoning={f.reasoning}", w.reasoning * min(1.0, f.reasoning / 2)))
    if f.max_tokens is not None and f.max_tokens > 128:
        terms.append((f"max_tokens={f.max_tokens}", w.max_tokens * min(1.0, math.log2(f.max_tokens / 128) / 4)))
    if f.simple:
        terms.append((f"simple={f.simple}", w.simple * min(2, f.simple)))
    score = min(1.0, max(0.0, sum(v for _, v in terms)))
    return score, [name for name, v in terms if v != 0]
