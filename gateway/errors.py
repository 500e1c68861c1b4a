"""Every failure becomes one OpenAI error object here, and only here.

    APIError(status, message, type, param, code, headers)    what the client sees
    ├── from decoding.errors (to_api_error):
    │     UnknownModel      -> 404 invalid_request_error, code model_not_found, param model
    │     PromptTooLong     -> 400 invalid_request_error, code context_length_exceeded, param messages|prompt
    │     EngineOverloaded  -> 503 server_error, code overloaded, Retry-After
    │     EngineStopped     -> 503 server_error, code unavailable, Retry-After
    │     ValueError        -> 400 invalid_request_error (SamplingParams / SpecParams refusals;
    │                          InvalidParameter: a grammar that does not compile, a bad logit_bias id, with param)
    ├── pydantic ValidationError -> 400 invalid_request_error, param from the error location
    └── anything else       -> 500 server_error (a real fault; logged with its request id)

Never a 5xx for a client's mistake: the SDK retries 5xx (and 408/409/429) twice.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from decoding.errors import EngineOverloaded, EngineStopped, PromptTooLong, UnknownModel
from gateway.observability.record import MAX_CLIENT_CHARS
from gateway.protocol import ErrorBody, ErrorDetail

log = logging.getLogger("specgate.gateway")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()


def clip(text: str, limit: int = MAX_CLIENT_CHARS) -> str:
    """A client's string as an error message quotes it: cut, so a megabyte sent is not a megabyte echoed."""
    return text if len(text) <= limit else text[:limit] + "..."


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unavailable(message: str, retry_after: int, code: str = "unavailable") -> APIError:
    return APIError(503, message, "server_error", code=code, headers={"Retry-After": str(retry_after)})


def _branch(part: int | str) -> bool:
    """A union branch's name that pydantic adds to a location (str, list[str], literal[...],
    NamedToolChoice): the wire's field names are lower case."""
    return isinstance(part, str) and (part in ("str", "int") or "[" in part or part[:1].isupper())


def _loc(loc: tuple[int | str, ...]) -> str | None:
    """pydantic's ('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _branch(part):
            out += f".{part}" if out else str(part)
    return out or None


def _reported(errors: list[Any]) -> Any:
    """The error to report: the first, or where it is a union's, the error of the branch the value
    went furthest into (a text part without its text is that, not "should be a valid string")."""
    first = errors[0]
    loc = tuple(first["loc"])
    cut = next((i for i, part in enumerate(loc) if _branch(part)), None)
    if cut is None:
        return first
    return max((e for e in errors if tuple(e["loc"])[:cut] == loc[:cut]), key=lambda e: len(e["loc"]))


def from_validation(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = _reported(errors)
    if first["type"] == "json_invalid" and "recursion limit" in first["msg"]:
        # valid JSON, past the depth pydantic's parser recurses to (200 levels)
        return bad_request("The JSON body is nested too deeply: at most 200 levels are read.")
    if first["type"] == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
            "your HTTP library correctly. The OpenAI API expects a JSON payload.)"
        )
    param = _loc(tuple(first["loc"]))
    if first["type"] == "model_type" and param is None:
        return bad_request("The request body must be a JSON object.")
    if first["type"] == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param)
    value = first.get("input")
    shown = repr(value) if not isinstance(value, dict | list) else type(value).__name__
    return bad_request(f"Invalid value for '{param}': {first['msg']} (got {shown[:80]}).", param=param)


def to_api_error(exc: BaseException, prompt_param: str = "messages", retry_after: int = 1) -> APIError:
    """Map any exception raised while serving a request (the one translation point). A 429 or
    503 always says when to retry: an upstream's, passed on, may have come without Retry-After. One
    that says not to retry (``x-should-retry: false``: a request too large for the key's tpm) stays so."""
    if isinstance(exc, APIError):
        said = {k.lower() for k in exc.headers}
        if exc.status in (429, 503) and not said & {"retry-after", "x-should-retry"}:
            exc.headers = {**exc.headers, "Retry-After": str(retry_after)}
        return exc
    if isinstance(exc, ValidationError):
        return from_validation(exc)
    if isinstance(exc, UnknownModel):
        # the engine's message quotes the name whole
        message = str(exc).replace(exc.model, clip(exc.model), 1)
        return APIError(404, message, param="model", code="model_not_found")
    if isinstance(exc, PromptTooLong):
        return bad_request(exc.describe(prompt_param), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, EngineOverloaded):
        return unavailable(str(exc), retry_after, code="overloaded")
    if isinstance(exc, EngineStopped):
        return unavailable("The server is shutting down; retry on another replica.", retry_after)
    if isinstance(exc, ValueError):  # decoding.errors.InvalidParameter names its parameter
        return bad_request(str(exc), param=getattr(exc, "param", None))
    log.error("unhandled error", exc_info=exc)
    return APIError(500, "The server had an error while processing your request.", "server_error")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def error_event(exc: BaseException) -> dict[str, Any]:
    """The one SSE event sent when generation fails after the 200 went out (then [DONE])."""
    return to_api_error(exc).body()
