"""Device probe: what capturing a server's graphs at load costs (``ModelSpec.max_batch``,
``StaticModel.capture_serving``) for the 7B-shaped target and 0.5B-shaped draft, compiled, in fast
and exact mode: seconds, graphs, and device memory the graph pool holds after.

    python -m bench.probe_capture [max_batch ...]   (default 64)
"""

from __future__ import annotations

import sys
import time

import torch

from bench.gpu import DRAFT, TARGET, build
from decoding.static import StaticModel

MAX_LEN = 8192


def main() -> None:
    rows = [int(a) for a in sys.argv[1:]] or [64]
    for shape, name in ((TARGET, "7B-shaped"), (DRAFT, "0.5B-shaped")):
        model = build(shape, 0)
        for exact in (False, True):
            for n in rows:
                torch.cuda.synchronize()
                m = StaticModel(model, MAX_LEN, slots=n + 1, graphs=True, compile_step=True, exact=exact)
                m.warm()
                torch.cuda.synchronize()
                held = torch.cuda.memory_reserved()
                t = time.perf_counter()
                count = m.capture_serving(n)
                torch.cuda.synchronize()
                print(
                    f"{name} exact={exact} max_batch={n}: {count} graphs in {time.perf_counter() - t:.1f} s, "
                    f"{(torch.cuda.memory_reserved() - held) / 2**30:.2f} GiB more reserved",
                    flush=True,
                )
                del m
                torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
