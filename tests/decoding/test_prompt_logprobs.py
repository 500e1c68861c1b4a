"""Prompt logprobs (legacy completions' echo with logprobs): every prompt token but the first scored
by the target given the tokens before it, as the model's own forward pass scores it, on each backend
a CPU runs; long prompts scored chunk by chunk; the completion the same with and without them, alone
and in a batch."""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding.engine import SCORED_CHUNK, Engine
from decoding.loader import ModelSpec, load_all
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams, StepOutput, TokenLogprob
from decoding.sequence import LoadedModel
from tests.decoding.test_batch import run_batch_outputs

TOP = 3
PROMPTS = [
    "hello wörld, write a poem",
    "def f(x):\n    return x * 2\n\ndef f(x):",
    "€€€ ünïcödé 日本語",
    "a",
]
_ids = itertools.count()


@pytest.fixture(scope="module")
def eager_model(tiny_models):
    """The tiny target on the eager backend (transformers' DynamicCache, one forward per sequence)."""
    return load_all([ModelSpec("eager", "tiny-random", dtype="float32", device="cpu", backend="eager")])


def request(model: str, ids: list[int], mode: str = "off", k: int = 4, **params) -> GenerationRequest:
    params.setdefault("max_tokens", 8)
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0)
    spec = SpecParams(SpecMode(mode), max_k=k, adaptive=False)
    return GenerationRequest(f"r{next(_ids)}", model, ids, SamplingParams(**params), spec)


def reference(model: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers model's own scores of ``ids[1:]`` [T-1] and its TOP best ids [T-1, TOP]."""
    with torch.no_grad():
        lp = torch.log_softmax(model.model(torch.tensor([ids])).logits[0, :-1].float(), -1)  # [T-1, V]
    return lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1), lp.topk(TOP, -1).indices


def outputs(engine: Engine, req: GenerationRequest, budget: int | None = None) -> list[StepOutput]:
    """Every output of ``req`` run alone, its prompt fed ``budget`` tokens a step (None: whole)."""
    seq = engine.start(req)
    outs: list[StepOutput] = []
    try:
        while not outs or outs[-1].finish_reason is None:
            out = engine.step_batch([seq], budget)[0]
            if out is not None:
                outs.append(out)
    finally:
        seq.release()
    return outs


def check_scores(
    got: list[TokenLogprob | None] | None, model: LoadedModel, ids: list[int], atol: float
) -> None:
    assert got is not None and len(got) == len(ids)
    assert got[0] is None  # nothing predicts the first token
    rest = [g for g in got[1:] if g is not None]
    assert len(rest) == len(ids) - 1
    assert [g.token_id for g in rest] == ids[1:]
    if not rest:
        return
    chosen, top = reference(model, ids)
    torch.testing.assert_close(torch.tensor([g.logprob for g in rest]), chosen, rtol=0, atol=atol)
    assert all(len(g.top) == TOP for g in rest)
    assert [[t for t, _ in g.top] for g in rest] == top.tolist()
    for g in rest:  # the token's own logprob is among the alternatives' where it is one of them
        assert g.logprob <= max(v for _, v in g.top) + 1e-6
        assert dict(g.top).get(g.token_id, g.logprob) == pytest.approx(g.logprob, abs=1e-6)


@pytest.mark.parametrize("backend", ["tiny", "eager"])
@pytest.mark.parametrize(
    "length,budget", [(1, None), (2, None), (40, None), (40, 7), (SCORED_CHUNK + 45, None)]
)
def test_prompt_logprobs_are_the_models_own(tiny_models, eager_model, backend, length, budget):
    models = {**tiny_models, **eager_model}
    ids = [(7 * i + 3) % 250 for i in range(length)]
    outs = outputs(Engine(models), request(backend, ids, prompt_logprobs=TOP, logprobs=1), budget)
    check_scores(outs[0].prompt_logprobs, tiny_models["tiny"], ids, atol=1e-4)
    assert all(o.prompt_logprobs is None for o in outs[1:])  # the first output carries them alone


