"""The batch-invariant matmul and RMSNorm (decoding/invariant.py) on a GPU: a row computes the same bits
whatever the batch's size and whatever its neighbours are, close to torch's ops, and the same inside
torch.compile'd code and a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from decoding import invariant
from decoding.layers import rms_norm

DEVICE = torch.device("cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not invariant.available(DEVICE), reason="needs CUDA and Triton"),
]

MS = (1, 9, 17, 64, 100, 576)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (N, K): a 7B-like qkv projection cut down, a K that BLOCK_K does not divide, an N that BLOCK_N does not
SHAPES = [(1152, 896), (512, 200), (1000, 512)]


def _randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def _close(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_a_row_the_same_bits_at_every_batch_size(dtype, N, K, bias):
    gen = torch.Generator().manual_seed(N + K)
    x = _randn(max(MS) + 7, K, dtype=dtype, gen=gen)
    w = _randn(N, K, dtype=dtype, gen=gen) / K**0.5
    b = _randn(N, dtype=dtype, gen=gen) if bias else None
    full = invariant.linear(x, w, b)  # [583, N]
    for M in MS:
        assert torch.equal(invariant.linear(x[:M], w, b), full[:M]), f"rows 0..{M} alone"
        # the same rows at other places in their tiles
        assert torch.equal(invariant.linear(x[7 : 7 + M], w, b), full[7 : 7 + M]), f"rows 7..{7 + M}"
    others = x.clone()
    others[1:] = _randn(x.shape[0] - 1, K, dtype=dtype, gen=gen)
    assert torch.equal(invariant.linear(others, w, b)[0], full[0]), "row 0 among other neighbours"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
def test_linear_matches_torch(dtype, N, K):
    gen = torch.Generator().manual_seed(1)
    x = _randn(2, 9, K, dtype=dtype, gen=gen)  # leading dims are rows
    w = _randn(N, K, dtype=dtype, gen=gen) / K**0.5
    b = _randn(N, dtype=dtype, gen=gen)
    got = invariant.linear(x, w, b)
    assert got.shape == (2, 9, N) and got.dtype == dtype
    ref = F.linear(x.double(), w.double(), b.double())
    assert _close(got, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 896, 3584])
def test_rms_norm_gives_a_row_the_same_bits_and_matches_layers(dtype, D):
    gen = torch.Generator().manual_seed(D)
    x = _randn(max(MS), D, dtype=dtype, gen=gen)
    w = 1 + 0.1 * _randn(D, dtype=dtype, gen=gen)
    full = invariant.rms_norm(x, w, 1e-6)
    for M in MS:
        assert torch.equal(invariant.rms_norm(x[:M], w, 1e-6), full[:M])
    ref = rms_norm(x, w, 1e-6)
    assert full.dtype == ref.dtype
    assert _close(full, ref) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_heads_of_a_strided_view(dtype):
    """Qwen3's q/k norms: per head, over a [N, H, hd] view into the fused q/k/v output."""
    gen = torch.Generator().manual_seed(3)
    qkv = _randn(27, 12 * 64, dtype=dtype, gen=gen)
    q = qkv[:, : 8 * 64].view(27, 8, 64)  # strides (768, 64, 1)
    w = 1 + 0.1 * _randn(64, dtype=dtype, gen=gen)
    got = invariant.rms_norm(q, w, 1e-6)
    assert _close(got, rms_norm(q, w, 1e-6)) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(invariant.rms_norm(q[9:18], w, 1e-6), got[9:18])


def test_the_ops_compute_the_same_bits_compiled_and_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(4)
    x = _randn(36, 512, dtype=torch.bfloat16, gen=gen)
    w = _randn(1024, 512, dtype=torch.bfloat16, gen=gen) / 512**0.5
    g = 1 + 0.1 * _randn(512, dtype=torch.bfloat16, gen=gen)

    def f(x: torch.Tensor) -> torch.Tensor:
        return invariant.linear(invariant.rms_norm(x, g, 1e-6), w)

    _same_bits_compiled_and_in_a_graph(f, x, rows=9)


def _same_bits_compiled_and_in_a_graph(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int):
    """``f`` compiled, and compiled under a CUDA graph, gives eager ``f``'s bits, and its first
    ``rows`` rows are those of ``f`` on them alone."""
    eager = f(x)
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), eager)
    static_x = x.clone()
    for _ in range(2):  # warm-up outside the graph (compilation)
        compiled(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(static_x)
    graph.replay()
    assert torch.equal(out, eager)
    assert torch.equal(out[:rows], f(x[:rows]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K", [(896, 4864), (128, 600), (100, 1000)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_linear_gives_a_row_the_same_bits_at_every_batch_size(dtype, N, K, bias):
    """Fast mode's split of a long-K weight (the 0.5B's down projection; a K that BLOCK_K does not
    divide; an N that 64 does not): a row's sum over the slices does not depend on the other rows."""
    assert invariant.split_slices(N, K, invariant._sms(0)) > 1
    linear = invariant.split_k_ops(DEVICE).linear
    gen = torch.Generator().manual_seed(N + K)
    x = _randn(max(MS) + 7, K, dtype=dtype, gen=gen)
    w = _randn(N, K, dtype=dtype, gen=gen) / K**0.5
    b = _randn(N, dtype=dtype, gen=gen) if bias else None
    full = linear(x, w, b)
    for M in MS:
        assert torch.equal(linear(x[:M], w, b), full[:M]), f"rows 0..{M} alone"
        assert torch.equal(linear(x[7 : 7 + M], w, b), full[7 : 7 + M]), f"rows 7..{7 + M}"
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert _close(full, ref) < 1e-2


def test_split_k_ops_compute_the_same_bits_compiled_and_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(5)
    ops = invariant.split_k_ops(DEVICE)
    x = _randn(9, 256, dtype=torch.bfloat16, gen=gen)
    w_up = _randn(1024, 256, dtype=torch.bfloat16, gen=gen) / 16  # wide: cuBLAS
    w_down = _randn(256, 1024, dtype=torch.bfloat16, gen=gen) / 32  # long K: split

    def f(x: torch.Tensor) -> torch.Tensor:
        return ops.linear(F.silu(ops.linear(x, w_up)), w_down)

    _same_bits_compiled_and_in_a_graph(f, x, rows=1)
