"""Legacy completions' echo with logprobs on the real server, through the official openai client: the
prompt's tokens lead the choice's logprobs (the first null: nothing predicts it, the rest the
target's own scores), streamed in the echo chunk with the same values as whole; a request without
echo is as before. lm-evaluation-harness's ``local-completions`` loglikelihood sends exactly this
(echo, logprobs=1, max_tokens=1, temperature=0) and reads ``token_logprobs[ctxlen:-1]``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
import torch

from decoding.tiny import byte_tokenizer
from tests.gateway.conftest import API_KEY, Server

PROMPT = "def f(x):\n    return x"  # ASCII: one byte-level token per character


def reference(tiny_models: Any, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 under the transformers model the server serves as "tiny"."""
    with torch.no_grad():
        logits = tiny_models["tiny"].model(torch.tensor([ids])).logits[0, :-1]  # [T-1, V]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(x) for x in lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)]


def columns(lp: Any) -> tuple[list[Any], ...]:
    return lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset


def test_echo_logprobs_score_the_prompt(client: openai.OpenAI, tiny_models: Any) -> None:
    ids = tiny_models["tiny"].tokenizer(PROMPT)["input_ids"]
    n = len(ids)
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    r = client.completions.create(echo=True, **kw)
    plain = client.completions.create(**kw)
    lp, lp_plain = r.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and lp_plain is not None
    tokens, token_lps, tops, offsets = columns(lp)
    assert len(tokens) == len(token_lps) == len(tops) == len(offsets) == n + 5
    assert "".join(tokens[:n]) == PROMPT and offsets[: n + 1] == list(range(n + 1))
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    assert token_lps[0] is None and tops[0] is None
    assert token_lps[1:n] == pytest.approx(reference(tiny_models, ids), abs=1e-4)
    for token, token_lp, top in zip(tokens[1:], token_lps[1:], tops[1:], strict=True):
        # the top 2, and the token itself where it is not among them (the legacy API's logprobs + 1)
        assert 2 <= len(top) <= 3 and top[token] == token_lp and token_lp <= max(top.values()) + 1e-6
    # the completion's part is what a request without echo gets, and that request is as before
    assert tokens[n:] == lp_plain.tokens and len(lp_plain.tokens or []) == 5
    assert token_lps[n:] == pytest.approx(lp_plain.token_logprobs, abs=1e-5)
    assert None not in (lp_plain.token_logprobs or []) and (lp_plain.text_offset or [])[0] == 0


def test_streamed_echo_chunk_carries_the_prompt_logprobs(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=3)
    whole = client.completions.create(**kw)
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs is not None and first.logprobs.tokens
    assert len(first.logprobs.tokens) == len(PROMPT) and first.logprobs.token_logprobs[0] is None  # type: ignore[index]
    got: tuple[list[Any], ...] = ([], [], [], [])
    for c in chunks:
        if c.choices[0].logprobs is not None:
            for acc, col in zip(got, columns(c.choices[0].logprobs), strict=True):
                acc.extend(col)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    want = columns(whole.choices[0].logprobs)
    assert got[0] == want[0] and got[3] == want[3]
    assert got[1][0] is None and got[1][1:] == pytest.approx(want[1][1:], abs=1e-5)
    assert [sorted(t) if t else t for t in got[2]] == [sorted(t) if t else t for t in want[2]]


