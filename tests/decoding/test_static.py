"""The static-cache runner (the CUDA fast path without graphs, which run only on a GPU) must match
the eager runner exactly in what it computes, and keep speculation lossless."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import pytest
import torch

from decoding.engine import Engine
from decoding.errors import ModelLoadError
from decoding.loader import ModelSpec, runner_factories
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
        GenerationRequest(
            "a",
            "tiny",
            ids,
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
            SpecParams(SpecMode.OFF),
        )
    )
    got, stats, _ = Engine(models).generate(
        GenerationRequest(
            "b",
            "tiny",
            ids,
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
            SpecParams(SpecMode(mode), max_k=4, adaptive=False),
        )
    )
    assert got == expected
    assert stats.spec_steps > 0


def test_unknown_and_unavailable_backends_are_refused(tiny_models):
    m = tiny_models["tiny"]
    with pytest.raises(ModelLoadError, match="unknown backend"):
        runner_factories(ModelSpec("x", "tiny-random", backend="warp"), m.model, m.device, 64)
    with pytest.raises(ModelLoadError, match="CUDA"):
        runner_factories(ModelSpec("x", "tiny-random", backend="cuda_graphs"), m.model, m.device, 64)


def test_tensorrt_backend_names_the_extra_when_missing(tiny_models):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    m = tiny_models["tiny"]
    with pytest.raises(ModelLoadError, match=r"specgate\[tensorrt\]"):
        runner_factories(ModelSpec("x", "tiny-random", backend="tensorrt"), m.model, m.device, 64)


def test_compiled_layers_match_the_eager_static_forward(tiny_models):
    """The `compile` backend (inductor, one compiled layer shared by all layers): T = 1, several
    verification lengths and a prefill chunk must all match the uncompiled forward."""
    m = tiny_models["tiny"]
    compiled = StaticModel(m.model, max_len=128, slots=1, graphs=False, compile_step=True).runner()
    plain = StaticModel(m.model, max_len=128, slots=1, graphs=False).runner()
    ids = list(range(20, 50))
    torch.testing.assert_close(compiled.forward(ids), plain.forward(ids), rtol=1e-4, atol=1e-4)
    for toks in ([1], [2, 3], [4, 5, 6, 7], [8]):
        torch.testing.assert_close(compiled.forward(toks), plain.forward(toks), rtol=1e-4, atol=1e-4)


def test_the_residual_add_rounds_as_an_eager_add():
    """decoding.layers.residual spells x + y with float32 casts inside compiled code (so inductor
    leaves the add out of the matmul before it): in bf16 its sum must be an eager add's, bit for bit."""
    from decoding.layers import residual

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).bfloat16()
    y = (torch.randn(64, 256, generator=g) * torch.logspace(-4, 1, 256)).bfloat16()
    compiled = torch.compile(residual, fullgraph=True)
    assert torch.equal(compiled(x, y), x + y)
    assert torch.equal(residual(x, y), x + y)


def test_fused_weights_leave_the_hf_model_unchanged(tiny_models):
    """Fusing q/k/v and gate/up rebinds the HF modules to views of the fused tensors: the HF
    forward still computes what it did, and no second copy of the weights is made."""
    m = tiny_models["tiny"]
    ids = torch.tensor([list(range(5, 25))])
    with torch.inference_mode():
        before = m.model(ids).logits
        StaticModel(m.model, max_len=64, slots=1, graphs=False)
        after = m.model(ids).logits
    torch.testing.assert_close(before, after, rtol=0, atol=0)
    attn = m.model.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()


def test_unsupported_architectures_are_refused_with_a_way_out(tiny_models):
    m = tiny_models["tiny"]
    m.model.config.model_type, saved = "gemma", m.model.config.model_type
    try:
        with pytest.raises(ModelLoadError, match="backend 'eager'"):
            StaticModel(m.model, max_len=64, slots=1, graphs=False)
    finally:
        m.model.config.model_type = saved


def test_exact_rows_are_bit_identical_to_one_token_steps(tiny_models):
    """Exact mode pads every short step to one width, so row j of a (k+1)-token verification is
    computed by the same kernels as a 1-token step at that position: equal to the bit, in bf16."""
    m = tiny_models["tiny"]
    model = copy.deepcopy(m.model).to(torch.bfloat16)
    static = StaticModel(model, max_len=128, slots=1, graphs=False, exact=True)
    r = static.runner()
    r.forward(list(range(30, 60)), logits=False)
    base = r.length
    block = r.forward([5, 6, 7, 8])
    r.crop(base)
    for j, tok in enumerate([5, 6, 7, 8]):
        assert torch.equal(r.forward([tok])[0], block[j])
    assert r.max_step_tokens == static.max_graph_tokens


