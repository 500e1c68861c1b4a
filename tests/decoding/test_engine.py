"""The engine on tiny random models in float32: lossless greedy speculation, the cut-back cache,
seeded sampling, the prompt-length check and the vocabulary check."""

from __future__ import annotations

import pytest
import torch

from decoding.drafters import lookup_ngram
from decoding.engine import Engine
from decoding.errors import PromptTooLong, UnknownModel, VocabMismatch
from decoding.loader import check_pair
from decoding.params import (
    FinishReason,
    GenerationRequest,
    RequestStats,
    SamplingParams,
    SpecMode,
    SpecParams,
)
from decoding.runner import EagerRunner

PROMPTS = ["hello wörld, write a poem", "def f(x):\n    return x * 2\n\ndef f(x):", "€€€ ünïcödé 日本語"]


def encode(models, text: str) -> list[int]:
    return models["tiny"].tokenizer(text)["input_ids"]


def run(engine, model, ids, mode, k, adaptive=False, **params):
    params.setdefault("max_tokens", 40)
    params.setdefault("ignore_eos", True)
    req = GenerationRequest(
        "r", model, ids, SamplingParams(**params), SpecParams(SpecMode(mode), max_k=k, adaptive=adaptive)
    )
    return engine.generate(req)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("model,mode", [("tiny", "draft"), ("tiny", "ngram"), ("tiny-self", "draft")])
def test_greedy_speculation_is_token_identical(tiny_models, prompt, k, model, mode):
    engine = Engine(tiny_models)
    ids = encode(tiny_models, prompt)
    plain, _, _ = run(engine, "tiny", ids, "off", 1, temperature=0)
    spec, stats, finish = run(engine, model, ids, mode, k, temperature=0)
    assert spec == plain
    assert finish == FinishReason.LENGTH and len(spec) == 40
    assert stats.steps <= 40


def test_self_draft_accepts_everything(tiny_models):
    engine = Engine(tiny_models)
    _, stats, _ = run(engine, "tiny-self", encode(tiny_models, PROMPTS[0]), "draft", 4, temperature=0)
    assert stats.acceptance_rate == 1.0
    assert stats.steps == 8  # 40 tokens at 5 per step
    assert stats.accepted_by_position == [8, 8, 8, 8] or stats.accepted_by_position[:3] == [8, 8, 8]


def test_adaptive_k_stays_lossless(tiny_models):
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[1])
    plain, _, _ = run(engine, "tiny", ids, "off", 1, temperature=0, max_tokens=80)
    for model in ("tiny", "tiny-self"):
        spec, _, _ = run(engine, model, ids, "draft", 8, adaptive=True, temperature=0, max_tokens=80)
        assert spec == plain


def test_penalties_are_lossless_under_speculation(tiny_models):
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[0])
    kw = dict(temperature=0, presence_penalty=0.7, frequency_penalty=0.4)
    plain, _, _ = run(engine, "tiny", ids, "off", 1, **kw)
    unpenalised, _, _ = run(engine, "tiny", ids, "off", 1, temperature=0)
    assert plain != unpenalised  # the penalty changes the output at all
    for model in ("tiny", "tiny-self"):
        spec, _, _ = run(engine, model, ids, "draft", 4, **kw)
        assert spec == plain


@pytest.mark.parametrize("mode", ["off", "draft", "ngram"])
def test_seed_reproduces_sampled_output(tiny_models, mode):
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[2])
    kw = dict(temperature=0.9, top_p=0.95, top_k=50, seed=42)
    a, _, _ = run(engine, "tiny", ids, mode, 3, **kw)
    b, _, _ = run(engine, "tiny", ids, mode, 3, **kw)
    c, _, _ = run(engine, "tiny", ids, mode, 3, **{**kw, "seed": 43})
    assert a == b
    assert a != c


def test_sampled_speculation_matches_target_distribution(tiny_models):
    """First two tokens under draft speculation vs plain sampling: same distribution (chi-square)."""
    from scipy.stats import chi2_contingency

    engine = Engine(tiny_models)
    ids = encode(tiny_models, "ab")
    counts: dict[str, dict[tuple[int, ...], int]] = {"off": {}, "draft": {}}
    for mode in counts:
        for seed in range(300):
            out, _, _ = run(engine, "tiny", ids, mode, 2, max_tokens=2, temperature=1.0, top_k=3, seed=seed)
            key = tuple(out[:1])
            counts[mode][key] = counts[mode].get(key, 0) + 1
    keys = sorted(set(counts["off"]) | set(counts["draft"]))
    table = [[counts[m].get(k, 0) + 1 for k in keys] for m in counts]
    assert len(keys) >= 2
    assert chi2_contingency(table).pvalue > 1e-3


