"""``/metrics`` (Prometheus text format from this app's own registry) and ``/dashboard`` (the static
page in ``gateway/static/`` that polls ``/metrics`` and draws the live numbers itself)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from gateway.observability.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from gateway.observability import Observability

STATIC = Path(__file__).resolve().parent.parent / "static"


@cache
def dashboard_html() -> str:
    return (STATIC / "dashboard.html").read_text(encoding="utf-8")


def routes(obs: Observability) -> list[Route]:
    async def metrics(request: Request) -> Response:
        return Response(obs.metrics.render(), media_type=CONTENT_TYPE)

    async def dashboard(request: Request) -> Response:
        return HTMLResponse(dashboard_html(), headers={"cache-control": "no-cache"})

    out = []
    if obs.settings.metrics:
        out.append(Route("/metrics", metrics, methods=["GET"], include_in_schema=False))
    if obs.settings.dashboard:
        out.append(Route("/dashboard", dashboard, methods=["GET"], include_in_schema=False))
    return out
