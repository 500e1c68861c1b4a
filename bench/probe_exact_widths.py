"""Device probe: which widths exact mode may run unpadded on the 7B shape (``decoding.exact.ExactWidths.prove``), and
how long its probe must be to see a width that rounds apart.

    python -m bench.probe_exact_widths

For batch buckets 1, 2, 4, 16 and 64 of the compiled, graphed 7B-shaped target (random weights,
bf16, exact mode): the widths shown with probes of 1, 4 and 36 tokens, with N = 1's own compile
counted as any other width (``own_compile`` off), then as the engine runs it. Prints a table only.
"""

from __future__ import annotations

import time

import torch

from bench.gpu import TARGET, build
from decoding import exact
from decoding.static import StaticModel


def main() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    m = StaticModel(build(TARGET, 0), 512, slots=4, graphs=True, compile_step=True, exact=True)
    m.warm()
    widths = m.widths
    own = widths.own_compile
    for tokens in (1, 4, exact.PROOF_TOKENS):
        exact.PROOF_TOKENS = tokens
        for engine in (False, True):
            widths.own_compile = own if engine else (lambda rows, width: False)  # type: ignore[method-assign]
            widths.proven.clear()
            for B in (1, 2, 4, 16, 64):
                t = time.perf_counter()
                shown = widths.prove(B)
                print(
                    f"probe {tokens:2d} tokens, own compile {'skipped' if engine else 'probed '}: bucket {B:2d} "
                    f"shows {shown} ({time.perf_counter() - t:.1f}s)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
