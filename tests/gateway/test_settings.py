"""Settings: defaults, YAML < env < flags, and errors that name the setting."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from gateway.settings import SettingsError, load_settings


def test_defaults_serve_the_default_pair_without_redis() -> None:
    s = load_settings(env={})
    assert [(m.name, m.draft) for m in s.models] == [
        ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"),
        ("qwen2.5-coder-0.5b", None),
    ]
    assert s.cache.redis_url is None and s.auth.api_keys == [] and s.stream_granularity == "step"


def test_precedence_flags_over_env_over_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server: {port: 9000, host: 0.0.0.0}\nlimits: {max_n: 3, rpm: 10}\n")
    env = {
        "SPECGATE_SERVER__PORT": "9100",
        "SPECGATE_LIMITS__MAX_N": "5",
        "SPECGATE_HOME": "/x",
        "OTHER": "1",
    }
    s = load_settings(cfg, overrides={"server": {"port": 9200}}, env=env)
    assert s.server.port == 9200 and s.server.host == "0.0.0.0"
    assert s.limits.max_n == 5 and s.limits.rpm == 10


def test_api_keys_from_env_and_json_lists() -> None:
    env = {"SPECGATE_API_KEYS": "a, b", "SPECGATE_MODELS": '[{"name": "t", "source": "tiny-random"}]'}
    s = load_settings(env=env)
    assert s.auth.api_keys == ["a", "b"] and [m.name for m in s.models] == ["t"]


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SPECGATE_LIMITS__MAX_N": "lots"}, "limits.max_n"),
        ({"SPECGATE_SERVER__PORT": "70000"}, "server.port"),
        ({"SPECGATE_STREAM_GRANULARITY": "word"}, "stream_granularity"),
        ({"SPECGATE_LIMITS__MAX_NN": "3"}, "limits.max_nn"),
        # a misspelt section: a path, so meant as a setting, which nothing else would read
        ({"SPECGATE_LIMIT__MAX_N": "3"}, "SPECGATE_LIMIT__MAX_N"),
        ({"SPECGATE_PORT": "9000"}, "SPECGATE_SERVER__PORT"),  # a setting's name without its section
        ({"SPECGATE_LIMITS__PREFILL_BUDGET": "0"}, "limits.prefill_budget"),
        ({"SPECGATE_MODELS": '[{"name": "a", "source": "s", "draft": "b"}]'}, "draft 'b'"),
        # checked by the settings, before the port opens, not by torch once loading has begun
        ({"SPECGATE_MODELS": '[{"name": "a", "source": "s", "device": "gpu"}]'}, "models.0.device"),
        ({"SPECGATE_MODELS": '[{"name": "a", "source": "s", "dtype": "bf16"}]'}, "models.0.dtype"),
    ],
)
def test_errors_name_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(SettingsError, match=named.replace(".", r"\.")):
        load_settings(env=env)


def test_bad_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("- just\n- a list\n")
    with pytest.raises(SettingsError, match="mapping"):
        load_settings(cfg, env={})


def test_the_step_budgets_reach_the_engine() -> None:
    """limits.prefill_budget and limits.burst_budget set the engine's prompt tokens a step (beside
    decoding requests, and with none); unset, the device's defaults (a CPU's burst is its chunk)."""
    from gateway.server import _build_engine

    models = '[{"name": "t", "source": "tiny-random", "dtype": "float32", "device": "cpu"}]'
    set_ = {
        "SPECGATE_MODELS": models,
        "SPECGATE_LIMITS__PREFILL_BUDGET": "24",
        "SPECGATE_LIMITS__BURST_BUDGET": "96",
    }
    for env, budgets in (({"SPECGATE_MODELS": models}, (64, 64)), (set_, (24, 96))):
        engine = _build_engine(load_settings(env=env))
        try:
            assert (engine.prefill_budget, engine.burst_budget) == budgets  # type: ignore[attr-defined]
            # ... and what loading made is out of garbage collection (decoding.warmup.freeze_heap)
            assert gc.get_freeze_count() > 0
        finally:
            gc.unfreeze()
            engine.shutdown()  # type: ignore[attr-defined]


def test_redis_url_alias_is_the_setting_every_part_reads(tmp_path: Path) -> None:
    """SPECGATE_REDIS_URL (README: "or SPECGATE_REDIS_URL") is cache.redis_url for the rate limits and
    the settings checks too, and above the YAML file like any variable; the long name wins."""
    url = "redis://127.0.0.1:6379/13"
    s = load_settings(env={"SPECGATE_REDIS_URL": url, "SPECGATE_LIMITS__SHARED": "true"})
    assert s.cache.redis_url == url and s.limits.shared
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cache: {redis_url: 'redis://from-yaml:6379/0'}\n")
    assert load_settings(cfg, env={"SPECGATE_REDIS_URL": url}).cache.redis_url == url
    both = {"SPECGATE_REDIS_URL": url, "SPECGATE_CACHE__REDIS_URL": "redis://long:6379/1"}
    assert load_settings(env=both).cache.redis_url == "redis://long:6379/1"
    keys = {"SPECGATE_API_KEYS": "a", "SPECGATE_AUTH__API_KEYS": '["b"]'}
    assert load_settings(env=keys).auth.api_keys == ["b"]
