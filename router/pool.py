"""The configured upstreams' clients, and the fallback chain's one rule.

Fallback happens only before the first byte reaches the client: each attempt is an "open" (for an
upstream, `UpstreamClient.open_stream`, which returns with the first event in hand; for the local
engine, the gateway's own first step). Once an attempt has opened, its failures are the stream's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import httpx

from router.config import UpstreamSettings
from router.faults import UpstreamError, UpstreamUnavailable
from router.upstream import UpstreamClient, UpstreamMetrics

log = logging.getLogger("specgate.router")

L = TypeVar("L")  # what names an attempt (a RouteDecision in the gateway)
R = TypeVar("R")  # what an attempt opens


class UpstreamPool:
    def __init__(
        self,
        upstreams: Iterable[UpstreamSettings],
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: UpstreamMetrics | None = None,
        instrument: Callable[[httpx.AsyncClient], None] | None = None,
    ):
        self.clients = {u.name: UpstreamClient(u, transport, metrics, instrument) for u in upstreams}

    def __getitem__(self, name: str) -> UpstreamClient:
        return self.clients[name]

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


async def first_available(
    attempts: Sequence[tuple[L, Callable[[], Awaitable[R]]]],
    fallback_on: tuple[type[BaseException], ...] = (UpstreamUnavailable,),
) -> tuple[L, R]:
    """Open the first attempt that opens; on `fallback_on` errors try the next. Other errors (a 4xx
    from an upstream: the request's fault) propagate at once. When all fail the last error is raised."""
    assert attempts, "first_available needs at least one attempt"
    last: BaseException | None = None
    for i, (label, open_) in enumerate(attempts):
        try:
            return label, await open_()
        except fallback_on as exc:
            last = exc
            if i + 1 < len(attempts):  # the last one's failure is the caller's answer, not a fallback
                log.warning("route %s failed before the first byte, falling back: %s", label, _summary(exc))
                log.debug("route %s failed: %s", label, exc)
    assert last is not None
    raise last


def _summary(exc: BaseException) -> str:
    """A failure as a warning names it: the upstream and the error's code, not its message. An
    upstream's error text is its own and may quote the request (a 5xx body echoing the prompt), and
    prompt text reaches logs only where observability.log_content says so; the message is logged
    at DEBUG."""
    if isinstance(exc, UpstreamError):
        return f"upstream '{exc.upstream}': {exc.code}"
    return type(exc).__name__
