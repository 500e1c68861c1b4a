"""Batch-invariant matmul and RMSNorm: Triton kernels whose row i computes the same bits whatever else
is in the batch, for exact mode on CUDA (docs/architecture.md, Exact mode).

Why kernels of our own: cuBLAS picks its GEMM kernel (tile shape, split-K) by M = rows x width, and an
inductor reduction picks its strategy by the row count, so a row rounds differently when the batch
around it changes size. Here nothing depends on M:
  - ``linear``: one [BLOCK_M, BLOCK_N] output tile per program, its K loop in fixed BLOCK_K steps
    from k = 0 into one float32 accumulator, no split-K; the tile shape is a function of (N, K, dtype)
    only (``linear_config``), never of M, so a row meets the same instructions in the same order in a
    batch of 1 as in a batch of 64. Rows past M are masked loads, which add exact zeros.
  - ``rms_norm``: one program per row, its block one size per D.
As in vLLM's and SGLang's deterministic modes (after Thinking Machines' batch_invariant_ops), with
tiles sized for decode (M of 9..576, memory-bound) rather than for large-M throughput.

    linear(x [..., K], w [N, K], bias [N] | None) -> [..., N]     x @ w.T (+ bias), float32 accumulation
    rms_norm(x [..., D], w [D], eps) -> [..., D]                   as decoding.layers.rms_norm

Both are torch.library custom ops (``specgate::linear``, ``specgate::rms_norm``) with fake
implementations, so torch.compile'd code and CUDA graphs call them as they are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from decoding.layers import Ops

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton: exact mode keeps torch's ops there
    triton = None

# Output tiles across N at which a wide tile still puts two programs on each of an H200's 132 SMs
_WIDE_N_PROGRAMS = 264


def available(device: torch.device) -> bool:
    """The kernels run on CUDA with Triton."""
    return triton is not None and device.type == "cuda"


class LinearConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@functools.cache
def linear_config(N: int, K: int, dtype: torch.dtype) -> LinearConfig:
    """The one tile of a weight shape: a function of (N, K, dtype), never of M (that is the point).

    Decode is memory-bound, and without split-K the grid is N / BLOCK_N tiles times M / BLOCK_M, so
    small-N weights (q/k/v, o, down: N of 3584..4608) take BLOCK_N = 32 to fill the SMs at M = 9
    (112..144 programs); the cost is that every N tile reads all of x again (from L2), M / BLOCK_N
    times the weights' own bytes, which grows with the batch. Where N is wide enough (gate/up,
    lm_head), 128. BLOCK_M = 64, the height of Hopper's tensor-core instruction: idle rows at M = 9
    cost compute the step has spare, and the weights' re-reads (one per M tile) stay few at
    M = 576. A starting point, not tuned: ``bench.probe_invariant`` times each shape against cuBLAS.
    """
    bn = 128 if -(-N // 128) >= _WIDE_N_PROGRAMS else max(16, min(32, triton.next_power_of_2(N)))
    if dtype == torch.float32:  # IEEE float32 dots run on FMA units: smaller tiles, fewer registers
        bk = min(32, max(16, triton.next_power_of_2(K)))
        return LinearConfig(32, min(bn, 64), bk, 4, 2)
    bk = min(128, max(16, triton.next_power_of_2(K)))
    return LinearConfig(64, bn, bk, 4, 3 if bn >= 128 else 4)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 variant)
    def _linear_kernel(
        X,  # [M, K]
        Wt,  # [N, K]
        Bias,  # [N] (unused without HAS_BIAS)
        Y,  # [M, N]
        M,
        N,
        K,
        sx_m,
        sw_n,
        sy_m,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs (tl.dot would round them to tf32)
    ):
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        # M tiles of one N tile are neighbours, so they share its weights through L2
        pid_m = pid % grid_m
        pid_n = pid // grid_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptr = X + rm[:, None] * sx_m + rk[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptr = Wt + rn[None, :] * sw_n + rk[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptr, mask=m_ok[:, None], other=0.0)
                w = tl.load(w_ptr, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = k0 + rk < K
                x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            x_ptr += BLOCK_K
            w_ptr += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            Y + rm[:, None] * sy_m + rn[None, :],
            acc.to(Y.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )

    @triton.jit
    def _rms_norm_kernel(
        X,  # [A, R, D] with its last dim contiguous (R = 1 for a [rows, D] input)
        Wt,  # [D]
        Y,  # [A * R, D] contiguous
        D,
        R,
        sx_a,
        sx_r,
        eps,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        x = tl.load(X + (row // R) * sx_a + (row % R) * sx_r + d, mask=ok, other=0.0)
        h = x.to(tl.float32)
        h = h * tl.math.rsqrt(tl.sum(h * h, 0) / D + eps)
        # as layers.rms_norm: normalised in float32, rounded to x's dtype, then times the weight
        w = tl.load(Wt + d, mask=ok, other=0.0).to(tl.float32)
        y = w * h.to(X.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * D + d, y.to(Y.dtype.element_ty), mask=ok)


@torch.library.custom_op(
    "specgate::linear", mutates_args=(), schema="(Tensor x, Tensor w, Tensor? bias) -> Tensor"
)
def _linear_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    K = x.shape[-1]
    N = w.shape[0]
    assert w.shape[1] == K and x.dtype == w.dtype, (
        f"x {x.dtype}{list(x.shape)} @ w.T {w.dtype}{list(w.shape)}"
    )
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    c = linear_config(N, K, x.dtype)
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n),)
    _linear_kernel[grid](
        x2,
        w,
        bias if bias is not None else w,
        y,
        M,
        N,
        K,
        x2.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=K % c.block_k == 0,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return y.view(*x.shape[:-1], N)


@_linear_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op(
    "specgate::rms_norm", mutates_args=(), schema="(Tensor x, Tensor w, float eps) -> Tensor"
)
def _rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    assert w.shape == (D,), f"weight {list(w.shape)} for rows of {D}"
    out_dtype = torch.promote_types(x.dtype, w.dtype)
    if x.dim() == 3 and x.stride(-1) == 1:  # e.g. Qwen3's per-head norms over a view of q/k/v
        x3 = x
    else:
        x3 = x.reshape(-1, 1, D)
        if x3.stride(-1) != 1:
            x3 = x3.contiguous()
    A, R = x3.shape[0], x3.shape[1]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if A * R == 0:
        return y
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(A * R,)](
        x3,
        w if w.stride(0) == 1 else w.contiguous(),
        y,
        D,
        R,
        x3.stride(0),
        x3.stride(1),
        eps,
        BLOCK_D=block,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
    )
    return y


@_rms_norm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with a row's bits independent of the other rows."""
    return torch.ops.specgate.linear(x, w, bias)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``decoding.layers.rms_norm`` with a row's bits independent of the other rows."""
    return torch.ops.specgate.rms_norm(x, w, eps)


OPS = Ops(linear, rms_norm)  # the layer's reductions in exact mode on CUDA (decoding.layers.Ops)
