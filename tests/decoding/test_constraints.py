"""Grammar masks and logit_bias under speculation, on tiny random models: the output is exactly the
masked, biased target's (token-identical greedy, the same distribution sampled), and it validates."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from decoding.constraints import Constraint, apply_logit_bias, apply_logit_mask
from decoding.drafters import PredictionDrafter, align
from decoding.engine import Engine
from decoding.errors import InvalidParameter
from decoding.params import (
    FinishReason,
    GenerationRequest,
    GrammarSpec,
    SamplingParams,
    SpecMode,
    SpecParams,
)

SCHEMAS = [
    {  # nested objects, enums, required, number ranges, bounded arrays
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "n": {"type": "number"}},
                "required": ["zip", "n"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3},
        },
        "required": ["name", "age", "role", "address", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]


def request(models, prompt, mode="off", grammar=None, k=4, bias=(), **params):
    params.setdefault("max_tokens", 160)
    params.setdefault("temperature", 0)
    ids = models["tiny"].tokenizer(prompt)["input_ids"]
    spec = SpecParams(SpecMode(mode), max_k=k, adaptive=False)
    return GenerationRequest(
        "r", "tiny", ids, SamplingParams(**params), spec, logit_bias=bias, grammar=grammar
    )


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("prompt", ["hello", "{ json please ü"])
def test_json_schema_output_validates_and_greedy_is_identical_across_modes(tiny_models, schema, prompt):
    engine = Engine(tiny_models)
    grammar = GrammarSpec("json_schema", json.dumps(schema))
    outs = {}
    for mode, model in (("off", "tiny"), ("draft", "tiny"), ("ngram", "tiny"), ("draft", "tiny-self")):
        req = request(tiny_models, prompt, mode, grammar)
        req = GenerationRequest(req.request_id, model, *[getattr(req, f) for f in ("prompt_token_ids", "params", "spec")],
                                grammar=grammar)  # fmt: skip
        tokens, stats, finish = engine.generate(req)
        assert finish == FinishReason.STOP
        jsonschema.validate(json.loads(tiny_models["tiny"].tokenizer.decode(tokens)), schema)
        outs[(mode, model)] = tokens
        if mode != "off":
            assert stats.drafted > 0
    first = next(iter(outs.values()))
    assert all(o == first for o in outs.values())


def test_forced_tokens_are_proposed_and_accepted(tiny_models):
    engine = Engine(tiny_models)
    schema = {
        "type": "object",
        "properties": {"a_long_key_name": {"enum": ["x"]}},
        "required": ["a_long_key_name"],
        "additionalProperties": False,
    }
    tokens, stats, _ = engine.generate(
        request(tiny_models, "hi", "ngram", GrammarSpec("json_schema", json.dumps(schema)))
    )
    assert tiny_models["tiny"].tokenizer.decode(tokens) == '{"a_long_key_name": "x"}'
    assert stats.steps < len(tokens) / 2  # forced runs cost one target pass each
    assert stats.accepted == stats.drafted


def test_sampled_constrained_choice_has_the_masked_target_distribution(tiny_models):
    """Chi-square: speculative sampling under a grammar draws from the masked target's distribution,
    computed here by hand (a prefix trie of the choices, not llguidance) from the target's logits."""
    choices = ["ab", "ac", "ba", "bcd"]
    tok = tiny_models["tiny"].tokenizer
    model = tiny_models["tiny"].model
    prompt_ids = tok("pick:")["input_ids"]
    expected = []
    for c in choices:
        p, ids = 1.0, list(prompt_ids)
        for i, ch in enumerate(c):
            allowed = sorted(
                {tok(o[i])["input_ids"][0] for o in choices if o.startswith(c[:i]) and len(o) > i}
            )
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            p *= float(logits[allowed].softmax(-1)[allowed.index(tok(ch)["input_ids"][0])])
            ids += tok(ch)["input_ids"]
        expected.append(p)
    assert abs(sum(expected) - 1) < 1e-4
    grammar = GrammarSpec("lark", "start: " + " | ".join(json.dumps(c) for c in choices))
    engine = Engine(tiny_models)
    N, B = 800, 8  # B sequences per batched step (the rows differ: own seeds, own grammar states)
    counts = dict.fromkeys(choices, 0)
    for first in range(0, N, B):
        seqs = [
            engine.start(
                request(tiny_models, "pick:", "draft", grammar, k=3, temperature=1.0, seed=s, max_tokens=8)
            )
            for s in range(first, first + B)
        ]
        out: dict[int, list[int]] = {id(s): [] for s in seqs}
        live = list(seqs)
        while live:
            steps = engine.step_batch(live)
            for s, step in zip(list(live), steps, strict=True):
                if step is not None:
                    out[id(s)] += step.token_ids
                    if step.finish_reason is not None:
                        assert step.finish_reason == FinishReason.STOP
                        live.remove(s)
        for s in seqs:
            counts[tok.decode(out[id(s)])] += 1
            s.release()
    observed = np.array([counts[c] for c in choices])
    exp = np.array(expected) / sum(expected) * N
    keep = exp >= 5  # chi-square needs expected counts of at least ~5; pool the rest
    obs_k = np.append(observed[keep], observed[~keep].sum())
    exp_k = np.append(exp[keep], exp[~keep].sum())
    if exp_k[-1] == 0:
        obs_k, exp_k = obs_k[:-1], exp_k[:-1]
    assert scipy_stats.chisquare(obs_k, exp_k).pvalue > 1e-3, (counts, expected)


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_logit_bias_output_is_the_biased_targets(tiny_models, mode):
    engine = Engine(tiny_models)
    plain, _, _ = engine.generate(request(tiny_models, "hello", max_tokens=30, ignore_eos=True))
    banned = plain[0]
    boosted = plain[3]
    bias = ((banned, -100.0), (boosted, 5.0))
    off, _, _ = engine.generate(
        request(tiny_models, "hello", "off", bias=bias, max_tokens=30, ignore_eos=True)
    )
    spec, stats, _ = engine.generate(
        request(tiny_models, "hello", mode, bias=bias, max_tokens=30, ignore_eos=True)
    )
    assert banned not in off and off != plain
    assert spec == off
    assert stats.drafted > 0


