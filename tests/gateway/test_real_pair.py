"""The gateway on the real Qwen2.5-Coder pair (slow: float32 on CPU)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from gateway.app import create_app
from gateway.settings import load_settings

pytestmark = pytest.mark.slow


@pytest.fixture
def app(real_pair: Any) -> Any:
    engine = AsyncEngine(Engine(real_pair))
    yield create_app(load_settings(env={}), engine=engine)
    engine.shutdown()


async def test_real_pair_stream_equals_whole_and_speculates(app: Any) -> None:
    body = {
        "model": "target",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a Python function that returns the string 'café ☕'."},
        ],
        "max_tokens": 24,
        "temperature": 0,
        # a fixed k: on a CPU without bf16 matrix units the goodput check keeps speculation off
        "speculative": {"mode": "draft", "max_k": 4, "adaptive": False},
    }
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300
    ) as c:
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        text = whole["choices"][0]["message"]["content"]
        assert "def " in text and "\ufffd" not in text
        assert whole["usage"]["speculative"]["drafter"] == "draft"
        assert whole["usage"]["speculative"]["accepted_tokens"] > 0  # the 0.5B agrees with the 1.5B often
        r = await c.post("/v1/chat/completions", json={**body, "stream": True, "stop": ["NEVER"]})
        data = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        chunks = [json.loads(d) for d in data[:-1]]
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == text
        # one chunk per verification step: with accepted drafts some chunks carry several tokens
        assert len(chunks) - 2 < whole["usage"]["completion_tokens"]
