"""The OpenAI Agents SDK (``openai-agents``), unmodified, against a real server on a scripted engine:
an Agent with two function tools completes a tool loop through ``Runner.run``, on the Responses
API (the SDK's default model) and on Chat Completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from decoding.tiny import byte_tokenizer
from tests.gateway.fakes import Turns, serve_turns

agents = pytest.importorskip("agents")

CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'
)
ANSWER = "In Paris it is sunny and 21 C, and the time is 14:05."


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, Turns]]:
    async with serve_turns([CALLS, ANSWER]) as served:
        yield served


@pytest.mark.parametrize("api", ["responses", "responses_streamed", "chat_completions"])
async def test_an_agent_with_two_tools_completes_a_tool_loop(served: tuple[str, Turns], api: str) -> None:
    url, engine = served
    called: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(("get_weather", city))
        return "sunny, 21 C"

    @agents.function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        called.append(("get_time", city))
        return "14:05"

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chat = api == "chat_completions"
    model_class: Any = agents.OpenAIChatCompletionsModel if chat else agents.OpenAIResponsesModel
    agent = agents.Agent(
        name="assistant",
        instructions="Answer with the tools.",
        tools=[get_weather, get_time],
        model=model_class(model="fake", openai_client=client),
    )
    config = agents.RunConfig(tracing_disabled=True)
    if api == "responses_streamed":  # the SDK reads the typed events itself
        streamed = agents.Runner.run_streamed(agent, "Weather and time in Paris?", run_config=config)
        kinds = {e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"}
        assert {"response.function_call_arguments.delta", "response.output_text.delta"} <= kinds
        result: Any = streamed
    else:
        result = await agents.Runner.run(agent, "Weather and time in Paris?", run_config=config)
    await client.close()
    assert result.final_output == ANSWER
    assert called == [("get_weather", "Paris"), ("get_time", "Paris")]
    first, second = (byte_tokenizer().decode(r.prompt_token_ids) for r in engine.requests)
    assert "Answer with the tools." in first and '"name": "get_time"' in first  # the tools, declared
    # the second turn holds both calls and both results
    assert "sunny, 21 C" in second and "14:05" in second and json.dumps({"city": "Paris"}) in second
