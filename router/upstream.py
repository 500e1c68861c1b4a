"""A client for one OpenAI-compatible upstream (vLLM, TGI, a hosted API), built on httpx.AsyncClient.

Streaming is split in two so that retries and fallback only ever happen before the client has seen a
byte: `open_stream()` sends the request, retries, and reads up to the first SSE event; once it returns,
the gateway sends its headers, and iterating the returned `UpstreamStream` can only fail with
`UpstreamStreamBroken`, which ends the client's stream with one in-band error event.

Its exceptions, and what an upstream's answer can be wrong in, are router/faults.py's.

Observed through an optional `UpstreamMetrics` (gateway.observability.Metrics): one `observe_upstream`
per attempt, by the exception's `outcome` (a stream's when it ends, so its latency runs to the last
byte), one `observe_upstream_retry` per retry, and the breaker's state after each. `instrument` is
called once on the httpx client (gateway.observability.Tracing.instrument_httpx: a CLIENT span per
call, whose `traceparent` replaces the forwarded one: same trace, with this call as the parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import json
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from router.breaker import CircuitBreaker
from router.config import UpstreamSettings
from router.faults import (
    REFUSED_US,
    CircuitOpen,
    UpstreamBadResponse,
    UpstreamConnectError,
    UpstreamError,
    UpstreamErrorEvent,
    UpstreamHTTPError,
    UpstreamPoolFull,
    UpstreamRefusedUs,
    UpstreamRejected,
    UpstreamStreamBroken,
    UpstreamTimeout,
    is_error,
    malformed,
    normalise_error,
)

# The most of one SSE line, and of one event's data, read from an upstream (an OpenAI chunk is a few
# KB; an upstream that ignores `stream` and answers one JSON body, a whole generation, is still one
# line). Past it the upstream is at fault: unbounded, one event of 400 MB held ~1.7 GB for 2 s, and a
# line that never ends was read until timeout_s.
MAX_EVENT_BYTES = 16 << 20
# The most of an error answer's body read, as of an event (its fields are kept, its message cut to
# 1,000 characters, so it is parsed whole where it fits): read unbounded, a body that never ended
# held the request until timeout_s.
MAX_ERROR_BYTES = MAX_EVENT_BYTES
_LINE_END = re.compile(rb"\r\n|\r|\n")
# What is read after [DONE] so that the connection goes back to httpx's pool (UpstreamStream._drain):
# the body's end (chunked encoding's last chunk) comes at once; more, or later, and it is closed
DRAIN_BYTES = 64 << 10
DRAIN_S = 1.0

FORWARDED_HEADERS = ("traceparent", "tracestate", "x-request-id")  # W3C trace context and our id
OUR_FIELDS = ("speculative", "stream_granularity")  # specgate extensions an upstream would refuse


class UpstreamMetrics(Protocol):
    def observe_upstream(self, upstream: str, outcome: str, seconds: float | None = None) -> None: ...

    def observe_upstream_retry(self, upstream: str, reason: str) -> None: ...

    def set_circuit_state(self, component: str, state: str) -> None: ...


@contextlib.contextmanager
def _translated(name: str) -> Iterator[None]:
    """The one place outside exceptions become ours."""
    try:
        yield
    except httpx.TimeoutException as exc:
        if isinstance(exc, httpx.PoolTimeout):
            raise UpstreamPoolFull(name, "every connection max_connections allows stayed busy") from exc
        if isinstance(exc, httpx.ConnectTimeout):
            raise UpstreamConnectError(name, f"connect timeout ({exc!r})") from exc
        raise UpstreamTimeout(name, f"timed out ({type(exc).__name__})") from exc
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        raise UpstreamConnectError(name, f"{type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise UpstreamBadResponse(name, f"{type(exc).__name__}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise UpstreamBadResponse(name, f"invalid JSON ({exc.msg})") from exc


def _retry_reason(exc: UpstreamError) -> str:
    """The specgate_upstream_retries label of a retryable error."""
    if isinstance(exc, UpstreamHTTPError):
        return "http_429" if exc.upstream_status == 429 else "http_5xx"
    return "connect"


def _retry_after(resp: httpx.Response) -> float | None:
    """The upstream's Retry-After in seconds: delay-seconds, or an HTTP date (RFC 9110 allows both;
    a date was read as none, and the client was told nothing)."""
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:  # "inf" and "nan" parse, and were a 500 where the header was written back
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # an obsolete date form without a zone: HTTP dates are GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, (when - datetime.datetime.now(datetime.UTC)).total_seconds())


def encode_event(obj: Mapping[str, Any]) -> bytes:
    """One SSE event in our wire format (compact JSON, UTF-8, `\\n\\n`)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True)
