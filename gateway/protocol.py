"""The OpenAI wire schemas (requests and responses), in one module.

Requests validate strictly (OpenAI refuses ``"max_tokens": "5"``; so do we) and ignore unknown fields
as vLLM does: OpenAI refuses them ("Unrecognized request argument supplied"), but clients written for
other servers send extras of their own (Open WebUI's ``num_keep``), which a drop-in server serves. Integers may arrive as integral floats (``568.0``: JSON Schema's ``integer`` admits
them, so schema-driven clients send them) and every integer has a range it can be held in, so an
out-of-range value is a 400 here and never an overflow further down. Parameters we cannot honour yet are declared so they can be refused by name
(``UNSUPPORTED``) rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Declared on requests only to be refused with a 400 naming them (see jobs.to_job).
UNSUPPORTED = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "web_search_options",
    "suffix",
    "best_of",
    *(
        # vLLM's extra body fields that shape the output and that this server does not implement:
        # one ignored would come back as an output it does not shape, so each is refused when set
        # (not null, false or empty), with what to send instead (VLLM_INSTEAD). Its guided decoding
        # (guided_json, guided_regex, guided_choice, guided_grammar, structured_outputs) is served:
        # GUIDED
        "stop_token_ids",
        "bad_words",
        "allowed_token_ids",
        "include_stop_str_in_output",
        "prompt_logprobs",
        "use_beam_search",
        "truncate_prompt_tokens",
        # a client's own Jinja template: vLLM refuses one too unless started with
        # --trust-request-chat-template (it runs the client's code in the server)
        "chat_template",
    ),
)
VLLM_INSTEAD = {
    "stop_token_ids": "stop (strings)",
    "prompt_logprobs": "echo with logprobs on /v1/completions",
    "chat_template": "/v1/completions with the prompt formatted as you need",
}
# vLLM's guided decoding, on chat and legacy completions: one of them at a time, and not beside
# response_format or tools (jobs._guided)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
# Chat-only parameters, refused by name on legacy completions.
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "prediction")


def _integral(value: Any) -> Any:
    """568.0 -> 568; anything else goes on to strict int validation (which refuses 568.5, "5", true)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Ranges sit inside the Annotated type, before the validator (so on the integer itself): on the
# field, or after the validator, pydantic renders them as stray "ge"/"le" schema keys, not as
# minimum/maximum.
Int = Annotated[int, BeforeValidator(_integral)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX), BeforeValidator(_integral)]
Count = Annotated[int, Field(ge=1, le=INT64_MAX), BeforeValidator(_integral)]  # max_tokens, n
TopK = Annotated[int, Field(ge=0, le=INT64_MAX), BeforeValidator(_integral)]
# vLLM's top_k: 0 or -1 (its default for years, which its clients send) take every token
VllmTopK = Annotated[int, Field(ge=-1, le=INT64_MAX), BeforeValidator(_integral)]
# a completion's max_tokens: 0 is the legacy API's "score the prompt" (echo, logprobs, nothing generated)
EchoCount = Annotated[int, Field(ge=0, le=INT64_MAX), BeforeValidator(_integral)]
MaxK = Annotated[int, Field(ge=1, le=32), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=20), BeforeValidator(_integral)]
LogprobCount = Annotated[int, Field(ge=0, le=5), BeforeValidator(_integral)]


