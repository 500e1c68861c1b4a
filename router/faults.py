"""What an upstream's answer can fail in, as the gateway sees it: the exception tree (each with
the status and OpenAI error object it becomes), an upstream's error payload normalised to that object,
and the chunk fields the gateway reads, checked once (`malformed`). router/upstream.py raises them.

Exceptions (every httpx exception is translated in `router.upstream._translated`, nowhere else):

    UpstreamError                 .status, .error_body() -> the OpenAI error object
    ├── UpstreamUnavailable       nothing reached the client: the gateway may fall back
    │   ├── UpstreamConnectError  refused, reset, DNS, TLS                        retried
    │   ├── UpstreamTimeout       no answer in time (it may still be working)     not retried
    │   ├── UpstreamPoolFull      max_connections busy (not the upstream's fault) not retried
    │   ├── UpstreamHTTPError     429 or 5xx                                      retried (a short Retry-After)
    │   ├── UpstreamBadResponse   not OpenAI's SSE, JSON or chunks                not retried
    │   ├── UpstreamErrorEvent    a stream whose first event is an error object   not retried
    │   ├── UpstreamRefusedUs     401, 403, 404: the gateway's key, model or URL  not retried
    │   └── CircuitOpen           the breaker refused the call                    not retried
    ├── UpstreamRejected          any other 4xx: the request's fault, passed on verbatim, never retried
    └── UpstreamStreamBroken      the stream died after its first event

Deliberate: an in-band `{"error": ...}` event from the upstream after its first event is yielded like
a chunk, not raised: it is the upstream's answer and the client should see it. As the first event it
is raised (`UpstreamErrorEvent`): nothing has reached the client, which gets a plain HTTP error or a
fallback instead of a 200 whose stream holds only the error. A stream whose [DONE] comes with a
choice unfinished (no finish_reason) and no error is `UpstreamBadResponse`: an answer cut short is
no answer (the formatter would have finished it "stop", and the cache kept it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError


def _error_obj(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class UpstreamError(Exception):
    status = 502
    code = "upstream_error"
    type_ = "server_error"
    retryable = False
    breaker_failure = True  # does it count against the upstream's circuit breaker
    outcome = "error"  # the specgate_upstream_requests label

    def __init__(self, upstream: str, message: str, retry_after: float | None = None):
        super().__init__(f"upstream '{upstream}': {message}")
        self.upstream = upstream
        self.retry_after = retry_after

    def error_body(self) -> dict[str, Any]:
        return _error_obj(str(self), self.type_, self.code)


class UpstreamUnavailable(UpstreamError):
    status = 503


class UpstreamConnectError(UpstreamUnavailable):
    code = "upstream_unavailable"
    retryable = True


class UpstreamTimeout(UpstreamUnavailable):
    status = 504
    code = "upstream_timeout"
    outcome = "timeout"


class UpstreamHTTPError(UpstreamUnavailable):
    retryable = True

    def __init__(self, upstream: str, upstream_status: int, message: str, retry_after: float | None = None):
        super().__init__(upstream, f"HTTP {upstream_status}: {message}", retry_after)
        self.upstream_status = upstream_status
        self.outcome = "http_4xx" if upstream_status < 500 else "http_5xx"
        if upstream_status == 429:
            # The upstream is alive, only busy: pass the rate limit on without tripping the breaker.
            self.status, self.code, self.type_, self.breaker_failure = (
                429,
                "rate_limit_exceeded",
                "rate_limit_error",
                False,
            )
        else:
            self.status = 503 if upstream_status == 503 else 502


class UpstreamPoolFull(UpstreamUnavailable):
    """Every connection `max_connections` allows was busy for timeout_s: the gateway's own limit,
    not the upstream's failure, so the breaker does not hear of it."""

    code = "upstream_busy"
    breaker_failure = False
    outcome = "pool_full"


class UpstreamBadResponse(UpstreamUnavailable):
    status = 502
    code = "upstream_bad_response"


class UpstreamErrorEvent(UpstreamUnavailable):
    """The upstream answered 200 and then, before any chunk, an in-band error (vLLM streams errors
    found while generating this way). Not counted against the breaker: the upstream is up, and a
    request that makes it fail would otherwise open the circuit for every tenant."""

    status = 502
    breaker_failure = False

    def __init__(self, upstream: str, event: Mapping[str, Any]):
        self.body = normalise_error(event, self.status)
        super().__init__(upstream, f"error event: {self.body['error']['message']}")

    def error_body(self) -> dict[str, Any]:
        return self.body  # the upstream's message, type and code


