"""A request body as the Job a backend serves (gateway/jobs.py): values other servers' clients send."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.remote import _body
from gateway.settings import load_settings
from tests.gateway.fakes import ScriptedEngine, token_ids


async def test_vllms_top_k_minus_one_is_no_top_k() -> None:
    """vLLM reads top_k -1 as "all tokens" (its default for years, and what clients written for it
    send): it was a 400 here. Below -1 is refused, as vLLM refuses it."""
    engine = ScriptedEngine([token_ids("ok")])
    app = create_app(load_settings(overrides={"cache": {"enabled": False}}, env={}), engine=engine)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test/v1") as http:
        client = openai.AsyncOpenAI(
            api_key="unused", base_url="http://test/v1", http_client=http, max_retries=0
        )
        chat = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], extra_body={"top_k": -1}
        )
        done = await client.completions.create(model="fake", prompt="x", extra_body={"top_k": -1})
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="fake", prompt="x", extra_body={"top_k": -2})
    assert chat.choices[0].message.content == "ok" and done.choices[0].text == "ok"
    assert [r.params.top_k for r in engine.requests] == [0, 0]
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "top_k"


def test_top_k_minus_one_goes_to_no_upstream() -> None:
    """An upstream is sent top_k only where it cuts (OpenAI's own API has no top_k)."""
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": -1}
    )
    job = to_job(req, "r", "anonymous", load_settings(env={}))
    assert job.top_k == 0 and "top_k" not in _body(job)


@pytest.mark.parametrize("body", [{"prompt": "x", "max_tokens": 3}, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}])  # fmt: skip
def test_min_tokens_above_max_tokens_is_refused_as_vllm_refuses_it(body: dict[str, object]) -> None:
    """vLLM's 400 ("min_tokens must be less than or equal to max_tokens"): it was served, cut at
    max_tokens, with a 200 that honoured neither."""
    from gateway.errors import APIError
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest, CompletionRequest

    cls = CompletionRequest if "prompt" in body else ChatCompletionRequest
    settings = load_settings(env={})
    with pytest.raises(APIError) as e:
        to_job(cls.model_validate({"model": "m", "min_tokens": 4, **body}), "r", "anonymous", settings)
    assert e.value.status == 400 and e.value.param == "min_tokens"
    to_job(cls.model_validate({"model": "m", "min_tokens": 3, **body}), "r", "anonymous", settings)


def test_text_as_the_only_modality_is_served() -> None:
    """``modalities: ["text"]`` is OpenAI's default, what this server does: it was refused as an
    unsupported parameter. Audio is still refused by name."""
    from gateway.errors import APIError
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    settings = load_settings(env={})
    to_job(ChatCompletionRequest.model_validate({**body, "modalities": ["text"]}), "r", "anonymous", settings)
    with pytest.raises(APIError) as e:
        to_job(
            ChatCompletionRequest.model_validate({**body, "modalities": ["text", "audio"]}),
            "r",
            "anonymous",
            settings,
        )
    assert e.value.param == "modalities"
