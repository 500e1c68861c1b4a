"""Render deploy/helm/specgate with Helm itself (Helm's Go SDK, through ``helm-python-sdk``), offline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "specgate"
RELEASE, NAMESPACE = "specgate", "llm"


def helm() -> Any:
    return pytest.importorskip("helm_python", reason="dev dependency helm-python-sdk is not installed")


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every manifest `helm template` would print for these values (NOTES.txt left out)."""
    with helm().Chart.load(str(CHART)) as chart:
        files = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}: {[d['kind'] for d in docs]}"
    return found[0]


def gateway_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gateway")


def env(container: dict[str, Any]) -> dict[str, Any]:
    """name -> value, or the valueFrom object where the value comes from elsewhere."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}
