"""``/v1/responses`` with the unmodified openai SDK: against a real uvicorn server on a scripted
engine (what the model writes is fixed, so calls and prompts can be asserted), and against a real
``specgate serve`` on the tiny random models (grammars force the call and the JSON)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from decoding.params import FinishReason
from decoding.tiny import byte_tokenizer
from gateway.app import create_app
from gateway.backends import Delta, Generation, Job
from gateway.response_events import ResponsesFormat
from gateway.settings import load_settings
from gateway.tools import ToolCallParser
from tests.gateway.conftest import API_KEY, Server, start_roomy_server, stop_server
from tests.gateway.fakes import ScriptedEngine, token_ids
from tests.servers import UNHURRIED_REDIS, RedisProcess, serve_in_loop

OTHER_KEY = "sk-other-tenant"
# the SDK's own event types, validated (the client constructs them unvalidated: a missing field passes)
STREAM_EVENT: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class Scripted:
    """A real server (uvicorn, this event loop) on a scripted engine; ``say`` sets what it writes next."""

    def __init__(self, engine: ScriptedEngine, url: str, app: Any):
        self.engine = engine
        self.url = url
        self.app = app

    def say(self, text: str, step: int = 4) -> None:
        ids = token_ids(text)
        self.engine.script = [ids[i : i + step] for i in range(0, len(ids), step)]

    def prompts(self) -> list[str]:
        tok = byte_tokenizer()
        return [tok.decode(r.prompt_token_ids) for r in self.engine.requests]

    def client(self, key: str = API_KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)


async def _scripted(**settings: Any) -> AsyncIterator[Scripted]:
    engine = ScriptedEngine([], finish=FinishReason.STOP)
    overrides = {"cache": {"enabled": False}, "auth": {"api_keys": [API_KEY, OTHER_KEY]}} | settings
    app = create_app(load_settings(overrides=overrides, env={}), engine=engine)
    url, server, task = await serve_in_loop(app)
    try:
        yield Scripted(engine, url, app)
    finally:
        server.should_exit = True
        await task


@pytest.fixture
async def scripted() -> AsyncIterator[Scripted]:
    async for s in _scripted():
        yield s


@pytest.fixture
async def scripted_redis(redis_server: RedisProcess) -> AsyncIterator[Scripted]:
    cache = {
        "enabled": False,
        "redis_url": redis_server.url,
        "key_prefix": "test-responses",
        **UNHURRIED_REDIS,
    }
    async for s in _scripted(cache=cache, responses={"ttl_s": 120}):
        yield s


async def test_a_plain_response(scripted: Scripted) -> None:
    scripted.say("Hello there, friend.")
    async with scripted.client() as client:
        r = await client.responses.create(model="fake", input="Say hello.", instructions="Be brief.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello there, friend." and r.error is None and r.incomplete_details is None
    [item] = r.output
    assert item.type == "message" and item.id.startswith("msg_") and item.status == "completed"
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert r.usage is not None and r.usage.output_tokens == len(token_ids("Hello there, friend."))
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (
        r.usage.input_tokens_details.cached_tokens == 0
        and r.usage.output_tokens_details.reasoning_tokens == 0
    )
    assert r.usage.model_extra is not None and r.usage.model_extra["speculative"]["steps"] == 5
    assert r.instructions == "Be brief." and r.store is True and r.tools == [] and r.tool_choice == "auto"
    Response.model_validate(r.to_dict())  # what the SDK's type requires, validated
    [prompt] = scripted.prompts()
    assert "Be brief." in prompt and "Say hello." in prompt


async def test_max_output_tokens_makes_it_incomplete(scripted: Scripted) -> None:
    scripted.say("Cut short.")
    scripted.engine.finish = FinishReason.LENGTH
    async with scripted.client() as client:
        r = await client.responses.create(model="fake", input="Go on.", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.output[0].status == "incomplete"
    assert r.max_output_tokens == 3 and scripted.engine.requests[0].params.max_tokens == 3


async def test_a_streamed_response_sends_openais_events_and_no_done(scripted: Scripted) -> None:
    text = "Streamed, piece by piece."
    scripted.say(text)
    async with scripted.client() as client:
        events = [e async for e in await client.responses.create(model="fake", input="Stream.", stream=True)]
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == text and len(deltas) > 1
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0 for d in deltas)
    final = events[-1].response
    assert final.output_text == text and final.status == "completed" and final.usage is not None
    assert events[0].response.status == "in_progress"
    async with httpx.AsyncClient(base_url=scripted.url) as raw:  # the wire itself: event lines, no [DONE]
        body = {"model": "fake", "input": "Stream.", "stream": True}
        r = await raw.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.headers["content-type"].startswith("text/event-stream") and "[DONE]" not in r.text
    blocks = [b for b in r.text.split("\n\n") if b.startswith("event: ")]
    for block in blocks:
        event_line, data_line = block.split("\n")
        payload = json.loads(data_line.removeprefix("data: "))
        assert payload["type"] == event_line.removeprefix("event: ")
        STREAM_EVENT.validate_python(payload)  # every field the SDK's own types require, as they type it


async def test_the_stream_helper_gives_the_final_response(scripted: Scripted) -> None:
    scripted.say("Through the helper.")
    async with scripted.client() as client, client.responses.stream(model="fake", input="Helper.") as stream:
        texts = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(texts) == final.output_text == "Through the helper." and final.status == "completed"


async def test_a_scripted_tool_call_streamed_and_not(scripted: Scripted) -> None:
    scripted.say(CALL)
    async with scripted.client() as client:
        r = await client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER])
        events = [
            e async for e in await client.responses.create(
                model="fake", input="Weather in Paris?", tools=[WEATHER], stream=True
            )
        ]  # fmt: skip
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert call.id is not None and call.id.startswith("fc_") and r.output_text == ""
    assert r.tools[0].name == "get_weather"
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    for e in events:
        STREAM_EVENT.validate_python(e.to_dict())
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments and json.loads(args) == {"city": "Paris"}
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert kinds[-1] == "response.completed"


async def test_a_tool_loop_with_previous_response_id(scripted: Scripted) -> None:
    """The second request's prompt holds the first exchange (its input and its call) and the new
    input (the call's output), as the chat template writes them."""
    scripted.say(CALL)
    async with scripted.client() as client:
        first = await client.responses.create(
            model="fake", input="Weather in Paris?", tools=[WEATHER], instructions="Use tools."
        )
        call = first.output[0]
        assert call.type == "function_call"
        scripted.say("It is sunny in Paris.")
        second = await client.responses.create(
            model="fake",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
            tools=[WEATHER],
        )
        scripted.say("You asked about Paris.")
        third = await client.responses.create(
            model="fake", previous_response_id=second.id, input="What did I ask?"
        )
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    one, two, three = scripted.prompts()
    assert "Use tools." in one and "Use tools." not in two  # instructions are not carried over
    assert "Weather in Paris?" in two and '"city": "Paris"' in two and "sunny, 21 C" in two
    assert "Weather in Paris?" in three and "It is sunny in Paris." in three and "What did I ask?" in three
    assert third.output_text == "You asked about Paris."
    async with scripted.client() as client:  # what third answered, as the SDK pages it
        items = [item async for item in client.responses.input_items.list(third.id, order="asc")]
        newest = await client.responses.input_items.list(third.id, limit=2)
    assert [i.type for i in items] == [
        "message",
        "function_call",
        "function_call_output",
        "message",
        "message",
    ]
    assert items[1].id == call.id and items[3].id == second.output[0].id  # outputs keep their ids
    assert all(i.id for i in items) and len({i.id for i in items}) == 5
    assert items[0].content[0].text == "Weather in Paris?"
    assert [i.id for i in newest.data] == [items[4].id, items[3].id] and newest.has_more
    assert first.usage and second.usage and third.usage
    assert first.usage.input_tokens < second.usage.input_tokens  # both declare the tool


async def test_get_delete_and_another_tenant(scripted: Scripted) -> None:
    scripted.say("Keep me.")
    async with scripted.client() as client, scripted.client(OTHER_KEY) as other:
        r = await client.responses.create(model="fake", input="Store this.", metadata={"k": "v"})
        got = await client.responses.retrieve(r.id)
        assert got.id == r.id and got.output_text == "Keep me." and got.metadata == {"k": "v"}
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(r.id)  # as if it did not exist
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.input_items.list(r.id)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.input_items.list(r.id, limit=500)
        assert bad.value.body["param"] == "limit"
        with pytest.raises(openai.BadRequestError) as err:
            await other.responses.create(model="fake", input="More.", previous_response_id=r.id)
        assert err.value.body["param"] == "previous_response_id"
        assert err.value.body["code"] == "previous_response_not_found"
        async with httpx.AsyncClient(base_url=scripted.url) as raw:
            deleted = await raw.delete(
                f"/v1/responses/{r.id}", headers={"Authorization": f"Bearer {API_KEY}"}
            )
        assert deleted.json() == {"id": r.id, "object": "response.deleted", "deleted": True}
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(r.id)
        assert missing.value.body["type"] == "invalid_request_error"
        unstored = await client.responses.create(model="fake", input="Forget this.", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)


async def test_responses_are_kept_in_redis_per_tenant(
    scripted_redis: Scripted, redis_server: RedisProcess
) -> None:
    import redis.asyncio as aioredis

    scripted_redis.say("Kept in Redis.")
    async with scripted_redis.client() as client, scripted_redis.client(OTHER_KEY) as other:
        r = await client.responses.create(model="fake", input="Remember.")
        assert (await client.responses.retrieve(r.id)).output_text == "Kept in Redis."
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(r.id)
        scripted_redis.say("Continued.")
        again = await client.responses.create(model="fake", input="And?", previous_response_id=r.id)
        await client.responses.delete(again.id)
    assert "Kept in Redis." in scripted_redis.prompts()[1]
    async with aioredis.Redis.from_url(redis_server.url) as db:
        keys = [k.decode() async for k in db.scan_iter("test-responses:responses:*")]
        assert len(keys) == 1 and keys[0].endswith(r.id)  # the deleted one is gone
        assert 0 < await db.ttl(keys[0]) <= 120
        await db.delete(*keys)


async def test_a_redis_that_cannot_answer_is_a_503_never_a_404(tmp_path: Any) -> None:
    """The store does not fail open as the cache does: a record that cannot be read is no "not
    found". An answer whose record cannot be written still goes out."""
    redis = RedisProcess(tmp_path)
    redis.start()
    try:
        cache = {
            "enabled": False,
            "redis_url": redis.url,
            "key_prefix": "test-responses",
            "timeout_ms": 2000.0,
        }
        async for served in _scripted(cache=cache, responses={"timeout_ms": 300}):
            served.say("Stored, then unreadable.")
            async with served.client() as client:
                r = await client.responses.create(model="fake", input="Keep.")
                redis.stop()
                with pytest.raises(openai.InternalServerError) as err:
                    await client.responses.retrieve(r.id)
                assert err.value.status_code == 503 and err.value.response.headers["retry-after"]
                with pytest.raises(openai.InternalServerError):
                    await client.responses.create(model="fake", input="More.", previous_response_id=r.id)
                unkept = await client.responses.create(model="fake", input="Again.")
                assert unkept.output_text == "Stored, then unreadable."
    finally:
        redis.stop()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "4"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "r"}}}, "text.format.schema"),
        ({"input": "x", "background": True}, "background"),
        ({}, "input"),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "no"}}},
            },
            "text.format",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
            "tools[0].parameters",
        ),
        ({"input": "x" * 5000}, "input"),  # past the context: context_length_exceeded, naming input
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
async def test_bad_input_is_a_400_naming_the_parameter(
    scripted: Scripted, body: dict[str, Any], param: str
) -> None:
    async with httpx.AsyncClient(base_url=scripted.url) as raw:
        r = await raw.post(
            "/v1/responses", json={"model": "fake", **body}, headers={"Authorization": f"Bearer {API_KEY}"}
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_a_fault_after_the_200_ends_the_stream_with_response_failed(scripted: Scripted) -> None:
    scripted.say("Partial answer.")
    scripted.engine.fail = "the engine broke"
    async with scripted.client() as client:
        events = [e async for e in await client.responses.create(model="fake", input="Fail.", stream=True)]
    assert events[-1].type == "response.failed"
    STREAM_EVENT.validate_python(events[-1].to_dict())
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and failed.error.code == "server_error"
    async with scripted.client() as client:
        with pytest.raises(openai.NotFoundError):  # nothing stored of a failed response
            await client.responses.retrieve(failed.id)


# ---- the tiny random models, through a real `specgate serve` -------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_roomy_server(tmp_path_factory.mktemp("responses"))
    yield s
    stop_server(s)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_grammar_forced_call_on_the_tiny_model(client: openai.OpenAI, choice: Any) -> None:
    r = client.responses.create(
        model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, temperature=0, max_output_tokens=200
    )  # fmt: skip
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls) and r.status == "completed"
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    with client.responses.stream(
        model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=choice, temperature=0, max_output_tokens=200
    ) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]


