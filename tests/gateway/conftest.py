"""A real ``specgate serve`` in a subprocess on tiny random models, shared by the module tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import yaml

from tests.servers import free_port

API_KEY = "sk-test-key"
ROOT = Path(__file__).resolve().parents[2]

TINY_MODELS = [
    {
        "name": "tiny",
        "source": "tiny-random",
        "draft": "tiny-draft",
        "dtype": "float32",
        "device": "cpu",
        "max_context": 512,
    },
    {
        "name": "tiny-draft",
        "source": "tiny-random-draft",
        "dtype": "float32",
        "device": "cpu",
        "max_context": 512,
    },
]


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(tmp: Path, settings: dict[str, object], env: dict[str, str] | None = None) -> Server:
    port = free_port()
    config = tmp / "specgate.yaml"
    config.write_text(yaml.safe_dump({"models": TINY_MODELS, **settings}))
    log = tmp / "server.log"
    with log.open("wb") as sink:  # the child keeps its own copy of the descriptor
        proc = _spawn(config, port, sink, env)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.output()}")
        try:
            if httpx.get(server.url + "/ready", headers=_auth(env), timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"server not ready in time:\n{server.output()}")


def _spawn(config: Path, port: int, sink: IO[bytes], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT,
        stdout=sink,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
    )


def _auth(env: dict[str, str] | None) -> dict[str, str]:
    keys = (env or {}).get("SPECGATE_API_KEYS")
    return {"Authorization": f"Bearer {keys.split(',')[0]}"} if keys else {}


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait(10)


def start_roomy_server(tmp: Path) -> Server:
    """The tiny models with room for tool definitions in the prompt (the byte tokenizer spends a
    token per byte), keys on, no response cache."""
    models = [{**m, "max_context": 2048} for m in TINY_MODELS]
    return start_server(
        tmp,
        {"models": models, "cache": {"enabled": False}, "limits": {"max_max_tokens": 512}},
        env={"SPECGATE_API_KEYS": API_KEY},
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """API keys from the environment (SPECGATE_API_KEYS), small limits so refusals are cheap to hit."""
    s = start_server(
        tmp_path_factory.mktemp("server"),
        {
            "limits": {"max_body_bytes": 65536, "max_n": 4, "max_max_tokens": 256},
            "server": {"sse_ping_s": 0.2},
            "cache": {"enabled": False},  # a replayed answer would hide what generation did
        },
        env={"SPECGATE_API_KEYS": f"{API_KEY},sk-other"},
    )
    yield s
    stop_server(s)


@pytest.fixture
def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def client(server: Server) -> Iterator[Any]:
    """The official SDK against the module's ``server`` (modules testing an app in process define
    their own ``client``)."""
    import openai

    with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0) as c:  # its sockets closed
        yield c
