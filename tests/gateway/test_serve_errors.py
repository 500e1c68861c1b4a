"""`specgate serve` refuses a configuration the app cannot start with as it refuses an invalid setting:
one `error:` line naming what is wrong and exit status 2, before the port opens, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.gateway.conftest import ROOT, TINY_MODELS

UPSTREAM = {
    "name": "vllm",
    "base_url": "http://127.0.0.1:9/v1",
    "model": "big",
    "api_key_env": "H19_UNSET_KEY",
}
CASES = {
    "a tier naming no configured model": (
        {"router": {"tiers": [{"name": "small", "model": "qwen2.5-coder-0.5b"}]}},
        {},
        "router.tiers[small].model",
    ),
    "an upstream key variable unset": ({"upstreams": [UPSTREAM]}, {}, "H19_UNSET_KEY"),
    "an exporter this build lacks": ({}, {"OTEL_TRACES_EXPORTER": "jaeger"}, "OTEL_TRACES_EXPORTER"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_start_up_errors_name_the_setting(case: str, tmp_path: Path) -> None:
    settings, env, named = CASES[case]
    config = tmp_path / "specgate.yaml"
    config.write_text(yaml.safe_dump({"models": TINY_MODELS, **settings}))
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", "9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")} | env,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert named in line


def test_a_port_in_use_is_one_error_line_before_any_model_loads(tmp_path: Path) -> None:
    """uvicorn bound the port only once the lifespan had begun loading the models: a port in use was
    reported after the load (40-60 s on the real pair), with exit status 3."""
    import socket

    config = tmp_path / "specgate.yaml"
    config.write_text(yaml.safe_dump({"models": TINY_MODELS}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
             "--port", str(port)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 2, run.stderr
    (line,) = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert "Traceback" not in run.stderr and "loading" not in run.stderr.lower()
