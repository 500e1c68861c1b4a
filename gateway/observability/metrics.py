"""Prometheus metrics: one ``Metrics`` object per app, on its own ``CollectorRegistry``.

Its own registry (not prometheus_client's global one) lets tests build several apps in one process
and read exact values back. Callers record through one method per event: the gateway
(``observe_request_done``, a stream's error after its 200 included, ``observe_abort``), the engine
wrapper (``observe_step``, ``observe_generation_done``), the local engine's worker thread
(``observe_batch_step``), the cache (``observe_cache``, ``observe_redis_error``,
``set_circuit_state``), the router (``observe_route``) and the upstream client
(``observe_upstream``, ``observe_upstream_retry``, ``observe_fallback``).

Label values stay bounded: every free-form value the server chose (model, tier, strategy, upstream,
...) goes through a ``_Bounded`` set that admits configured names, then at most ``cap`` others, then
maps the rest to ``"other"``. A model name as the client sent it is a label only when the server
knows it (configured, or already served); any other is ``"unknown"``, so clients cannot mint label
values (a 1 MB model name is one 404, not one 1 MB time series). No prompt, user or key text ever
becomes a label.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from decoding.costs import pow2_bucket
from decoding.params import BatchStep, RequestStats, StepOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER = "other"
UNKNOWN = "unknown"  # a model the client named that this server does not serve

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
FAST_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)  # cache, router
COUNT_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)  # tokens per step, k (max_k <= 32)
ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # requests in an engine step (decoding.graphs')
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # tokens an engine step emits
MAX_POSITION = 32  # SpecParams.max_k's upper bound

# Circuit breaker states as gauge values (alert on `specgate_circuit_state == 2`).
CIRCUIT_STATES = {"closed": 0, "half_open": 1, "open": 2}
ABORT_PHASES = frozenset({"queued", "prefill", "decode", "cache", "upstream", "stream"})
CACHE_TIERS = frozenset({"exact", "semantic"})
CACHE_OUTCOMES = frozenset({"hit", "miss", "error", "skip"})
# OpenAI's error types (gateway/errors.py's, and what upstreams send); any other is "other"
ERROR_TYPES = frozenset(
    {"server_error", "invalid_request_error", "rate_limit_error", "authentication_error", "permission_error"}
)

# Routes are labelled by template; anything else (404 probes, scanners) is "other".
ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/responses/{id}/input_items",
        "/v1/models",
        "/v1/models/{id}",
        "/health",
        "/ready",
        "/metrics",
        "/dashboard",
        "/openapi.json",
    }
)


def batch_label(rows: int) -> str:
    """The power of two at or above ``rows``, past the largest batch bucket "256+": a bounded label."""
    return "256+" if rows > 256 else str(pow2_bucket(rows))


def route_label(path: str) -> str:
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}/input_items" if path.endswith("/input_items") else "/v1/responses/{id}"
    return OTHER


class EngineGauges(Protocol):
    """What the queue-depth and in-flight gauges read (any ``decoding.client.EngineClient``)."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def active(self) -> int: ...


class _Bounded:
    """Admits the configured values, then up to ``cap`` more, then maps everything else to "other"."""

    def __init__(self, known: Iterable[str] = (), cap: int = 32):
        self.known = set(known)
        self.cap = cap
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if not value:
            return "none"
        if self.admitted(value):
            return value
        if len(self._seen) < self.cap:
            self._seen.add(value)
            return value
        return OTHER

    def admitted(self, value: str) -> bool:
        return value in self.known or value in self._seen