class UpstreamRefusedUs(UpstreamUnavailable):
    """A 401, 403 or 404 from the upstream: it refused the gateway (the key of `api_key_env`, the
    configured `model` or `base_url`), not the client's request, which names neither. Passed on
    verbatim, a client with a good key (or none needed) got the SDK's AuthenticationError for
    the gateway's key, and one asking for `auto` a 404 for a model it never named, with no
    fallback. A 502, and the route falls back. Not counted against the breaker: a 404 can be one
    endpoint's (a chat-only API's /completions), and the other requests still get through."""

    status = 502
    code = "upstream_refused_gateway"
    breaker_failure = False
    outcome = "http_4xx"

    def __init__(self, upstream: str, upstream_status: int, message: str):
        super().__init__(upstream, f"HTTP {upstream_status}: {message}")
        self.upstream_status = upstream_status


REFUSED_US = (401, 403, 404)  # what the upstream answers the gateway's own settings with


class CircuitOpen(UpstreamUnavailable):
    code = "upstream_circuit_open"
    breaker_failure = False
    outcome = "circuit_open"


class UpstreamRejected(UpstreamError):
    breaker_failure = False
    outcome = "http_4xx"

    def __init__(self, upstream: str, status: int, body: dict[str, Any]):
        super().__init__(upstream, str(body["error"].get("message")))
        self.status = status
        self.body = body

    def error_body(self) -> dict[str, Any]:
        return self.body  # the upstream's own error object: its message, type, param and code


class UpstreamStreamBroken(UpstreamError):
    code = "upstream_stream_broken"


MAX_MESSAGE_CHARS = 1000  # of an upstream's error message passed on (a 3 MB one came back whole)
MAX_FIELD_CHARS = 128  # of its type, code and param


def _field(value: Any, limit: int = MAX_FIELD_CHARS) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def normalise_error(payload: Any, status: int) -> dict[str, Any]:
    """Any upstream error payload as the OpenAI error object (vLLM, TGI and FastAPI differ): strings,
    bounded. An upstream's `param` that was an object failed the gateway's own error model, a 400
    blaming the client's 'param', or mid-stream a stream cut without its error event or [DONE]."""
    default = "invalid_request_error" if status < 500 else "server_error"
    message: Any = None
    type_: Any = None
    code = param = None
    if isinstance(payload, Mapping):
        err = payload.get("error")
        if isinstance(err, Mapping):
            message, type_, code, param = (
                err.get("message"),
                err.get("type"),
                err.get("code"),
                err.get("param"),
            )
        elif isinstance(err, str):  # TGI: {"error": "...", "error_type": "..."}
            message, type_ = err, payload.get("error_type")
        else:  # vLLM's older {"object": "error", "message": ...}; FastAPI's {"detail": ...}
            key = next((k for k in ("message", "detail") if k in payload), None)
            if key is not None:
                message, type_ = payload[key], payload.get("type")
    if message is None:
        message = payload if isinstance(payload, str) else json.dumps(payload)
    return _error_obj(
        _field(message, MAX_MESSAGE_CHARS) or f"HTTP {status}",
        _field(type_ or default),
        None if code is None else _field(code),
        None if param is None else _field(param),
    )


class _Read(BaseModel):
    """The fields of an upstream chunk the gateway reads, with their types (strict: "0" is no
    index, true no count); whatever else an upstream sends is its own and passes."""

    model_config = ConfigDict(extra="allow", strict=True)


class _Function(_Read):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(_Read):
    index: NonNegativeInt = 0
    function: _Function | None = None


class _Delta(_Read):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(_Read):
    index: NonNegativeInt = 0
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class _Usage(_Read):
    prompt_tokens: NonNegativeInt | None = None
    completion_tokens: NonNegativeInt | None = None


class _Chunk(_Read):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None


def is_error(event: Mapping[str, Any]) -> bool:
    """An in-band error, not a chunk: OpenAI's ``{"error": {...}}`` (TGI's ``{"error": "..."}``), or
    vLLM's older ``{"object": "error", "message": ...}``, which was read as a chunk of no choices
    and dropped, so an answer the upstream never finished came back as a whole one."""
    return ("error" in event or event.get("object") == "error") and "choices" not in event


def malformed(event: Mapping[str, Any]) -> str | None:
    """What makes a chunk unreadable as OpenAI's (a field the gateway reads, of the wrong type), or
    None. Checked here, once, so that an upstream's garbage is its fault (502) wherever it is read:
    a choice that was a string, an index "zero" or a usage count "x" were a 500 with a traceback or
    a 400 blaming the client. An in-band error object is not a chunk: not checked."""
    if is_error(event):
        return None
    try:
        _Chunk.model_validate(event)
    except ValidationError as exc:
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return None
