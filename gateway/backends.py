"""What serving talks to: a ``Backend`` turns a backend-neutral ``Job`` into text deltas.

    serving.py  (HTTP shapes, SSE)  ──Job──▶  Backend.start(job) ──▶ Generation (async iterator of Delta)
                                             ├── LocalBackend   (gateway/local.py: the EngineClient on this box)
                                             └── remote backends (router/: OpenAI-compatible upstreams)

``start`` does every check that can refuse the job (unknown model, prompt too long, overload) and
raises before returning, so serving can still answer with a plain HTTP error; nothing after
``start`` returns may be a client error. A ``Generation`` must stop its work when closed early.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Protocol

from decoding.params import SpecParams

# vLLM's sampling and chat template extras a Job carries (a remote upstream gets those a client set:
# Job.vllm_extras)
VLLM_EXTRAS = (
    "top_k",
    "min_tokens",
    "ignore_eos",
    "min_p",
    "repetition_penalty",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "cache_salt",
)


@dataclass(frozen=True)
class Job:
    """One OpenAI request, validated and normalised (n, stops, token limit resolved)."""

    request_id: str
    kind: Literal["chat", "completion"]
    model: str
    # chat: [{"role", "content"}], content as plain text (None: an assistant turn of tool calls only),
    # plus "tool_calls" on assistant turns and "tool_call_id" on tool turns, in OpenAI's shape
    messages: list[dict[str, Any]] | None = None
    prompts: list[str | list[int]] | None = None  # completion: each prompt gets n choices
    n: int = 1
    max_tokens: int | None = None  # None: the backend's default, bounded by its context
    # the field the client bounded a chat with: a remote upstream gets the limit under that name
    # (OpenAI's reasoning models refuse max_tokens; older OpenAI-compatible servers know only it)
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stops: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    # vLLM's extras (protocol._Sampling; VLLM_EXTRAS)
    min_tokens: int = 0
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    # chat: the template opens a new assistant turn, or continues the last message in place (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables (vLLM's)
    cache_salt: str | None = None  # prefix caching: reuse only what was cached under this salt (vLLM's)
    logprobs: int | None = None  # None: no logprobs; N: chosen token plus N alternatives
    echo: bool = False  # completion: the prompt text precedes the completion
    spec: SpecParams = field(default_factory=SpecParams)
    granularity: Literal["step", "token"] = "step"
    tenant: str = "anonymous"
    user: str | None = None
    # chat: structured outputs, tools, Predicted Outputs, as the client sent them (validated);
    # None is the API's default, so a request without them keeps its cache key
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    prediction: str | None = None  # the predicted content, as text
    logit_bias: dict[str, float] | None = None  # {"<token id>": bias}
    # vLLM's guided decoding, {name: value} as the client sent it (jobs._guided; chat and completions)
    guided: dict[str, Any] | None = None

    @property
    def choices(self) -> int:
        """The choices the response holds: n for each prompt (one engine request each)."""
        return self.n * (len(self.prompts) if self.prompts is not None else 1)

    @property
    def calls_tools(self) -> bool:
        """Tools may be called (so output text is parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def calls_only(self) -> bool:
        """The answer is tool calls alone: tool_choice required or a named function (grammars.grammar_for
        forces the calls)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def vllm_extras(self) -> dict[str, Any]:
        """vLLM's sampling extras this job sets (those away from their neutral defaults)."""
        defaults = {f.name: f.default for f in fields(self) if f.name in VLLM_EXTRAS}
        return {k: getattr(self, k) for k in VLLM_EXTRAS if getattr(self, k) != defaults[k]}


@dataclass
class LogprobEntry:
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class PromptLogprobs:
    """A prompt's tokens scored (legacy completions' echo with logprobs): the first token has no
    logprob and no alternatives (nothing predicts it), every later one is in ``rest``."""

    first: str
    rest: list[LogprobEntry]


@dataclass
class ToolCallDelta:
    """One piece of one tool call: its first (``id`` and ``name`` set, ``arguments`` "") or an
    ``arguments`` fragment. The fragments of one ``index`` concatenate to the call's arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    """A tool call's id, OpenAI-shaped: it names one call of one response."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Delta:
    """New output for one choice: one engine step (or one token with granularity ``token``)."""

    index: int
    text: str
    logprobs: list[LogprobEntry] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls" on the last delta of a choice
    completion_tokens: int = 0  # tokens this delta accounts for (usage)
    tool_calls: list[ToolCallDelta] | None = None  # call pieces after ``text``, in order
    # echo with logprobs: the choice's prompt scored, on a delta of its own before the choice's first
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class Generation:
    """A started job. Iterate for deltas of every choice, interleaved; ``aclose`` stops the work."""

    prompt_tokens: int
    deltas: AsyncIterator[Delta]
    # completion echo: one per prompt; none where the deltas' text carries the echo (a remote upstream's)
    prompt_texts: list[str] = field(default_factory=list)
    # completion echo with logprobs: each choice's first delta is its prompt's logprobs
    # (Delta.prompt_logprobs), which the streamed echo waits for
    echo_logprobs: bool = False
    speculative: dict[str, Any] | None = None  # filled by the backend once every choice finished
    # prompt tokens of every choice reused from the model's prefix cache, once they finished (0 for a
    # cache replay: no model saw the prompt)
    cached_tokens: int = 0
    # Predicted Outputs: (accepted, rejected) prediction tokens of every choice, once they finished
    # (gateway.local.prediction_found, summed); kept with a cached answer, so a replay reports them too
    prediction_tokens: tuple[int, int] | None = None

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self.deltas

    async def aclose(self) -> None:
        aclose = getattr(self.deltas, "aclose", None)
        if aclose is not None:
            await aclose()


class Backend(Protocol):
    name: str

    def model_ids(self) -> list[str]: ...

    # the prompt tokens ``start`` will count for ``job`` (a remote upstream's: an estimate)
    async def prompt_tokens(self, job: Job) -> int: ...

    async def start(self, job: Job) -> Generation: ...


class CacheLookup(Protocol):
    @property
    def header(self) -> str: ...  # x-specgate-cache: "exact; similarity=1.0000", "semantic; ...", "miss"

    def replay(self) -> Generation | None: ...  # a hit, as a generation; None on a miss

    def store(self, fmt: Any, gen: Generation) -> None: ...  # after the last delta only


class ServingCache(Protocol):
    """Seam for gateway/cache/ (gateway.cache.seam.GatewayCache): ``app.state.gateway.cache``.
    ``lookup`` before generation (raises only an APIError 400 for a bad ``cache`` body field);
    ``job.tenant`` scopes entries."""

    async def start(self) -> None: ...

    async def lookup(self, job: Job, headers: Any, raw_body: bytes) -> CacheLookup: ...

    async def close(self) -> None: ...