def test_exact_steps_pad_to_the_narrowest_width_the_device_showed(tiny_models):
    """Exact mode's width for a step (decoding.exact.ExactWidths.width): the narrowest width at least as wide
    as its widest row that ExactWidths.prove showed for its bucket, else the exact width. Nothing shown
    (a CPU, no graphs, a bucket not proven) pads every row as before; a width shown for one bucket
    says nothing of another; and the cost model prices verifications by rows only where every
    bucket shown runs every verification width unpadded (padding)."""
    static = StaticModel(tiny_models["tiny"].model, max_len=64, slots=2, graphs=False, exact=True)
    X = static.max_graph_tokens
    assert static.step_shape(2, 1, 0, exact=True).width == X
    assert static.exact_padding == X
    static.widths.proven = {1: (2, 3, 5, X), 2: (*range(1, X), X)}
    assert static.widths.width(1, 1) == X  # graphs off: what was shown is the graphs' kernels
    static.graphs_enabled = True  # (a CPU model cannot replay graphs: only the choice is under test)
    assert [static.widths.width(1, w) for w in range(1, X + 1)] == [2, 2, 3, 5, 5, *[X] * (X - 5)]
    assert [static.widths.width(2, w) for w in range(1, X + 1)] == list(range(1, X + 1))
    assert static.widths.width(4, 1) == X  # a bucket not proven
    assert static.step_shape(2, 1, 0, exact=True).width == 1
    assert static.step_shape(2, 1, 0, exact=False).width == 1
    static.exact_min_rows = 4  # the bucket exact_min_rows holds a step at is the one looked up
    assert static.step_shape(2, 1, 0, exact=True).width == X
    assert static.exact_padding == X  # bucket 1 pads widths 4, 6, 7, 8
    static.widths.proven[1] = tuple(range(2, X + 1))
    assert static.exact_padding == 0  # width 1 padded to 2 is a plain step's matter, not k's
    assert not static.widths.own_compile(1, 1)  # eager: one code for every shape
    static.compiled = True  # compiled: one token in all is N = 1's own static compile
    assert (
        static.widths.own_compile(1, 1)
        and not static.widths.own_compile(1, 2)
        and not static.widths.own_compile(2, 1)
    )


def test_exact_speculation_in_bf16_equals_target_only(tiny_models):
    models = {}
    for name in ("tiny", "tiny-draft"):
        lm = tiny_models[name]
        static = StaticModel(
            copy.deepcopy(lm.model).to(torch.bfloat16), max_len=256, slots=2, graphs=False, exact=True
        )
        models[name] = replace(
            lm, model=static.model, runner_factory=static.runner, draft_runner_factory=static.draft_runner
        )
    ids = list(range(40, 70))
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = Engine(models)
    expected, _, _ = engine.generate(GenerationRequest("a", "tiny", ids, p, SpecParams(SpecMode.OFF)))
    for mode in ("draft", "ngram"):
        got, stats, _ = engine.generate(
            GenerationRequest("b", "tiny", ids, p, SpecParams(SpecMode(mode), max_k=6, adaptive=False))
        )
        assert got == expected
        assert stats.spec_steps > 0


def test_compile_backend_loads_warm_and_matches_eager(tiny_models):
    """`backend: compile` through the loader compiles at load (warm) and serves what eager serves."""
    m = tiny_models["tiny"]
    serve, draft = runner_factories(
        ModelSpec("x", "tiny-random", backend="compile", slots=2), m.model, m.device, 128
    )
    ids = list(range(10, 40))
    for factory in (serve, draft):
        r = factory(m.model)
        torch.testing.assert_close(r.forward(ids), EagerRunner(m.model).forward(ids), rtol=1e-4, atol=1e-4)
        r.release()
    assert serve(m.model).max_step_tokens == 9  # exact by default: k is capped at 8
    assert draft(m.model).max_step_tokens is None


def test_auto_backend_and_the_static_context_cap(tiny_models, monkeypatch):
    from decoding import loader

    monkeypatch.setattr(loader, "STATIC_CONTEXT", 256)  # below tiny-random's 4096 positions

    spec = ModelSpec("x", "tiny-random")
    assert loader.resolve_backend(spec, torch.device("cpu"), torch.bfloat16) == "static"
    assert loader.resolve_backend(spec, torch.device("cuda"), torch.bfloat16) == "compile"
    with pytest.raises(ModelLoadError, match="unknown backend"):
        loader.resolve_backend(replace(spec, backend="warp"), torch.device("cpu"), torch.float32)
    m = loader.load(replace(spec, backend="static", dtype="float32"))
    assert m.max_context == 256
    assert m.runner_factory(m.model).max_step_tokens == 9
    assert loader.load(replace(spec, backend="eager", dtype="float32")).max_context == 4096  # the model's own
    auto = loader.load(replace(spec, dtype="float32", device="cpu"))  # static on a CPU, exact off
    assert auto.max_context == 256 and auto.runner_factory(auto.model).max_step_tokens is None


def test_biases_the_static_layer_does_not_apply_are_refused(tiny_models):
    model = copy.deepcopy(tiny_models["tiny"].model)
    o = model.model.layers[0].self_attn.o_proj
    o.bias = torch.nn.Parameter(torch.zeros(o.out_features))
    with pytest.raises(ModelLoadError, match="q/k/v biases only"):
        StaticModel(model, max_len=64, slots=1, graphs=False)


def test_only_a_small_models_long_k_weights_are_split_and_never_by_the_batch():
    """decoding.invariant.split_slices, on the H200's 132 SMs: the shapes bench.probe_skinny_split
    measured faster split (the 0.5B's and the 1.5B's down projections) and those it measured faster on
    cuBLAS (the 0.5B's q/k/v, o and lm_head, the 7B's down projection)."""
    from decoding.invariant import split_slices

    assert split_slices(896, 4864, 132) == 9  # 14 tiles: about one program per SM
    assert split_slices(1536, 8960, 132) == 5
    for N, K in [(1152, 896), (896, 896), (151936, 896), (3584, 18944), (4608, 3584)]:
        assert split_slices(N, K, 132) == 1, (N, K)
    assert split_slices(64, 256, 132) == 4  # never more slices than 64-wide blocks of K


def test_without_split_k_asks_cublas_for_no_workspace_unless_the_environment_sizes_one(monkeypatch):
    """The loader calls it before a CUDA model's first matmul (decoding.static.NO_SPLIT_K says why);
    a workspace the operator configured is theirs to keep."""
    from decoding.static import NO_SPLIT_K, without_split_k

    for k in NO_SPLIT_K:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert without_split_k() == {"CUBLASLT_WORKSPACE_SIZE": "0"}
    assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "0"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert without_split_k() == {}
