"""pydantic-ai (``pydantic-ai-slim[openai]``), unmodified, against a real server on a scripted engine:
an ``Agent`` completes a tool loop, and one with an output type gets its structured result (pydantic-ai
asks for it as a call of its ``final_result`` tool), on Chat Completions and on the Responses API.
A call of a function without ``strict`` is scripted in a wrapper models write (issue 51)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from decoding.tiny import byte_tokenizer
from tests.gateway.fakes import serve_turns

pydantic_ai = pytest.importorskip("pydantic_ai")
pai_openai = pytest.importorskip("pydantic_ai.models.openai")
pai_providers = pytest.importorskip("pydantic_ai.providers.openai")

ANSWER = "It is sunny and 21 C in Oslo."


class Weather(BaseModel):
    city: str
    temperature_c: int


def model(client: openai.AsyncOpenAI, api: str) -> Any:
    provider = pai_providers.OpenAIProvider(openai_client=client)
    cls = pai_openai.OpenAIChatModel if api == "chat" else pai_openai.OpenAIResponsesModel
    return cls("fake", provider=provider)


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("strict", [False, True])
async def test_an_agent_completes_a_tool_loop(api: str, strict: bool) -> None:
    # without strict: the call as Qwen2.5 wrote it in a LangChain tool loop (issue 51), which came
    # back as content; a strict function's call is checked by a grammar that writes Qwen2.5's tags
    tag = "tool_call" if strict else "tools"
    call = f'<{tag}>\n{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}\n</{tag}>'
    async with serve_turns([call, ANSWER]) as (url, engine):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        called: list[str] = []
        agent = pydantic_ai.Agent(model(client, api), instructions="Answer with the tools.")

        @agent.tool_plain(strict=strict)
        def get_weather(city: str) -> str:
            """The weather in a city."""
            called.append(city)
            return "sunny, 21 C"

        result = await agent.run("Weather in Oslo?")
        await client.close()
        assert result.output == ANSWER and called == ["Oslo"]
        first, second = (byte_tokenizer().decode(r.prompt_token_ids) for r in engine.requests)
        assert '"name": "get_weather"' in first  # the tool, declared
        assert "sunny, 21 C" in second and json.dumps({"city": "Oslo"}) in second


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_an_agent_with_an_output_type_gets_its_structured_result(api: str) -> None:
    # pydantic-ai asks for a strict call of final_result (tool_choice required): a grammar writes it,
    # in Qwen2.5's tags, which the scripted engine writes for it here
    call = '<tool_call>\n{"name": "final_result", "arguments": {"city": "Oslo", "temperature_c": 21}}\n</tool_call>'
    async with serve_turns([call]) as (url, engine):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        agent = pydantic_ai.Agent(model(client, api), output_type=Weather)
        result = await agent.run("Weather in Oslo, as data.")
        await client.close()
        assert result.output == Weather(city="Oslo", temperature_c=21)
        [request] = engine.requests
        assert request.grammar is not None and request.grammar.param == "tools"  # the call is forced
        assert '"name": "final_result"' in byte_tokenizer().decode(request.prompt_token_ids)
