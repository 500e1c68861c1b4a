"""A draft whose logits are narrower than its target's, one tokenizer between them (Qwen2.5-0.5B's
151,936 beside the 7B's 152,064; issue 53): tiny-random drafting for tiny-random-padded, which is
tiny-random with 61 random rows past the tokenizer's 259 ids. The target gives those rows mass, so
its output holds ids the draft has no row for; speculation still emits exactly the target's."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from decoding.drafters import DraftModelDrafter, propose_many
from decoding.engine import Engine
from decoding.errors import VocabMismatch
from decoding.loader import check_pair
from decoding.params import GenerationRequest, GrammarSpec, SamplingParams, SpecMode, SpecParams
from decoding.verify import verify_sampling
from decoding.vocab import VocabFit, vocab_fit
from tests.decoding.test_batch import PROMPTS, run_batch

TOKENS = 259  # the byte tokenizer's ids; tiny-random-padded has 320 logits
_ids = itertools.count()


@pytest.fixture(scope="module")
def pair():
    from decoding.loader import ModelSpec, load_all

    return load_all(
        [
            ModelSpec("big", "tiny-random-padded", draft="small", dtype="float32", device="cpu", slots=16),
            ModelSpec("small", "tiny-random", dtype="float32", device="cpu", slots=16),
        ]
    )


def request(models, prompt, mode="off", k=4, **params) -> GenerationRequest:
    params.setdefault("max_tokens", 24)
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0)
    grammar, bias = params.pop("grammar", None), params.pop("bias", ())
    ids = models["big"].tokenizer(prompt)["input_ids"]
    spec = SpecParams(SpecMode(mode), max_k=k, adaptive=False)
    return GenerationRequest(
        f"v{next(_ids)}", "big", ids, SamplingParams(**params), spec, logit_bias=bias, grammar=grammar
    )


def test_the_padded_pair_loads_and_its_draft_gets_the_shared_ids(pair):
    big, small = pair["big"], pair["small"]
    assert (big.vocab_size, small.vocab_size, big.token_ids) == (320, TOKENS, TOKENS)
    check_pair(big, small)  # load_all ran it too
    assert vocab_fit(big, small) == VocabFit(draft=TOKENS, target=320, shared=TOKENS)
    assert vocab_fit(small, small) is None


def test_a_pair_whose_tokenizers_differ_is_still_refused(pair):
    from transformers import AutoTokenizer

    from decoding import store

    other = replace(pair["small"], name="odd-draft")
    tok = AutoTokenizer.from_pretrained(store.model_dir("tiny-random"))
    tok.add_tokens(["<extra>"])  # id 259: a real token the target's tokenizer lacks
    other.tokenizer = tok
    with pytest.raises(VocabMismatch, match=r"odd-draft.*token entries differ"):
        check_pair(pair["big"], other)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_speculation_is_token_identical_alone_and_in_a_batch(pair, k):
    engine = Engine(pair)
    reqs = [request(pair, p, "draft", k, max_tokens=12 + 5 * i) for i, p in enumerate(PROMPTS)]
    plain = {r.request_id: engine.generate(replace(r, spec=SpecParams(SpecMode.OFF)))[0] for r in reqs}
    # the target emits padding ids, which the draft is then fed: the case this file is about
    assert any(t >= TOKENS for out in plain.values() for t in out)
    drafted = accepted = 0
    for r in reqs:
        out, stats, _ = engine.generate(r)
        assert out == plain[r.request_id]
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert accepted > 0 and drafted > accepted  # drafts were both kept and cut back
    assert run_batch(engine, reqs, join_at=[0, 3, 3, 7, 1, 12], budget=5) == plain


def test_sampled_drafts_are_real_tokens_with_p_at_the_targets_width(pair):
    from decoding.admission import drafter_for

    r = request(pair, "hello", "draft", temperature=1.5, seed=3)
    drafter = drafter_for(pair, pair["big"], r, 3)
    assert isinstance(drafter, DraftModelDrafter)
    drafter.min_confidence = 0.0
    tokens = [*r.prompt_token_ids, 300, 317]  # the target's padding ids, fed to the draft
    counts = torch.zeros(320, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        prop = propose_many([(drafter, tokens, 6, r.params, counts, g)])[0]
        assert prop is not None and prop.probs is not None
        assert prop.probs.shape == (6, 320)
        assert (prop.tokens < TOKENS).all()
        assert (prop.probs[:, TOKENS:] == 0).all()
        torch.testing.assert_close(prop.probs.sum(-1), torch.ones(6))
        drafter.rollback(len(tokens) - 1)
    drafter.release()


def test_rejection_sampling_with_a_widened_draft_reproduces_the_padded_target():
    """The draft's p is zero at the target's padding ids, the target's q is not: the emitted token
    still follows q over every id, padding included."""
    g = torch.Generator().manual_seed(0)
    fit = VocabFit(draft=6, target=8, shared=6)
    q = torch.tensor([[0.05, 0.3, 0.1, 0.05, 0.1, 0.1, 0.2, 0.1]])
    p = fit.widen(torch.tensor([[2.0, 0.1, 0.1, 1.0, 0.5, 0.1]])).softmax(-1)  # [1, 8]
    assert (p[0, 6:] == 0).all()
    draws = 20000
    hist = torch.zeros(8)
    for _ in range(draws):
        d = torch.multinomial(p, 1, generator=g)[:, 0]
        _, tokens = verify_sampling(d, p, torch.cat([q, q]), g)
        hist[tokens[0]] += 1  # the accepted draft or the recovered token
    assert chisquare(hist.numpy(), (q[0] * draws).numpy()).pvalue > 1e-3
    assert hist[6:].sum() > 0.25 * draws  # the padding ids' 0.3, which only the residual gives


def test_vocab_fit_narrows_a_wider_draft_to_the_targets_ids():
    fit = VocabFit(draft=10, target=8, shared=7)
    x = torch.arange(10.0)[None]
    assert fit.narrow(x).shape == (1, 7)
    wide = fit.widen(x)
    assert wide.shape == (1, 8) and wide[0, 7] == float("-inf") and wide[0, 6] == 6
    assert fit.feedable([9, 3]) == [9, 3]  # a narrower target never emits an id the draft lacks
    assert VocabFit(draft=6, target=8, shared=6).feedable([7, 5]) == [5, 5]


def test_sampled_speculation_matches_target_only_on_the_padded_pair(pair):
    """First tokens of seeded requests, sampled with draft speculation and without: one distribution
    (chi-square), padding ids among its outcomes."""
    engine = Engine(pair)
    counts: dict[str, dict[int, int]] = {"off": {}, "draft": {}}
    for mode in counts:
        for s in range(240):
            out = engine.generate(
                request(pair, "ab", mode, 2, max_tokens=2, temperature=1.0, top_k=4, seed=s)
            )[0]
            counts[mode][out[0]] = counts[mode].get(out[0], 0) + 1
    keys = sorted(set(counts["off"]) | set(counts["draft"]))
    assert len(keys) >= 2
    table = [[counts[m].get(k, 0) + 1 for k in keys] for m in counts]
    assert chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_grammar_and_logit_bias_on_the_padded_pair_are_the_targets(pair, mode):
    engine = Engine(pair)
    plain = engine.generate(request(pair, "hello", max_tokens=30))[0]
    # ban the first token, boost a padding id the target would not pick first
    bias = ((plain[0], -100.0), (300, 4.0))
    off = engine.generate(request(pair, "hello", bias=bias, max_tokens=30))[0]
    spec, stats, _ = engine.generate(request(pair, "hello", mode, bias=bias, max_tokens=30))
    assert off != plain and plain[0] not in off
    assert spec == off and stats.drafted > 0
    grammar = GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    g_off = engine.generate(request(pair, "{ json", grammar=grammar, bias=bias, max_tokens=40))[0]
    g_spec, stats, _ = engine.generate(
        request(pair, "{ json", mode, grammar=grammar, bias=bias, max_tokens=40)
    )
    assert g_spec == g_off and stats.drafted > 0
    assert all(t < TOKENS for t in g_off)  # the grammar allows no padding id


def test_greedy_speculation_on_llamacpp_is_token_identical(pair, tmp_path):
    """The pair on llama.cpp, which refuses a token id past its vocabulary: the target's padding ids
    reach the draft as ids it has."""
    pytest.importorskip("llama_cpp")
    from decoding.llamacpp import GGUFInfo, LlamaCppModel
    from decoding.sequence import LoadedModel
    from tests.decoding.tiny_gguf import write_gguf

    models = {}
    for name, draft in (("big", "small"), ("small", None)):
        t = pair[name]
        llama = LlamaCppModel(write_gguf(t, tmp_path / f"{name}.gguf"), 512, 2, repack=False, kv_type="f32")
        m = LoadedModel(name, GGUFInfo(llama, t.model.config), t.tokenizer, draft, max_context=512)  # type: ignore[arg-type]
        m.runner_factory, m.draft_runner_factory = llama.runner, llama.draft_runner  # type: ignore[assignment]
        models[name] = m
    assert models["big"].vocab_size == 320 and models["small"].vocab_size == TOKENS
    engine = Engine(models)
    seen_padding = False
    for i, p in enumerate(PROMPTS[:4]):
        plain = engine.generate(request(models, p, max_tokens=20 + 4 * i))[0]
        spec, stats, _ = engine.generate(request(models, p, "draft", 3, max_tokens=20 + 4 * i))
        assert spec == plain and stats.drafted > 0
        seen_padding |= any(t >= TOKENS for t in plain)
    assert seen_padding