def test_bad_logit_bias_token_and_uncompilable_grammar_are_refused_by_name(tiny_models):
    engine = Engine(tiny_models)
    with pytest.raises(InvalidParameter) as e:
        engine.check(request(tiny_models, "x", bias=((10**6, 1.0),)))
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidParameter) as e:
        engine.check(request(tiny_models, "x", grammar=GrammarSpec("json_schema", '{"type": "nonsense"}')))
    assert e.value.param == "response_format"
    with pytest.raises(InvalidParameter) as e:
        engine.check(request(tiny_models, "x", grammar=GrammarSpec("lark", "start: (", param="tools")))
    assert e.value.param == "tools"


def test_a_bad_regex_is_refused_with_the_parsers_reason_on_one_line(tiny_models):
    """The regex parser puts its reason on a later line, under a caret drawing: the 400 said only
    "regex parse error:". The grammar excerpt llguidance quotes stays out of the message."""
    engine = Engine(tiny_models)
    with pytest.raises(InvalidParameter) as e:
        engine.check(request(tiny_models, "x", grammar=GrammarSpec("regex", "[z-a]", param="guided_regex")))
    message = str(e.value)
    assert e.value.param == "guided_regex" and "\n" not in message
    assert message.endswith("invalid character class range, the start must be <= the end")


@pytest.mark.parametrize(
    ("regex", "ascii", "other"),
    [(r"\d{3}", "123", "١٢٣"), (r"[\d-]+", "1-2", "١-٢"), (r"\w+", "a_1", "é"), (r"\D", "x", "5")],
)
def test_guided_regex_classes_are_ascii_as_vllms_backends_read_them(tiny_models, regex, ascii, other):
    """``\\d`` is 0-9 and ``\\w`` ASCII word characters, as xgrammar, outlines and JSON Schema's
    patterns read them: llguidance's regex let ``\\d{3}`` match Arabic-Indic digits."""
    tok = tiny_models["tiny"].tokenizer

    def accepts(text: str) -> bool:
        c = Constraint(GrammarSpec("regex", regex, param="guided_regex"), tok, 259, (tok.eos_token_id,))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return c.check_drafts(ids) == len(ids)

    assert accepts(ascii) and not accepts(other)


