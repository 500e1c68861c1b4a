"""The per-request record that the middleware, the engine wrapper and the handlers fill in.

The middleware creates one ``RequestRecord`` per HTTP request and makes it reachable through a
context variable, so code deeper down (the engine wrapper, the cache, the router seam) adds what it
knows without threading an argument through every call. When the response ends, the middleware
turns the record into metrics, span attributes and one log line.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

from decoding.params import RequestStats

# Client-chosen strings kept on the record (and so logged and put on spans) are cut to this length.
MAX_CLIENT_CHARS = 128

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "specgate_request", default=None
)


def current_request() -> RequestRecord | None:
    """The record of the request being served, or None outside one (CLI, tests on the engine)."""
    return _current.get()


@dataclass
class RequestRecord:
    method: str
    route: str  # route template or "other": never the raw path
    log_content: bool = False
    started: float = field(default_factory=time.perf_counter)
    request_id: str | None = None
    response_id: str | None = None  # the id the answer carries (chatcmpl-..., cmpl-...)
    status: int = 0
    stream: bool = False
    request_model: str | None = None  # as the client asked ("auto", an alias, a name)
    model: str | None = None  # the model that served it
    operation: str | None = None  # chat | text_completion
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    usage_set: bool = False  # the handler reported usage; engine counts are then not used
    finish_reasons: list[str] = field(default_factory=list)
    first_token: float | None = None  # perf_counter of the first generated token
    first_byte: float | None = None  # perf_counter of the first response body byte
    ended: float | None = None
    phase: str = "gateway"  # cache, route, queued, decode, upstream, stream: where an abort happened
    aborted: bool = False
    cache: str | None = None  # exact | semantic | miss | skip
    route_tier: str | None = None
    route_strategy: str | None = None
    upstream: str | None = None
    error_type: str | None = None  # an error's code, else its type (never its message)
    # the OpenAI error type of the event a stream ended with after its 200 (a failure the status hides)
    stream_error: str | None = None
    generations: list[RequestStats] = field(default_factory=list)
    prompt_text: str | None = None  # kept only with log_content
    completion_text: str | None = None

    # ---- what handlers call ---------------------------------------------------------------

    def set_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        """The usage the response reports (cache hits and upstream calls need this; local
        generations are counted by the engine wrapper when a handler does not call it)."""
        self.prompt_tokens, self.completion_tokens, self.usage_set = prompt_tokens, completion_tokens, True

    def set_content(self, prompt: str | None = None, completion: str | None = None) -> None:
        """Prompt/completion text for the log line and span; dropped unless ``log_content``."""
        if not self.log_content:
            return
        if prompt is not None:
            self.prompt_text = prompt
        if completion is not None:
            self.completion_text = (self.completion_text or "") + completion

    def mark_first_token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()

    # ---- derived ----------------------------------------------------------------------------

    @property
    def duration_s(self) -> float:
        return (self.ended or time.perf_counter()) - self.started

    @property
    def ttft_s(self) -> float | None:
        """First generated token, else (cache hits, upstream passthrough) the first body byte of
        a successful response that carried tokens."""
        if self.first_token is not None:
            return self.first_token - self.started
        if self.first_byte is not None and self.completion_tokens and 200 <= self.status < 300:
            return self.first_byte - self.started
        return None

    def spec_totals(self) -> dict[str, int]:
        g = self.generations
        return {
            "steps": sum(s.steps for s in g),
            "drafted": sum(s.drafted for s in g),
            "accepted": sum(s.accepted for s in g),
            "spec_disabled_steps": sum(s.spec_disabled_steps for s in g),
        }


# ---- one-line seams for the handlers (no-ops outside a request) -------------------------------

_OPERATIONS = {"chat": "chat", "completion": "text_completion"}


def observe_job(job: Any) -> None:
    """What the client asked for (a ``gateway.backends.Job``), for the span and the log line."""
    rec = _current.get()
    if rec is None:
        return
    rec.request_model = job.model[:MAX_CLIENT_CHARS]
    rec.operation = _OPERATIONS.get(job.kind, rec.operation)
    rec.temperature, rec.top_p, rec.max_tokens, rec.seed = (
        job.temperature,
        job.top_p,
        job.max_tokens,
        job.seed,
    )
    if rec.log_content:  # a chat's turns one a line, or a completion's prompts
        turns = job.messages or []
        prompt = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in turns)
        rec.set_content(prompt=prompt if job.kind == "chat" else "\n".join(map(str, job.prompts or [])))


def note_phase(phase: str) -> None:
    """Where the request is, for an abort's phase: ``cache`` replaying a hit, ``upstream`` waiting
    for an upstream's first event (the local engine's wrapper sets ``queued`` and ``decode``)."""
    rec = _current.get()
    if rec is not None:
        rec.phase = phase


def note_response_id(response_id: str) -> None:
    """The id the answer carries (``chatcmpl-...``), for the span's ``gen_ai.response.id``, which the
    GenAI conventions define as the completion's id: it held the request id."""
    rec = _current.get()
    if rec is not None:
        rec.response_id = response_id


def note_served(model: str, upstream: str | None = None) -> None:
    """The route that served the request, after any fallback: its model (the engine's wrapper names
    the model a request is submitted to, refused or not: a full engine's fallback to an upstream was
    labelled with the local model), and ``upstream``, whose stream it now passes on."""
    rec = _current.get()
    if rec is None:
        return
    rec.model = model[:MAX_CLIENT_CHARS]
    if upstream is not None:
        rec.upstream = upstream[:MAX_CLIENT_CHARS]
        rec.phase = "stream"


def note_first_token() -> None:
    """The request's first token arrived (a backend that is not the observed engine: an upstream).
    Without it the time to first token is the first body byte's, for a request not streamed the
    whole answer's."""
    rec = _current.get()
    if rec is not None:
        rec.mark_first_token()


def note_usage(prompt_tokens: int, completion_tokens: int) -> None:
    """The usage the response reports (local, cached or upstream alike)."""
    rec = _current.get()
    if rec is not None:
        rec.set_usage(prompt_tokens, completion_tokens)


def error_kind(error: Any) -> str | None:
    """What telemetry names an OpenAI error object (``{"error": {...}}``) by: its code, else its
    type, cut to 64 characters; never its message, which may quote the prompt or an upstream."""
    err = error.get("error") if isinstance(error, dict) else None
    if not isinstance(err, dict):
        return None
    kind = err.get("code") or err.get("type")
    return str(kind)[:64] if kind else None


def note_stream_error(error: dict[str, Any]) -> None:
    """The error event a stream ends with after its 200 went out (then [DONE]): the request
    failed, which its status no longer can say."""
    rec = _current.get()
    if rec is None:
        return
    err = error.get("error")
    kind = err.get("type") if isinstance(err, dict) else None
    rec.stream_error = str(kind)[:64] if kind else "server_error"
    rec.error_type = error_kind(error) or rec.stream_error


def note_completion(texts: list[str]) -> None:
    """The text the response carries, every choice's one a line (kept only with ``log_content``)."""
    rec = _current.get()
    if rec is not None and rec.log_content:  # no join on every request where nothing keeps it
        rec.set_content(completion="\n".join(texts))
