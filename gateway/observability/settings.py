"""Observability settings (the `observability:` section of specgate.yaml). Owned by observability."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ObservabilitySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    log_json: bool = False
    log_content: bool = False  # prompt/completion text in logs and spans: off unless asked for