def test_zero_alternatives_score_the_token_alone(tiny_models):
    ids = tiny_models["tiny"].tokenizer(PROMPTS[0])["input_ids"]
    got = outputs(Engine(tiny_models), request("tiny", ids, prompt_logprobs=0))[0].prompt_logprobs
    assert got is not None and got[0] is None and all(g is not None and g.top == () for g in got[1:])


@pytest.mark.parametrize("mode", ["off", "draft", "ngram"])
def test_scoring_the_prompt_leaves_the_completion_alone(tiny_models, mode):
    engine = Engine(tiny_models)
    ids = tiny_models["tiny"].tokenizer(PROMPTS[1])["input_ids"]
    plain = outputs(engine, request("tiny", ids, mode, max_tokens=16, logprobs=2))
    scored = outputs(engine, request("tiny", ids, mode, max_tokens=16, logprobs=2, prompt_logprobs=2))
    assert all(o.prompt_logprobs is None for o in plain)
    assert [t for o in scored for t in o.token_ids] == [t for o in plain for t in o.token_ids]
    a = [x for o in plain for x in o.logprobs or []]
    b = [x for o in scored for x in o.logprobs or []]
    assert [x.token_id for x in b] == [x.token_id for x in a] and len(a) == 16
    assert [x.logprob for x in b] == pytest.approx([x.logprob for x in a], abs=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_in_a_batch_equal_alone(tiny_models, overlap):
    """Scored prompts joining a batch at different steps, chunked by a small budget beside rows that
    speculate and rows whose prompts are not scored, with steps queued ahead or not: each prompt's
    scores are those it gets alone."""
    engine = Engine(tiny_models)
    engine.overlap = overlap
    tok = tiny_models["tiny"].tokenizer
    reqs = [
        request("tiny", tok(PROMPTS[0])["input_ids"], "draft", prompt_logprobs=TOP),
        request("tiny", tok(PROMPTS[1])["input_ids"], "ngram", max_tokens=20),
        request("tiny", tok(PROMPTS[2])["input_ids"], "off", prompt_logprobs=1, logprobs=1),
        request("tiny", tok(PROMPTS[3])["input_ids"], "draft", prompt_logprobs=TOP),
        request("tiny", tok(PROMPTS[1] * 3)["input_ids"], "draft", prompt_logprobs=2, max_tokens=4),
    ]
    alone = {r.request_id: outputs(engine, r) for r in reqs}
    batched = run_batch_outputs(engine, reqs, join_at=[0, 0, 2, 3, 3], budget=9)
    assert (engine.ahead_steps > 0) == overlap
    for r in reqs:
        solo, got = alone[r.request_id], batched[r.request_id]
        assert [t for o in got for t in o.token_ids] == [t for o in solo for t in o.token_ids]
        if r.params.prompt_logprobs is None:
            assert all(o.prompt_logprobs is None for o in got)
            continue
        a, b = solo[0].prompt_logprobs, got[0].prompt_logprobs
        assert a is not None and b is not None and len(a) == len(b) == len(r.prompt_token_ids)
        assert b[0] is None
        for x, y in zip(a[1:], b[1:], strict=True):
            assert x is not None and y is not None
            assert y.token_id == x.token_id and y.logprob == pytest.approx(x.logprob, abs=1e-5)
            assert [t for t, _ in y.top] == [t for t, _ in x.top]


# ---- llama.cpp: a scored prompt's chunk is wider than exact mode's step --------------------------

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMACPP = True
except ImportError:
    HAVE_LLAMACPP = False


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models, tmp_path_factory):
    if not HAVE_LLAMACPP:
        pytest.skip(
            "llama-cpp-python is not installed (the llamacpp extra: pip install 'specgate[llamacpp]')"
        )
    from tests.decoding.tiny_gguf import write_gguf

    return write_gguf(tiny_models["tiny"], tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def on_llamacpp(tiny_models, path, flash_attn: bool) -> dict[str, LoadedModel]:
    """The tiny target on llama.cpp in exact mode. Weights as they ship (repack=False): a repacking
    build with AMX kernels would first check them in a child process on this model, whose head size
    (16) q8_0 cannot hold; an f32 cache for the same reason. Flash attention rounds q and k to f16
    on the CPU, so only without it are the scores the transformers model's to 1e-3."""
    from decoding.llamacpp import GGUFInfo, LlamaCppModel

    tiny = tiny_models["tiny"]
    llama = LlamaCppModel(path, 512, 2, repack=False, kv_type="f32", flash_attn=flash_attn)
    info = GGUFInfo(llama, tiny.model.config)
    model = LoadedModel("llama", info, tiny.tokenizer, max_context=512, eos_token_ids=tiny.eos_token_ids)  # type: ignore[arg-type]
    model.runner_factory, model.draft_runner_factory = llama.runner, llama.draft_runner  # type: ignore[assignment]
    return {"llama": model}


@pytest.mark.parametrize("budget", [None, 5])
def test_llamacpp_scores_a_prompt_wider_than_its_exact_step(tiny_models, tiny_gguf, budget):
    models = on_llamacpp(tiny_models, tiny_gguf, flash_attn=False)
    ids = [(7 * i + 3) % 250 for i in range(40)]
    seq = Engine(models).start(request("llama", ids))
    assert seq.runner.max_step_tokens is not None and seq.runner.max_step_tokens < 39  # exact mode
    seq.release()
    outs = outputs(Engine(models), request("llama", ids, prompt_logprobs=TOP), budget)
    check_scores(outs[0].prompt_logprobs, tiny_models["tiny"], ids, atol=1e-3)


@pytest.mark.parametrize("mode", ["off", "ngram"])
def test_llamacpp_scoring_the_prompt_leaves_the_completion_alone(tiny_models, tiny_gguf, mode):
    """A scored chunk decodes whole, as an unscored one does: the cache, and so the completion and
    its logprobs, are the same bits."""
    models = on_llamacpp(tiny_models, tiny_gguf, flash_attn=True)
    engine = Engine(models)
    ids = tiny_models["tiny"].tokenizer(PROMPTS[1] * 2)["input_ids"]
    plain = outputs(engine, request("llama", ids, mode, max_tokens=16, logprobs=1))
    scored = outputs(engine, request("llama", ids, mode, max_tokens=16, logprobs=1, prompt_logprobs=1))
    assert scored[0].prompt_logprobs is not None and len(scored[0].prompt_logprobs) == len(ids)
    a = [(x.token_id, x.logprob) for o in plain for x in o.logprobs or []]
    b = [(x.token_id, x.logprob) for o in scored for x in o.logprobs or []]
    assert a == b and len(a) == 16


# ---- CUDA: the static backend's chunk graphs take logit-free chunks only ------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["cuda_graphs", "compile"])
def test_graphed_backends_score_prompts_beside_graphed_steps(tiny_models, backend):
    """A scored chunk runs the eager plan (GraphSet._chunks_fit), a short one (at most
    the graph width) with the decode rows; the scores are the model's own and the rows beside
    them decode as they do alone."""
    spec = ModelSpec(
        "g", "tiny-random", dtype="float32", device="cuda", backend=backend, max_context=512, slots=4
    )
    models = load_all([spec])
    engine = Engine(models)
    decoding = request("g", list(range(30, 70)), max_tokens=24)
    alone = [t for o in outputs(engine, decoding) for t in o.token_ids]
    scored = [request("g", [(5 * i + 1) % 250 for i in range(n)], prompt_logprobs=TOP) for n in (60, 5)]
    seqs = [engine.start(decoding)]
    got: dict[str, list[StepOutput]] = {r.request_id: [] for r in [decoding, *scored]}
    step = 0
    while seqs:
        if step == 3:  # the decoding row is past its prompt: the scored ones join beside it
            seqs += [engine.start(r) for r in scored]
        for s, o in zip(list(seqs), engine.step_batch(seqs, prefill_budget=16), strict=True):
            if o is not None:
                got[o.request_id].append(o)
                if o.finish_reason is not None:
                    seqs.remove(s)
                    s.release()
        step += 1
    assert [t for o in got[decoding.request_id] for t in o.token_ids] == alone
    for r in scored:  # against the CPU model: float32 sums in another order (the H200: 1.2e-4 off at -4.9)
        check_scores(got[r.request_id][0].prompt_logprobs, tiny_models["tiny"], r.prompt_token_ids, atol=1e-3)