def test_cut_back_cache_equals_fresh_forward(tiny_models):
    m = tiny_models["tiny"]
    ids = encode(tiny_models, PROMPTS[0])
    runner = EagerRunner(m.model)
    runner.forward(ids)
    runner.forward([5, 6, 7, 8])  # four drafted tokens, then three rejected
    runner.crop(len(ids) + 1)
    cont = runner.forward([9, 10])
    fresh = EagerRunner(m.model).forward([*ids, 5, 9, 10])
    torch.testing.assert_close(cont, fresh[-2:], rtol=1e-4, atol=1e-4)


def test_stop_token_ends_generation_without_emitting_it(tiny_models):
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[0])
    full, _, _ = run(engine, "tiny", ids, "off", 1, temperature=0)
    stop = full[5]
    first = full.index(stop)
    out, _, finish = run(engine, "tiny", ids, "draft", 4, temperature=0, stop_token_ids=(stop,))
    assert finish == FinishReason.STOP
    assert out == full[:first]


def test_prompt_longer_than_context_is_refused_before_work(tiny_models):
    engine = Engine(tiny_models)
    ctx = tiny_models["tiny"].max_context
    with pytest.raises(PromptTooLong) as e:
        engine.check(GenerationRequest("r", "tiny", [1] * ctx, SamplingParams(max_tokens=1)))
    assert str(ctx) in str(e.value)
    assert engine.total_steps == 0


def test_unknown_model(tiny_models):
    with pytest.raises(UnknownModel):
        Engine(tiny_models).check(GenerationRequest("r", "nope", [1], SamplingParams()))


def test_mismatched_pair_is_refused_naming_both(tiny_models):
    from dataclasses import replace

    from transformers import AutoTokenizer

    from decoding import store

    other = replace(tiny_models["tiny-draft"], name="odd-draft")
    tok = AutoTokenizer.from_pretrained(store.model_dir("tiny-random-draft"))
    tok.add_tokens(["<extra>"])
    other.tokenizer = tok
    with pytest.raises(VocabMismatch, match=r"odd-draft.*tiny|tiny.*odd-draft"):
        check_pair(tiny_models["tiny"], other)


def test_ngram_lookup_prefers_longest_latest_match():
    import numpy as np

    seq = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    assert lookup_ngram(seq, 3, max_ngram=3, min_ngram=1) == [4, 5, 7]  # "2 3" latest earlier -> 4
    assert lookup_ngram(np.array([5, 6, 7]), 2, 3, 1) == []


def test_penalty_counts_every_accepted_token_including_repeats(tiny_models):
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[1])
    req = GenerationRequest(
        "c",
        "tiny-self",
        ids,
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, frequency_penalty=0.1),
        SpecParams(SpecMode.DRAFT, max_k=6, adaptive=False),
    )
    seq = engine.start(req)
    while engine.step(seq).finish_reason is None:
        pass
    completion = torch.tensor(seq.tokens[len(ids) :])
    expected = torch.bincount(completion, minlength=seq.counts.shape[0])
    assert torch.equal(seq.counts, expected)
    seq.release()


def _drafted_per_step(engine, model, ids, confidence, **params):
    spec = SpecParams(SpecMode.DRAFT, max_k=6, adaptive=False, draft_confidence=confidence)
    req = GenerationRequest("c", model, ids, SamplingParams(max_tokens=30, ignore_eos=True, **params), spec)
    out, stats, _ = engine.generate(req)
    return out, stats


@pytest.mark.parametrize("params", [dict(temperature=0), dict(temperature=0.8, seed=3)])
def test_draft_confidence_stops_drafting_without_changing_output(tiny_models, params):
    """A random tiny draft is never 99.99% sure, so with that threshold every proposal stops after
    its first token; with 0 it drafts the full k. The output is the same either way."""
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[0])
    full, full_stats = _drafted_per_step(engine, "tiny", ids, 0.0, **params)
    cut, cut_stats = _drafted_per_step(engine, "tiny", ids, 0.9999, **params)
    # without the stop every step drafts k = 6 (but the last ones, which never draft past max_tokens)
    assert (
        len(full_stats.drafted_by_position) == 6
        and full_stats.drafted_by_position[0] == full_stats.spec_steps
    )
    assert full_stats.drafted_by_position[5] >= full_stats.spec_steps - 5
    assert cut_stats.drafted == cut_stats.spec_steps and len(cut_stats.drafted_by_position) == 1
    if params["temperature"] == 0:
        plain, _, _ = run(engine, "tiny", ids, "off", 1, max_tokens=30, temperature=0)
        assert full == cut == plain
    else:  # seeded: the stop depends on draft probabilities alone, so the seed still repeats
        again, _ = _drafted_per_step(engine, "tiny", ids, 0.9999, **params)
        assert cut == again


