"""Device probe: the M-invariant split-K Triton matmul (decoding.invariant, ``LinearConfig.split``)
against cuBLAS without split-K, on the q/k/v, o and down projections of the 0.5B draft, the 7B target
and the 1.5B (the real pair's target), for several tiles.

    python -m bench.probe_skinny_split

For each shape and tile, device microseconds per product at each M (a graph of 20 products), and
whether every row's bits are the same at every M (the property fast mode's identity rests on). Run on
the H200 on 2026-12-04 (docs/benchmarks.md): it chose the tile of ``decoding.invariant.split_k_ops``
and the shapes ``split_slices`` splits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.gpu import DRAFT, TARGET
from bench.probe_invariant import graph_time
from decoding import invariant
from decoding.invariant import LinearConfig
from decoding.static import without_split_k

MS = (1, 4, 5, 9, 16, 36, 64, 144, 576)


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    D, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = D // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    return {"qkv": (qkv, D), "o": (D, D), "down": (D, inter)}


def configs(K: int) -> list[LinearConfig]:
    out = []
    for bm in (16, 64):
        for bn in (32, 64):
            for bk in (64,):
                for split in (4, 8, 16):
                    if K // bk >= split:
                        out.append(LinearConfig(bm, bn, bk, 4, 4, split))
    return out


def times(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[float]:
    """Device microseconds per product of the first M rows of ``x``, at each M."""
    return [graph_time(lambda m=m: product(x[:m]), 20) for m in MS]


def main() -> None:
    without_split_k()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print("sms", torch.cuda.get_device_properties(0).multi_processor_count, flush=True)
    q15 = dict(DRAFT, hidden_size=1536, intermediate_size=8960, num_attention_heads=12)
    for label, cfg in (("draft", DRAFT), ("target", TARGET), ("q1.5b", q15)):
        for name, (N, K) in shapes(cfg).items():
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            x = torch.randn(max(MS), K, device="cuda", dtype=torch.bfloat16)
            cub = times(lambda a, w=w: F.linear(a, w), x)
            print(f"{label} {name} N={N} K={K} cuBLAS " + " ".join(f"{t:6.1f}" for t in cub), flush=True)
            rows = []
            for c in configs(K):
                ts = times(lambda a, w=w, c=c: invariant._launch(a, w, None, c), x)
                full = invariant._launch(x, w, None, c)
                same = all(torch.equal(invariant._launch(x[:m], w, None, c), full[:m]) for m in MS)
                err = (full.float() - x.float() @ w.float().T).abs().max().item()
                rows.append((ts[1], c, ts, same, err))
            for _, c, ts, same, err in sorted(rows, key=lambda r: r[0])[:6]:
                tag = f"bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.split}"
                cells = " ".join(f"{t:6.1f}" for t in ts)
                print(f"  {tag:22s} {cells}  invariant={same} err={err:.3g}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
