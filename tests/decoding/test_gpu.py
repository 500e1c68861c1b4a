"""The CUDA fast path on a GPU: graph replays compute what the eager static forward computes, and
speculation over graphs stays lossless. Skipped where there is no CUDA device."""

from __future__ import annotations

import pytest
import torch

from decoding.engine import Engine
from decoding.loader import ModelSpec, load_all
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.static import StaticModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def gpu_models():
    return load_all([
        ModelSpec("tiny", "tiny-random", draft="tiny-draft", dtype="float32", device="cuda", backend="cuda_graphs", max_context=512),
        ModelSpec("tiny-draft", "tiny-random-draft", dtype="float32", device="cuda", backend="cuda_graphs", max_context=512),
        ModelSpec("tiny-eager", "tiny-random", dtype="float32", device="cuda", backend="eager", max_context=512),
    ])


def test_graph_replay_matches_eager_static(gpu_models):
    m = gpu_models["tiny"].model
    graphs = StaticModel(m, 256, slots=1, graphs=True).runner()
    plain = StaticModel(m, 256, slots=1, graphs=False).runner()
    ids = list(range(10, 40))
    for r in (graphs, plain):
        r.forward(ids, logits=False)
    for toks in ([1], [2, 3, 4], [5, 6, 7, 8, 9]):
        torch.testing.assert_close(graphs.forward(toks), plain.forward(toks), rtol=1e-4, atol=1e-4)
        graphs.crop(graphs.length - 1)
        plain.crop(plain.length - 1)


@pytest.mark.parametrize("mode,k", [("draft", 2), ("draft", 5), ("ngram", 4)])
def test_speculation_over_graphs_is_lossless(gpu_models, mode, k):
    engine = Engine(gpu_models)
    ids = list(range(30, 60))
    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected, _, _ = engine.generate(GenerationRequest("a", "tiny-eager", ids, p, SpecParams(SpecMode.OFF)))
    got, _, _ = engine.generate(GenerationRequest("b", "tiny", ids, p, SpecParams(SpecMode(mode), max_k=k, adaptive=False)))
    assert got == expected
