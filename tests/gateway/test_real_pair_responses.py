"""The Responses API on the real Qwen2.5-Coder pair (slow: float32 on CPU): a tool loop the model
itself chooses (tool_choice auto), answered by previous_response_id, streamed as it is whole."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from gateway.app import create_app
from gateway.settings import load_settings
from tests.servers import serve_in_loop

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
async def client(real_pair: Any) -> AsyncIterator[openai.AsyncOpenAI]:
    engine = AsyncEngine(Engine(real_pair))
    app = create_app(load_settings(overrides={"cache": {"enabled": False}}, env={}), engine=engine)
    url, server, task = await serve_in_loop(app)
    try:
        async with openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600
        ) as c:
            yield c
    finally:
        server.should_exit = True
        await task
        engine.shutdown()


async def test_the_model_calls_a_tool_and_answers_from_its_output(client: openai.AsyncOpenAI) -> None:
    ask: dict[str, Any] = {
        "model": "target",
        "tools": [WEATHER],
        "temperature": 0,
        "max_output_tokens": 64,
        "extra_body": {"speculative": {"mode": "draft", "max_k": 4, "adaptive": False}},
    }
    first = await client.responses.create(input="What is the weather in Oslo right now?", **ask)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Oslo"
    assert first.usage is not None and first.usage.model_extra is not None
    assert first.usage.model_extra["speculative"]["drafter"] == "draft"
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Snow, -3 C"}
    # tool_choice none: under auto the 1.5B calls the tool again with its result in view, on the
    # chat path alike (the same messages through /v1/chat/completions call it too)
    then = {**ask, "input": [answer], "previous_response_id": first.id, "tool_choice": "none"}
    second = await client.responses.create(**then)
    assert second.status == "completed" and (
        "-3" in second.output_text or "snow" in second.output_text.lower()
    )
    async with client.responses.stream(**then) as stream:
        streamed = await stream.get_final_response()
    assert streamed.output_text == second.output_text  # greedy: the same answer, streamed
