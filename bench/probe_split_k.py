"""Device probe: the draft's skinny GEMMs with K split into S slices (a strided batched product, then
a float32 sum over the slices) against one product, under the engine's no-split-K setting.

    python -m bench.probe_split_k

With no split-K, cuBLAS covers a weight of N = 896 outputs with 14 tiles of 64 (the 0.5B draft's o
and down projections), 14 of the H200's 132 SMs. Splitting K by hand gives S times the tiles; the
slices' partial products are rounded to bf16 before their sum, which moves a drafter's proposals
only (its rounding never reaches the output).
"""

from __future__ import annotations

import torch

from bench.gpu import DRAFT, TARGET
from bench.probe_invariant import graph_time
from decoding.static import without_split_k

MS = (1, 4, 8, 16, 36, 72)


def split_linear(x: torch.Tensor, w: torch.Tensor, s: int) -> torch.Tensor:
    M, K = x.shape
    xs = x.view(M, s, K // s).transpose(0, 1)  # [S, M, K/S]
    ws = w.view(w.shape[0], s, K // s).transpose(0, 1)  # [S, N, K/S]
    return torch.bmm(xs, ws.transpose(1, 2)).sum(0, dtype=torch.float32).to(x.dtype)  # [M, N]


def main() -> None:
    without_split_k()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    for label, shape in (("draft", DRAFT), ("target", TARGET)):
        D, inter, L = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
        hd = D // shape["num_attention_heads"]
        qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * hd
        for name, (N, K) in {
            "qkv": (qkv, D),
            "o": (D, D),
            "gate_up": (2 * inter, D),
            "down": (D, inter),
        }.items():
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(L)]
            cells = [row(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), ws) for M in MS]
            print(f"{label} {name:7s} {N:6d}x{K:5d} us: " + " | ".join(cells), flush=True)
            torch.cuda.empty_cache()


def row(x: torch.Tensor, ws: list[torch.Tensor]) -> str:
    """One product per weight, then each split of K that divides it: microseconds per product."""
    out = [f"M={x.shape[0]}: {graph_time(lambda: [torch.mm(x, w.t()) for w in ws], 1) / len(ws):5.1f}"]
    for s in (2, 4, 8):
        if x.shape[1] % (s * 8) == 0:
            t = graph_time(lambda: [split_linear(x, w, s) for w in ws], 1) / len(ws)  # noqa: B023
            out.append(f"S{s} {t:5.1f}")
    return " ".join(out)


if __name__ == "__main__":
    main()
