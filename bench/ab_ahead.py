"""Device A/B: ``bench.gpu_batch`` with speculative steps queued ahead (the engine's default on CUDA,
``decoding.ahead.Ahead.speculate``) or without (``off``: each speculative step launched by the call that
commits it, as before 2026-12-02).

    python -m bench.ab_ahead on|off [bench.gpu_batch's arguments, e.g. --quick --ns 1,2,4 --out F]
"""

from __future__ import annotations

import sys

from bench import gpu_batch
from decoding.ahead import Ahead


def main() -> None:
    variant, rest = sys.argv[1], sys.argv[2:]
    if variant not in ("on", "off"):
        raise SystemExit(__doc__)
    if variant == "off":
        Ahead.speculate = lambda self, rows, read_at: None  # type: ignore[method-assign]
    gpu_batch.main(rest)


if __name__ == "__main__":
    main()
