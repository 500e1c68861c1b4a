"""deploy/docker-compose.yml is a valid compose file (the compose specification's JSON schema) and its
services are wired to each other and to the files it mounts. No Docker engine ran it here."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy.chart import ROOT
from tests.deploy.schemas import compose_validator

DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return doc


def _ports(service: dict[str, Any]) -> set[int]:
    return {int(str(p).split(":")[-1].split("/")[0]) for p in service.get("ports", [])}


def test_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    errors = [f"{e.json_path}: {e.message}" for e in compose_validator().iter_errors(compose)]
    assert errors == []


def test_the_schema_check_catches_mistakes(compose: dict[str, Any]) -> None:
    bad = yaml.safe_load(COMPOSE_FILE.read_text())
    bad["services"]["gateway"]["stop_grace_period"] = 45  # a number, not a duration
    bad["services"]["redis"]["helthcheck"] = bad["services"]["redis"].pop("healthcheck")
    messages = " ".join(e.message for e in compose_validator().iter_errors(bad))
    assert "45" in messages and "helthcheck" in messages


def test_the_whole_stack_is_there(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"gateway", "redis", "prometheus", "grafana", "jaeger"}
    ui_ports = {name: _ports(s) for name, s in compose["services"].items()}
    assert 8000 in ui_ports["gateway"] and 9090 in ui_ports["prometheus"]
    assert 3000 in ui_ports["grafana"] and 16686 in ui_ports["jaeger"]


def test_gateway_is_built_from_the_cpu_dockerfile_with_models_in_a_volume(compose: dict[str, Any]) -> None:
    gw = compose["services"]["gateway"]
    context = (COMPOSE_FILE.parent / gw["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / gw["build"]["dockerfile"]).is_file()
    (volume,) = gw["volumes"]
    name, target = volume.split(":")
    assert name in compose["volumes"] and target == gw["environment"]["SPECGATE_HOME"]


def test_gateway_reaches_redis_and_jaeger_by_service_name(compose: dict[str, Any]) -> None:
    services, env = compose["services"], compose["services"]["gateway"]["environment"]
    redis = urlparse(env["SPECGATE_CACHE__REDIS_URL"])
    assert redis.hostname == "redis" and redis.port == 6379
    assert compose["services"]["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"
    otlp = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert otlp.hostname == "jaeger"
    # the gateway ships the OTLP/HTTP exporter only; 4318 is the collector's OTLP/HTTP port
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf" and otlp.port == 4318
    assert env["OTEL_TRACES_EXPORTER"] == "otlp"
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")


def test_gateway_stops_with_sigterm_and_time_to_drain(compose: dict[str, Any]) -> None:
    gw = compose["services"]["gateway"]
    assert gw["stop_signal"] == "SIGTERM"
    drain = float(gw["environment"]["SPECGATE_LIMITS__DRAIN_TIMEOUT_S"])
    assert float(gw["stop_grace_period"].removesuffix("s")) > drain


def _bind_mounts(service: dict[str, Any]) -> list[tuple[Path, str]]:
    out = []
    for v in service.get("volumes", []):
        src, target = v.split(":")[:2]
        if src.startswith("."):
            out.append(((COMPOSE_FILE.parent / src).resolve(), target))
    return out


def test_every_bind_mount_exists(compose: dict[str, Any]) -> None:
    missing = [
        str(src.relative_to(ROOT))
        for s in compose["services"].values()
        for src, _ in _bind_mounts(s)
        if not src.exists()
    ]
    assert missing == [], "mounted by docker-compose.yml but not in the repository"


def _observability_file(relative: str) -> Path:
    path = DEPLOY / relative
    if not path.exists():
        pytest.fail(f"deploy/{relative} is missing (owned by the observability work)")
    return path


def test_prometheus_scrapes_the_gateway_and_loads_the_alert_rules(compose: dict[str, Any]) -> None:
    config = yaml.safe_load(_observability_file("prometheus/prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    assert "gateway:8000" in targets
    # rule files resolve against the config file's directory, mounted whole at /etc/prometheus
    ((src, target),) = _bind_mounts(compose["services"]["prometheus"])
    assert src == DEPLOY / "prometheus" and target == "/etc/prometheus"
    rules = [Path(r) for r in config.get("rule_files", [])]
    assert any(r.name == "alerts.yml" for r in rules)
    for r in rules:
        local = src / r.relative_to(target) if r.is_absolute() else src / r
        assert local.exists(), f"prometheus.yml loads {r}, which is not in deploy/prometheus/"


def test_grafana_provisioning_points_at_the_mounted_paths(compose: dict[str, Any]) -> None:
    mounts = {target: src for src, target in _bind_mounts(compose["services"]["grafana"])}
    provisioning = _observability_file("grafana/provisioning")
    _observability_file("grafana/dashboards/specgate.json")
    datasources = [
        d
        for f in sorted((provisioning / "datasources").glob("*.y*ml"))
        for d in yaml.safe_load(f.read_text())["datasources"]
    ]
    assert any(d["type"] == "prometheus" and urlparse(d["url"]).hostname == "prometheus" for d in datasources)
    providers = [
        p
        for f in sorted((provisioning / "dashboards").glob("*.y*ml"))
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    paths = {p["options"]["path"] for p in providers}
    assert any(mounts.get(path) == DEPLOY / "grafana" / "dashboards" for path in paths), (paths, mounts)
