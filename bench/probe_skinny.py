"""Device probe: could a Triton GEMM for a decode step's few rows beat cuBLAS on the 7B shape's weights?

    python -m bench.probe_skinny

At M = 16 cuBLAS reaches 2.6-2.9 TB/s of weight bytes on q/k/v and o and ~3.7 on gate/up and down,
against 4.15 on lm_head (bench.probe_gemm, 2026-12-02): q/k/v's and o's few output tiles leave SMs
idle, and gate/up's ~2.2 waves of tiles leave a tail. This times, for each shape at M = 1 and 16,
cuBLAS (as the engine configures it: no split-K) against a Triton kernel that keeps M in one 16-row
tile and streams the weights once, over tile widths, K slices (a fixed split of K summed in float32 in a fixed
order, so a row's bits do not depend on M) and pipeline depths; and whether the best one is
M-invariant (row 0 of ``x[:M] @ W.T`` bitwise equal for every M up to 16). Nothing in the engine uses
it: it says whether the lever exists.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from bench.probe_gemm import shapes
from bench.probe_invariant import graph_time
from decoding.static import without_split_k


@triton.jit
def _skinny(
    x_ptr, w_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """out[s, :M, n-tile] = x[:M, K-slice s] @ w[n-tile, K-slice s].T, float32; one program per
    (n-tile, slice), its whole M in one tile."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    per = K // SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_s * per, (pid_s + 1) * per, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :])
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(out_ptr + pid_s * M * N + rm[:, None] * N + rn[None, :], acc, mask=rm[:, None] < M)


def skinny(
    x: torch.Tensor,
    w: torch.Tensor,
    out32: torch.Tensor,
    bn: int,
    bk: int,
    split: int,
    stages: int,
    warps: int,
) -> torch.Tensor:
    """x [M <= 16, K] @ w [N, K].T through ``_skinny``; ``out32`` [split, M, N], bf16 where split is 1."""
    M, K = x.shape
    N = w.shape[0]
    _skinny[(N // bn, split)](x, w, out32, M, N, K, 16, bn, bk, split, num_stages=stages, num_warps=warps)
    return out32.sum(0).to(torch.bfloat16) if split > 1 else out32[0]  # split 1 stores bf16


def time_skinny(x: torch.Tensor, ws: list[torch.Tensor], cfg: tuple[int, int, int, int, int]) -> float:
    """Microseconds per product over every weight of ``ws`` in one CUDA graph."""
    M, N = x.shape[0], ws[0].shape[0]
    o = torch.empty(cfg[2], M, N, device="cuda", dtype=torch.float32 if cfg[2] > 1 else torch.bfloat16)
    return graph_time(lambda: [skinny(x, w, o, *cfg) for w in ws], 1) / len(ws)


def time_cublas(x: torch.Tensor, ws: list[torch.Tensor]) -> float:
    outs = [torch.empty(x.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    return graph_time(lambda: [torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs, strict=True)], 1) / len(ws)


def row0(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int, int]) -> torch.Tensor:
    o = torch.empty(
        cfg[2], x.shape[0], w.shape[0], device="cuda", dtype=torch.float32 if cfg[2] > 1 else torch.bfloat16
    )
    return skinny(x, w, o, *cfg)


def probe_shape(name: str, N: int, K: int, copies: int) -> None:
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    for M in (1, 16):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        base = time_cublas(x, ws)
        best: tuple[float, tuple[int, int, int, int, int] | None] = (float("inf"), None)
        for cfg in itertools.product((64, 128), (128, 256), (1, 2, 4), (3, 5), (4,)):
            bn, bk, split = cfg[:3]
            if N % bn or K % (bk * split):
                continue
            try:
                best = min(best, (time_skinny(x, ws, cfg), cfg))
            except Exception as exc:  # a tile that does not fit shared memory
                print(f"   {name} {cfg}: {type(exc).__name__}", flush=True)
        us, found = best
        print(
            f"{name:8s} M={M:3d}: cuBLAS {base:6.1f} us {N * K * 2 / base / 1e6:4.2f} TB/s; Triton best {us:6.1f} us "
            f"{N * K * 2 / us / 1e6:4.2f} TB/s at (bn, bk, split, stages, warps) {found}",
            flush=True,
        )
        if M == 16 and found is not None:
            xx = torch.randn(16, K, device="cuda", dtype=torch.bfloat16)
            ref = row0(xx[:1], ws[0], found)[0]
            inv = all(torch.equal(row0(xx[:m], ws[0], found)[0], ref) for m in range(2, 17))
            err = (row0(xx, ws[0], found).float() - xx.float() @ ws[0].float().t()).abs().max().item()
            print(f"   M-invariant 1..16: {inv}; max |err| against float32 {err:.2e}", flush=True)


def main() -> None:
    without_split_k()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    for name, (N, K, copies) in shapes().items():
        if name != "lm_head":
            probe_shape(name, N, K, copies)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
