# ruff: noqa: B023  (closures are timed at once, inside their loop iteration)
"""Device probe: what a step that mixes decode rows with a prefill chunk costs, and where it goes.

    python -m bench.probe_prefill [kernels]

``kernels``: instead of the table, each graphed step's device time by kernel (name, count, us), for
16 decode rows alone and beside a 32- and a 128-token chunk: what a chunk adds to a step.

On the 7B shape of ``bench.gpu`` (random weights, bf16, compiled layer halves): 16 decode rows at
~200 tokens of context, alone (a CUDA graph replay) and beside one prompt chunk of C tokens at
~3,000 tokens of context, as a captured graph and eagerly, device and host time per step.
Prints a table only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from bench.gpu import TARGET, build
from bench.probe_batch import event_time
from bench.probe_invariant import graph_time
from bench.profile_step import kernel_table, profile_kernels
from decoding import kernels
from decoding.runner import Row
from decoding.static import StaticModel

MAX_LEN = 4352
ROWS = 16


def chunk_kernel_time() -> None:
    """The chunk attention's device time per layer (partials and merge) for chunks of 32, 128 and 512
    tokens at 3,000 tokens of context (7B heads: 28 query, 4 kv, 128 wide), at each launch shape of
    the partial kernel (query tile, warps, pipeline stages; the first is the default), each call
    replayed in a CUDA graph as a step runs it."""
    KV, H, HD, ctx = 4, 28, 128, 3000
    k = torch.randn(2, MAX_LEN, KV, HD, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    default = (kernels.CHUNK_TILE, kernels.CHUNK_WARPS, kernels.CHUNK_STAGES)
    shapes = [default] + [
        s for s in ((64, 4, 2), (64, 4, 3), (128, 8, 2), (128, 8, 3), (32, 4, 2)) if s != default
    ]
    for T in (32, 128, 512):
        q = torch.randn(T, H, HD, device="cuda", dtype=torch.bfloat16)
        rows = torch.zeros(8, 4, dtype=torch.long, device="cuda")
        rows[0] = torch.tensor([1, ctx, 0, T])
        for tile, warps, stages in shapes:
            us = graph_time(lambda: kernels.chunk_attention(q, k, v, rows, HD**-0.5, tile, warps, stages), 20)
            print(
                f"chunk attention, {T} tokens at {ctx} of context, tile {tile} warps {warps} stages {stages}:"
                f" {us:.1f} us per layer",
                flush=True,
            )


def by_kernel(what: str, f: Callable[[], object], top: int = 14) -> None:
    """``f``'s kernels by name under the profiler (its CUDA graph replayed: each kernel shows)."""
    kernel_table(what, profile_kernels(f), top)


def main() -> None:
    chunk_kernel_time()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    target = build(TARGET, 0)
    tm = StaticModel(target, MAX_LEN, slots=ROWS + 2, graphs=True, compile_step=True)
    tm.warm()
    ids = torch.randint(0, 150000, (MAX_LEN,), device="cuda")
    for s in range(ROWS + 1):  # every slot holds a context to attend over
        for at in range(0, 3584, 512):
            tm.forward_rows([Row(s, ids[at : at + 512], at, "none")])
    slots, starts = list(range(ROWS)), [200 + s for s in range(ROWS)]
    one = ids[:ROWS, None]  # [16, 1]

    def decode() -> None:
        tm.forward_batch(slots, starts, one)

    def mixed(chunk: int, rows: int = ROWS) -> None:
        decode_rows = [Row(s, ids[s : s + 1], st) for s, st in zip(slots[:rows], starts[:rows], strict=True)]
        tm.forward_rows([*decode_rows, Row(ROWS, ids[:chunk], 3000, "none")])

    if "kernels" in sys.argv[1:]:
        by_kernel("decode, 16 rows", decode)
        for chunk in (32, 128):
            by_kernel(f"16 rows + chunk {chunk}", lambda: mixed(chunk))
        return
    print("step                                   device ms   host ms", flush=True)
    dev, host = event_time(decode)
    print(f"decode, 16 rows (graph)                {dev:9.2f} {host:9.2f}", flush=True)
    for chunk in (32, 64, 128, 256, 512):
        for rows, what in ((ROWS, "16 rows + chunk"), (0, "chunk alone    ")):
            for graphs in (True, False):
                tm.graphs_enabled = graphs
                dev, host = event_time(lambda: mixed(chunk, rows))
                tm.graphs_enabled = True
                label = "graph" if graphs else "eager"
                print(f"{what} {chunk:4d} ({label})        {dev:9.2f} {host:9.2f}", flush=True)


if __name__ == "__main__":
    main()