def test_every_choice_and_prompt_gets_its_echo_and_scores(client: openai.OpenAI) -> None:
    prompts = ["abc", "xyz"]
    kw: dict[str, Any] = dict(
        model="tiny", prompt=prompts, n=2, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    whole = client.completions.create(**kw)
    firsts: dict[int, Any] = {}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            firsts.setdefault(ch.index, ch)
    assert sorted(firsts) == [0, 1, 2, 3]
    for i, ch in firsts.items():
        prompt = prompts[i // 2]
        assert ch.text == prompt and ch.logprobs.tokens == list(prompt)
        assert ch.logprobs.token_logprobs[0] is None and ch.logprobs.top_logprobs[0] is None
        scored = whole.choices[i].logprobs
        assert scored is not None and scored.tokens[:3] == list(prompt)  # type: ignore[index]
        assert ch.logprobs.token_logprobs[1:] == pytest.approx(scored.token_logprobs[1:3], abs=1e-5)  # type: ignore[index]


def test_lm_eval_loglikelihood_request(client: openai.OpenAI, tiny_models: Any) -> None:
    """lm-evaluation-harness's local-completions: context + continuation as token ids, one token
    generated and dropped; the continuation's logprobs and is_greedy from the prompt's scores."""
    tok = tiny_models["tiny"].tokenizer
    context, continuation = tok("The capital of France is")["input_ids"], tok(" Paris")["input_ids"]
    ids = context + continuation
    r = client.completions.create(
        model="tiny", prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 1
    ctxlen = len(context)
    got = lp.token_logprobs[ctxlen:-1]
    assert got == pytest.approx(reference(tiny_models, ids)[ctxlen - 1 :], abs=1e-4)
    greedy = [t == max(top.values()) for t, top in zip(got, lp.top_logprobs[ctxlen:-1], strict=True)]  # type: ignore[union-attr]
    assert len(greedy) == len(continuation)


async def test_scores_do_not_depend_on_what_runs_beside(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    kw: dict[str, Any] = dict(
        model="tiny", prompt=PROMPT * 3, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    alone = await client.completions.create(**kw)
    other = client.completions.create(model="tiny", prompt="x" * 40, max_tokens=40, temperature=0)
    beside, _ = await asyncio.gather(client.completions.create(**kw), other)
    await client.close()
    a, b = alone.choices[0].logprobs, beside.choices[0].logprobs
    assert a is not None and b is not None and a.tokens == b.tokens
    assert b.token_logprobs[0] is None  # type: ignore[index]
    assert b.token_logprobs[1:] == pytest.approx(a.token_logprobs[1:], abs=1e-5)  # type: ignore[index]


def test_tokens_that_split_a_character_keep_their_bytes_and_offsets(
    client: openai.OpenAI, server: Server
) -> None:
    """The byte-level tokenizer splits "🦩" into four tokens and "é" into two, each of which decodes
    alone to U+FFFD. Their logprob tokens are ``bytes:\\xNN`` (as OpenAI writes them), distinct
    alternatives stay distinct keys, a character's pieces all start at its offset (offsets never go
    back), and chat's ``bytes`` are the token's own."""
    prompt = "a🦩é"
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None and lp.top_logprobs
    n = len(prompt.encode())
    assert lp.tokens[:n] == [
        "a",
        "bytes:\\xf0",
        "bytes:\\x9f",
        "bytes:\\xa6",
        "bytes:\\xa9",
        "bytes:\\xc3",
        "bytes:\\xa9",
    ]
    assert lp.text_offset[: n + 1] == [0, 1, 1, 1, 1, 2, 2, 3]  # the completion's first at len(prompt)
    assert lp.text_offset == sorted(lp.text_offset)
    # no two alternatives collide on U+FFFD: the top 3, plus the token where it is not among them
    pairs = zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True)
    assert all(len(top) == 3 + (t not in list(top)[:3]) for t, top in pairs)
    # chat: a token forced to 0xC3 (the first byte of "é") carries that byte, not U+FFFD's three
    c3 = byte_tokenizer().convert_tokens_to_ids("Ã")  # 0xC3 in byte-level's alphabet
    chat = httpx.post(
        server.base_url + "/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
            "logit_bias": {str(c3): 100},
        },
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [("bytes:\\xc3", [0xC3])]
    alts = content[0]["top_logprobs"]
    assert len({a["token"] for a in alts}) == 3 and all(a["bytes"] != [0xEF, 0xBF, 0xBD] for a in alts)


def test_a_special_token_the_text_leaves_out_moves_no_offset(client: openai.OpenAI) -> None:
    """A completion's text leaves special tokens out, so its logprobs show one as "" and the offsets
    after it stay within the text (they ran 12 characters past it for <|im_start|>)."""
    start = byte_tokenizer().convert_tokens_to_ids("<|im_start|>")
    r = client.completions.create(
        model="tiny", prompt="ab", max_tokens=3, temperature=0, echo=True, logprobs=1,
        logit_bias={str(start): 100},
    )  # fmt: skip
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert lp.tokens[2:] == ["", "", ""] and "<|im_start|>" not in text and text == "ab"
    assert lp.text_offset == [0, 1, 2, 2, 2]


def test_a_token_after_bytes_that_are_no_character_starts_after_their_replacement(
    client: openai.OpenAI,
) -> None:
    """Bytes that never become a character read as U+FFFD in the text once a later byte proves it,
    and the token that proves it starts after that U+FFFD: ``a \\xde \\xc4 \\xee 0 +`` reads
    ``a���0+``, and "0" was said to start at 3 (a U+FFFD), "+" at 5, its own place, by luck."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok, b2u = byte_tokenizer(), bytes_to_unicode()
    ids = [tok.convert_tokens_to_ids(b2u[b]) for b in b"a\xde\xc4\xee0+"]
    for stream in (False, True):
        r = client.completions.create(
            model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=0, stream=stream
        )
        chunks = list(r) if stream else [r]  # type: ignore[arg-type]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens or []
        ]
        offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset or []]  # fmt: skip
        assert text.startswith("a\ufffd\ufffd\ufffd0+") and len(tokens) == len(offsets) == 8
        assert offsets[:6] == [0, 1, 2, 3, 4, 5]
        for token, at in zip(tokens, offsets, strict=True):  # a whole character stands where it starts
            if not token.startswith("bytes:") and token:
                assert text[at : at + len(token)] == token, (token, at, text)