class _Wire(BaseModel):
    """A request object as a client sends it. OpenAI's schemas mark their optional fields nullable
    (``"n": null``, ``"stream": null``, ``"logprobs": null``), and clients that send every field send
    the unset ones as null: a null is the field left out, its default (and a required field's null
    is its absence, refused by name)."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _Request(_Wire):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Wire):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SpeculativeOptions(_Wire):
    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["auto", "off", "draft", "ngram"] = "auto"
    max_k: MaxK | None = None
    # false: always draft max_k tokens, skipping the adaptive k and the goodput check (benchmarks,
    # and tests that must see speculation on hardware where it does not pay)
    adaptive: bool | None = None
    # stop drafting after a token the draft model gave less than this probability (0: never; unset:
    # the engine's default for the draft's device, decoding.admission.DRAFT_CONFIDENCE)
    draft_confidence: float | None = Field(default=None, ge=0, lt=1)


class TextPart(_Wire):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class _Strict(_Wire):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None: an assistant turn that only called tools; every other role needs content, as OpenAI's
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @field_validator("content", mode="after")
    @classmethod
    def _content_unless_assistant(cls, content: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"Missing required parameter: a {role} message needs content")
        if content == [] and role != "assistant":  # OpenAI refuses an empty array: it is no content
            raise ValueError("empty array. Expected an array with minimum length 1")
        return content

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any, info: ValidationInfo) -> Any:
        """An image, audio or file part gets a 400 that says so, not a union's "not a string". An
        assistant's refusal part (OpenAI's, in a history replayed from it) is its text."""
        if info.data.get("role") == "assistant" and isinstance(content, list):
            content = [
                {"type": "text", "text": p["refusal"]}
                if isinstance(p, dict) and p.get("type") == "refusal" and isinstance(p.get("refusal"), str)
                else p
                for p in content
            ]
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"content parts of type {kind[:40]!r} are not supported: the models here read text"
                )
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    # OpenAI's rule for the name, as for a function's: a-z, A-Z, 0-9, _ and -, at most 64
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Prediction(_Strict):
    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(_Request):
    """Fields shared by chat and legacy completions."""

    model: str = Field(min_length=1)
    max_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    # [0, 1] as OpenAI's schema has it (clients send 0 for "the likeliest token only", which vLLM and
    # TGI once refused: TGI#2231); 0 is served as the smallest top_p (jobs.to_job)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: Count = 1
    stop: str | list[str] | None = None
    # n seeded choices use seed, seed + 1, ...: the range keeps every one within a 64-bit generator seed
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # extra body fields (the SDK's extra_body)
    top_k: VllmTopK | None = None
    # vLLM's sampling extras, as vLLM reads them: tokens before EOS or a stop may end the output, no
    # end at EOS, tokens below min_p x the likeliest dropped, tokens already in the prompt or output
    # penalised (logit / r where positive, x r where negative)
    min_tokens: TopK = 0
    ignore_eos: bool = False
    min_p: float = Field(default=0.0, ge=0, le=1)
    # from 0.01: a logit divided by a denormal penalty overflows to inf (the fuzz test's 500)
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100)
    # vLLM's: the prompt's prefix is reused only from requests that sent the same salt (prefix caching)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    speculative: SpeculativeOptions | None = None
    stream_granularity: Literal["step", "token"] | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # refused by name when present
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    stop_token_ids: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    include_stop_str_in_output: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    truncate_prompt_tokens: Any = None
    chat_template: Any = None

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    # vLLM's chat template extras: continue_final_message continues the last message in place (an
    # assistant prefill: "Sure, here is") instead of opening a new assistant turn after it; the
    # generation prompt defaults to on, and to off with continue_final_message (vLLM's users send
    # both; the two together are refused, as vLLM refuses them)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, say); jobs.py refuses
    # those that would set what the template call itself decides
    chat_template_kwargs: dict[str, Any] | None = None
    # as OpenAI documents it: "logprobs must be set to true if this parameter is used" (else a 400)
    top_logprobs: TopLogprobs | None = Field(
        default=None, description="Needs logprobs: true; without it the request is refused."
    )

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]  # token ids: checked by jobs._prompts
    # 0 with echo only (jobs.to_job); 16 when absent or null, as OpenAI's legacy API and vLLM default it
    max_tokens: EchoCount = 16
    echo: bool = False
    logprobs: LogprobCount | None = None
    suffix: Any = None
    # best_of = n is served (it selects nothing); best_of > n, a selection, is refused (jobs.to_job)
    best_of: Count | None = None
    # chat-only, refused by name here (CHAT_ONLY)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    prediction: Any = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


# ---- responses ----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # {accepted_prediction_tokens, rejected_prediction_tokens} with Predicted Outputs
    completion_tokens_details: dict[str, int] | None = None
    # {cached_tokens}: prompt tokens whose KV a request before left (prefix caching), as OpenAI reports
    prompt_tokens_details: dict[str, int] | None = None
    speculative: dict[str, Any] | None = None  # RequestStats.as_dict(), merged over choices


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # with echo the prompt's tokens come first, and the first one's logprob and alternatives are
    # null: nothing predicts it (as OpenAI and vLLM send it)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]  # where each token starts in the choice's text (its echoed prompt included)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None  # left out of the body when None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...} or {"tool_calls": [...]}, {} last
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # serialised only with include_usage (then null except on the last)


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specgate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
