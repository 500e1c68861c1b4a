"""The router's seam into serving: run a `router.policy.RouteDecision` on the local engine or an upstream.

    serving ─▶ RoutingService.route(job, local) ─▶ Route: the router's pick (job, x-specgate-route)
               Route.start(): primary, then fallbacks, until one starts ─▶ (decision that served, Generation)
                        ├── LocalBackend   (job.model and job.spec set from the decision)
                        └── RemoteBackend  (gateway/remote.py: an upstream through router.upstream)

Fallback happens only inside `start`, before serving sends a byte; the `x-specgate-route` header
then names the route that actually served.

Observed (with the app's `Observability`): `observe_route` once per decision (the router's pick,
before any fallback), `observe_fallback` per step down the chain.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from decoding.errors import EngineOverloaded, EngineStopped, UnknownModel
from gateway.backends import Backend, Generation, Job
from gateway.errors import unavailable
from gateway.remote import RemoteBackend, api_error
from gateway.settings import Settings
from router.config import RouterSettings, TierSettings
from router.faults import UpstreamError, UpstreamUnavailable
from router.policy import BackendKind, RouteDecision, Router
from router.pool import UpstreamPool, first_available

if TYPE_CHECKING:
    from gateway.observability import Metrics, Observability

log = logging.getLogger("specgate.router")


class _Loading(Exception):
    """The local engine is not loaded yet (a remote fallback may still serve)."""


class Route:
    """One request's route: the router's decision, then its fallbacks. ``job`` and ``label`` are the
    router's pick; ``start`` returns the decision that actually served, after any fallback."""

    def __init__(
        self, attempts: list[tuple[RouteDecision, Backend | None, Job]], metrics: Metrics | None = None
    ):
        self.attempts = attempts
        self.metrics = metrics
        self.job = attempts[0][2]  # model resolved, speculation strategy chosen
        self.label = attempts[0][0].header_value()  # the x-specgate-route header

    async def start(self) -> tuple[RouteDecision, Generation]:
        def opener(i: int, backend: Backend | None, j: Job) -> Any:
            async def open_() -> Generation:
                if i > 0 and self.metrics is not None:  # attempt i-1 failed before the first byte
                    self.metrics.observe_fallback(self.attempts[i - 1][0].tier, self.attempts[i][0].tier)
                if backend is None:
                    raise _Loading("The models are still loading; retry shortly.")
                return await backend.start(j)

            return open_

        try:
            return await first_available(
                [(d, opener(i, b, j)) for i, (d, b, j) in enumerate(self.attempts)],
                fallback_on=(UpstreamUnavailable, EngineOverloaded, EngineStopped, _Loading),
            )
        except UpstreamError as exc:
            raise api_error(exc) from exc
        except _Loading as exc:
            raise unavailable(str(exc), 1, code="loading") from exc


class RoutingService:
    """`state.router`: built once at start from the gateway's settings."""

    def __init__(self, settings: Settings, obs: Observability | None = None):
        models = {m.name: m.draft for m in settings.models}
        rs = settings.router
        try:
            self.router = Router(rs, upstreams=settings.upstreams, models=models)
        except ValueError:
            if "tiers" in rs.model_fields_set:
                raise  # configured tiers that name unknown models or upstreams: refuse to start
            # The default tiers name the default pair; with other models, `auto` serves the first one.
            first = settings.models[0].name
            log.info("router: default tiers need %s; routing `auto` to %s", sorted(models), first)
            rs = rs.model_copy(update={"tiers": [TierSettings(name="default", model=first)]})
            self.router = Router(RouterSettings.model_validate(rs.model_dump()), settings.upstreams, models)
        self.metrics = obs.metrics if obs is not None else None
        instrument = obs.tracing.instrument_httpx if obs is not None else None
        self.pool = UpstreamPool(self.router.upstreams.values(), metrics=self.metrics, instrument=instrument)
        self.remotes = {name: RemoteBackend(client) for name, client in self.pool.clients.items()}

    async def aclose(self) -> None:
        await self.pool.aclose()

    def _job(self, job: Job, d: RouteDecision) -> Job:
        if d.backend == BackendKind.REMOTE:
            return dataclasses.replace(job, model=d.model)
        return dataclasses.replace(job, model=d.model, spec=d.spec_params(job.spec))

    async def route(self, job: Job, local: Backend | None) -> Route:
        if local is not None:
            # here, not in the engine, whose 404 listed its own models and left out `auto` and the
            # upstreams' models, which /v1/models lists; an upstream's configured name is served too
            # (the router's explicit route), unlisted
            listed = {*local.model_ids(), *self.router.names()}
            if job.model not in listed and job.model not in self.router.upstreams:
                raise UnknownModel(job.model, sorted(listed))
        messages = job.messages if job.kind == "chat" else None
        prompt = None if job.kind == "chat" else " ".join(p for p in job.prompts or [] if isinstance(p, str))
        d = self.router.route(
            job.model, messages, prompt, job.max_tokens, job.temperature, job.spec, tools=job.calls_tools
        )
        if self.metrics is not None:
            self.metrics.observe_route(d.tier, d.strategy.value, d.elapsed_us / 1e6)
        attempts: list[tuple[RouteDecision, Backend | None, Job]] = [
            (x, self.remotes[x.upstream] if x.upstream is not None else local, self._job(job, x))
            for x in (d, *d.fallbacks)
        ]
        return Route(attempts, self.metrics)
