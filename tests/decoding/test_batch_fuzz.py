"""Random mixes of requests, each alone and then in a batch, on the tiny float32 models: every
request's tokens, finish and logprobs are the same whatever shares its steps. Each case draws the
sampling parameters, shaping (logit_bias, a grammar, Predicted Outputs, min_tokens, stop ids),
speculation mode and k, prompt, arrival step and prefill budget at random from a fixed seed; the
batched engine's guarantees are then checked together rather than one parameter at a time (a longer
run of this kind found a grammar's end not ending a row under ignore_eos, 4cba8b2). ``SPECGATE_FUZZ_EXAMPLES`` runs
more cases (12 took 23 s on the 2-core EPYC)."""

from __future__ import annotations

import itertools
import os
import random

import pytest

from decoding.engine import Engine
from decoding.params import GenerationRequest, GrammarSpec, SamplingParams, SpecMode, SpecParams, StepOutput
from tests.decoding.test_batch import PROMPTS, run_batch_outputs

CASES = int(os.environ.get("SPECGATE_FUZZ_EXAMPLES", "8"))
REGEXES = [r"[a-z ]{3,20}", r"(yes|no|maybe)", r"\d{1,5}(\.\d+)?"]
SCHEMA = (
    '{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},'
    ' "required": ["a", "b"]}'
)
_ids = itertools.count()


def random_request(models, rng: random.Random) -> GenerationRequest:
    tok = models["tiny"].tokenizer
    p: dict = {"max_tokens": rng.randint(1, 30), "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.5:
        p["temperature"] = 0
    else:
        p |= {"temperature": rng.choice([0.5, 1.0, 1.5]), "seed": rng.randint(0, 1000)}
        p |= {"top_p": rng.choice([0.5, 0.9])} if rng.random() < 0.4 else {}
        p |= {"top_k": rng.choice([1, 5, 50])} if rng.random() < 0.4 else {}
        p |= {"min_p": 0.1} if rng.random() < 0.3 else {}
    p |= {"presence_penalty": rng.choice([-1.0, 0.5, 2.0])} if rng.random() < 0.3 else {}
    p |= {"frequency_penalty": rng.choice([-0.5, 0.5, 1.0])} if rng.random() < 0.3 else {}
    p |= {"repetition_penalty": rng.choice([0.8, 1.3])} if rng.random() < 0.3 else {}
    p |= {"min_tokens": rng.randint(0, 10)} if rng.random() < 0.3 else {}
    p |= {"logprobs": rng.choice([0, 1, 5])} if rng.random() < 0.3 else {}
    p |= {"prompt_logprobs": rng.choice([0, 2])} if rng.random() < 0.2 else {}
    p |= {"stop_token_ids": tuple(rng.sample(range(10, 250), 3))} if rng.random() < 0.2 else {}
    spec = SpecParams(
        SpecMode(rng.choice(["off", "draft", "ngram", "auto"])),
        max_k=rng.randint(1, 8),
        adaptive=rng.random() < 0.5,
    )
    shaping: dict = {}
    if rng.random() < 0.3:
        shaping["logit_bias"] = tuple(
            (rng.randint(0, 250), rng.choice([-100.0, 5.0, 100.0])) for _ in range(2)
        )
    pick = rng.random()
    if pick < 0.15:
        shaping["grammar"] = GrammarSpec("regex", rng.choice(REGEXES))
    elif pick < 0.25:
        shaping["grammar"] = GrammarSpec("json_schema", SCHEMA)
    elif pick < 0.4:
        shaping["prediction"] = tuple(tok(rng.choice(PROMPTS))["input_ids"])
    ids = tok(rng.choice(PROMPTS) * rng.randint(1, 4))["input_ids"]
    return GenerationRequest(f"f{next(_ids)}", "tiny", ids, SamplingParams(**p), spec, **shaping)


def outcome(outs: list[StepOutput]) -> tuple:
    """Tokens, finish, and every logprob: the chosen and the alternatives' ids, and their values."""
    tokens = [t for o in outs for t in o.token_ids]
    finish = [o.finish_reason for o in outs if o.finish_reason is not None]
    lps = [(e.token_id, e.logprob, tuple(t for t, _ in e.top)) for o in outs for e in (o.logprobs or [])]
    scored = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
    prompt = None if scored is None else [None if e is None else (e.token_id, e.logprob) for e in scored]
    return tokens, finish, lps, prompt


def values(got: tuple) -> list[float]:
    """The logprob values of an ``outcome`` (float32 rows of one pass and of another differ in the
    last bits: compared to 1e-3), the rest of it with them set to 0."""
    out = [e[1] for e in got[2]] + [e[1] for e in got[3] or [] if e is not None]
    got[2][:] = [(t, 0.0, top) for t, _, top in got[2]]
    if got[3] is not None:
        got[3][:] = [None if e is None else (e[0], 0.0) for e in got[3]]
    return out


@pytest.mark.parametrize("case", range(CASES))
def test_random_requests_give_the_same_output_alone_and_batched(tiny_models, case):
    rng = random.Random(1000 + case)
    engine = Engine(tiny_models)
    reqs = [random_request(tiny_models, rng) for _ in range(rng.randint(2, 8))]
    join_at = [rng.randint(0, 6) for _ in reqs]
    budget = rng.choice([None, 3, 7, 16])
    alone = {r.request_id: outcome(run_batch_outputs(engine, [r])[r.request_id]) for r in reqs}
    batched = run_batch_outputs(engine, reqs, join_at=join_at, budget=budget)
    for r in reqs:
        got, want = outcome(batched[r.request_id]), alone[r.request_id]
        assert values(got) == pytest.approx(values(want), abs=1e-3), (r, join_at, budget)
        assert got == want, (r, join_at, budget)
