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
import torch.nn.functional as F

from decoding import layers
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
    split: int = 1  # slices of K summed in a second kernel, in slice order (``split_k_ops``)


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
        Y,  # [M, N]; with SPLIT, float32 partial sums [S, M, N] (contiguous)
        M,
        N,
        K,
        sx_m,
        sw_n,
        sy_m,
        K_SPLIT,  # K positions a split covers (a multiple of BLOCK_K); K without SPLIT
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs (tl.dot would round them to tf32)
    ):
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        # M tiles of one N tile are neighbours, so they share its weights through L2
        pid_m = pid % grid_m
        pid_n = (pid // grid_m) % grid_n
        pid_s = pid // (grid_m * grid_n)  # 0 without SPLIT
        k_lo = pid_s * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptr = X + rm[:, None] * sx_m + (k_lo + rk)[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptr = Wt + rn[None, :] * sw_n + (k_lo + rk)[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
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
        out = m_ok[:, None] & n_ok[None, :]
        if SPLIT:  # this slice of K's partial sums, added up in slice order by _split_sum_kernel
            tl.store(Y + pid_s * M * N + rm[:, None] * N + rn[None, :], acc, mask=out)
        else:
            if HAS_BIAS:
                acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Y + rm[:, None] * sy_m + rn[None, :], acc.to(Y.dtype.element_ty), mask=out)

    @triton.jit
    def _split_sum_kernel(
        P,  # [S, M * N] float32 partial sums
        Bias,  # [N] (unused without HAS_BIAS)
        Y,  # [M * N] contiguous
        MN,
        N,
        S: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < MN
        acc = tl.load(P + i, mask=ok, other=0.0)
        for s in tl.static_range(1, S):  # in slice order: an element's sum is the same whatever M is
            acc += tl.load(P + s * MN + i, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(Bias + i % N, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + i, acc.to(Y.dtype.element_ty), mask=ok)

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
    return _launch(x, w, bias, linear_config(w.shape[0], x.shape[-1], x.dtype))


def _launch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, c: LinearConfig) -> torch.Tensor:
    """x @ w.T (+ bias) with tile ``c``: one kernel, or with ``c.split`` > 1 a kernel of partial
    sums over that many slices of K and a second that adds them up in slice order."""
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
    k_split = _k_split(K, c)
    S = triton.cdiv(K, k_split)
    split = S > 1
    out = torch.empty(S, M, N, dtype=torch.float32, device=x.device) if split else y
    grid = (triton.cdiv(M, c.block_m) * triton.cdiv(N, c.block_n) * S,)
    _linear_kernel[grid](
        x2,
        w,
        bias if bias is not None else w,
        out,
        M,
        N,
        K,
        x2.stride(0),
        w.stride(0),
        y.stride(0),
        k_split,
        HAS_BIAS=bias is not None,
        EVEN_K=K % c.block_k == 0,
        SPLIT=split,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    if split:
        block = 1024
        _split_sum_kernel[(triton.cdiv(M * N, block),)](
            out,
            bias if bias is not None else w,
            y,
            M * N,
            N,
            S=S,
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return y.view(*x.shape[:-1], N)


def _k_split(K: int, c: LinearConfig) -> int:
    """K positions one of ``c.split`` slices covers: whole blocks of BLOCK_K (the last slice may be
    short, and fewer slices may be needed than asked); K itself without a split."""
    blocks = -(-K // c.block_k)
    return -(-blocks // c.split) * c.block_k if c.split > 1 else K


@_linear_op.register_fake
def _linear_shape(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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


# ---- split K for the long-K projections of small models (fast and plain exact mode) -------------
#
# cuBLAS, run without split-K as the engine asks (decoding.static.without_split_k, which keeps its
# GEMMs M-invariant), covers a weight of N outputs with about N / 64 tiles, whatever K is. A small
# model's down projection is long in K and narrow in N: the 0.5B draft's [896, 4864] runs on 14 of the
# H200's 132 SMs, 12-14 us at 1-5 rows for 8.7 MB of weight, the largest of the draft's per-layer costs.
# Here K is split into a fixed number of slices (a function of N, K and the device's SM count, never
# of M) whose float32 partial sums are added up in slice order, so a row's bits still do not depend
# on the rows beside it: 6.8 us there, and the 1.5B's [1536, 8960] 23 -> 11 us at 1 row. Measured on
# the H200 (bench.probe_skinny_split, docs/benchmarks.md); wider weights (the 7B's [3584, 18944] with
# 56 tiles, every q/k/v and o) stay faster on cuBLAS and keep it.


def split_slices(N: int, K: int, sms: int) -> int:
    """Slices of K for a weight [N, K] (1: no split, cuBLAS): a long-K weight (K >= 4N) whose 64-wide
    output tiles fill at most a quarter of the SMs gets about one program per SM."""
    tiles = -(-N // 64)
    if K < 4 * N or 4 * tiles > sms:
        return 1
    return max(2, min(sms // tiles, K // 64))


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@torch.library.custom_op(
    "specgate::linear_split_k", mutates_args=(), schema="(Tensor x, Tensor w, Tensor? bias) -> Tensor"
)
def _linear_split_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    N, K = w.shape
    S = split_slices(N, K, _sms(x.device.index or 0))
    return _launch(x, w, bias, LinearConfig(64, 64, 64, 4, 4, S))


_linear_split_op.register_fake(_linear_shape)


def split_k_ops(device: torch.device) -> Ops:
    """The layer's ops for fast and plain exact mode on CUDA: torch's, but a long-K weight's matmul
    split as above. The choice is per weight shape, so every role a model serves in (target, draft)
    and every batch meets the same kernels."""
    sms = _sms(device.index if device.index is not None else torch.cuda.current_device())

    def split_k_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        N, K = w.shape
        if x.dtype == torch.float32 or split_slices(N, K, sms) == 1:
            return F.linear(x, w, bias)
        return torch.ops.specgate.linear_split_k(x, w, bias)

    return Ops(split_k_linear, layers.rms_norm)
