"""Device probe: the 7B-shaped target's GEMMs one by one, at the row counts a batched step feeds them.

    python -m bench.probe_gemm            # cuBLAS as this process finds it configured
    python -m bench.probe_gemm --both     # the engine's no-split-K setting, then torch's default,
                                          # each in a child process (the setting is per process)

For each weight shape (q/k/v, o, gate/up, down, lm_head) and M rows: microseconds per product and the
weight bandwidth it reaches (weight bytes / time; at these M the weights are nearly all the traffic),
over as many weight copies as the model has layers so that L2 (60 MB) holds none of them, in one
CUDA graph. And whether cuBLAS is M-invariant for that shape: row 0 of ``x[:M] @ W.T`` bitwise equal
for every M up to 576, which is what would let exact mode stop padding (docs/architecture.md, Exact
mode). An answer for this device, library and shape only; nothing in the engine relies on it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from bench.gpu import TARGET
from bench.probe_invariant import graph_time
from decoding.static import NO_SPLIT_K, without_split_k

MS = (1, 2, 4, 8, 16, 32, 64, 80, 144, 576)


def shapes() -> dict[str, tuple[int, int, int]]:
    """name: (N, K, copies)."""
    D, inter, L = TARGET["hidden_size"], TARGET["intermediate_size"], TARGET["num_hidden_layers"]
    hd = D // TARGET["num_attention_heads"]
    qkv = (TARGET["num_attention_heads"] + 2 * TARGET["num_key_value_heads"]) * hd
    return {
        "qkv": (qkv, D, L),
        "o": (D, D, L),
        "gate_up": (2 * inter, D, L),
        "down": (D, inter, L),
        "lm_head": (TARGET["vocab_size"], D, 4),
    }


def time_shape(N: int, K: int, copies: int, M: int) -> float:
    """Microseconds per product, the median of graph replays over ``copies`` weights."""
    ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]

    def run() -> None:
        for w, o in zip(ws, outs, strict=True):
            torch.mm(x, w.t(), out=o)

    return graph_time(run, 1) / copies


def m_invariant(N: int, K: int) -> bool:
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(MS[-1], K, device="cuda", dtype=torch.bfloat16)
    ref = (x[:1] @ w.t())[0]
    return all(torch.equal((x[:M] @ w.t())[0], ref) for M in range(2, MS[-1] + 1))


def main() -> None:
    if "--both" in sys.argv:
        for label, env in (
            ("no split-K (the engine's setting)", {**os.environ, **NO_SPLIT_K}),
            (
                "torch's default cuBLAS workspace",
                {k: v for k, v in os.environ.items() if k not in NO_SPLIT_K},
            ),
        ):
            print(f"== {label}", flush=True)
            subprocess.run([sys.executable, "-m", "bench.probe_gemm"], env=env, check=True)
        return
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        without_split_k()  # keeps what the parent set
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, env {os.environ.get('CUBLAS_WORKSPACE_CONFIG')}"
    )
    print("shape    N x K           " + " ".join(f"{f'M={m}':>13}" for m in MS) + "  M-invariant")
    for name, (N, K, copies) in shapes().items():
        cells = []
        for M in MS:
            us = time_shape(N, K, copies, M)
            torch.cuda.empty_cache()
            cells.append(f"{us:6.1f}us {N * K * 2 / us / 1e6:4.2f}")
        print(f"{name:8s} {N:6d} x {K:5d}  " + " ".join(cells) + f"  {m_invariant(N, K)}", flush=True)
    print("(each cell: microseconds per product, then TB/s of weight bytes)")


if __name__ == "__main__":
    main()
