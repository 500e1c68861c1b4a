"""Device probe: what a server's CUDA graphs hold in device memory, against what the default
``limits.max_active`` sizing leaves for them (decoding/sizing.py: GPU_RESERVE of the device plus
GPU_RESERVE_BYTES).

    python -m bench.probe_graph_memory [ROWS] [fast]

Loads the 7B-shaped target and the 0.5B-shaped draft (random weights, bf16, compiled layer) as the
loader does for ``max_batch`` ROWS (default 64): exact mode unless ``fast``, ``capture_serving``, then
``time_steps``; and prints the start-up step table (ms by batch and width) and, model by model, the graphs captured, the capture's seconds and the
device memory allocated and reserved before and after. Prints lines only.
"""

from __future__ import annotations

import sys
import time

import torch

from bench.gpu import DRAFT, TARGET, build
from decoding.sizing import GPU_RESERVE, GPU_RESERVE_BYTES
from decoding.static import StaticModel

MAX_LEN = 4352  # bench.gpu_batch's: a 4,000-token prompt and its output


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def device_used() -> int:
    """Bytes in use on the device (every process, the caching allocator's reserve and graph pools
    included, as the sizing's free memory sees them), after the allocator gives back its cache."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def main() -> None:
    rows = next((int(a) for a in sys.argv[1:] if a.isdigit()), 64)
    exact = "fast" not in sys.argv[1:]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    free, total = torch.cuda.mem_get_info()
    print(
        f"{torch.cuda.get_device_name()}: {gib(total)}, {gib(free)} free; torch {torch.__version__}; "
        f"sizing reserve {gib(GPU_RESERVE * total + GPU_RESERVE_BYTES)}; rows {rows}, "
        f"{'exact' if exact else 'fast'} mode",
        flush=True,
    )
    models = []  # held, so that one model's graphs are not freed while the next is measured
    held = 0
    for name, shape, seed in (("target", TARGET, 0), ("draft", DRAFT, 1)):
        m = StaticModel(
            build(shape, seed), MAX_LEN, slots=rows + 2, graphs=True, compile_step=True, exact=exact
        )
        models.append(m)
        used0 = device_used()
        t0 = time.perf_counter()
        m.warm()
        n = m.capture_serving(rows)
        table = m.time_steps()
        used1 = device_used()
        held += used1 - used0
        widths = f", exact widths {m.widths.proven}" if exact else ""
        print(
            f"{name}: {n} graphs in {time.perf_counter() - t0:.1f} s (compile included); device memory "
            f"in use {gib(used0)} with weights and KV -> {gib(used1)} (+{gib(used1 - used0)}){widths}",
            flush=True,
        )
        for B in sorted({B for B, _ in table if B}):  # the start-up table: ms by (batch, width)
            print(
                f"  {name} B={B} ms by width:",
                " ".join(f"{1e3 * t:.3f}" for (b, _), t in sorted(table.items()) if b == B),
            )
    print(f"graphs, activations and pools of both models: {gib(held)} beyond weights and KV")


if __name__ == "__main__":
    main()
