"""The Grafana dashboard and Prometheus rules only use metrics, labels and label values the gateway
exports."""

from __future__ import annotations

import json
import re
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest
import yaml

from gateway.observability.metrics import CACHE_OUTCOMES, CACHE_TIERS, ERROR_TYPES, ROUTES, Metrics

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


SELECTOR = re.compile(r"\b(specgate_[a-z_]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([a-z_]+)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*(?:,|$)')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# the values a label can take where the gateway fixes them: a matcher on any other matches nothing
CLOSED: dict[tuple[str, str], AbstractSet[str]] = {
    ("specgate_cache_lookups", "tier"): CACHE_TIERS,
    ("specgate_cache_lookups", "outcome"): CACHE_OUTCOMES,
    ("specgate_stream_errors", "type"): ERROR_TYPES,
    ("specgate_circuit_state", "component"): {"redis", "rate_limits"},
    ("specgate_engine_steps", "kind"): {"spec", "plain"},
    ("specgate_requests", "status"): {str(s) for s in range(100, 600)},
}


def _labels() -> dict[str, tuple[set[str], str]]:
    """Every exported series name: (its label names, its family's name)."""
    out = {}
    for c in Metrics().registry._collector_to_names:
        name, kind, labels = c._name, c._type, set(c._labelnames)  # type: ignore[attr-defined]
        suffixes = {"histogram": ("_sum", "_count", "_created"), "counter": ("_total", "_created")}
        for s in suffixes.get(kind, ("",)):
            out[name + s] = (labels, name)
        if kind == "histogram":
            out[name + "_bucket"] = (labels | {"le"}, name)
    return out


def _queries() -> list[str]:
    dash = json.loads((DEPLOY / "grafana/dashboards/specgate.json").read_text())
    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    return _exprs(dash["panels"]) + [r["expr"] for r in rules]


def _values(label: str, family: str) -> AbstractSet[str] | None:
    if label == "route":
        return set(ROUTES) | {"other"}
    return CLOSED.get((family, label))


def _problems(q: str, exported: dict[str, tuple[set[str], str]]) -> list[str]:
    out = []
    assert q.count("(") == q.count(")") and q.count("{") == q.count("}") and q.count('"') % 2 == 0, q
    names = SELECTOR.findall(q)
    for name, matchers in names:
        labels, family = exported[name]
        parsed = MATCHER.findall(matchers)
        assert len(parsed) == len([m for m in matchers.split(",") if m.strip()]), (name, matchers)
        for label, op, value in parsed:
            if label not in labels:
                out.append(f"{name} has no label {label!r}: {q}")
                continue
            allowed = _values(label, family)
            free = allowed is None or op not in ("=", "=~") or "$" in value  # $model: Grafana's
            if not free and not any(re.fullmatch(value, v) for v in allowed or ()):
                out.append(f"{name}{{{label}{op}{value!r}}} matches no value it takes: {q}")
    for group in GROUPING.findall(q):
        for label in filter(None, (g.strip() for g in group.split(","))):
            if not any(label in exported[n][0] for n, _ in names):
                out.append(f"grouping by {label!r}, which none of its series has: {q}")
    return out


def test_queries_select_labels_and_values_the_gateway_exports() -> None:
    """A label the series lacks, or a value it never takes, is a panel with no data and an alert that
    can never fire, with no error anywhere: Prometheus just matches nothing."""
    exported = _labels()
    problems = [p for q in _queries() for p in _problems(q, exported)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "query",
    [
        'sum(rate(specgate_requests_total{code=~"5.."}[5m]))',  # the label is `status`
        'max(specgate_circuit_state{component="cache"})',  # the cache's breaker is "redis"
        'sum(rate(specgate_stream_errors_total{type="api_error"}[5m]))',  # OpenAI's type: server_error
        "sum by (le) (rate(specgate_time_to_first_token_seconds_count[5m]))",  # le is the buckets'
        'sum(rate(specgate_requests_total{route=~"/chat/.*"}[5m]))',  # routes are /v1/...
    ],
)
def test_the_label_check_catches_mistakes(query: str) -> None:
    assert _problems(query, _labels())