class Metrics:
    def __init__(self, models: Iterable[str] = (), upstreams: Iterable[str] = (), cap: int = 32):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_label = _Bounded(models, cap)
        self.upstream_label = _Bounded(upstreams, cap)
        self.tier_label = _Bounded((), cap)
        self.strategy_label = _Bounded((), cap)
        self._engine_bound = False
        r = self.registry

        # ---- requests (gateway) -----------------------------------------------------------
        self.requests = Counter(
            "specgate_requests",
            "HTTP requests by route, model and status.",
            ["route", "model", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "specgate_request_duration_seconds",
            "Time from request received to last response byte.",
            ["route", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "specgate_time_to_first_token_seconds",
            "Time from request received to the first generated token.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "specgate_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            ["model"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("specgate_prompt_tokens", "Prompt tokens.", ["model"], registry=r)
        self.completion_tokens = Counter(
            "specgate_completion_tokens", "Completion tokens.", ["model"], registry=r
        )
        self.in_flight = Gauge(
            "specgate_requests_in_flight", "HTTP requests being served.", ["route"], registry=r
        )
        self.stream_errors = Counter(
            "specgate_stream_errors",
            "Streams that ended in an error event after their 200 (engine or upstream failure, drain "
            "cut-off), by the error's OpenAI type: failures specgate_requests_total counts as 200s.",
            ["route", "model", "type"],
            registry=r,
        )
        self.aborted = Counter(
            "specgate_aborted_requests",
            "Requests ended early (client gone, shutdown) by the phase they were in.",
            ["route", "phase"],
            registry=r,
        )

        # ---- engine and speculation -------------------------------------------------------
        self.queue_depth = Gauge(
            "specgate_engine_queue_depth", "Requests waiting for an engine slot.", registry=r
        )
        self.engine_active = Gauge(
            "specgate_engine_active_requests", "Requests the engine is decoding.", registry=r
        )
        self.steps = Counter(
            "specgate_engine_steps",
            "Target forward passes after prefill: kind=spec verifies drafted tokens, kind=plain does not.",
            ["model", "kind"],
            registry=r,
        )
        self.drafted = Counter(
            "specgate_spec_drafted_tokens", "Draft tokens proposed.", ["model"], registry=r
        )
        self.accepted = Counter(
            "specgate_spec_accepted_tokens", "Draft tokens accepted.", ["model"], registry=r
        )
        self.position_drafted = Counter(
            "specgate_spec_position_drafted",
            "Verification steps that drafted a token at this position (1-based).",
            ["model", "position"],
            registry=r,
        )
        self.position_accepted = Counter(
            "specgate_spec_position_accepted",
            "Verification steps whose drafted token at this position (1-based) was accepted.",
            ["model", "position"],
            registry=r,
        )
        self.accepted_per_step = Histogram(
            "specgate_spec_accepted_per_step",
            "Draft tokens accepted per verification step (the bonus/corrected token not counted).",
            ["model"],
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.k_chosen = Histogram(
            "specgate_spec_k",
            "Draft length k chosen per step (0: plain step).",
            ["model"],
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        # per engine step over a target's batch (AsyncEngine.add_step_observer), where the ones above
        # count each request's share of it
        self.batch_rows = Histogram(
            "specgate_engine_batch_rows",
            "Requests given tokens by one engine step (one forward pass of a target over its batch).",
            ["model"],
            buckets=ROW_BUCKETS,
            registry=r,
        )
        self.prefill_chunks = Counter(
            "specgate_engine_prefill_chunks",
            "Requests an engine step gave no token: their prompt chunk rode it (a request that joined "
            "while the step was queued ahead counts too, its chunk riding the next).",
            ["model"],
            registry=r,
        )
        self.step_tokens = Histogram(
            "specgate_engine_step_tokens",
            "Tokens one engine step emitted, every row of its batch.",
            ["model"],
            buckets=STEP_TOKEN_BUCKETS,
            registry=r,
        )
        self.step_k = Histogram(
            "specgate_engine_step_k",
            "The draft length an engine step's rows drafted up to (0: a plain step), by batch size "
            "(the power of two at or above the step's rows).",
            ["model", "batch"],
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.spec_disabled_steps = Counter(
            "specgate_spec_disabled_steps",
            "Plain steps taken because the goodput check switched speculation off.",
            ["model"],
            registry=r,
        )
        self.spec_switched_off = Counter(
            "specgate_spec_switched_off_requests",
            "Generations in which the goodput check switched speculation off at least once.",
            ["model"],
            registry=r,
        )
        self.generations = Counter(
            "specgate_generations",
            "Engine generations finished, by finish reason and drafter.",
            ["model", "finish_reason", "drafter"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "specgate_engine_queue_wait_seconds",
            "Time queued before admission.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "specgate_engine_prefill_seconds",
            "Prompt prefill time.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        # prefix caching (decoding/prefix.py): hit rate = hit / (hit + miss)
        self.prefix_lookups = Counter(
            "specgate_prefix_cache_lookups",
            "Engine generations by whether their prompt reused a cached prefix (outcome=hit|miss).",
            ["model", "outcome"],
            registry=r,
        )
        self.engine_prompt_tokens = Counter(
            "specgate_engine_prompt_tokens",
            "Prompt tokens of engine generations: source=cached reused a prefix's KV, computed were prefilled.",
            ["model", "source"],
            registry=r,
        )

        # ---- cache ------------------------------------------------------------------------
        self.cache_lookups = Counter(
            "specgate_cache_lookups", "Cache lookups by tier and outcome.", ["tier", "outcome"], registry=r
        )
        self.cache_lookup_duration = Histogram(
            "specgate_cache_lookup_duration_seconds",
            "Cache lookup latency.",
            ["tier"],
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            "specgate_cache_redis_errors", "Redis command failures.", ["op"], registry=r
        )
        self.circuit_state = Gauge(
            "specgate_circuit_state",
            "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
            ["component"],
            registry=r,
        )

        # ---- router and upstreams ---------------------------------------------------------
        self.route_decisions = Counter(
            "specgate_route_decisions",
            "Routing decisions by tier and strategy.",
            ["tier", "strategy"],
            registry=r,
        )
        self.route_duration = Histogram(
            "specgate_route_decision_duration_seconds",
            "Time to score and route a request.",
            buckets=FAST_BUCKETS,
            registry=r,
        )
        self.upstream_requests = Counter(
            "specgate_upstream_requests",
            "Calls to remote upstreams by outcome.",
            ["upstream", "outcome"],
            registry=r,
        )
        self.upstream_duration = Histogram(
            "specgate_upstream_request_duration_seconds",
            "Upstream call latency (to the end of the response).",
            ["upstream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_retries = Counter(
            "specgate_upstream_retries", "Upstream retries by reason.", ["upstream", "reason"], registry=r
        )
        self.upstream_fallbacks = Counter(
            "specgate_upstream_fallbacks",
            "Fallbacks to the next tier before the first byte.",
            ["from_tier", "to_tier"],
            registry=r,
        )

    # ---- gateway ------------------------------------------------------------------------------

    def observe_request_done(
        self,
        route: str,
        model: str | None,
        status: int,
        seconds: float,
        *,
        ttft_s: float | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        requested_model: str | None = None,
        stream_error: str | None = None,
    ) -> None:
        """One finished HTTP request. ``route`` is a path or template (unknown paths become "other").
        ``model``: the model that served it (the server's choice); failing that, ``requested_model``
        (the client's string) labels it only if the server knows that name. ``stream_error``: the
        OpenAI type of the error event a stream ended with after its 200."""
        route = route_label(route)
        m = self.model_label(model) if model else self.requested_model_label(requested_model)
        self.requests.labels(route, m, str(status)).inc()
        if stream_error is not None:
            self.stream_errors.labels(route, m, stream_error if stream_error in ERROR_TYPES else OTHER).inc()
        self.request_duration.labels(route, m).observe(seconds)
        if prompt_tokens:
            self.prompt_tokens.labels(m).inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.labels(m).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if completion_tokens > 1:
                self.tpot.labels(m).observe(max(seconds - ttft_s, 0.0) / (completion_tokens - 1))

    def requested_model_label(self, value: str | None) -> str:
        if not value:
            return "none"
        return value if self.model_label.admitted(value) else UNKNOWN

    def know_models(self, names: Iterable[str]) -> None:
        """Names clients may send (a loaded engine's models, aliases): labels of their own."""
        self.model_label.known.update(names)

    def observe_abort(self, route: str, phase: str) -> None:
        self.aborted.labels(route_label(route), phase if phase in ABORT_PHASES else OTHER).inc()

    def request_started(self, route: str) -> None:
        self.in_flight.labels(route_label(route)).inc()

    def request_ended(self, route: str) -> None:
        self.in_flight.labels(route_label(route)).dec()

    # ---- engine -------------------------------------------------------------------------------

    def bind_engine(self, engine: EngineGauges) -> None:
        """Queue depth and active requests read from the engine at scrape time."""
        self.queue_depth.set_function(lambda: engine.queue_depth)
        self.engine_active.set_function(lambda: engine.active)
        self.know_models(getattr(engine, "model_names", ()))
        add_step_observer = getattr(engine, "add_step_observer", None)  # the local engine's alone
        if add_step_observer is not None:
            add_step_observer(self.observe_batch_step)
        self._engine_bound = True

    def observe_batch_step(self, step: BatchStep) -> None:
        """One engine step over a target's batch (called on the engine's thread)."""
        m = self.model_label(step.model)
        if step.prefilling:
            self.prefill_chunks.labels(m).inc(step.prefilling)
        if not step.rows:
            return  # prompt chunks alone: no step of the batch's decoding
        self.batch_rows.labels(m).observe(step.rows)
        self.step_tokens.labels(m).observe(step.tokens)
        self.step_k.labels(m, batch_label(step.rows)).observe(step.drafted)

    def observe_step(self, model: str, step: StepOutput) -> None:
        """One verification (or plain) step of one request, as the engine yielded it."""
        m = self.model_label(model)
        k, n = step.drafted, step.accepted
        if k == 0 and not step.token_ids and step.finish_reason is not None:
            return  # the closing output of an aborted/failed request: no forward pass happened
        self.steps.labels(m, "spec" if k else "plain").inc()
        self.k_chosen.labels(m).observe(k)
        if k == 0:
            return
        self.drafted.labels(m).inc(k)
        self.accepted.labels(m).inc(n)
        self.accepted_per_step.labels(m).observe(n)
        for i in range(1, min(k, MAX_POSITION) + 1):
            self.position_drafted.labels(m, str(i)).inc()
            if i <= n:
                self.position_accepted.labels(m, str(i)).inc()

    def observe_generation_done(self, model: str, stats: RequestStats, finish_reason: str) -> None:
        """The engine's final stats for one generation (the last ``StepOutput.stats``)."""
        m = self.model_label(model)
        self.generations.labels(m, finish_reason, self.strategy_label(stats.drafter)).inc()
        self.queue_wait.labels(m).observe(stats.queue_s)
        self.prefill.labels(m).observe(stats.prefill_s)
        self.prefix_lookups.labels(m, "hit" if stats.cached_tokens else "miss").inc()
        self.engine_prompt_tokens.labels(m, "cached").inc(stats.cached_tokens)
        self.engine_prompt_tokens.labels(m, "computed").inc(stats.prompt_tokens - stats.cached_tokens)
        if stats.spec_disabled_steps:
            self.spec_disabled_steps.labels(m).inc(stats.spec_disabled_steps)
            self.spec_switched_off.labels(m).inc()

    # ---- cache --------------------------------------------------------------------------------

    def observe_cache(self, tier: str, outcome: str, seconds: float | None = None) -> None:
        """One cache lookup: tier exact|semantic, outcome hit|miss|error|skip."""
        tier = tier if tier in CACHE_TIERS else OTHER
        self.cache_lookups.labels(tier, outcome if outcome in CACHE_OUTCOMES else OTHER).inc()
        if seconds is not None:
            self.cache_lookup_duration.labels(tier).observe(seconds)

    def observe_redis_error(self, op: str) -> None:
        self.redis_errors.labels(op if op in ("get", "set", "search", "evict", "ping") else OTHER).inc()

    def set_circuit_state(self, component: str, state: str) -> None:
        """component: "redis" (the cache), "rate_limits" (their Redis) or an upstream name;
        state: closed|half_open|open."""
        assert state in CIRCUIT_STATES, (
            f"circuit state must be one of {sorted(CIRCUIT_STATES)}, got {state!r}"
        )
        name = component if component in ("redis", "rate_limits") else self.upstream_label(component)
        self.circuit_state.labels(name).set(CIRCUIT_STATES[state])

    # ---- router and upstreams -----------------------------------------------------------------

    def observe_route(self, tier: str, strategy: str, seconds: float | None = None) -> None:
        self.route_decisions.labels(self.tier_label(tier), self.strategy_label(strategy)).inc()
        if seconds is not None:
            self.route_duration.observe(seconds)

    def observe_upstream(self, upstream: str, outcome: str, seconds: float | None = None) -> None:
        """One upstream call: outcome ok|error|timeout|http_4xx|http_5xx|circuit_open|pool_full."""
        u = self.upstream_label(upstream)
        ok = ("ok", "error", "timeout", "http_4xx", "http_5xx", "circuit_open", "pool_full")
        self.upstream_requests.labels(u, outcome if outcome in ok else OTHER).inc()
        if seconds is not None:
            self.upstream_duration.labels(u).observe(seconds)

    def observe_upstream_retry(self, upstream: str, reason: str) -> None:
        """reason: connect|timeout|http_429|http_5xx."""
        ok = ("connect", "timeout", "http_429", "http_5xx")
        self.upstream_retries.labels(self.upstream_label(upstream), reason if reason in ok else OTHER).inc()

    def observe_fallback(self, from_tier: str, to_tier: str) -> None:
        self.upstream_fallbacks.labels(self.tier_label(from_tier), self.tier_label(to_tier)).inc()

    # ---- exposition ---------------------------------------------------------------------------

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (0.0 when absent): for tests and the CLI."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v
