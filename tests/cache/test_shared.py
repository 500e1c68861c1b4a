"""Two ``specgate serve`` processes (tiny random models) share one redis-server: an answer generated
by one is a hit on the other. One gets the URL from its config, the other from SPECGATE_REDIS_URL."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import Server, start_server, stop_server
from tests.servers import UNHURRIED_REDIS, RedisProcess


@pytest.fixture
def two_gateways(own_redis: RedisProcess, tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = start_server(tmp_path / "a", {"cache": {"redis_url": own_redis.url, **UNHURRIED_REDIS}})
    try:
        unhurried = {f"SPECGATE_CACHE__{k.upper()}": str(v) for k, v in UNHURRIED_REDIS.items()}
        b = start_server(tmp_path / "b", {}, env={"SPECGATE_REDIS_URL": own_redis.url, **unhurried})
    except Exception:
        stop_server(a)
        raise
    yield a, b
    stop_server(a)
    stop_server(b)


def ask(server: Server, text: str, **extra: object) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 8,
    }
    r = httpx.post(server.base_url + "/chat/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_two_processes_share_hits(two_gateways: tuple[Server, Server]) -> None:
    a, b = two_gateways
    first = ask(a, "What is a mutex?")
    assert first.headers["x-specgate-cache"] == "miss"
    for _ in range(50):  # the store is a background task on A
        r = ask(b, "What is a mutex?")
        if r.headers["x-specgate-cache"] != "miss":
            break
        time.sleep(0.05)
    assert r.headers["x-specgate-cache"] == "exact; similarity=1.0000"
    assert r.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    streamed = ask(b, "What is a mutex?", stream=True)
    assert streamed.headers["x-specgate-cache"].startswith("exact") and streamed.text.endswith(
        "data: [DONE]\n\n"
    )

    # semantic across processes, once both embedders have loaded (they load in the background)
    deadline = time.monotonic() + 60
    i = 0
    while time.monotonic() < deadline:
        i += 1
        ask(b, f"How do I reverse a list of {i} strings in Python?")
        time.sleep(0.2)
        hit = ask(a, f"How can I reverse a list of {i} strings in Python?").headers["x-specgate-cache"]
        if hit.startswith("semantic"):
            break
    assert hit.startswith("semantic; similarity="), "paraphrase never hit across processes"
