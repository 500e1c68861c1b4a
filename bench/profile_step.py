"""Device probe: what a compiled 1-token step is made of (kernels by name, count and time) and what
it costs under CUDA graphs, for the draft and target shapes.

    python -m bench.profile_step [--order]

``--order`` also lists the first 40 kernels of the profiled step in launch order. ``--prefill R,T``
instead times a prefill step of R prompts of T tokens on the target (fast mode, as a burst of
prompts meets it at start-up), its kernels by name and the matmul rate it reaches.

Run on the H200 (2026-11-29) it also tried attention as two matmuls around an inductor-fused
softmax, and inductor's coordinate-descent tuning and max-autotune: none beat the default (SDPA,
cuBLAS) by more than run-to-run spread, and max-autotune was slower, so neither was kept.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from bench.gpu import DRAFT, MAX_LEN, TARGET, build, cuda_time
from decoding.runner import Row
from decoding.static import StaticModel

PROMPT = list(range(100, 228))


def profile_kernels(f: Callable[[], object]) -> list[Any]:
    """The device kernels of one call of ``f`` (after three warm-up calls), in launch order, under
    the profiler; a CUDA graph's replay shows each of its kernels."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(what: str, ks: list[Any], top: int) -> None:
    """Kernels by name: count, mean and total device time, the dearest first."""
    n: Counter[str] = Counter()
    t: Counter[str] = Counter()
    for e in ks:
        n[e.name[:90]] += 1
        t[e.name[:90]] += e.device_time
    print(f"== {what}: {len(ks)} kernels, {sum(t.values()) / 1e3:.2f} ms of kernel time", flush=True)
    for name, us in t.most_common(top):
        print(f"   {n[name]:5d} x {us / n[name]:7.1f} us = {us / 1e3:6.3f} ms  {name}", flush=True)


def kernels(m: StaticModel, top: int, order: int = 0) -> None:
    r = m.runner(exact=False)
    r.forward(PROMPT, logits=False)
    tok = torch.tensor([5], device="cuda")
    saved, m.graphs_enabled = m.graphs_enabled, False
    ks = profile_kernels(lambda: r.forward(tok))
    m.graphs_enabled = saved
    r.release()
    kernel_table("one eager 1-token step", ks, top)
    for e in ks[:order]:  # the first kernels in launch order: what one layer is made of
        print(f"   {e.device_time:6.1f} us  {e.name[:100]}")


def step(m: StaticModel, exact: bool) -> float:
    r = m.runner(exact=exact)
    r.forward(PROMPT, logits=False)
    L = r.length
    tok = torch.tensor([7], device="cuda")

    def f() -> None:
        r.forward(tok)
        r.crop(L)

    t = cuda_time(f, 50)
    r.release()
    return t


def prefill(rows: int, tokens: int) -> None:
    """A prefill step of ``rows`` prompts of ``tokens`` each: device ms, kernel table, TFLOP/s of the
    weights' products (2 x non-embedding parameters x tokens; attention and lm_head left out)."""
    m = StaticModel(build(TARGET, 0), MAX_LEN, slots=rows, graphs=True, compile_step=True)
    ids = [torch.randint(0, 1000, (tokens,), device="cuda") for _ in range(rows)]
    batch = [Row(s, ids[s], 0, "last") for s in range(rows)]
    t = cuda_time(lambda: m.forward_rows(batch), 10)
    D, inter, L = TARGET["hidden_size"], TARGET["intermediate_size"], TARGET["num_hidden_layers"]
    hd = D // TARGET["num_attention_heads"]
    qkv = (TARGET["num_attention_heads"] + 2 * TARGET["num_key_value_heads"]) * hd
    params = L * (qkv * D + D * D + 3 * inter * D)
    print(f"prefill {rows} x {tokens}: {t * 1e3:.2f} ms, {2 * params * rows * tokens / t / 1e12:.0f} TFLOP/s")
    kernel_table(f"prefill {rows} x {tokens}", profile_kernels(lambda: m.forward_rows(batch)), 16)


def main() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    if "--prefill" in sys.argv:
        rows, tokens = map(int, sys.argv[sys.argv.index("--prefill") + 1].split(","))
        prefill(rows, tokens)
        return
    for shape, seed in ((DRAFT, 1), (TARGET, 0)):
        m = StaticModel(build(shape, seed), MAX_LEN, slots=1, graphs=True, compile_step=True, exact=True)
        print(
            f"{shape['hidden_size']}-wide: 1-token step {step(m, False) * 1e3:.3f} ms, exact step {step(m, True) * 1e3:.3f} ms"
        )
        kernels(m, 16, order=40 if "--order" in sys.argv else 0)
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