@pytest.mark.parametrize("mode", ["off", "draft", "ngram"])
@pytest.mark.parametrize(
    ("grammar", "eos_bias"),
    [(GrammarSpec("regex", r"\d{1,5}"), 0.0), (GrammarSpec("regex", r"\d{1,5}"), 100.0),
     (GrammarSpec("lark", 'start: "yes" | "no"'), 0.0)],
)  # fmt: skip
def test_a_grammars_end_ends_the_output_even_with_ignore_eos(tiny_models, mode, grammar, eos_bias):
    """ignore_eos (as benchmark clients send it) beside a grammar: the EOS the grammar allows where
    its output may end, ends it. It was output and gone on from: the EOS's text inside the output,
    then more digits after it, or once the grammar had ended, unconstrained tokens (in a batch) or
    a grammar error (alone)."""
    from tests.decoding.test_batch import run_batch

    engine = Engine(tiny_models)
    tok = tiny_models["tiny"].tokenizer
    eos = tok.eos_token_id
    reqs = [
        request(tiny_models, p, mode, grammar, bias=((eos, eos_bias),), max_tokens=40, ignore_eos=True, **kw)
        for p, kw in (("hello", {}), ("{ json please ü", {"temperature": 1.0, "seed": 3}), ("x", {"min_tokens": 30}))
    ]  # fmt: skip
    reqs = [GenerationRequest(f"r{i}", *[getattr(r, f) for f in ("model", "prompt_token_ids", "params", "spec", "logit_bias", "grammar")])
            for i, r in enumerate(reqs)]  # fmt: skip
    checker = Constraint(grammar, tok, 259, (eos,))
    for r in reqs:
        tokens, _, finish = engine.generate(r)
        assert finish == FinishReason.STOP and eos not in tokens
        assert checker.check_drafts([*tokens, eos]) == len(tokens) + 1, tok.decode(
            tokens
        )  # whole and complete
    alone = {r.request_id: engine.generate(r)[0] for r in reqs}
    assert run_batch(engine, reqs, join_at=[0, 1, 2], budget=3) == alone


def test_constraint_rolls_back_what_it_did_not_commit(tiny_models):
    tok = tiny_models["tiny"].tokenizer
    c = Constraint(GrammarSpec("lark", 'start: "yes" | "no"'), tok, 259, (tok.eos_token_id,))
    y, e, s = (tok(ch)["input_ids"][0] for ch in "yes")
    n = tok("n")["input_ids"][0]
    assert c.check_drafts([y, e, n]) == 2  # cut at the first rejected token
    masks = c.masks([y, e])
    assert masks.shape == (3, 259)
    assert masks[0].nonzero().flatten().tolist() == sorted([y, n])
    assert masks[1].nonzero().flatten().tolist() == [e] and masks[2].nonzero().flatten().tolist() == [s]
    assert c.draft_mask([y]).nonzero().flatten().tolist() == [e]
    assert c.masks([])[0].nonzero().flatten().tolist() == sorted([y, n])  # nothing was consumed
    c.commit([y, e, s])
    assert c.done and c.propose_forced() == []


def test_apply_logit_mask_and_bias():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.5, 0.5]])
    allowed = torch.tensor([[True, False, True], [False, False, False]])
    out = apply_logit_mask(logits, allowed)
    assert out[0].tolist() == [1.0, float("-inf"), 3.0]
    assert out[1].tolist() == [0.5, 0.5, 0.5]  # nothing allowed (past an end token): left alone, no NaN
    assert apply_logit_bias(logits, torch.tensor([0.0, -100.0, 1.0]))[0].tolist() == [1.0, -98.0, 4.0]
    assert apply_logit_bias(logits, None) is logits


