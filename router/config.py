"""Router settings (the `router:` and `upstreams:` sections of specgate.yaml). Owned by the router."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class UpstreamSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    base_url: str
    model: str  # the model name the upstream knows
    api_key_env: str | None = None  # environment variable holding the upstream's API key
    timeout_s: float = 60.0


class RouterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    default_alias: str = "auto"  # `model` values that are routed by complexity
