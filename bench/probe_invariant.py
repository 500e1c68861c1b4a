# ruff: noqa: B023  (closures are timed at once, inside their loop iteration)
"""Device probe for exact mode's batch-invariant kernels (decoding/invariant.py) on the 7B shapes.

    python -m bench.probe_invariant [--reps 20]

  1. device time per call of the Triton matmul against F.linear (cuBLAS), bf16, on each projection of
     a Qwen2.5-7B layer and the lm_head at M = 9, 36, 144, 576 (decode steps of 1, 4, 16 and 64 rows at
     exact mode's width of 9), with the bandwidth each reaches; RMSNorm likewise at D = 3584;
  2. bit identity: each row of the Triton matmul at M = 9, 36, 144 (and among other neighbours) against
     the same row at M = 576; cuBLAS's own answer to the same question, for contrast.
Times are CUDA-graph replays of ``reps`` calls (device time, no launch cost), as the engine runs them.
Prints tables only; nothing is written to docs/. Exits non-zero if a Triton row differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from decoding import invariant
from decoding.layers import rms_norm

# Qwen2.5-7B: hidden 3584, 28 query / 4 kv heads of 128, intermediate 18944, vocab 152064
SHAPES = {
    "qkv": (4608, 3584),
    "o": (3584, 3584),
    "gate_up": (37888, 3584),
    "down": (3584, 18944),
    "lm_head": (152064, 3584),
}
MS = (9, 36, 144, 576)
PEAK_GBS = 4800.0  # H200 HBM3e, nominal


def graph_time(f: Callable[[], object], reps: int) -> float:
    """Median device microseconds per call of ``f``, replayed as one CUDA graph of ``reps`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph (Triton's compile, cuBLAS's handles)
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            f()
    graph.replay()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(1e3 * a.elapsed_time(b) / reps)
    del graph
    return sorted(times)[len(times) // 2]


def timing_table(reps: int) -> None:
    print("== matmul y = x @ w.T, bf16: device us per call (GB/s: weights + x + y over the Triton time)")
    print(
        f"{'shape':<8} {'N':>7} {'K':>6} {'M':>4} {'cuBLAS':>8} {'triton':>8} {'ratio':>6} {'GB/s':>6} {'of peak':>7}  tile"
    )
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        x = torch.randn(max(MS), K, device="cuda", dtype=torch.bfloat16)
        c = invariant.linear_config(N, K, torch.bfloat16)
        for M in MS:
            xm = x[:M]
            t_cublas = graph_time(lambda: F.linear(xm, w), reps)
            t_triton = graph_time(lambda: invariant.linear(xm, w), reps)
            gbs = 2 * (N * K + M * K + M * N) / (t_triton * 1e3)
            print(
                f"{name:<8} {N:>7} {K:>6} {M:>4} {t_cublas:>8.1f} {t_triton:>8.1f} "
                f"{t_triton / t_cublas:>6.2f} {gbs:>6.0f} {gbs / PEAK_GBS:>7.0%}  "
                f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}",
                flush=True,
            )
    print("== RMSNorm over D = 3584, bf16: device us per call")
    print(f"{'M':>4} {'torch':>8} {'compiled':>8} {'triton':>8}")
    g = 1 + 0.1 * torch.randn(3584, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(rms_norm, fullgraph=True, dynamic=False)
    for M in MS:
        x = torch.randn(M, 3584, device="cuda", dtype=torch.bfloat16)
        t_torch = graph_time(lambda: rms_norm(x, g, 1e-6), reps)
        t_comp = graph_time(lambda: compiled(x, g, 1e-6), reps)
        t_triton = graph_time(lambda: invariant.rms_norm(x, g, 1e-6), reps)
        print(f"{M:>4} {t_torch:>8.1f} {t_comp:>8.1f} {t_triton:>8.1f}", flush=True)


def _rows_agree(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> tuple[bool, float]:
    """Whether every row of ``f`` at M = 9, 36, 144 and among other neighbours has the bits it has at
    M = 576; and the largest difference where not."""
    full = f(x)
    others = torch.randn_like(x)
    others[:9] = x[:9]
    worst, same = 0.0, True
    for got, want in [(f(x[:M]), full[:M]) for M in MS[:-1]] + [(f(others)[:9], full[:9])]:
        if not torch.equal(got, want):
            same = False
            worst = max(worst, (got.float() - want.float()).abs().max().item())
    return same, worst


def identity_table() -> bool:
    print("== bit identity of a row across M = 9, 36, 144, 576 and other neighbours (bf16)")
    print(f"{'shape':<8} {'triton':>8} {'cuBLAS':>8} {'cuBLAS max diff':>16}")
    ok = True
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
        x = torch.randn(max(MS), K, device="cuda", dtype=torch.bfloat16)
        t_same, _ = _rows_agree(lambda a: invariant.linear(a, w), x)
        c_same, c_diff = _rows_agree(lambda a: F.linear(a, w), x)
        ok &= t_same
        print(
            f"{name:<8} {'same' if t_same else 'DIFFER':>8} {'same' if c_same else 'differ':>8} {c_diff:>16.3g}"
        )
    x = torch.randn(max(MS), 3584, device="cuda", dtype=torch.bfloat16)
    g = 1 + 0.1 * torch.randn(3584, device="cuda", dtype=torch.bfloat16)
    n_same, _ = _rows_agree(lambda a: invariant.rms_norm(a, g, 1e-6), x)
    ok &= n_same
    print(f"{'rms_norm':<8} {'same' if n_same else 'DIFFER':>8}")
    return ok


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20, help="calls per timed CUDA graph")
    args = ap.parse_args(argv)
    assert invariant.available(torch.device("cuda")), "needs CUDA and Triton"
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    with torch.inference_mode():
        ok = identity_table()
        timing_table(args.reps)
    if not ok:
        print("FAIL: a Triton row's bits depend on M", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
