"""The remote backend's reading of an upstream's SSE chunks (gateway/remote.py), on scripted events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.backends import Delta, Generation, Job
from gateway.observability.record import RequestRecord, _current
from gateway.remote import _body, _deltas


class ScriptedStream:
    """An upstream's chunks as ``router.upstream.UpstreamStream`` yields them."""

    def __init__(self, events: list[dict[str, Any]]):
        self.events = events

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        for event in self.events:
            yield event

    async def aclose(self) -> None:
        pass


def chunk(text: str, finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


async def read(job: Job, events: list[dict[str, Any]]) -> tuple[Generation, list[Delta]]:
    gen = Generation(prompt_tokens=0, deltas=None)  # type: ignore[arg-type]
    return gen, [d async for d in _deltas(ScriptedStream(events), job, gen)]  # type: ignore[arg-type]


@pytest.mark.parametrize("echo", [False, True])
async def test_completion_tokens_are_the_upstreams_count(echo: bool) -> None:
    """Chunks are counted as tokens until the upstream's usage chunk says how many there were. An
    echoed prompt's chunk is no completion token, and a count above the upstream's was kept: usage
    (and the key's token charge) was one too many for a remote completion with echo."""
    job = Job(request_id="r", kind="completion", model="m", prompts=["Say"], echo=echo, max_tokens=2)
    events = [chunk(" a"), chunk(" b"), chunk("", "length"), {"choices": [], "usage": {
        "prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}]  # fmt: skip
    if echo:
        events.insert(0, chunk("Say"))
    gen, deltas = await read(job, events)
    assert "".join(d.text for d in deltas) == ("Say" if echo else "") + " a b"
    assert sum(d.completion_tokens for d in deltas) == 2 and gen.prompt_tokens == 1


async def test_a_step_of_several_tokens_is_counted_by_the_upstream() -> None:
    job = Job(request_id="r", kind="chat", model="m", messages=[{"role": "user", "content": "x"}])
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "one two three"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}},
    ]
    _, deltas = await read(job, events)
    assert sum(d.completion_tokens for d in deltas) == 3


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_the_upstream_gets_the_limit_under_the_clients_name_for_it(field: str) -> None:
    """A chat bounded with max_completion_tokens goes upstream with it: OpenAI's reasoning models
    refuse max_tokens ("Use 'max_completion_tokens' instead"), and every request was sent with it.
    One bounded with max_tokens (or not at all) keeps max_tokens, which older servers know."""
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest
    from gateway.settings import Settings

    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], field: 7}
    )
    body = _body(to_job(req, "r", "anonymous", Settings()))
    assert body[field] == 7 and len({"max_tokens", "max_completion_tokens"} & set(body)) == 1


def test_vllms_extras_go_upstream_only_where_the_client_set_them() -> None:
    """An upstream vLLM honours min_tokens, ignore_eos, min_p and repetition_penalty; one that does
    not know them may refuse them, so a request that did not set them does not send them."""
    msgs = [{"role": "user", "content": "x"}]
    bare = _body(Job(request_id="r", kind="chat", model="m", messages=msgs))
    assert not {"min_tokens", "ignore_eos", "min_p", "repetition_penalty"} & set(bare)
    job = Job(request_id="r", kind="chat", model="m", messages=msgs, min_tokens=4, repetition_penalty=1.1)
    assert {k: v for k, v in _body(job).items() if k not in bare} == {
        "min_tokens": 4,
        "repetition_penalty": 1.1,
    }


def test_top_k_goes_upstream_where_the_client_set_it() -> None:
    """top_k, which the README lists with vLLM's extras passed on when set, was never sent: a
    gateway in front of a second specgate sampled without it, and the same seeded request gave
    other tokens through the gateway than from the upstream directly."""
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest, CompletionRequest
    from gateway.settings import Settings

    msgs = [{"role": "user", "content": "x"}]
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, "top_k": 3, "seed": 9})
    cmpl = CompletionRequest.model_validate({"model": "m", "prompt": "x", "top_k": 3})
    for req in (chat, cmpl):
        assert _body(to_job(req, "r", "anonymous", Settings()))["top_k"] == 3
    assert "top_k" not in _body(Job(request_id="r", kind="chat", model="m", messages=msgs))


async def test_the_upstreams_prediction_counts_are_kept() -> None:
    """With Predicted Outputs the upstream's usage counts accepted and rejected prediction tokens;
    through the gateway they were always 0 and 0 (a real second specgate said 15 rejected)."""
    from gateway.formatting import ChatFormat

    job = Job(request_id="r", kind="chat", model="m", messages=[{"role": "user", "content": "x"}],
              prediction="The sea is wide")  # fmt: skip
    usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6, "completion_tokens_details": {
        "accepted_prediction_tokens": 1, "rejected_prediction_tokens": 15}}  # fmt: skip
    events = [
        {"choices": [{"index": 0, "delta": {"content": "The"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
        {"choices": [], "usage": usage},
    ]
    gen, deltas = await read(job, events)
    fmt = ChatFormat("m", False, 1, prediction=True)
    for d in deltas:
        fmt.fold(d)
    details = fmt.whole(gen)["usage"]["completion_tokens_details"]
    assert (details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]) == (1, 15)


def test_vllms_guided_decoding_goes_upstream_as_the_client_sent_it() -> None:
    """guided_* and structured_outputs reach a remote upstream under the client's name and value
    (a vLLM there serves them), and nothing is sent where the client set none."""
    from gateway.jobs import to_job
    from gateway.protocol import ChatCompletionRequest, CompletionRequest
    from gateway.settings import Settings

    msgs = [{"role": "user", "content": "x"}]
    for guided in ({"guided_choice": ["a", "b"]}, {"structured_outputs": {"json": {"type": "object"}}}):
        chat = ChatCompletionRequest.model_validate({"model": "m", "messages": msgs, **guided})
        cmpl = CompletionRequest.model_validate({"model": "m", "prompt": "x", **guided})
        for req in (chat, cmpl):
            body = _body(to_job(req, "r", "anonymous", Settings()))
            assert {k: body[k] for k in guided} == guided
    plain = _body(to_job(ChatCompletionRequest(model="m", messages=msgs), "r", "anonymous", Settings()))
    assert not {k for k in plain if k.startswith("guided") or k == "structured_outputs"}


async def test_an_upstreams_first_token_is_timed_when_it_arrives() -> None:
    """A remote request's time to first token was its response's first byte: for a request not
    streamed, the whole answer's time, which filled specgate_time_to_first_token_seconds (and the
    TTFT p99 alert) with full latencies and the time per output token with zeros."""
    job = Job(request_id="r", kind="chat", model="m", messages=[{"role": "user", "content": "x"}])
    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    rec = RequestRecord("POST", "/v1/chat/completions")
    token = _current.set(rec)
    try:
        gen = Generation(prompt_tokens=0, deltas=None)  # type: ignore[arg-type]
        deltas = _deltas(ScriptedStream(events), job, gen)  # type: ignore[arg-type]
        assert (await anext(deltas)).text == "Hel"
        first = rec.first_token
        assert first is not None, "the first token was not timed as it came"
        assert [d.text async for d in deltas] == ["lo", ""]
        assert rec.first_token == first
    finally:
        _current.reset(token)
