"""The Grafana dashboard and Prometheus rules only use metrics the gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from gateway.observability.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NAME = re.compile(r"\bspecgate_[a-z_]+\b")
SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")


def _exported() -> set[str]:
    names = set()
    for metric in Metrics().registry.collect():
        names.update(metric.name + s for s in SUFFIXES)
    return names


def _exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k in ("expr", "query", "definition") and isinstance(v, str)] + [
            e for v in node.values() for e in _exprs(v)
        ]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_dashboard_queries_name_exported_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/specgate.json").read_text())
    exprs = _exprs(dash["panels"]) + _exprs(dash["templating"])
    assert len(exprs) > 20
    unknown = {n for e in exprs for n in NAME.findall(e)} - _exported()
    assert not unknown, f"dashboard queries metrics the gateway does not export: {sorted(unknown)}"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for topic in (
        "first token",
        "tokens / s",
        "acceptance",
        "per step",
        "on/off",
        "cache hit",
        "route mix",
        "error",
    ):
        assert topic in titles, topic


def test_alert_rules_name_exported_metrics() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    assert {"SpecgateHighErrorRate", "SpecgateTTFTp99High", "SpecgateRedisCircuitOpen"} <= {
        r["alert"] for r in rules
    }
    unknown = {n for r in rules for n in NAME.findall(r["expr"])} - _exported()
    assert not unknown, sorted(unknown)
