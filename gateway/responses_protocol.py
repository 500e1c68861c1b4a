"""The Responses API's request schema (``POST /v1/responses``), and its input as chat messages.

Shapes as OpenAI documents them and the ``openai`` SDK's ``types.responses`` declare them: tools are
flat (``{"type": "function", "name", "parameters"}``, not nested under ``function``), a named
tool choice is ``{"type": "function", "name"}``, structured output is ``text.format``. What the chat
path shares is gateway/responses.py's translation into a ``ChatCompletionRequest``; the refusals
here name the Responses parameters (``input[2].call_id``, ``text.format``).

Deliberate divergences: ``strict`` on a function is applied as given (absent: not enforced), as
vLLM's Responses API reads it, where OpenAI's default is true; OpenAI's hosted tools (web search,
file search, ...), non-text input (images, files, audio), ``background``, ``conversation`` and
``prompt`` templates are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from gateway.protocol import Count, Int64, SpeculativeOptions, VllmTopK, _Request, _Strict

# accepted for what they are here: text, and no hosted state beyond previous_response_id
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# declared to be refused by name when set (not null, false or empty): no silent drop
UNSUPPORTED = ("background", "conversation", "prompt", "max_tool_calls", "top_logprobs")


def _text_parts_only(content: Any) -> Any:
    """An image, file or audio part gets a 400 that says so, not a union's "not a string"."""
    for part in content if isinstance(content, list) else []:
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in TEXT_PARTS:
            raise ValueError(
                f"content parts of type {kind[:40]!r} are not supported: the models here read text"
            )
    return content


class ItemText(_Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


Content = Annotated[
    str | list[Annotated[ItemText | RefusalPart, Field(discriminator="type")]],
    BeforeValidator(_text_parts_only),
]


def text_of(content: str | list[ItemText | RefusalPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, ItemText) else p.refusal for p in content)


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as OpenAI sends it
    id: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content
    id: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]
ITEM_TYPES = ("message", "function_call", "function_call_output")


def _typed(items: Any) -> Any:
    """OpenAI's easy input messages leave out ``type`` ("message"); any other item type (reasoning,
    item references, hosted tools' calls) is refused by name, not as a failed union."""
    if not isinstance(items, list):
        return items
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            kind = item.get("type")
            if kind is None and "role" in item:
                item = {**item, "type": "message"}
            elif isinstance(kind, str) and kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}]: items of type {kind[:40]!r} are not supported by this server")
        out.append(item)
    return out


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


def _function_tools(tools: Any) -> Any:
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise ValueError(f"tools[{i}]: tools of type {kind[:40]!r} are not supported, only functions")
    return tools


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class JsonSchemaText(_Strict):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class PlainText(_Strict):
    type: Literal["text", "json_object"]


class TextConfig(_Strict):
    format: Annotated[JsonSchemaText | PlainText, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; a model here has no such knob


class ResponsesRequest(_Request):
    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    # accepted and ignored: they change nothing a client can see here
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None  # extra output data OpenAI can add (none of it exists here)
    # the chat path's extras (the SDK's extra_body), passed on as they are
    speculative: SpeculativeOptions | None = None
    stream_granularity: Literal["step", "token"] | None = None
    seed: Int64 | None = None
    top_k: VllmTopK | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100)
    # refused by name when set (UNSUPPORTED)
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None

    # before the unions, so that a refusal is reported once and not as every branch's mismatch
    _input = field_validator("input", mode="before")(_typed)
    _tools = field_validator("tools", mode="before")(_function_tools)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512."""
        if value is not None and (
            len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())
        ):
            raise ValueError("at most 16 pairs, keys up to 64 characters and values up to 512")
        return value

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        """``input`` as items: a string is one user message."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_extras(self) -> dict[str, Any]:
        """The chat path's extras this request sets, as a chat request spells them."""
        names = ("speculative", "stream_granularity", "seed", "top_k", "min_p", "repetition_penalty")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
