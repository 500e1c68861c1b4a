"""``specgate serve``: settings, uvicorn, model loading after the port is open, SIGTERM drain.

Drain (SIGTERM): readiness goes false and new inference requests get 503 at once, in-flight ones
run to the end or until ``limits.drain_timeout_s``, then the server exits with status 0. A second
SIGTERM, or SIGINT, exits the usual uvicorn way.

sse-starlette patches uvicorn so that a shutdown signal ends every open stream immediately; that
would cut in-flight streams short, so its automatic drain is disabled here and its exit flag is set
only when our drain is over (see sse_starlette.sse.AppStatus). At the drain timeout, what still runs
is told first: a stream gets one OpenAI error event and ``[DONE]``, a plain request a 503.

Uploads are bounded in time: the request head by ``server.header_timeout_s`` (``TimedH11Protocol``,
below uvicorn's ASGI layer, since a head never completed never reaches the app) and the body by
``server.body_timeout_s`` (``gateway.limits.body_deadline``); a body still arriving when the drain
begins is a 503 at once rather than a request the drain must wait for. A body the app answered
before reading (a 401, 404, 413) is never waited for: the connection closes after the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys
import time
from dataclasses import replace
from types import FrameType
from typing import Any

import h11
import uvicorn
from sse_starlette.sse import AppStatus
from uvicorn.protocols.http.h11_impl import H11Protocol

from decoding.client import EngineClient
from gateway.app import create_app
from gateway.serving import GatewayState
from gateway.settings import Settings, SettingsError, load_settings

log = logging.getLogger("specgate.server")

CUT_GRACE_S = 2.0  # after the drain timeout: time for cut-off requests to send their error


_HEAD_TIMEOUT = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers, from the
    connection's start or from the first byte of a later request on a kept-alive connection
    (uvicorn's keep-alive timeout covers the idle time between requests, not a head sent a byte a
    second). ``header_timeout_s`` is set on a subclass (``timed_h11``).

    A response that ends while its request's body is still arriving closes the connection (issue
    48): uvicorn kept it alive and dropped the body's further bytes unread, and the first of them
    cancelled its keep-alive timer for good, so a client answered early (a 401 or 404 before the
    body was read) held the connection with one byte more. The app says ``Connection: close`` on
    such answers (``GatewayMiddleware``), after which uvicorn closes; this closes after any answer
    that did not say so. Either close is uvicorn's immediate one, not the lingering close of RFC
    9112 section 9.6: a client still writing a large body may meet a reset before it has read
    the answer."""

    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in: the body has its own deadline
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        # the rest of this request's body would never be read: no next request can follow it
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()
        super().on_response_complete()

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = (
            f"The request headers did not arrive within {self.header_timeout_s:g}s (server.header_timeout_s)."
        )
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_timeout",
                }
            }
        ).encode()
        self.transport.write(_HEAD_TIMEOUT % (len(body), body))
        self.transport.close()


def timed_h11(header_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: GatewayState, drain_timeout_s: float):
        super().__init__(config)
        self.gateway = state
        self.drain_timeout_s = drain_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._drain_started or self._loop is None:
            AppStatus.should_exit = True
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        self.gateway.draining = True  # /ready false and new requests 503, from this instant
        log.info(
            "SIGTERM: draining %d in-flight request(s), up to %.0fs",
            self.gateway.inflight,
            self.drain_timeout_s,
        )
        loop = self._loop
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        self.gateway.drain_started.set()  # uploads still arriving are refused now
        deadline = time.monotonic() + self.drain_timeout_s
        while self.gateway.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.gateway.inflight:
            log.warning("drain timeout: %d request(s) still running are cut off", self.gateway.inflight)
            self.gateway.cut.set()  # each gets its error (an SSE event, or a 503) ...
            grace = time.monotonic() + CUT_GRACE_S
            while self.gateway.inflight > 0 and time.monotonic() < grace:
                await asyncio.sleep(0.05)
        AppStatus.should_exit = True  # ... before any stream still open is ended
        self.should_exit = True

    def fail(self) -> None:
        """Model loading failed: nothing to serve."""
        self.exit_code = 1
        self.should_exit = True


def _build_engine(settings: Settings) -> EngineClient:
    # decoding's engine imports torch: only here, where the server builds it
    from decoding.async_engine import AsyncEngine
    from decoding.engine import Engine
    from decoding.grammar import GrammarLimits
    from decoding.loader import ModelSpec, load_all
    from decoding.sizing import default_max_active
    from decoding.warmup import freeze_heap, warm_up

    specs = [
        ModelSpec(
            m.name,
            m.source,
            m.draft,
            m.dtype,
            m.device,
            m.max_context,
            backend=m.backend,
            exact=m.exact,
            batch_invariant=m.batch_invariant,
            prefix_caching=m.prefix_caching,
        )
        for m in settings.models
    ]
    max_active = settings.limits.max_active or default_max_active(specs)
    # static-cache backends hold one KV slot per live sequence: a model can be a target for
    # max_active requests and a draft for as many more
    specs = [replace(s, slots=2 * max_active, max_batch=max_active) for s in specs]
    limits = settings.limits
    grammar = GrammarLimits(limits.max_grammar_bytes, timeout_s=limits.grammar_timeout_s)
    engine = Engine(load_all(specs), grammar_limits=grammar)
    for name, m in engine.models.items():
        if m.device.type == "cuda":  # kernels that load on first use, loaded before the first request
            log.info("model %s: warmed up in %d steps", name, warm_up(engine, name))
    log.info("%d objects of the loaded models frozen out of garbage collection", freeze_heap())
    return AsyncEngine(engine, max_active, limits.max_queued, limits.prefill_budget, limits.burst_budget)


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads. uvicorn binds its own only after the app's
    lifespan has begun, and that starts the models loading: a port in use was reported then, and
    the process waited for the load to end (40-60 s on the real pair) to exit with status 3."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(config: str | None = None, host: str | None = None, port: int | None = None, **flags: Any) -> int:
    """Run the gateway until SIGTERM/SIGINT. ``flags`` are further settings overrides (nested dicts)."""
    server_flags = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    overrides: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    if server_flags:
        overrides["server"] = server_flags
    try:
        settings = load_settings(config, overrides)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # torch and transformers load here, before the port opens: loading weights is what /ready covers
    import decoding.async_engine
    import decoding.loader  # noqa: F401

    AppStatus.disable_automatic_graceful_drain()
    try:
        app = create_app(settings, load_engine=lambda: _build_engine(settings))
    except ValueError as exc:  # what only a built app checks: tiers' models, upstream keys, OTEL_*
        log.debug("the app refused its settings", exc_info=True)  # `specgate -v serve`: the traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uv = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_level="info",
        timeout_graceful_shutdown=5,
        access_log=False,
        http=timed_h11(settings.server.header_timeout_s),
    )
    try:
        sock = _listen(settings.server.host, settings.server.port)
    except OSError as exc:
        print(
            f"error: cannot listen on {settings.server.host}:{settings.server.port}: {exc}", file=sys.stderr
        )
        return 2
    host = f"[{settings.server.host}]" if ":" in settings.server.host else settings.server.host
    # uvicorn names the address only for a socket of its own binding
    log.info("listening on http://%s:%d (CTRL+C to quit)", host, settings.server.port)
    server = DrainingServer(uv, app.state.gateway, settings.limits.drain_timeout_s)
    app.state.on_load_failure = server.fail
    server.run(sockets=[sock])
    engine = app.state.gateway.extra.get("engine")
    if engine is not None:
        engine.shutdown()
    return server.exit_code
