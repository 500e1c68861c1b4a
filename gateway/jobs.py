"""A request body, validated, as the ``Job`` a backend serves (``to_job``): every refusal that depends
on the body alone (parameters this server lacks, limits, structured-output schemas, prompt token
ids) is a 400 naming its parameter, raised before anything is routed. The HTTP exchange around it is
gateway/serving.py's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from decoding.params import SpecMode, SpecParams
from gateway.backends import Job
from gateway.errors import bad_request
from gateway.grammars import guided_kind
from gateway.protocol import (
    CHAT_ONLY,
    GUIDED,
    UNSUPPORTED,
    VLLM_INSTEAD,
    ChatCompletionRequest,
    CompletionRequest,
)
from gateway.settings import Settings

# top_p 0 as OpenAI serves it, the nucleus of the likeliest token alone: the smallest positive float
# keeps just that token (sampling keeps the first token always), and the engine (and a vLLM upstream)
# takes top_p in (0, 1]
SMALLEST_TOP_P = 5e-324
# apply_chat_template's own arguments and the variables it passes the template itself: a
# chat_template_kwargs key among them would replace the messages, the tools, the template or how
# the prompt ends (vLLM drops such keys since a template swapped this way ran a client's code)
TEMPLATE_OWN = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"}
)  # fmt: skip


def to_job(
    req: ChatCompletionRequest | CompletionRequest, request_id: str, tenant: str, settings: Settings
) -> Job:
    """Limits and refusals that depend on the server's settings, then the backend-neutral job."""
    limits = settings.limits
    refused = UNSUPPORTED if isinstance(req, ChatCompletionRequest) else UNSUPPORTED + CHAT_ONLY
    best_of = getattr(req, "best_of", None)
    if best_of is not None:
        # as OpenAI and vLLM refuse them, before anything this server lacks: fewer candidates than
        # choices, and a stream of candidates that are only ranked once every one has finished
        if best_of < req.n:
            raise bad_request(
                f"best_of must be greater than or equal to n, got n={req.n} and best_of={best_of}.",
                param="best_of",
            )
        if req.stream and best_of > 1:
            raise bad_request("best_of must be 1 when streaming (stream: true).", param="best_of")
    # best_of = n selects nothing (the n generated are the n returned): clients send best_of: 1
    selects = best_of is not None and best_of != req.n
    for name in refused:
        value = getattr(req, name, None)
        # an empty value is none (fill-in-the-middle clients send suffix "", vLLM's clients
        # stop_token_ids [] or use_beam_search false); an object is set even empty ({} asks for
        # any JSON, or OpenAI's default web search)
        if value is None or value is False or value == "" or value == []:
            continue
        if name == "modalities" and value == ["text"]:  # OpenAI's default: what is served here
            continue
        if name != "best_of" or selects:
            instead = f" Use {VLLM_INSTEAD[name]} instead." if name in VLLM_INSTEAD else ""
            raise bad_request(f"The parameter '{name}' is not supported by this server.{instead}", param=name)
    if req.stream_options is not None and not req.stream:  # as OpenAI and vLLM refuse it
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.", param="stream_options"
        )
    if req.n > limits.max_n:
        raise bad_request(f"n must be at most {limits.max_n}, got {req.n}.", param="n")
    limit = req.token_limit
    if limit == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        # echo with max_tokens 0 scores the prompt and generates nothing (lm-eval-harness's
        # loglikelihood requests, as the legacy API and vLLM serve them); without echo there is nothing
        raise bad_request(
            "Invalid value for 'max_tokens': it must be at least 1, or 0 with echo (the prompt alone).",
            param="max_tokens",
        )
    if limit is not None and limit > limits.max_max_tokens:
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        raise bad_request(f"{param} must be at most {limits.max_max_tokens}, got {limit}.", param=param)
    if limit is not None and req.min_tokens > limit:  # as vLLM refuses it: neither could be honoured
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={limit}, got {req.min_tokens}.",
            param="min_tokens",
        )
    if len(req.stops) > limits.max_stops:
        raise bad_request(
            f"At most {limits.max_stops} stop sequences are allowed, got {len(req.stops)}.", param="stop"
        )
    prompts = _prompts(req.prompt) if isinstance(req, CompletionRequest) else None
    choices = req.n * (len(prompts) if prompts is not None else 1)
    # each choice is one engine request: more than can run and wait at once could never be admitted,
    # so a 503 telling the client to retry would be a lie. The engine takes max_queued waiting beside
    # its free slots (AsyncEngine.submit): at least one where max_active is sized at start (unset),
    # so `max_queued: 0` (nothing waits) still serves; it refused every request
    running = limits.max_active or 1
    if choices > limits.max_queued + running:
        param = "prompt" if prompts is not None and len(prompts) > 1 else "n"
        raise bad_request(
            f"This request needs {choices} generations (prompts x n), more than the server runs and queues "
            f"at once (limits.max_queued = {limits.max_queued} waiting beside {running} running); split it "
            "into smaller requests.",
            param=param,
        )
    spec = _spec(req)
    common: dict[str, Any] = dict(
        request_id=request_id,
        model=req.model,
        n=req.n,
        max_tokens=limit,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p or SMALLEST_TOP_P,
        top_k=max(req.top_k or 0, 0),  # vLLM's -1: every token, as 0
        seed=req.seed,
        stops=tuple(req.stops),
        presence_penalty=req.presence_penalty,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty,
        cache_salt=_cache_salt(req.cache_salt, tenant if settings.auth.prefix_cache_per_key else None),
        spec=spec,
        granularity=req.stream_granularity or settings.stream_granularity,
        tenant=tenant,
        user=req.user,
        logit_bias=_logit_bias(req.logit_bias),
        guided=_guided(req),
    )
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.max_completion_tokens is not None:
            common["max_tokens_field"] = "max_completion_tokens"
        reserved = sorted(set(req.chat_template_kwargs or {}) & TEMPLATE_OWN)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {reserved[0]!r}: the request's own fields decide it.",
                param="chat_template_kwargs",
            )
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request(
                "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true.",
                param="continue_final_message",
            )
        return Job(
            kind="chat",
            messages=_messages(req),
            logprobs=logprobs,
            add_generation_prompt=not req.continue_final_message
            if req.add_generation_prompt is None
            else req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs or None,
            **_structured(req),
            **common,
        )
    return Job(kind="completion", prompts=prompts, logprobs=req.logprobs, echo=req.echo, **common)


