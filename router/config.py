"""Router settings (the `router:` and `upstreams:` sections of specgate.yaml). Owned by the router.

    upstreams:                       # top level (the gateway's) or inside `router:`; names are unique
      - {name: vllm, base_url: "http://10.0.0.5:8000/v1", model: Qwen/Qwen2.5-Coder-7B-Instruct}
    router:
      default_alias: auto            # `model` values routed by complexity ("auto" always is)
      tiers:                         # ascending by threshold: a score >= threshold may use the tier
        - {name: small, model: qwen2.5-coder-0.5b, threshold: 0.0, speculation: false}
        - {name: large, model: qwen2.5-coder-1.5b, threshold: 0.25}
        - {name: remote, upstream: vllm, threshold: 0.8, fallback: [large]}
      strategy: {max_k: 8, allowed_modes: [off, draft, ngram, auto], high_temperature: 1.2}

Local models (and which has a draft) come from the gateway's `models:` list; `router.models` exists for
using the router alone. Everything is validated when the settings are built, references between
sections when the `Router` is built, and errors name the setting.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from decoding.params import SpecMode

SMALL_MODEL = "qwen2.5-coder-0.5b"
LARGE_MODEL = "qwen2.5-coder-1.5b"


class UpstreamSettings(BaseModel):
    """One remote OpenAI-compatible server (vLLM, TGI, a hosted API)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    base_url: str  # up to and including the version prefix, e.g. http://host:8000/v1
    model: str  # the model name the upstream knows
    api_key_env: str | None = None  # environment variable holding the upstream's API key
    # the longest wait for the next byte and for the next event (`: ping` comments alone do not reset
    # it): 504 `upstream_timeout` before the first event, an error event after; connecting: min(5, this)
    timeout_s: float = Field(default=60.0, gt=0)
    retries: int = Field(
        default=2, ge=0, le=10
    )  # extra attempts on connect errors, 429 and 5xx, never on 4xx
    backoff_s: float = Field(default=0.25, ge=0)  # first retry delay, doubled per attempt (Retry-After wins)
    # A Retry-After longer than this is passed on at once (to the client, with the header, or to the
    # route's fallback) instead of waited out: waited, Retry-After 2 on a 429 held the request 4 s
    # before its 429 or its fallback with the default 2 retries, and a hosted API's 20-60 s up to 2 min
    max_retry_wait_s: float = Field(default=1.0, ge=0)
    # connections open to it at once, streams included (None: no limit; the gateway's rate limits
    # bound them). A request past it waits for one up to timeout_s, then is a 503 that does not count
    # against the breaker: httpx's default of 100 made the 101st concurrent stream a 504 that did
    max_connections: int | None = Field(default=None, ge=1)
    breaker_failures: int = Field(default=5, ge=1)  # consecutive failures that open the circuit
    breaker_reset_s: float = Field(
        default=30.0, gt=0
    )  # how long it stays open before one probe is let through


class LocalModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    draft: str | None = None  # the draft model served with it; None: prompt lookup is its only drafter


class TierSettings(BaseModel):
    """One tier: a local model or an upstream, chosen when the complexity score reaches `threshold`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    threshold: float = Field(default=0.0, ge=0.0, le=1.0)
    model: str | None = None  # a key of `router.models`
    upstream: str | None = None  # a name in `router.upstreams`
    # False: no draft-model speculation on this tier; input-grounded requests still use prompt
    # lookup, which needs no draft model (router.policy, rule 2)
    speculation: bool = True
    # Tiers to try, in order, when this one fails before the first byte. None: the next tier up, then
    # the ones below from nearest; [] turns fallback off.
    fallback: list[str] | None = None

    @model_validator(mode="after")
    def _one_target(self) -> TierSettings:
        if (self.model is None) == (self.upstream is None):
            raise ValueError(f"router.tiers[{self.name}]: set exactly one of `model` or `upstream`")
        return self


class StrategyLimits(BaseModel):
    """What the router, and a request's `speculative` override, may ask of the engine."""

    model_config = ConfigDict(extra="forbid")

    max_k: int = Field(default=8, ge=1, le=32)  # cap on the engine's adaptive draft length
    allowed_modes: list[SpecMode] = Field(default_factory=lambda: list(SpecMode))
    # Above this temperature draft acceptance collapses (the target and draft distributions flatten
    # differently), so verification costs more than it saves: decode plainly.
    high_temperature: float = Field(default=1.2, ge=0.0)
    # Prompt lookup for "long context, short answer": prompt chars at least this many times max_tokens.
    grounded_ratio: float = Field(default=8.0, gt=0)

    @field_validator("allowed_modes", mode="before")
    @classmethod
    def _off_is_a_mode(cls, v: object) -> object:
        # YAML 1.1 (PyYAML's) reads a bare `off` as false: `allowed_modes: [off, ngram]`, as this
        # module's docstring spells it, was refused as "got False"
        return [SpecMode.OFF if m is False else m for m in v] if isinstance(v, list) else v


