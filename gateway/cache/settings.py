"""Cache settings (the `cache:` section of specgate.yaml). Owned by the cache."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CacheSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    redis_url: str | None = None  # None: in-process LRU
