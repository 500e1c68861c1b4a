"""Device probe: what a draft's catch-up pass costs by rows and tokens (a prompt-chunk graph of the
0.5B-shaped draft, no logits), with the chunk graphs' row table and largest bucket as they are
(decoding.graphs.CHUNK_ROWS, CHUNK_BUCKETS) and raised to 32 rows and 2048 tokens.

    python -m bench.probe_catch_up

A draft catches up in passes of up to CHUNK_ROWS rows and the largest chunk bucket of tokens
(drafters.catch_up_many): the 16 prompts of a batch's first speculative step, or the backlog of
plain steps at a probe. Whether fewer, larger passes would be cheaper depends on how much of a
pass is its fixed cost (its kernels' launches) and how the chunk kernel's grid, one program column
per table row, grows with the table.

On the H200 (2026-12-02, 20:58 UTC): a pass of 512 tokens cost 2.2-2.5 ms whatever its rows (1, 4 or
8), one of 1024 tokens 3.5-3.7 ms (8 or 16 rows, a 32-row table): the fixed part of a pass is about
0.9 ms and each token about 2.8 us more, so passes twice as large save ~20% of a backlog's catch-up,
and the backlog itself (rows x tokens) is most of its cost.
"""

from __future__ import annotations

import torch

import decoding.graphs as graphs
import decoding.static as static
from bench.gpu import DRAFT, build, cuda_time
from decoding.runner import Row

CONFIGS = ((1, 512), (4, 128), (8, 64), (8, 128), (16, 64), (16, 128), (32, 64), (8, 256))


def main() -> None:
    model = build(DRAFT, 1)
    for rows_max, buckets in ((8, (32, 64, 128, 256, 512)), (32, (32, 64, 128, 256, 512, 1024, 2048))):
        graphs.CHUNK_ROWS = rows_max
        graphs.CHUNK_BUCKETS = buckets
        m = static.StaticModel(model, 4096, slots=33, graphs=True, compile_step=True)
        m.warm()
        print(f"table of {rows_max} rows, chunks up to {buckets[-1]} tokens:", flush=True)
        for R, T in CONFIGS:
            if rows_max < R or buckets[-1] < R * T:
                continue
            ids = torch.randint(0, 1000, (T,), device="cuda")
            rows = [Row(s, ids, 128, "none") for s in range(R)]
            t = cuda_time(lambda m=m, rows=rows: m.forward_rows(rows), 30)  # type: ignore[misc]
            print(
                f"   {R:3d} rows x {T:4d} tokens ({R * T:5d}): {t * 1e3:6.2f} ms, {t * 1e6 / (R * T):5.2f} us/token"
            )
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
