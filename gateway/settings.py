"""The gateway's one settings object, read once at start.

Precedence: command-line flags > environment (``SPECGATE_*``) > YAML file > defaults. Environment
names follow the YAML path with ``__`` between levels (``SPECGATE_LIMITS__MAX_N=4``); values that
look like JSON lists or objects are parsed as JSON (``SPECGATE_MODELS='[...]'``).
``SPECGATE_API_KEYS`` (a comma-separated list) and ``SPECGATE_REDIS_URL`` are short names for
``SPECGATE_AUTH__API_KEYS`` and ``SPECGATE_CACHE__REDIS_URL`` (the long name wins). A name with
``__`` whose first part is no section, or a setting's name without its section (``SPECGATE_PORT``),
is an error; other ``SPECGATE_*`` variables (``SPECGATE_HOME``,
the model store's) are not settings and are left alone.

Every section refuses unknown keys, so a typo is an error at start that names the setting, not a
silently ignored value.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.cache.settings import CacheSettings
from gateway.observability.settings import ObservabilitySettings
from router.config import RouterSettings, UpstreamSettings

ENV_PREFIX = "SPECGATE_"


class SettingsError(Exception):
    pass


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    sse_ping_s: float = Field(default=10.0, ge=0)  # keep-alive comment interval (long prefills, proxies)
    # A client that sends its request line and headers slower than this is answered 408 and dropped
    # (uvicorn's own keep-alive timeout covers only idle connections between requests).
    header_timeout_s: float = Field(default=10.0, gt=0)
    # ...and one whose body has not fully arrived this long after its headers: 408, connection closed
    body_timeout_s: float = Field(default=30.0, gt=0)
    # Origins a browser may call the API from (CORS), as vLLM's --allowed-origins: every one by
    # default, since the API authenticates by bearer key, never by cookie; [] turns CORS off
    cors_allow_origins: list[str] = Field(default_factory=lambda: ["*"])


class ModelSettings(_Section):
    name: str = Field(min_length=1)  # the `model` clients send
    source: str  # alias, tiny-random, local directory, .gguf file or hub id (decoding.loader)
    draft: str | None = None  # name of another configured model used as this one's draft
    # checked here, so a typo is an error at start naming the setting, not torch's once loading has
    # begun with the port open (decoding.loader.pick_dtype and pick_device read them)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    max_context: int | None = Field(default=None, ge=2)
    # eager | static | cuda_graphs | compile | tensorrt | llamacpp; auto: compile (falling back to
    # cuda_graphs) on a GPU; on a CPU llamacpp for a GGUF at dtype auto where the `llamacpp` extra is
    # installed, else static (decoding.loader.ModelSpec.backend)
    backend: Literal["auto", "eager", "static", "cuda_graphs", "compile", "tensorrt", "llamacpp"] = "auto"
    # the static backends' exact mode (see docs/architecture.md, Exact mode); unset: on wherever
    # padding is cheap (decoding.loader.ModelSpec.exact)
    exact: bool | None = None
    # exact mode on a GPU also batch-invariant (a request's tokens do not depend on what else is in the
    # batch), at a cost in throughput (decoding.loader.ModelSpec.batch_invariant)
    batch_invariant: bool = False
    # llama.cpp: a finished request's KV stays in its slot for the next request sharing its prompt's
    # prefix (decoding.prefix; docs/architecture.md, Prefix caching); false: every prompt prefilled whole
    prefix_caching: bool = True


class AuthSettings(_Section):
    api_keys: list[str] = Field(default_factory=list)  # empty: no auth
    # Paths served without a key when keys are set. Beyond /health, readiness and metrics are open by
    # default because Kubernetes probes and Prometheus scrapers carry no key, and the dashboard is a
    # static page over /metrics that a browser opens without one. None of them holds prompt text.
    # Set to ["/health"] to require a key everywhere else. /openapi.json is not public by default:
    # it describes an API that needs a key (add it here to publish the schema).
    public_paths: list[str] = Field(default_factory=lambda: ["/health", "/ready", "/metrics", "/dashboard"])
    # a key's requests reuse only the prompt prefixes its own requests left in the engine's KV (each
    # request salted by its tenant, as vLLM's cache_salt): no other key learns from cached_tokens or
    # timing whether a prompt was sent (docs/architecture.md, Prefix caching)
    prefix_cache_per_key: bool = False


class LimitSettings(_Section):
    max_body_bytes: int = Field(default=1_000_000, ge=1024)
    max_n: int = Field(default=8, ge=1)
    max_max_tokens: int = Field(default=4096, ge=1)
    # a chat request without max_tokens: None generates until the model stops or the context is full,
    # up to max_max_tokens, as OpenAI's and vLLM's chat do (completions default to 16, as OpenAI's
    # legacy API does). 512 cut long answers short with finish_reason "length" where a client
    # written against OpenAI expected the whole of it.
    default_max_tokens: int | None = Field(default=None, ge=1)
    max_stops: int = Field(default=4, ge=0)
    rpm: int | None = Field(default=None, ge=1)  # requests per minute per key; None: unlimited
    tpm: int | None = Field(default=None, ge=1)  # tokens (prompt + completion) per minute per key
    # rpm/tpm buckets in Redis (cache.redis_url), one limit across every gateway replica; None:
    # shared whenever a Redis is configured. False: each process keeps its own buckets.
    shared: bool | None = None
    # requests the engine batches; None: 4 on a CPU, on a GPU as many as the KV caches fit in its
    # free memory, up to 64 (decoding.sizing.default_max_active, logged at start)
    max_active: int | None = Field(default=None, ge=1)
    max_queued: int = Field(default=32, ge=0)  # beyond this, 503 with Retry-After
    # prompt tokens a step prefills beside the decoding requests (vLLM's max_num_batched_tokens less
    # the decode rows): a long prompt enters in chunks of this many, so the streams running beside
    # it wait at most one chunk a token; None: 128 on a GPU, 64 on a CPU
    prefill_budget: int | None = Field(default=None, ge=1)
    # ... and in a step with no request decoding (a burst reaching an idle server); None: 2048 on a
    # GPU, prefill_budget on a CPU (an abort waits for the step it arrives in)
    burst_budget: int | None = Field(default=None, ge=1)
    # a grammar (response_format's schema, guided_*, tools' parameters) larger than this is a 400
    # before it is compiled, and one whose compile outlasts the timeout a 400 (decoding.grammar)
    max_grammar_bytes: int = Field(default=262_144, ge=1024)
    grammar_timeout_s: float = Field(default=10.0, gt=0)
    retry_after_s: int = Field(default=1, ge=0)
    drain_timeout_s: float = Field(default=30.0, ge=0)


def default_models() -> list[ModelSettings]:
    return [
        ModelSettings(name="qwen2.5-coder-1.5b", source="qwen2.5-coder-1.5b", draft="qwen2.5-coder-0.5b"),
        ModelSettings(name="qwen2.5-coder-0.5b", source="qwen2.5-coder-0.5b"),
    ]


class ResponsesSettings(_Section):
    """The Responses API's stored responses (gateway/response_store.py): in cache.redis_url's Redis
    when one is set, else in process."""

    ttl_s: int = Field(default=86400, ge=1)  # how long a stored response can be read or continued
    max_entries: int = Field(default=1024, ge=1)  # in process (no Redis): oldest dropped past this
    timeout_ms: float = Field(default=1000.0, gt=0)  # each Redis call's bound; past it a 503


class Settings(_Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    models: list[ModelSettings] = Field(default_factory=default_models, min_length=1)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    stream_granularity: Literal["step", "token"] = "step"
    router: RouterSettings = Field(default_factory=RouterSettings)
    upstreams: list[UpstreamSettings] = Field(default_factory=list)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)

    @model_validator(mode="after")
    def _check_models(self) -> Settings:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"models: duplicate name(s) {', '.join(dupes)}")
        for m in self.models:
            if m.draft is not None and m.draft not in names:
                raise ValueError(f"models: '{m.name}' names draft '{m.draft}', which is not configured")
        if self.limits.shared and self.cache.redis_url is None:
            raise ValueError("limits.shared needs a Redis: set cache.redis_url (SPECGATE_REDIS_URL)")
        return self


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


# Short names for two settings an operator sets most; the long name wins where both are set.
ALIASES = {"SPECGATE_API_KEYS": ("auth", "api_keys"), "SPECGATE_REDIS_URL": ("cache", "redis_url")}


def _env_layer(env: Mapping[str, str]) -> dict[str, Any]:
    layer: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key in ALIASES:
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in Settings.model_fields:
            if len(path) > 1:  # a path, so meant as a setting: a misspelt section was ignored silently
                sections = ", ".join(Settings.model_fields)
                raise SettingsError(f"{key}: {path[0]!r} is no settings section (one of {sections})")
            meant = [
                f"{ENV_PREFIX}{section.upper()}__{key[len(ENV_PREFIX) :]}"
                for section, field in Settings.model_fields.items()
                if isinstance(field.annotation, type)
                and issubclass(field.annotation, BaseModel)
                and path[0] in field.annotation.model_fields
            ]
            if meant:  # SPECGATE_PORT: a setting's name without its section
                raise SettingsError(f"{key} is no setting: {' or '.join(meant)} is")
            continue  # SPECGATE_HOME and friends belong to other parts of specgate
        value = json.loads(raw) if raw.strip()[:1] in ("[", "{") else raw
        node = layer
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    # An alias is read here, with every other setting, so what it sets is the one value the whole
    # gateway sees: SPECGATE_REDIS_URL read by the cache alone left the rate limits per process
    # and `limits.shared: true` refused as having no Redis.
    for key, (section, name) in ALIASES.items():
        if key in env:
            raw = env[key]
            value = [k.strip() for k in raw.split(",") if k.strip()] if name == "api_keys" else raw
            layer.setdefault(section, {}).setdefault(name, value)
    return layer


def _describe(exc: ValidationError) -> str:
    lines = []
    for e in exc.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or "settings"
        lines.append(f"  {where}: {e['msg']} (got {e.get('input')!r})"[:300])
    return "invalid settings:\n" + "\n".join(lines)


def load_settings(
    config: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Defaults < YAML ``config`` < environment < ``overrides`` (flags, as a nested dict)."""
    data: dict[str, Any] = {}
    if config is not None:
        path = Path(config)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"cannot read config {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise SettingsError(f"config {path}: the top level must be a mapping")
        data = loaded
    try:
        data = _merge(data, _env_layer(os.environ if env is None else env))
    except json.JSONDecodeError as exc:
        raise SettingsError(f"a SPECGATE_* variable holds invalid JSON: {exc}") from exc
    data = _merge(data, {k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(_describe(exc)) from exc