def test_prediction_alignment_resynchronises_after_an_edit():
    pred = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9], dtype=np.int64)
    assert align(pred, np.array([], dtype=np.int64), 0, 8) == 0
    assert align(pred, np.array([1, 2, 3]), 3, 8) == 3
    assert align(pred, np.array([1, 2, 3, 42, 43, 5]), 5, 8) == 5  # rejoined after an edit
    assert align(pred, np.array([1, 77]), 2, 8) is None
    d = PredictionDrafter(torch.device("cpu"), (10, 11, 12, 13), prompt_tokens=2)
    params = SamplingParams()
    assert d.propose([0, 0], 3, params, torch.zeros(1), None).tokens.tolist() == [10, 11, 12]
    assert d.propose([0, 0, 10, 99, 11], 3, params, torch.zeros(1), None).tokens.tolist() == [12, 13]


def test_prediction_is_lossless_and_drafts_from_the_prediction(tiny_models):
    engine = Engine(tiny_models)
    plain, _, _ = engine.generate(request(tiny_models, "hello", max_tokens=40, ignore_eos=True))
    edited = [*plain[:10], 5, 6, 7, *plain[12:]]  # the prediction differs from the output in the middle
    req = request(tiny_models, "hello", "auto", max_tokens=40, ignore_eos=True, k=8)
    req = GenerationRequest(req.request_id, req.model, req.prompt_token_ids, req.params, req.spec,
                            prediction=tuple(edited))  # fmt: skip
    out, stats, _ = engine.generate(req)
    assert out == plain
    assert stats.drafter == "prediction"
    assert stats.tokens_per_step > 4


@pytest.mark.slow
def test_real_pair_tool_call_uses_the_tool_call_token_and_parses(real_pair):
    from gateway.grammars import grammar_for
    from gateway.tools import ToolCallParser

    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    tok = real_pair["target"].tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[tool],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    grammar = grammar_for(None, [tool], "required", False)
    engine = Engine(real_pair)
    outs = []
    for mode in ("off", "draft"):
        req = GenerationRequest(
            "r", "target", list(ids), SamplingParams(max_tokens=48, temperature=0),
            SpecParams(SpecMode(mode), max_k=4), grammar=grammar,
        )  # fmt: skip
        tokens, _, finish = engine.generate(req)
        assert finish == FinishReason.STOP
        outs.append(tokens)
    assert outs[0] == outs[1]
    assert outs[0][0] == tok.convert_tokens_to_ids("<tool_call>")  # the trained token, not its spelling
    parser = ToolCallParser()
    content, calls = parser.feed(tok.decode(outs[0], skip_special_tokens=True))
    more, rest = parser.flush()
    calls += rest
    assert (content + more).strip() == "" and calls[0].name == "get_weather"
    assert json.loads("".join(c.arguments for c in calls))["city"] == "Paris"


@pytest.mark.slow
def test_real_pair_predicted_outputs_beat_prompt_lookup_on_a_code_edit(real_pair):
    from bench.structured import CODE_B as code

    tok = real_pair["target"].tokenizer
    prompt = f"Add a docstring to the `pop` method in this code and return the whole code, no commentary:\n\n```python\n{code}```"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    engine = Engine(real_pair)
    prediction = tuple(tok.encode(f"```python\n{code}```", add_special_tokens=False))
    runs = {}
    for name, mode, pred in (
        ("none", "off", None),
        ("ngram", "ngram", None),
        ("prediction", "auto", prediction),
    ):
        # k fixed: an adaptive k follows measured step times, which a loaded CPU moves (a CI run on
        # the AMX box drafted ~2 a step for the prediction after one slow verification); what is
        # compared here is the drafts, not the controller
        req = GenerationRequest(
            "r", "target", list(ids), SamplingParams(max_tokens=72, temperature=0),
            SpecParams(SpecMode(mode), max_k=8, adaptive=False), prediction=pred,
        )  # fmt: skip
        runs[name] = engine.generate(req)
    assert runs["prediction"][0] == runs["none"][0] == runs["ngram"][0]
    assert runs["prediction"][1].tokens_per_step > runs["ngram"][1].tokens_per_step