class Rewrite:
    """What the gateway changes on each upstream chunk so the client sees one consistent response.
    None leaves the upstream's value."""

    id: str | None = None
    model: str | None = None  # the name the client is answered with
    created: int | None = None
    system_fingerprint: str | None = None
    include_usage: bool = False  # the client asked for stream_options.include_usage

    def apply(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if is_error(chunk):
            return {"error": normalise_error(chunk, 500)["error"]}
        for key in ("id", "model", "created", "system_fingerprint"):
            value = getattr(self, key)
            if value is not None:
                chunk[key] = value
        for choice in chunk.get("choices") or ():
            choice.setdefault("logprobs", None)
            choice.setdefault("finish_reason", None)
        if self.include_usage:
            chunk.setdefault("usage", None)
        return chunk


def _too_large(upstream: str) -> UpstreamBadResponse:
    return UpstreamBadResponse(upstream, f"an event over {MAX_EVENT_BYTES} bytes")


async def sse_lines(chunks: AsyncIterator[bytes], upstream: str) -> AsyncIterator[str]:
    """SSE's lines, ended by CR, LF or CRLF and nothing else, each at most ``MAX_EVENT_BYTES``.
    httpx's ``aiter_lines`` ends a line wherever ``str.splitlines`` does, at U+2028, U+2029, U+0085
    and the C0 separators too, which JSON carries raw inside a string (pydantic's JSON, vLLM's, and
    ``ensure_ascii=False``'s, ours): an answer holding one broke mid-stream as invalid JSON. Lines are
    cut on bytes, then decoded whole, so a character split between chunks is safe."""
    buf = bytearray()
    after_cr = False  # the last chunk ended in CR: an LF opening this one completes that CRLF
    async for chunk in chunks:
        if not chunk:
            continue
        if after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        after_cr = chunk.endswith(b"\r")
        start = 0
        for end in _LINE_END.finditer(chunk):
            buf += chunk[start : end.start()]
            start = end.end()
            yield buf.decode("utf-8", "replace")
            buf.clear()
        buf += chunk[start:]
        if len(buf) > MAX_EVENT_BYTES:
            raise _too_large(upstream)
    if buf:
        yield buf.decode("utf-8", "replace")


class UpstreamStream:
    """The upstream's SSE as chunk dicts. Made by `UpstreamClient.open_stream`, first event in hand."""

    def __init__(self, client: UpstreamClient, resp: httpx.Response, rewrite: Rewrite, started: float):
        self._client, self._resp, self._rewrite = client, resp, rewrite
        self.upstream = client.name  # who to blame in errors about what it sent
        self._lines = sse_lines(resp.aiter_bytes(), client.name)
        self._first: dict[str, Any] | None = None
        self._done = False
        self._unfinished: set[int] | None = (
            None  # choices seen without their finish_reason; None: no chunk yet
        )
        self._closing: asyncio.Future[None] | None = None  # the response's close, once begun
        self._finished: set[int] = set()  # choices seen with their finish_reason
        self._errored = False  # an in-band error came
        self._started = started  # perf_counter when the request was sent
        self._outcome: str | None = "ok"  # observed when the stream closes; None once observed
        self.status_code = resp.status_code

    async def _next_event(self) -> dict[str, Any] | None:
        """The next data event, or None at `[DONE]`, within `timeout_s`. Raises httpx errors
        untranslated, `UpstreamBadResponse` for a chunk the gateway cannot read, and `UpstreamTimeout`
        when no event came in time: httpx's read timeout counts bytes, so an upstream that sent
        `: ping` comments and nothing else held the client forever."""
        timeout = self._client.settings.timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._read_event()
        except TimeoutError:
            raise UpstreamTimeout(self._client.name, f"no event in {timeout:g} s") from None

    async def _read_event(self) -> dict[str, Any] | None:
        data: list[str] = []
        size = 0
        async for line in self._lines:
            if line.startswith(":"):
                continue  # comment / keep-alive
            if line == "":
                if not data:
                    continue
                payload = "\n".join(data)
                if payload.strip() == "[DONE]":
                    self._check_done()
                    return None
                return self._checked(json.loads(payload), payload)
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value[1:] if value.startswith(" ") else value)
                size += len(data[-1])
                if size > MAX_EVENT_BYTES:  # an event of many data lines
                    raise _too_large(self._client.name)
        if data:  # a last event without its blank line
            payload = "\n".join(data)
            if payload.strip() == "[DONE]":
                self._check_done()
                return None
            return self._checked(json.loads(payload), payload)
        if self._unfinished == set():
            # The body ended cleanly (a cut one raises in httpx) after every choice's finish: some
            # servers never send [DONE], and the SDK reading them directly ends there without an
            # error; here the whole answer became a 502, or an error event after its last chunk
            return None
        # A body that ended cleanly (httpx raises for a cut one) will end the same way if asked again:
        # not retried, so an upstream that ignores `stream` and answers JSON (a whole generation
        # each time) is asked once, not 1 + retries times
        kind = self._resp.headers.get("content-type", "no content-type")
        raise UpstreamBadResponse(self._client.name, f"the body ({kind[:64]}) ended without [DONE]")

    def _check_done(self) -> None:
        if self._unfinished is None:  # it was an empty 200: no answer, yet cached as one
            raise UpstreamBadResponse(self._client.name, "[DONE] before any choice")
        if self._unfinished and not self._errored:  # cut short: the formatter would finish it "stop"
            raise UpstreamBadResponse(
                self._client.name, f"[DONE] before choice {min(self._unfinished)} finished"
            )

    def _checked(self, event: Any, payload: str) -> dict[str, Any]:
        if not isinstance(event, dict):
            raise json.JSONDecodeError("event is not a JSON object", payload, 0)
        if is_error(event):
            self._errored = True  # its answer is the error: the choices it cut need no finish
        wrong = malformed(event)
        if wrong is not None:
            raise UpstreamBadResponse(self._client.name, f"unreadable chunk: {wrong}")
        for c in event.get("choices") or ():
            if self._unfinished is None:
                self._unfinished = set()
            if c.get("finish_reason") is None:
                if c.get("index", 0) not in self._finished:  # a chunk after its finish (usage)
                    self._unfinished.add(c.get("index", 0))
            else:
                self._unfinished.discard(c.get("index", 0))
                self._finished.add(c.get("index", 0))
        return self._rewrite.apply(event)

    async def _peek(self) -> None:
        with _translated(self._client.name):
            self._first = await self._next_event()
        if self._first is None:
            self._done = True

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[dict[str, Any]]:
        try:
            if self._first is not None:
                first, self._first = self._first, None
                yield first
            while not self._done:
                try:
                    with _translated(self._client.name):
                        event = await self._next_event()
                except UpstreamError as exc:
                    self._client.breaker.record_failure()
                    self._outcome = UpstreamStreamBroken.outcome
                    raise UpstreamStreamBroken(
                        self._client.name, f"stream broke after it started: {exc}"
                    ) from exc
                if event is None:
                    self._done = True
                    break
                if is_error(event):
                    self._outcome = "error"  # its in-band error: passed on, and the call failed
                yield event
        finally:
            await self.aclose()

    async def _drain(self) -> None:
        """Read the body's end after a whole answer, then close: httpx returns a connection read to
        its end to its pool. Closed unread (the chunked body's last chunk still to come after
        [DONE]), the connection was closed with it, and every request to an upstream opened a new
        one: a TCP (and, to a hosted API, a TLS) handshake each, 20 connections for 20 requests
        against a local stand-in. An upstream that sends more than ``DRAIN_BYTES`` after [DONE], or
        takes longer than ``DRAIN_S``, has its connection closed instead."""
        read = 0
        try:
            async with asyncio.timeout(DRAIN_S):
                async for line in self._lines:
                    read += len(line) + 1
                    if read > DRAIN_BYTES:
                        break
        except Exception:  # whatever ends the read, the close below drops the connection
            pass
        # no one awaits this task: a close that fails (the client shut with the server) ends it
        # quietly rather than as an exception never retrieved
        with contextlib.suppress(Exception):
            await self._resp.aclose()

    async def aclose(self) -> None:
        """Close the upstream connection (the client left, or the stream ended). The close runs to
        its end even when the caller is cancelled (a client leaving cancels the task reading the
        stream): cut inside httpx's close, the connection stayed in the pool as in use, and with
        `max_connections` set each client that left mid-stream took a connection for good. After a
        whole answer the body's end is read in the background (``_drain``): its client does not
        wait for it."""
        if self._outcome is not None:
            self._client._observe(self._outcome, self._started)
            self._outcome = None
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._drain() if self._done else self._resp.aclose())
            if self._done:
                _draining.add(self._closing)  # held until it ends (the loop keeps weak references)
                self._closing.add_done_callback(_draining.discard)
        if not self._done:
            await asyncio.shield(self._closing)


