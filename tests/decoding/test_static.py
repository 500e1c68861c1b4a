"""The static-cache runner (the CUDA fast path without graphs, which run only on a GPU) must match
the eager runner exactly in what it computes, and keep speculation lossless."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from decoding.engine import Engine
from decoding.errors import ModelLoadError
from decoding.loader import ModelSpec, runner_factory
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.runner import EagerRunner
from decoding.static import StaticModel


def test_static_logits_match_eager_through_a_rejection(tiny_models):
    m = tiny_models["tiny"]
    ids = m.tokenizer("static caches overwrite rejected slots")["input_ids"]
    static = StaticModel(m.model, max_len=128, slots=2, graphs=False).runner()
    eager = EagerRunner(m.model)
    for runner in (static, eager):
        runner.forward(ids[:-1], logits=False)
    a = static.forward([ids[-1], 7, 8, 9])
    b = eager.forward([ids[-1], 7, 8, 9])
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    static.crop(len(ids) + 1)
    eager.crop(len(ids) + 1)
    torch.testing.assert_close(static.forward([3, 4]), eager.forward([3, 4]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_engine_on_static_runners_is_lossless(tiny_models, mode):
    def static_copy(name: str) -> object:
        lm = tiny_models[name]
        return replace(lm, runner_factory=StaticModel(lm.model, max_len=256, slots=2, graphs=False).runner)

    models = {name: static_copy(name) for name in ("tiny", "tiny-draft")}
    ids = models["tiny"].tokenizer("hello static world")["input_ids"]
    expected, _, _ = Engine(tiny_models).generate(
        GenerationRequest("a", "tiny", ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), SpecParams(SpecMode.OFF))
    )
    got, stats, _ = Engine(models).generate(
        GenerationRequest("b", "tiny", ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), SpecParams(SpecMode(mode), max_k=4, adaptive=False))
    )
    assert got == expected
    assert stats.spec_steps > 0


def test_unknown_and_unavailable_backends_are_refused(tiny_models):
    m = tiny_models["tiny"]
    with pytest.raises(ModelLoadError, match="unknown backend"):
        runner_factory(ModelSpec("x", "tiny-random", backend="warp"), m.model, m.device, 64)
    with pytest.raises(ModelLoadError, match="CUDA"):
        runner_factory(ModelSpec("x", "tiny-random", backend="cuda_graphs"), m.model, m.device, 64)


def test_tensorrt_backend_names_the_extra_when_missing(tiny_models):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    m = tiny_models["tiny"]
    with pytest.raises(ModelLoadError, match=r"specgate\[tensorrt\]"):
        runner_factory(ModelSpec("x", "tiny-random", backend="tensorrt"), m.model, m.device, 64)
