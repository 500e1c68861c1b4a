"""Plain request and output types shared by the engine and everything that talks to it.

No torch here: the gateway and router import these without pulling in the model stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class SpecMode(StrEnum):
    """How a request is decoded. ``auto`` lets the engine pick: the draft model when the target
    has one, else prompt lookup."""

    AUTO = "auto"
    OFF = "off"
    DRAFT = "draft"
    NGRAM = "ngram"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's: neither EOS nor a stop id before this many tokens (decoding.constraints.Shaping)
    min_tokens: int = 0
    min_p: float = 0.0  # tokens below min_p x the likeliest's probability are dropped
    # tokens already in the prompt or the output: logit / r where positive, logit x r where negative
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # None: none; N >= 0: the chosen token's logprob plus N alternatives
    # None: none; N >= 0: each prompt token's logprob given the tokens before it, plus N alternatives
    # (legacy completions' echo with logprobs; StepOutput.prompt_logprobs)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and n < 0:
                raise ValueError(f"{name} must be >= 0, got {n}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.01 <= self.repetition_penalty <= 100:  # a denormal divisor sends a logit to inf
            raise ValueError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True)
class SpecParams:
    mode: SpecMode = SpecMode.AUTO
    max_k: int = 8  # upper bound for the adaptive k
    adaptive: bool = True  # False: always propose max_k tokens (benchmarks, tests)
    # a draft model stops drafting after a token it gave less than this probability (0: never);
    # None: the engine's default for the draft's device (decoding.admission.DRAFT_CONFIDENCE), or 0
    # when adaptive is off
    draft_confidence: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_k <= 32:
            raise ValueError(f"speculative.max_k must be in [1, 32], got {self.max_k}")
        if self.draft_confidence is not None and not 0 <= self.draft_confidence < 1:
            raise ValueError(f"speculative.draft_confidence must be in [0, 1), got {self.draft_confidence}")


# The one JSON layout constrained output uses (llguidance JSON options; why: decoding/grammar.py).
# Here, torch-free, because the gateway embeds it in tool-call grammars (``%json`` with x-guidance).
JSON_LAYOUT: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, compiled by the grammar engine (decoding/grammar.py, llguidance).

    ``kind`` "json_schema": ``text`` is a JSON schema (serialised); "lark": ``text`` is an llguidance
    Lark grammar (it may embed schemas with ``%json{...}``, as tool calls do); "regex": the whole
    output matches ``text`` (vLLM's guided_regex).
    """

    kind: str  # "json_schema" | "lark" | "regex"
    text: str
    param: str = "response_format"  # the request parameter a compile error names ("tools" for tools)

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "lark", "regex"):
            raise ValueError(f"grammar kind must be 'json_schema', 'lark' or 'regex', got {self.kind!r}")


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    model: str  # name of a local model known to the engine
    prompt_token_ids: list[int]
    params: SamplingParams = SamplingParams()
    spec: SpecParams = SpecParams()
    # added to the target's and the draft's logits before anything else reads them (OpenAI's
    # logit_bias: bias in [-100, 100]; -100 bans a token, +100 all but forces it)
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: GrammarSpec | None = None  # output constrained to this grammar (structured outputs, tools)
    # Predicted Outputs: the expected completion as token ids; drafts come from it (lossless)
    prediction: tuple[int, ...] | None = None
    # vLLM's cache_salt: a prompt prefix is reused only from requests that gave the same salt
    cache_salt: str | None = None
    # ``grammar`` compiled for ``model`` (a decoding.grammar.CompiledGrammar), set by the engine's
    # ``prepare`` or ``check``; None: not compiled yet
    compiled: object | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class RequestStats:
    """What speculation did for one request. ``accepted_by_position[i]`` counts steps whose
    i-th drafted token was accepted; ``drafted_by_position[i]`` steps that drafted an i-th token."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, reused from a request before (prefix caching), not computed
    completion_tokens: int = 0
    steps: int = 0  # target forward passes after prefill (verifications and plain steps)
    spec_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_disabled_steps: int = 0  # plain steps taken because the goodput check switched speculation off
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafter: str = "none"

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def record_step(self, k: int, n: int, seconds: float) -> None:
        """One decode step that drafted ``k`` tokens (0: plain) and accepted ``n`` of them."""
        self.steps += 1
        self.decode_s += seconds
        if k == 0:
            return
        self.spec_steps += 1
        self.drafted += k
        self.accepted += n
        while len(self.drafted_by_position) < k:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(k):
            self.drafted_by_position[i] += 1
            if i < n:
                self.accepted_by_position[i] += 1

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per target forward pass after prefill (accepted drafts plus the corrected or
        bonus token; plain steps count, so about 1 with speculation off)."""
        return self.completion_tokens / self.steps if self.steps else 0.0

    @property
    def accepted_per_spec_step(self) -> float:
        """Accepted draft tokens per speculative (verification) step; 0 where none drafted."""
        return self.accepted / self.spec_steps if self.spec_steps else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Deprecated alias of ``tokens_per_step`` (the name said accepted drafts; it never counted
        them): kept one release for clients that read it (issue 51)."""
        return self.tokens_per_step

    def as_dict(self) -> dict[str, object]:
        return {
            "drafter": self.drafter,
            "steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "spec_steps": self.spec_steps,
            "accepted_tokens_per_spec_step": round(self.accepted_per_spec_step, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            # deprecated: tokens_per_step under its old, misleading name (README, "Usage")
            "mean_accepted_per_step": round(self.tokens_per_step, 4),
            "accepted_by_position": list(self.accepted_by_position),
            "drafted_by_position": list(self.drafted_by_position),
            "spec_disabled_steps": self.spec_disabled_steps,
        }


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop token id (stop strings are the gateway's, on text)
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class StepOutput:
    """One engine step for one request: the tokens accepted by this verification (one SSE chunk)."""

    request_id: str
    token_ids: list[int]
    drafted: int = 0
    accepted: int = 0
    logprobs: list[TokenLogprob] | None = None
    # on a request's first output where SamplingParams.prompt_logprobs asked for them: one per prompt
    # token, log p(token | the tokens before it); the first is None (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None  # set on the final output
    error: str | None = None  # set with finish_reason ERROR
    error_param: str | None = None  # with error: the request parameter at fault (its grammar's), if any
    cached_tokens: int = 0  # RequestStats.cached_tokens, on every output (a client may leave early)


@dataclass(frozen=True)
class BatchStep:
    """One engine step over a target's batch, as metrics see it (``AsyncEngine.add_step_observer``):
    what a request's ``StepOutput`` cannot say, since it is one row of the step."""

    model: str
    rows: int  # requests the step gave tokens to
    prefilling: int  # requests given no token: a prompt chunk rode the step (or, for a request that
    # joined while the step was queued ahead, rides the next one)
    tokens: int  # tokens the step emitted, every row's
    drafted: int  # the most tokens any row drafted (the step's k; 0: a plain step)