def test_draft_confidence_default_follows_device_and_adaptive(tiny_models):
    from decoding.admission import DRAFT_CONFIDENCE

    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[0])

    def confidence(**spec):
        req = GenerationRequest(
            "d", "tiny", ids, SamplingParams(max_tokens=4), SpecParams(SpecMode.DRAFT, **spec)
        )
        seq = engine.start(req)
        seq.release()
        return seq.drafter.min_confidence

    assert confidence() == DRAFT_CONFIDENCE["cpu"] > 0
    assert confidence(adaptive=False) == 0.0  # a fixed k stays fixed
    assert confidence(adaptive=False, draft_confidence=0.3) == 0.3
    with pytest.raises(ValueError, match="draft_confidence"):
        SpecParams(draft_confidence=1.0)


def _reference(model, ids: list[int], n: int, penalty: float) -> list[int]:
    """Greedy decoding by hand with vLLM's repetition penalty over the prompt and the output."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[torch.tensor(ids + out)] = True
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        out.append(int(logits.argmax()))
    return out


def test_repetition_penalty_is_vllms_and_lossless_under_speculation(tiny_models):
    """repetition_penalty (vLLM's extra): a seen token's logit divided by it where positive and
    multiplied where negative, over the prompt's tokens and the output's; the same greedy output
    with every drafter as without speculation."""
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[1])
    kw = dict(temperature=0, repetition_penalty=1.5, max_tokens=24)
    plain, _, _ = run(engine, "tiny", ids, "off", 1, **kw)
    assert plain == _reference(tiny_models["tiny"].model, ids, 24, 1.5)
    assert plain != run(engine, "tiny", ids, "off", 1, temperature=0, max_tokens=24)[0]
    for model, mode in (("tiny", "draft"), ("tiny", "ngram"), ("tiny-self", "draft")):
        assert run(engine, model, ids, mode, 4, **kw)[0] == plain, (model, mode)


@pytest.mark.parametrize("mode", ["off", "draft", "ngram"])
def test_min_tokens_holds_back_every_stop_until_then(tiny_models, mode):
    """min_tokens (vLLM's extra): neither a stop id nor EOS before that many tokens; after it they
    end the output as before. Speculation gives the same tokens (the ban is on the target's and
    the draft's rows alike)."""
    engine = Engine(tiny_models)
    ids = encode(tiny_models, PROMPTS[0])
    full, _, _ = run(engine, "tiny", ids, "off", 1, temperature=0)
    stop = full[2]
    early, _, finish = run(engine, "tiny", ids, mode, 4, temperature=0, stop_token_ids=(stop,))
    assert finish == FinishReason.STOP and len(early) == full.index(stop) < 6
    out, _, finish = run(engine, "tiny", ids, mode, 4, temperature=0, stop_token_ids=(stop,), min_tokens=6)
    assert len(out) >= 6 and stop not in out[:6]
    want, _, _ = run(engine, "tiny", ids, "off", 1, temperature=0, stop_token_ids=(stop,), min_tokens=6)
    assert out == want
    if finish == FinishReason.STOP:  # it ended at the stop once it might
        assert stop not in out


def test_min_p_drops_the_unlikely_and_keeps_the_likeliest():
    from decoding.sampling import probs_from_logits

    logits = torch.tensor([[4.0, 3.0, 1.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(min_p=0.2))
    raw = logits.softmax(-1)
    assert torch.equal(probs[0] > 0, raw[0] >= 0.2 * raw[0].max())  # 4 and 3 stay (3: 0.37 of 4)
    assert probs[0, 2] == 0 and torch.allclose(probs.sum(-1), torch.ones(2))
    assert torch.allclose(probs[1], raw[1])  # all equal: all stay
    assert probs_from_logits(logits, SamplingParams(min_p=1.0))[0].argmax() == 0
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    for bad in (0, 5e-324, float("nan"), 101):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)


def test_a_draft_served_at_a_shorter_context_than_its_target_stops_drafting_at_its_end():
    """Each model's max_context is its own, and a draft's may be shorter than its target's (a
    2k-token draft for a 4k target): past the draft's context the row decodes plainly, with the
    output it has alone. Its cache overflowed, and the request failed mid-stream as a server error."""
    from decoding.loader import ModelSpec, load_all

    models = load_all(
        [  # the draft is the target's own weights: it drafts every step, up to its context's end
            ModelSpec("t", "tiny-random", draft="d", dtype="float32", device="cpu", max_context=256),
            ModelSpec("d", "tiny-random", dtype="float32", device="cpu", max_context=64),
        ]
    )
    engine = Engine(models)
    prompt = list(range(3, 43))  # 40 tokens: the draft's context ends 24 tokens into the completion

    def run(mode: SpecMode) -> tuple[list[int], RequestStats, FinishReason]:
        params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        return engine.generate(
            GenerationRequest("r", "t", prompt, params, SpecParams(mode, max_k=4, adaptive=False))
        )

    plain, _, _ = run(SpecMode.OFF)
    drafted, stats, finish = run(SpecMode.DRAFT)
    assert finish == FinishReason.LENGTH and len(plain) == 120
    assert drafted == plain
    assert stats.accepted > 0
