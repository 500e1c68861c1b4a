"""`specgate serve` never reaches for a model hub: a source that is no pinned alias, tiny model, local
directory or .gguf file is looked up in the local Hugging Face cache only, and a model that cannot be
loaded ends the process with one `error:` line naming it, not a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from tests.gateway.conftest import ROOT
from tests.servers import free_port


def test_a_hub_id_is_never_fetched_and_its_failure_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "specgate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [{"name": "m", "source": "no-such-org/no-such-model", "device": "cpu"}],
                "router": {"tiers": [{"name": "only", "model": "m"}]},
            }
        )
    )
    with socket.socket() as proxy:  # every HTTP(S) request of the process would come here first
        proxy.bind(("127.0.0.1", 0))
        proxy.listen(16)
        url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_", "OTEL_"))}
        env |= {
            "SPECGATE_HOME": str(tmp_path / "store"),
            "HTTPS_PROXY": url,
            "HTTP_PROXY": url,
            "ALL_PROXY": url,
        }
        env |= {"HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "", "no_proxy": ""}
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "serve",
                "--config",
                str(config),
                "--port",
                str(free_port()),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=150,
            env=env,
        )
        proxy.setblocking(False)
        try:
            conn, _ = proxy.accept()
        except BlockingIOError:
            conn = None
        if conn is not None:
            conn.close()
    assert conn is None, "the gateway opened a connection to fetch a model"
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    (line,) = [line for line in run.stderr.splitlines() if "could not load" in line]
    assert "no-such-org/no-such-model" in line and "does not download from a model hub" in line