def test_json_schema_text_format_on_the_tiny_model(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    r = client.responses.create(
        model="tiny", input="A person.", text={"format": fmt}, temperature=0, max_output_tokens=200
    )
    assert r.status == "completed" and r.text is not None and r.text.format is not None
    jsonschema.validate(json.loads(r.output_text), schema)
    streamed = "".join(
        e.delta
        for e in client.responses.create(
            model="tiny",
            input="A person.",
            text={"format": fmt},
            temperature=0,
            max_output_tokens=200,
            stream=True,
        )
        if e.type == "response.output_text.delta"
    )
    assert streamed == r.output_text


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int


def test_the_sdks_parse_helper_on_the_tiny_model(client: openai.OpenAI) -> None:
    """``responses.parse(text_format=...)`` sends a strict json_schema and parses output_text into it."""
    r = client.responses.parse(
        model="tiny", input="A person.", text_format=Person, temperature=0, max_output_tokens=200
    )
    assert isinstance(r.output_parsed, Person)


def test_plain_and_continued_on_the_tiny_model(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Hello.", max_output_tokens=8, temperature=0)
    assert first.status == "incomplete" and first.usage is not None and first.usage.output_tokens == 8
    second = client.responses.create(
        model="tiny", input="More.", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens + 8
    assert client.responses.retrieve(second.id).output_text == second.output_text


# ---- the format alone: however the deltas are cut, the events rebuild the whole --------------------


def _deltas(text: str, size: int, names: list[str]) -> list[Delta]:
    """``text`` as the local backend cuts it into deltas (``size`` characters a step), calls parsed."""
    parser = ToolCallParser(names)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    out = []
    for p in pieces:
        content, calls = parser.feed(p)
        out.append(Delta(0, content, completion_tokens=1, tool_calls=calls or None))
    content, calls = parser.flush()
    out.append(
        Delta(0, content, finish_reason="tool_calls" if parser.calls else "stop", tool_calls=calls or None)
    )
    return out


def _rebuilt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output as a client rebuilds it from the events alone."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = {**e["item"], "content": [], "text": "", "arguments": ""}
        elif e["type"] == "response.output_text.delta":
            items[e["output_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            done = e["item"]
            kept = items[e["output_index"]]
            assert done["id"] == kept["id"]
            assert kept["text" if done["type"] == "message" else "arguments"] == (
                done["content"][0]["text"] if done["type"] == "message" else done["arguments"]
            )
            items[e["output_index"]] = done
    return [items[i] for i in sorted(items)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
async def test_events_rebuild_the_whole_output_however_the_text_is_cut(size: int) -> None:
    text = f"Let me look.{CALL}\n{CALL.replace('Paris', 'Oslo')}"
    job = Job(
        request_id="r",
        kind="chat",
        model="m",
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
    )
    whole = ResponsesFormat("m", job, {})
    streamed = ResponsesFormat("m", job, {})
    events = [json.loads(e["data"]) for e in streamed.opening(Generation(0, _no_deltas()))]
    for d in _deltas(text, size, ["get_weather"]):
        whole.fold(d)
        events += [json.loads(e["data"]) for e in streamed.chunks(d)]
    gen = Generation(5, _no_deltas())
    await whole.settle(gen)
    await streamed.settle(gen)
    events += [json.loads(e["data"]) for e in streamed.closing(gen)]
    output = whole.whole(gen)["output"]
    assert [i["type"] for i in output] == ["message", "function_call", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me look."
    assert [json.loads(i["arguments"])["city"] for i in output[1:]] == ["Paris", "Oslo"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    rebuilt = _rebuilt(events)
    strip = [{k: v for k, v in i.items() if k != "id"} for i in output]
    assert [{k: v for k, v in i.items() if k != "id"} for i in rebuilt] == strip
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == rebuilt


async def _no_deltas() -> AsyncIterator[Delta]:
    return
    yield


async def test_a_cached_response_replays_text_and_calls() -> None:
    """The response cache keys a Responses request as the chat request it means, and replays it
    through the Responses format: items and events with fresh ids."""
    async for served in _scripted(cache={"enabled": True}):
        served.say(f"Let me look.{CALL}")
        async with served.client() as client:
            body: dict[str, Any] = {
                "model": "fake",
                "input": "Weather?",
                "tools": [WEATHER],
                "temperature": 0,
            }
            fresh = await client.responses.create(**body)
            await served.app.state.gateway.cache.cache.drain()  # the store is written after the answer
            raw = await client.responses.with_raw_response.create(**body)
            events = [e async for e in await client.responses.create(**body, stream=True)]
        assert raw.headers["x-specgate-cache"].startswith("exact") and len(served.engine.requests) == 1
        cached = raw.parse()
        assert (
            [i.type for i in cached.output] == [i.type for i in fresh.output] == ["message", "function_call"]
        )
        assert cached.output[1].arguments == fresh.output[1].arguments
        assert cached.output[1].call_id != fresh.output[1].call_id and cached.id != fresh.id
        assert events[-1].type == "response.completed" and events[-1].response.output_text == "Let me look."


async def test_a_key_is_needed(scripted: Scripted) -> None:
    async with httpx.AsyncClient(base_url=scripted.url) as raw:
        for r in (
            await raw.post("/v1/responses", json={"model": "fake", "input": "x"}),
            await raw.get("/v1/responses/resp_x"),
            await raw.delete("/v1/responses/resp_x"),
        ):
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