def _logit_bias(bias: dict[str, float] | None) -> dict[str, float] | None:
    if not bias:
        return None
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):  # isdigit alone admits "²" and "١٢"
            raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}.", param="logit_bias")
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}.", param="logit_bias")
    return {str(int(k)): float(v) for k, v in bias.items()}


def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages, normalised (developer -> system, text parts joined); a tool result must
    answer a call an earlier assistant turn made."""
    out: list[dict[str, Any]] = []
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "assistant" and m.tool_calls:
            msg["content"] = m.text() or None
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            called.update(c.id for c in m.tool_calls)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_request("A tool message needs a tool_call_id.", param=f"messages[{i}].tool_call_id")
            if m.tool_call_id not in called:
                raise bad_request(
                    f"Invalid parameter: messages[{i}].tool_call_id '{m.tool_call_id[:64]}' answers no earlier "
                    "tool call.",
                    param=f"messages[{i}].tool_call_id",
                )
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _guided(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
    """vLLM's guided decoding as the client sent it, ``{name: value}``, its types checked (the
    grammar engine checks the rest), or None. vLLM's own rules: one kind at a time, and none beside
    response_format or tools."""
    # empty is none, as for the refused extras (to_job)
    given = {name: getattr(req, name) for name in GUIDED if getattr(req, name) not in (None, "", [])}
    if not given:
        return None
    name = next(iter(given))
    if len(given) > 1:
        raise bad_request(f"Only one kind of guided decoding may be given, got {sorted(given)}.", param=name)
    fmt = getattr(req, "response_format", None)
    if (fmt is not None and fmt.type != "text") or (
        getattr(req, "tools", None) and req.tool_choice != "none"
    ):
        other = "response_format" if fmt is not None and fmt.type != "text" else "tools"
        raise bad_request(f"'{name}' cannot be combined with '{other}'.", param=name)
    value = given[name]
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise bad_request("structured_outputs must be an object.", param=name)
        kinds = {k for k, v in value.items() if v is not None and v is not False}
        unknown = sorted(kinds - set(_STRUCTURED_KEYS))
        if unknown or len(kinds) != 1:
            raise bad_request(
                f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}"
                + (f"; '{unknown[0][:64]}' is not supported by this server." if unknown else "."),
                param=name,
            )
    key, inner, param = guided_kind(name, value)
    if key == "json":
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except ValueError:
                raise bad_request("The JSON schema is not valid JSON.", param=param) from None
        if not isinstance(inner, dict) or not _schema_ok(inner):
            raise bad_request("The JSON schema must be an object whose types are JSON types.", param=param)
    elif key in ("regex", "grammar") and (not isinstance(inner, str) or not inner):
        raise bad_request(f"'{param}' must be a non-empty string.", param=param)
    elif key == "choice" and (
        not isinstance(inner, list) or not inner or not all(isinstance(c, str) and c for c in inner)
    ):
        raise bad_request(f"'{param}' must be a non-empty list of non-empty strings.", param=param)
    return {name: value}


def _structured(req: ChatCompletionRequest) -> dict[str, Any]:
    """tools, tool_choice, response_format and prediction as Job fields, checked for consistency."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice: str | dict[str, Any] | None = None
    if req.tool_choice is not None:
        choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise bad_request(
                f"tool_choice names a function that is not in tools: '{name[:64]}'.", param="tool_choice"
            )
    elif choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs at least one tool in tools.", param="tool_choice")
    fmt = req.response_format.model_dump(exclude_none=True, by_alias=True) if req.response_format else None
    if fmt is not None and fmt["type"] == "json_schema":
        schema = fmt.get("json_schema", {}).get("schema")
        if "json_schema" not in fmt:
            raise bad_request(
                "response_format json_schema needs a json_schema object.", param="response_format"
            )
        if schema is not None and not _schema_ok(schema):
            raise bad_request(
                "Invalid schema for response_format: a 'type' names no JSON type.", param="response_format"
            )
    if fmt is not None and fmt["type"] == "text":
        fmt = None  # the default; keeps the cache key of a request that did not send it
    for i, t in enumerate(tools or []):
        params = t["function"].get("parameters")
        if params is not None and not _schema_ok(params):
            raise bad_request(f"Invalid schema for function '{t['function']['name']}'.", param="tools")
        kind = params.get("type", "object") if isinstance(params, dict) else "object"
        if "object" not in (kind if isinstance(kind, list) else [kind]):
            # OpenAI's refusal, in its words: a call's arguments are an object, so no call could
            # come of any other schema (the model's [568] was markup left in content)
            raise bad_request(
                f"Invalid schema for function '{t['function']['name']}': schema must be a JSON Schema of "
                f"'type: \"object\"', got 'type: \"{str(kind)[:40]}\"'.",
                param=f"tools[{i}].function.parameters",
                code="invalid_function_parameters",
            )
    return {
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": fmt,
        "prediction": req.prediction.text() if req.prediction is not None else None,
    }


_JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _schema_ok(schema: Any) -> bool:
    """A cheap structural check (the grammar compiler does the rest): every ``type`` names JSON types."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if t is not None else []
    if any(x not in _JSON_TYPES for x in types):
        return False
    subs: list[Any] = (
        list((schema.get("properties") or {}).values()) if isinstance(schema.get("properties"), dict) else []
    )
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            subs.append(schema[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            subs.extend(schema[key])
    for defs in ("$defs", "definitions"):
        if isinstance(schema.get(defs), dict):
            subs.extend(schema[defs].values())
    return all(_schema_ok(x) for x in subs)


def _spec(req: ChatCompletionRequest | CompletionRequest) -> SpecParams:
    """Speculation for the request. (A seeded sampled request drafts a fixed k so the seed repeats:
    the engine decides that, see decoding.engine.Engine.start.)"""
    opts = req.speculative
    mode = SpecMode(opts.mode) if opts is not None else SpecMode.AUTO
    max_k = opts.max_k if opts is not None and opts.max_k is not None else None
    adaptive = opts is None or opts.adaptive is None or opts.adaptive
    confidence = opts.draft_confidence if opts is not None else None
    return SpecParams(
        mode=mode, max_k=max_k or SpecParams.max_k, adaptive=adaptive, draft_confidence=confidence
    )


MAX_TOKEN_ID = 2**31 - 1  # what an int32 index holds; the model's own vocabulary is the backend's check


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty.", param="prompt")
    prompts: list[str | list[int]] = (
        [list(prompt)] if all(isinstance(p, int) for p in prompt) else list(prompt)  # type: ignore[arg-type]
    )
    for p in prompts:
        if not isinstance(p, str) and any(not 0 <= t <= MAX_TOKEN_ID for t in p):
            bad = next(t for t in p if not 0 <= t <= MAX_TOKEN_ID)
            raise bad_request(
                f"Token ids in prompt must be in [0, {MAX_TOKEN_ID}], got {str(bad)[:40]}.", param="prompt"
            )
    return prompts


def _cache_salt(salt: str | None, tenant: str | None) -> str | None:
    """The request's prefix-cache salt, scoped to its tenant where keys are kept apart
    (``auth.prefix_cache_per_key``): opaque, since a remote upstream receives it as vLLM's cache_salt."""
    if tenant is None:
        return salt
    return hashlib.sha256(f"{tenant}\0{salt or ''}".encode()).hexdigest()[:32]
