"""The router inside the gateway: a real `specgate serve` (tiny models) routes `auto` to a second
real `specgate serve` as its remote tier, and falls back to its local tier when that one dies."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import Server, start_server, stop_server

HARD = "Prove step by step that the algorithm's complexity is O(n log n), and explain why."


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    upstream = start_server(tmp_path_factory.mktemp("upstream"), {})
    try:
        gateway = start_server(tmp_path_factory.mktemp("gateway"), {
            "cache": {"enabled": False},  # repeated prompts must reach a backend, not a cached replay
            "upstreams": [{"name": "a", "base_url": upstream.base_url, "model": "tiny", "retries": 0,
                           "breaker_failures": 1, "breaker_reset_s": 60}],
            "router": {"tiers": [{"name": "small", "model": "tiny-draft", "speculation": False},
                                 {"name": "remote", "upstream": "a", "threshold": 0.25, "fallback": ["small"]}]},
        })  # fmt: skip
    except BaseException:
        stop_server(upstream)
        raise
    yield upstream, gateway
    stop_server(gateway)
    stop_server(upstream)


def stream(server: Server, model: str, prompt: str) -> tuple[httpx.Headers, str, list[dict[str, Any]]]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return r.headers, text, chunks


def test_auto_routes_hard_prompts_to_the_remote_tier_verbatim(servers: tuple[Server, Server]) -> None:
    upstream, gateway = servers
    headers, text, chunks = stream(gateway, "auto", HARD)
    assert headers["x-specgate-route"].startswith("tier=remote; model=tiny; strategy=off; score=")
    _, direct, _ = stream(upstream, "tiny", HARD)
    assert text == direct and text  # the upstream's text, passed through unchanged
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 12  # exact, from the upstream's usage chunk


def test_easy_prompts_stay_local_and_explicit_models_skip_routing(servers: tuple[Server, Server]) -> None:
    _, gateway = servers
    headers, text, _ = stream(gateway, "auto", "hi")
    assert text
    assert headers["x-specgate-route"] == "tier=small; model=tiny-draft; strategy=off; score=0.00"
    headers, _, _ = stream(gateway, "tiny", HARD)
    assert headers["x-specgate-route"].startswith("tier=explicit; model=tiny; strategy=auto")


def test_dead_upstream_falls_back_to_the_local_tier(servers: tuple[Server, Server]) -> None:
    upstream, gateway = servers
    stop_server(upstream)  # SIGKILL
    for _ in range(2):  # the first finds it dead, the second finds the circuit open: both fall back
        headers, text, _ = stream(gateway, "auto", HARD)
        assert headers["x-specgate-route"].startswith("tier=small; model=tiny-draft; strategy=off")
        assert text