_draining: set[asyncio.Future[None]] = set()


class UpstreamClient:
    def __init__(
        self,
        settings: UpstreamSettings,
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: UpstreamMetrics | None = None,
        instrument: Callable[[httpx.AsyncClient], None] | None = None,
    ):
        self.settings = settings
        self.name = settings.name
        self.metrics = metrics
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s)
        headers = {"content-type": "application/json"}
        if settings.api_key_env is not None:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise ValueError(
                    f"upstreams[{settings.name}].api_key_env: ${settings.api_key_env} is not set"
                )
            headers["authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(settings.timeout_s, connect=min(5.0, settings.timeout_s))
        limits = httpx.Limits(max_connections=settings.max_connections)  # httpx's default: 100
        self._http = httpx.AsyncClient(base_url=settings.base_url.rstrip("/") + "/", timeout=timeout,
                                       headers=headers, transport=transport, limits=limits)  # fmt: skip
        if instrument is not None:
            instrument(self._http)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _request(
        self, path: str, body: Mapping[str, Any], headers: Mapping[str, str] | None, stream: bool
    ) -> httpx.Request:
        payload = {k: v for k, v in body.items() if k not in OUR_FIELDS}
        payload["model"] = self.settings.model
        payload["stream"] = stream
        lowered = {k.lower(): v for k, v in (headers or {}).items()}
        fwd = {k: lowered[k] for k in FORWARDED_HEADERS if k in lowered}
        if stream:
            fwd["accept"] = "text/event-stream"
        return self._http.build_request("POST", path.lstrip("/"), json=payload, headers=fwd)

    async def _status_error(self, resp: httpx.Response) -> UpstreamError:
        raw = bytearray()
        async for chunk in resp.aiter_bytes():
            raw += chunk
            if len(raw) >= MAX_ERROR_BYTES:
                break
        await resp.aclose()
        try:
            payload: Any = json.loads(raw)
        except ValueError:
            payload = raw.decode("utf-8", "replace")
        if resp.status_code == 429 or resp.status_code >= 500:
            message = normalise_error(payload, resp.status_code)["error"]["message"]
            return UpstreamHTTPError(self.name, resp.status_code, message, _retry_after(resp))
        if resp.status_code in REFUSED_US:
            message = normalise_error(payload, resp.status_code)["error"]["message"]
            return UpstreamRefusedUs(self.name, resp.status_code, message)
        return UpstreamRejected(self.name, resp.status_code, normalise_error(payload, resp.status_code))

    def _too_long(self, exc: UpstreamError) -> bool:
        """Is the upstream's Retry-After longer than a retry here may wait (max_retry_wait_s)?"""
        return exc.retry_after is not None and exc.retry_after > self.settings.max_retry_wait_s

    def _delay(self, attempt: int, exc: UpstreamError) -> float:
        if exc.retry_after is not None:
            return exc.retry_after  # at most max_retry_wait_s: _too_long
        # Exponential backoff with jitter, so retrying gateways do not stampede a recovering upstream.
        return self.settings.backoff_s * (2.0**attempt) * random.uniform(0.5, 1.0)

    def _observe(self, outcome: str, started: float | None = None) -> None:
        """One call's outcome and latency, and the breaker's state after it."""
        if self.metrics is not None:
            seconds = None if started is None else time.perf_counter() - started
            self.metrics.observe_upstream(self.name, outcome, seconds)
            self.metrics.set_circuit_state(self.name, self.breaker.state.value)

    async def _attempts(self, once: Any) -> Any:
        """Run `once(started)` under the breaker, retrying what may be retried, with backoff."""
        last: UpstreamError | None = None
        for attempt in range(self.settings.retries + 1):
            if not self.breaker.allow():
                self._observe(CircuitOpen.outcome)
                raise CircuitOpen(self.name, "circuit open after repeated failures",
                                  retry_after=self.breaker.retry_after()) from last  # fmt: skip
            started = time.perf_counter()
            try:
                result = await once(started)
            except UpstreamError as exc:
                if exc.breaker_failure:
                    self.breaker.record_failure()
                elif not isinstance(exc, UpstreamHTTPError):
                    self.breaker.record_success()  # a 4xx: the upstream is up and answering
                self._observe(exc.outcome, started)
                if not exc.retryable or attempt == self.settings.retries or self._too_long(exc):
                    raise
                if self.metrics is not None:
                    self.metrics.observe_upstream_retry(self.name, _retry_reason(exc))
                last = exc
                await asyncio.sleep(self._delay(attempt, exc))
                continue
            self.breaker.record_success()
            if not isinstance(result, UpstreamStream):  # a stream is observed when it closes
                self._observe("ok", started)
            return result
        raise AssertionError("unreachable")

    async def open_stream(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
        rewrite: Rewrite | None = None,
    ) -> UpstreamStream:
        """Send a streaming request and read its first event. Raises `UpstreamUnavailable` (fall back)
        or `UpstreamRejected` (pass on); after it returns nothing has reached the client yet."""

        async def once(started: float) -> UpstreamStream:
            with _translated(self.name):
                resp = await self._http.send(self._request(path, body, headers, True), stream=True)
                if resp.status_code != 200:
                    raise await self._status_error(resp)
            stream = UpstreamStream(self, resp, rewrite or Rewrite(), started)
            try:
                await stream._peek()
                first = stream._first
                if first is not None and is_error(first):
                    raise UpstreamErrorEvent(self.name, first)
            except BaseException:
                await resp.aclose()
                raise
            return stream

        result: UpstreamStream = await self._attempts(once)
        return result

    async def complete(
        self,
        path: str,
        body: Mapping[str, Any],
        headers: Mapping[str, str] | None = None,
        rewrite: Rewrite | None = None,
    ) -> dict[str, Any]:
        """A non-streaming call; the response with id/model rewritten."""

        async def once(started: float) -> dict[str, Any]:
            with _translated(self.name):
                resp = await self._http.send(self._request(path, body, headers, False))
                if resp.status_code != 200:
                    raise await self._status_error(resp)
                data = resp.json()
            if not isinstance(data, dict):
                raise UpstreamBadResponse(self.name, "response is not a JSON object")
            wrong = malformed(data)
            if wrong is not None:
                raise UpstreamBadResponse(self.name, f"unreadable response: {wrong}")
            return (rewrite or Rewrite()).apply(data)

        result: dict[str, Any] = await self._attempts(once)
        return result
