"""The environment the compose file and the chart give the gateway means what they intend to
gateway/settings.py: every SPECGATE_* name is a real setting (a typo would be ignored silently, since
non-section names are left to other parts of specgate) or one of the few non-settings we read
elsewhere, and the values load. Also: the paths that probes and Prometheus call without credentials."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import Settings, load_settings
from tests.deploy.chart import ROOT, gateway_container, one, render
from tests.deploy.test_chart import SCENARIOS

# Read by the model store and the container entrypoint, not by the settings layer.
NOT_SETTINGS = {"SPECGATE_HOME", "SPECGATE_SKIP_PULL", "SPECGATE_PULL_MODELS"}
# Stand-ins for what the chart reads from Secrets.
SECRET_SAMPLES = {
    "SPECGATE_API_KEYS": "key-one,key-two",
    "SPECGATE_CACHE__REDIS_URL": "redis://:pw@redis.llm:6379/0",
}


def _compose_env() -> dict[str, str]:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    raw = compose["services"]["gateway"]["environment"]
    # compose interpolation, for the one form the file uses: ${NAME:-default} with NAME unset
    return {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in raw.items()}


def _chart_env(values: dict[str, Any]) -> dict[str, str]:
    out = {}
    for e in gateway_container(render(values)).get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "secretKeyRef" in e["valueFrom"]:
            out[e["name"]] = SECRET_SAMPLES[e["name"]]
    return out


def _check_names(env: dict[str, str]) -> None:
    for name in env:
        if not name.startswith("SPECGATE_") or name == "SPECGATE_API_KEYS":
            continue
        section = name.removeprefix("SPECGATE_").lower().split("__")[0]
        if name in NOT_SETTINGS:
            assert section not in Settings.model_fields, (
                f"{name} now collides with the settings section {section!r}"
            )
        else:
            assert section in Settings.model_fields, f"{name} is no gateway setting and would be ignored"


def test_compose_environment_loads_as_intended() -> None:
    env = _compose_env()
    _check_names(env)
    s = load_settings(env=env)
    assert s.cache.redis_url == "redis://redis:6379/0"
    assert s.auth.api_keys == []  # SPECGATE_API_KEYS unset on the host: no auth
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    grace = compose["services"]["gateway"]["stop_grace_period"]
    assert int(grace.removesuffix("s")) > s.limits.drain_timeout_s


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_chart_environment_and_config_load_as_intended(scenario: str, tmp_path: Path) -> None:
    values = SCENARIOS[scenario]
    env = _chart_env(values)
    _check_names(env)
    docs = render(values)
    config = None
    if values.get("config"):
        config = tmp_path / "specgate.yaml"
        config.write_text(one(docs, "ConfigMap")["data"]["specgate.yaml"])
    s = load_settings(config, env=env)
    assert s.limits.drain_timeout_s == 30
    if "apiKeys" in values:
        assert s.auth.api_keys == ["key-one", "key-two"]
    if "redis" in values:
        assert s.cache.redis_url is not None
    if config is not None:
        assert [u.name for u in s.upstreams] == [u["name"] for u in values["config"]["upstreams"]]


def test_chart_models_value_is_the_target_with_its_draft() -> None:
    s = load_settings(env=_chart_env({}))
    target, draft = s.models
    assert (target.name, target.draft) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
    assert (draft.name, draft.draft) == ("qwen2.5-coder-0.5b", None)
    (alone,) = load_settings(env=_chart_env({"model": {"name": "tiny-random", "draft": ""}})).models
    assert (alone.source, alone.draft) == ("tiny-random", None)


def _public_paths() -> set[str]:
    from gateway.settings import AuthSettings

    return set(AuthSettings().public_paths)


def test_liveness_path_needs_no_api_key() -> None:
    assert "/health" in _public_paths()


# kubelet probes and Prometheus send no Authorization header: with keys required there, the pod would
# never turn Ready and every scrape would get a 401.
def test_readiness_path_needs_no_api_key() -> None:
    assert "/ready" in _public_paths()


def test_metrics_path_needs_no_api_key() -> None:
    assert "/metrics" in _public_paths()
