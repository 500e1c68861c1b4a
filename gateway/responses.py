"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API on the
chat path.

A Responses request becomes the ``ChatCompletionRequest`` it means (instructions as the system
message, input items as messages, flat function tools nested as chat's, ``text.format`` as
``response_format``, ``max_output_tokens`` as ``max_completion_tokens``) and goes through
``serving.serve`` like a chat request: limits, rate, routing, the cache, speculation, grammars for
tools and formats, metrics and traces are the chat path's own. Only the answer's shape differs
(gateway/response_events.py), and the finished response is kept per tenant for ``GET`` and
``previous_response_id`` (gateway/response_store.py).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.errors import APIError, bad_request, clip, to_api_error
from gateway.jobs import to_job
from gateway.protocol import ChatCompletionRequest
from gateway.response_events import ResponsesFormat, new_id
from gateway.response_store import ResponseStore
from gateway.responses_protocol import (
    UNSUPPORTED,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputItem,
    JsonSchemaText,
    MessageItem,
    ResponsesRequest,
    text_of,
)
from gateway.serving import GatewayState, Parsed, serve

log = logging.getLogger("specgate.gateway")

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEMS: TypeAdapter[list[Item]] = TypeAdapter(list[InputItem])
# a chat parameter an error names -> the Responses API's
_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


async def create(request: Request) -> Response:
    return await serve(request, parse, "input")


async def parse(request: Request, body: bytes, state: GatewayState) -> Parsed:
    try:
        req = ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        raise to_api_error(_untagged(exc)) from exc
    for name in UNSUPPORTED:
        if getattr(req, name) not in (None, False, "", [], 0):
            raise bad_request(f"The parameter '{name}' is not supported by this server.", param=name)
    limit = state.settings.limits.max_max_tokens
    if req.max_output_tokens is not None and req.max_output_tokens > limit:
        raise bad_request(
            f"max_output_tokens must be at most {limit}, got {req.max_output_tokens}.",
            param="max_output_tokens",
        )
    tenant: str = request.state.tenant
    store = _store(state)
    context: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        record = await store.get(tenant, req.previous_response_id)
        if record is None:  # another tenant's id reads as a missing one
            raise bad_request(
                f"Previous response with id '{clip(req.previous_response_id)}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        context = record["context"] + record["response"]["output"]
    new = req.items()
    if not new and not context:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    messages = chat_messages(req.instructions, _ITEMS.validate_python(context), new)
    try:
        chat = ChatCompletionRequest.model_validate(chat_body(req, messages))
        job = to_job(chat, request.state.request_id, tenant, state.settings)
    except (APIError, ValidationError) as exc:
        raise in_our_words(to_api_error(exc)) from exc
    fields = echoed(req)
    kept = context + [_with_id(item.model_dump(exclude_none=True)) for item in new]

    async def keep(response: dict[str, Any]) -> None:
        try:
            await store.put(tenant, response["id"], {"response": response, "context": kept})
        except Exception as exc:  # the answer still goes out; it just cannot be continued or read back
            log.warning("could not store response %s: %s", response["id"], exc)

    return Parsed(
        job,
        req.stream,
        lambda served: ResponsesFormat(served, job, fields, keep if req.store else None),
        words=in_our_words,
    )


def chat_messages(instructions: str | None, prior: list[Item], new: list[Item]) -> list[dict[str, Any]]:
    """Chat messages for the items a response answers: ``prior`` (a previous response's context and
    output, checked when it was made) then ``new``. Function calls join the assistant turn before
    them, as one chat turn holds its text and its calls; a call's output must answer a call."""
    out: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    called: set[str] = set()
    for i, item in [(None, it) for it in prior] + list(enumerate(new)):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            called.add(item.call_id)
        else:
            if item.call_id not in called:
                raise bad_request(
                    f"No tool call found for function call output with call_id '{clip(item.call_id, 64)}'.",
                    param=f"input[{i}].call_id" if i is not None else "previous_response_id",
                )
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return out


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request this Responses request means."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
        **req.chat_extras(),
    }
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, JsonSchemaText):
        spec = fmt.model_dump(exclude={"type"}, exclude_none=True, by_alias=True)
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    return {k: v for k, v in body.items() if v is not None}


