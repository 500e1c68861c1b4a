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


@pytest.mark.parametrize("logprobs", [None, 2])
def test_remote_completion_echo_is_the_upstreams(
    servers: tuple[Server, Server], logprobs: int | None
) -> None:
    """A legacy completion with echo routed to the remote tier: the upstream echoes the prompt in its
    text (the gateway adds none of its own) and, asked for logprobs, scores it; both pass through as
    the upstream sent them, streamed or not."""
    upstream, gateway = servers
    body: dict[str, Any] = {"prompt": HARD, "max_tokens": 4, "temperature": 0, "echo": True}
    if logprobs is not None:
        body["logprobs"] = logprobs
    direct = httpx.post(upstream.base_url + "/completions", json={**body, "model": "tiny"}, timeout=60).json()
    r = httpx.post(gateway.base_url + "/completions", json={**body, "model": "auto"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-specgate-route"].startswith("tier=remote; model=tiny")
    want, got = direct["choices"][0], r.json()["choices"][0]
    assert got["text"] == want["text"] and got["text"].startswith(HARD)
    with httpx.stream(
        "POST", gateway.base_url + "/completions", json={**body, "model": "auto", "stream": True}, timeout=60
    ) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    chunks = [c["choices"][0] for c in events if c["choices"]]
    assert "".join(c["text"] for c in chunks) == want["text"]
    if logprobs is None:
        assert got["logprobs"] is None and all(c["logprobs"] is None for c in chunks)
        return
    assert want["logprobs"]["token_logprobs"][0] is None and len(want["logprobs"]["tokens"]) == len(HARD) + 4
    streamed: dict[str, list[Any]] = {k: [] for k in want["logprobs"]}
    for c in chunks:
        for k, v in (c["logprobs"] or {}).items():
            streamed[k].extend(v)
    for lp in (got["logprobs"], streamed):
        assert (
            lp["tokens"] == want["logprobs"]["tokens"]
            and lp["text_offset"] == want["logprobs"]["text_offset"]
        )
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        # (each request scores the prompt anew on the float32 upstream: 1.9e-5 apart once in a full run)
        assert lp["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-4)
        assert [sorted(t) for t in lp["top_logprobs"][1:]] == [
            sorted(t) for t in want["logprobs"]["top_logprobs"][1:]
        ]


def test_dead_upstream_falls_back_to_the_local_tier(servers: tuple[Server, Server]) -> None:
    upstream, gateway = servers
    stop_server(upstream)  # SIGKILL
    for _ in range(2):  # the first finds it dead, the second finds the circuit open: both fall back
        headers, text, _ = stream(gateway, "auto", HARD)
        assert headers["x-specgate-route"].startswith("tier=small; model=tiny-draft; strategy=off")
        assert text