DEFAULT_MODELS = {SMALL_MODEL: LocalModel(), LARGE_MODEL: LocalModel(draft=SMALL_MODEL)}


def _default_tiers() -> list[TierSettings]:
    return [
        TierSettings(name="small", model=SMALL_MODEL, threshold=0.0, speculation=False),
        TierSettings(name="large", model=LARGE_MODEL, threshold=0.25),
    ]


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # False: routed aliases go to the last (largest) tier
    default_alias: str = "auto"  # `model` values that are routed by complexity; "auto" always is
    # Local models and their drafts. None: whatever the gateway's `models:` list serves (the default
    # pair when used alone). Set it only to route among models configured outside specgate.yaml.
    models: dict[str, LocalModel] | None = None
    tiers: list[TierSettings] = Field(default_factory=_default_tiers)
    # Upstreams may live here or in the gateway's top-level `upstreams:`; the Router sees both.
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    strategy: StrategyLimits = Field(default_factory=lambda: StrategyLimits())

    @model_validator(mode="after")
    def _consistent(self) -> RouterSettings:
        if not self.tiers:
            raise ValueError("router.tiers: at least one tier is needed")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"router.tiers: duplicate tier names in {names}")
        if self.tiers[0].threshold != 0.0:
            raise ValueError("router.tiers[0].threshold must be 0.0 so every score has a tier")
        for prev, cur in zip(self.tiers, self.tiers[1:], strict=False):
            if cur.threshold < prev.threshold:
                raise ValueError(
                    f"router.tiers: thresholds must ascend, {cur.name}={cur.threshold} < {prev.name}={prev.threshold}"
                )
        for t in self.tiers:
            for f in t.fallback or []:
                if f not in names or f == t.name:
                    raise ValueError(f"router.tiers[{t.name}].fallback: '{f}' is not another tier in {names}")
        return self  # references to models and upstreams: `check_references`, run by the Router

    def check_references(
        self, upstreams: list[UpstreamSettings], models: dict[str, LocalModel] | None
    ) -> None:
        """Tiers name configured models and upstreams. Run again by `Router` with the gateway's
        top-level `models:` and `upstreams:`, which a `router:` section alone cannot see."""
        ups = [u.name for u in upstreams]
        if len(set(ups)) != len(ups):
            raise ValueError(f"upstreams: duplicate names in {ups}")
        local = DEFAULT_MODELS if models is None else models
        for t in self.tiers:
            if t.model is not None and t.model not in local:
                raise ValueError(
                    f"router.tiers[{t.name}].model: '{t.model}' is not a configured model {sorted(local)}"
                )
            if t.upstream is not None and t.upstream not in ups:
                raise ValueError(
                    f"router.tiers[{t.name}].upstream: '{t.upstream}' is not a configured upstream {ups}"
                )
        for name, m in local.items():
            if m.draft is not None and m.draft not in local:
                # The draft must be loaded too; listing it keeps one source of truth for what is resident.
                raise ValueError(f"models[{name}].draft: '{m.draft}' is not a configured model")

    def all_upstreams(self, extra: list[UpstreamSettings] | None = None) -> list[UpstreamSettings]:
        return [*self.upstreams, *(extra or [])]

    def tier(self, name: str) -> TierSettings:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)