def echoed(req: ResponsesRequest) -> dict[str, Any]:
    """What the response object repeats of its request, defaults filled in as OpenAI fills them."""
    fmt = (
        req.text.format.model_dump(by_alias=True)
        if req.text is not None and req.text.format
        else {"type": "text"}
    )
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump() for t in req.tools or []],
        "text": {"format": fmt},
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "background": False,
    }


# the tags of the request's discriminated unions (items, content parts, text.format), which pydantic
# writes into an error's location: input[0].message.content is the client's input[0].content
_TAGS = frozenset(
    {"message", "function_call", "function_call_output", "input_text", "output_text", "text", "refusal",
     "json_schema", "json_object"}
)  # fmt: skip


def _untagged(exc: ValidationError) -> ValidationError:
    """``exc`` with the union tags taken out of its locations, so a refusal names the parameter as sent."""
    details: list[Any] = []
    for e in exc.errors(include_url=False):
        loc = [
            p
            for i, p in enumerate(e["loc"])
            if not (i and p in _TAGS and (isinstance(e["loc"][i - 1], int) or e["loc"][i - 1] == "format"))
        ]
        details.append(
            {
                "type": e["type"],
                "loc": tuple(loc),
                "input": e.get("input"),
                **({"ctx": e["ctx"]} if "ctx" in e else {}),
            }
        )
    try:
        return ValidationError.from_exception_data(exc.title, details)
    except Exception:  # an error pydantic cannot rebuild (a custom type): as it came, tags and all
        return exc


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def _with_id(item: dict[str, Any]) -> dict[str, Any]:
    """An input item as stored: with an id of its own (``input_items`` lists items by id)."""
    return item if "id" in item else {"id": new_id(_ID_PREFIXES[item["type"]]), **item}


def in_our_words(error: APIError) -> APIError:
    """A refusal from the chat path, naming the parameter as this API names it."""
    name = error.param
    if name is not None and name.startswith("tools[") and ".function" in name:
        error.param = name.replace(".function", "", 1)
    elif name is not None:
        error.param = _PARAMS.get(name.split("[", 1)[0].split(".", 1)[0], name)
    for chat, ours in _PARAMS.items():
        if chat != "messages":  # the word is too common to replace in prose
            error.message = error.message.replace(chat, ours)
    return error


def _store(state: GatewayState) -> ResponseStore:
    store: ResponseStore = state.extra["responses"]
    return store


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{clip(response_id)}' not found.", param="response_id")


async def retrieve(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    record = await _store(request.app.state.gateway).get(request.state.tenant, response_id)
    if record is None:
        raise _not_found(response_id)
    return JSONResponse(record["response"])


async def delete(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not await _store(request.app.state.gateway).delete(request.state.tenant, response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def input_items(request: Request) -> Response:
    """The items a stored response answered (a previous response's included), OpenAI's list page:
    ``order`` (``desc``, newest first, by default), ``limit`` (1-100, 20) and ``after`` (an item id)."""
    response_id = request.path_params["response_id"]
    record = await _store(request.app.state.gateway).get(request.state.tenant, response_id)
    if record is None:
        raise _not_found(response_id)
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(
            f"Invalid value for 'order': expected 'asc' or 'desc', got {clip(order, 16)!r}.", "order"
        )
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and 1 <= int(limit) <= 100):
        raise bad_request(
            f"Invalid value for 'limit': an integer from 1 to 100, got {clip(limit, 16)!r}.", "limit"
        )
    items = [_listed(item) for item in record["context"]]
    items = items[::-1] if order == "desc" else items
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"No input item with id '{clip(after, 64)}' in this response.", "after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(limit)]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    """A stored item as OpenAI lists it: a message's text as a content part, a status on each."""
    if item["type"] == "message" and isinstance(item["content"], str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        item = {**item, "content": [{"type": kind, "text": item["content"]}]}
    return {**item, "status": item.get("status", "completed")}
