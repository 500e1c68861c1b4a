"""CPU probe: could a llama.cpp target verify long drafts cheaply and still round every row as a
one-token step does? Two candidates, on the 1.5B (docs/architecture.md, "The llama.cpp backend"):

  - the pinned Q4_K_M with repacked weights, every step padded to a multiple of 4 rows: the repacked
    Q4_K kernels are a GEMV for the rows past the last whole group of 4 and a GEMM for the groups, so
    if a GEMM row rounds the same whatever shares its step, padded steps are width-invariant;
  - the same weights requantised to Q8_0 (``llama_model_quantize``, into a temporary file), whose
    kernels may take every width the same way.

For each: whether row j of a W-token step equals row j of a (j+1)-token step (a 1-token step padded
to 4 rows too), and the step's cost by width (logits at every row), medians of 5.

    python -m bench.probe_llamacpp_tiles
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from decoding import store
from decoding.llamacpp import HELD, LlamaCppModel, _lib

TARGET = "qwen2.5-coder-1.5b"
STEPS = [(785 + 7 * j) % 150000 for j in range(16)]  # token ids: logits, not text
PAD = 0  # a padding row's token: its logits are never read
WIDTHS = (1, 2, 3, 4, 5, 8, 12, 16)


def _step(llama: LlamaCppModel, slot: int, start: int, tokens: list[int], real: int) -> torch.Tensor:
    """Logits [real, V] of the first ``real`` rows of one decode of ``tokens`` at ``start``."""
    llama.cut(slot, start)
    return llama._decode([(t, start + j, slot, j < real) for j, t in enumerate(tokens)])


def probe(path: Path, name: str) -> None:
    llama = LlamaCppModel(path, 2048, 1)
    name += f", {HELD[llama.held]}"
    r = llama.runner()
    try:
        prompt = list(range(1000, 1110))
        r.forward(prompt, logits=False)
        L = len(prompt)
        rows = {W: _step(llama, r.slot, L, STEPS[:W], W) for W in WIDTHS}
        padded = _step(llama, r.slot, L, STEPS[:1] + [PAD] * 3, 1)
        print(f"{name}, {llama.threads} threads, context {L}:")
        print(f"   1-token step padded to 4 rows == unpadded: {torch.equal(padded[0], rows[1][0])}")
        print("   row j of a W-token step == row j of the (j+1)-token step ('?': not probed):")
        for W in WIDTHS[1:]:
            marks = "".join(
                "?" if j + 1 not in rows else "=" if torch.equal(rows[W][j], rows[j + 1][j]) else "x"
                for j in range(W)
            )
            print(f"     W = {W:2d}: {marks}")
        base = None
        for W in WIDTHS:
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                _step(llama, r.slot, L, STEPS[:W], W)
                ts.append(time.perf_counter() - t)
            med = statistics.median(ts)
            base = base or med
            print(f"   W = {W:2d}: {1e3 * med:6.1f} ms, {med / base:5.2f}x its 1-token step", flush=True)
    finally:
        r.release()
        llama.close()


def main() -> None:
    src = store.gguf_file(TARGET)
    lib = _lib()
    probe(src, "Q4_K_M as pinned")
    with tempfile.TemporaryDirectory() as tmp:
        q8 = Path(tmp) / "q8_0.gguf"
        params = lib.llama_model_quantize_default_params()
        params.ftype = lib.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        if lib.llama_model_quantize(str(src).encode(), str(q8).encode(), params) != 0:
            raise SystemExit("llama_model_quantize failed")
        probe(q8, "requantised to Q8_0")


if __name__ == "__main__":
    main()
