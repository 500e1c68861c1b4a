"""The routing decision: which tier and model serve a request, and how it is decoded.

The router decides, it never generates: the gateway takes a `RouteDecision` and runs it on the local
engine or an upstream. Strategy rules, first match wins:

  1. temperature > `strategy.high_temperature`                                    -> off
     (at high temperature acceptance collapses; verifying then costs more than it saves)
  2. the request is input-grounded (edit this code, extract from this text, or a long prompt with a
     short answer)                                                                -> ngram (prompt lookup)
     on every tier, `speculation: false` ones included: prompt lookup needs no draft model and
     costs one verification per step, and grounded rewrites are where it pays most
  3. the tier has speculation off                                                 -> off
  4. the model has a draft                                                        -> draft
  5. otherwise                                                                    -> off
then a per-request `speculative` override replaces the mode if config allows it, and max_k is capped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from decoding.params import SpecMode, SpecParams
from router.config import DEFAULT_MODELS, LocalModel, RouterSettings, TierSettings, UpstreamSettings
from router.features import DEFAULT_WEIGHTS, Features, Weights, complexity, extract

EXPLICIT = "explicit"  # the tier name reported when the client named a model itself


class BackendKind(StrEnum):
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True)
class RouteDecision:
    tier: str
    model: str  # local model name, or the upstream's model name
    backend: BackendKind
    upstream: str | None  # set for remote backends
    strategy: SpecMode  # routed local: never AUTO; explicit: AUTO unless overridden/not allowed; remote: OFF
    max_k: int
    score: float  # complexity in [0, 1]; 0.0 for explicit models
    reasons: tuple[str, ...]
    fallbacks: tuple[RouteDecision, ...] = ()  # tried in order if this one fails before the first byte
    routed: bool = True  # False: the client named the model, routing was skipped
    elapsed_us: float = 0.0  # time spent deciding

    def __str__(self) -> str:
        """How a log line names it (the dataclass repr, every field and the fallbacks' in full, was
        a fallback warning's ~500 characters)."""
        where = f"upstream {self.upstream}, " if self.upstream is not None else ""
        return f"{self.tier} ({where}model {self.model})"

    def header_value(self) -> str:
        """The `x-specgate-route` header."""
        return f"tier={self.tier}; model={self.model}; strategy={self.strategy.value}; score={self.score:.2f}"

    def spec_params(self, requested: SpecParams | None = None) -> SpecParams:
        """The request's speculation settings with this decision's mode and k (the rest, such as
        ``adaptive: false`` for seeded sampling, stays as the gateway set it)."""
        return replace(requested or SpecParams(), mode=self.strategy, max_k=self.max_k)


class Router:
    """Built once at start. `upstreams` and `models` (name -> draft name or None) are the gateway's
    top-level sections; they join `settings.upstreams` and replace `settings.models`."""

    def __init__(
        self,
        settings: RouterSettings,
        upstreams: list[UpstreamSettings] | None = None,
        models: Mapping[str, str | None] | None = None,
        weights: Weights = DEFAULT_WEIGHTS,
    ):
        local = {n: LocalModel(draft=d) for n, d in models.items()} if models is not None else settings.models
        ups = settings.all_upstreams(upstreams)
        settings.check_references(ups, local)  # raises ValueError naming the setting
        self.settings = settings
        self.weights = weights
        self.models: dict[str, LocalModel] = local if local is not None else dict(DEFAULT_MODELS)
        self.upstreams = {u.name: u for u in ups}
        self._aliases = {"auto", settings.default_alias}
        self._upstream_by_model = {u.model: u.name for u in ups}

    def is_routed(self, model: str) -> bool:
        return model in self._aliases

    def names(self) -> set[str]:
        """The `model` values served beyond the local models: the aliases routed by complexity
        (``auto`` always) and the upstreams' models. ``/v1/models`` lists them, so a client that
        offers what the list holds (a chat UI's model picker) offers the router too."""
        return self._aliases | set(self._upstream_by_model)

    def tier_for(self, score: float) -> TierSettings:
        if not self.settings.enabled:
            return self.settings.tiers[-1]
        chosen = self.settings.tiers[0]
        for tier in self.settings.tiers:
            if score >= tier.threshold:
                chosen = tier
        return chosen

    def route(
        self,
        model: str,
        messages: Sequence[Any] | None = None,
        prompt: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        spec: SpecParams | None = None,
        tools: bool = False,
    ) -> RouteDecision:
        """Decide for one request. ``spec``: the request's own speculation settings; a mode other
        than AUTO overrides the router's where config allows it, and max_k caps k. ``tools``: the
        model may call tools; such a request is never "easy" (it scores at least the second tier's
        threshold): choosing a call and filling its arguments is beyond the small tier."""
        t0 = time.perf_counter()
        f = extract(messages, prompt, max_tokens)
        mode, max_k = (spec.mode, spec.max_k) if spec is not None else (None, None)
        temp = 1.0 if temperature is None else temperature  # the OpenAI default
        if not self.is_routed(model):
            decision = self._explicit(model, f, temp, mode, max_k)
        else:
            score, reasons = complexity(f, self.weights)
            tiers = self.settings.tiers
            if tools and len(tiers) > 1 and score < tiers[1].threshold:
                score, reasons = tiers[1].threshold, [*reasons, "tools"]
            tier = self.tier_for(score)
            primary = self._target(tier, f, temp, mode, max_k, score, reasons)
            fallbacks = tuple(
                self._target(self.settings.tier(n), f, temp, mode, max_k, score, reasons)
                for n in self._chain(tier)
            )
            decision = replace(primary, fallbacks=fallbacks)
        return replace(decision, elapsed_us=(time.perf_counter() - t0) * 1e6)

    # ---- helpers ------------------------------------------------------------------------------

    def _chain(self, tier: TierSettings) -> list[str]:
        if tier.fallback is not None:
            return list(tier.fallback)
        names = [t.name for t in self.settings.tiers]
        i = names.index(tier.name)
        return names[i + 1 : i + 2] + names[:i][::-1]  # next one up, then downwards from nearest

    def _target(
        self,
        tier: TierSettings,
        f: Features,
        temp: float,
        mode: SpecMode | None,
        max_k: int | None,
        score: float,
        reasons: list[str],
    ) -> RouteDecision:
        if tier.upstream is not None:
            up = self.upstreams[tier.upstream]
            return RouteDecision(
                tier.name, up.model, BackendKind.REMOTE, up.name, SpecMode.OFF, self.settings.strategy.max_k,
                round(score, 4), (*reasons, "remote"),
            )  # fmt: skip
        assert tier.model is not None  # guaranteed by TierSettings validation
        strategy, k, why = self._strategy(tier.model, f, temp, mode, max_k, tier.speculation)
        return RouteDecision(
            tier.name, tier.model, BackendKind.LOCAL, None, strategy, k, round(score, 4), (*reasons, *why)
        )

    def _explicit(
        self, model: str, f: Features, temp: float, mode: SpecMode | None, max_k: int | None
    ) -> RouteDecision:
        if model not in self.models and (model in self.upstreams or model in self._upstream_by_model):
            up = self.upstreams[self._upstream_by_model.get(model, model)]
            return RouteDecision(
                EXPLICIT, up.model, BackendKind.REMOTE, up.name, SpecMode.OFF, self.settings.strategy.max_k, 0.0,
                ("explicit", "remote"), routed=False,
            )  # fmt: skip
        # A named model keeps the engine's own choice (AUTO) unless the request overrides it: naming
        # a model opts out of routing, strategy included. A name the router does not know still goes
        # to the local backend (the gateway's RoutingService answers a name nothing serves with a 404).
        limits = self.settings.strategy
        local = self.models.get(model)
        chosen = SpecMode.AUTO
        why = ["explicit"]
        if mode is not None and mode != SpecMode.AUTO:
            if mode in limits.allowed_modes:
                chosen = mode
                why.append(f"override-{mode.value}")
            else:
                why.append(f"override-{mode.value}-not-allowed")
        if chosen not in limits.allowed_modes:  # AUTO, where config leaves it out: the nearest allowed
            chosen = self._allowed(SpecMode.DRAFT, local is not None and local.draft is not None)
        k = max(1, min(limits.max_k, max_k) if max_k is not None else limits.max_k)
        return RouteDecision(
            EXPLICIT, model, BackendKind.LOCAL, None, chosen, k, 0.0, tuple(why), routed=False
        )

    def _strategy(
        self,
        model: str,
        f: Features,
        temp: float,
        mode: SpecMode | None,
        max_k: int | None,
        speculation: bool,
    ) -> tuple[SpecMode, int, list[str]]:
        limits = self.settings.strategy
        local = self.models.get(model)
        has_draft = local is not None and local.draft is not None
        why: list[str] = []
        if temp > limits.high_temperature:
            chosen, why = SpecMode.OFF, [f"temperature>{limits.high_temperature:g}"]
        elif f.grounded or (
            f.max_tokens is not None and f.prompt_chars >= limits.grounded_ratio * f.max_tokens * 4
        ):
            # ~4 chars per token: a prompt many times the answer's length is mostly being quoted from.
            chosen, why = SpecMode.NGRAM, ["grounded"]
        elif not speculation:
            chosen, why = SpecMode.OFF, ["tier-no-spec"]
        elif has_draft:
            chosen, why = SpecMode.DRAFT, ["open"]
        else:
            chosen, why = SpecMode.OFF, ["no-draft"]
        if mode is not None and mode != SpecMode.AUTO:
            if mode not in limits.allowed_modes:
                why.append(f"override-{mode.value}-not-allowed")
            elif mode == SpecMode.DRAFT and not has_draft:
                why.append("override-draft-without-draft")
            else:
                chosen = mode
                why.append(f"override-{mode.value}")
        chosen = self._allowed(chosen, has_draft)
        k = min(limits.max_k, max_k) if max_k is not None else limits.max_k
        return chosen, max(1, k), why

    def _allowed(self, mode: SpecMode, has_draft: bool) -> SpecMode:
        """Step down draft -> ngram -> off until config allows the mode (off is always allowed)."""
        allowed = self.settings.strategy.allowed_modes
        order = [SpecMode.DRAFT, SpecMode.NGRAM, SpecMode.OFF]
        for m in order[order.index(mode) :]:
            if m == SpecMode.OFF or (m in allowed and (m != SpecMode.DRAFT or has_draft)):
                return m
        return SpecMode.OFF
