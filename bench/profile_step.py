"""Device probe: which kernels a compiled 1-token step launches, by name and count, for the draft and
the target shapes (what decides a batch-1 step once the weights are read at full bandwidth).

    python -m bench.profile_step
"""

from __future__ import annotations

from collections import Counter

import torch

from bench.gpu import DRAFT, MAX_LEN, TARGET, build
from decoding.static import StaticModel


def profile(shape: dict, seed: int, compile_step: bool) -> None:
    m = StaticModel(build(shape, seed), MAX_LEN, slots=1, graphs=False, compile_step=compile_step)
    r = m.runner(exact=False)
    r.forward(list(range(100, 228)), logits=False)
    tok = torch.tensor([5], device="cuda")
    for _ in range(3):
        r.forward(tok)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        r.forward(tok)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    layers = len(m.weights)
    print(f"\n== {shape['hidden_size']}-wide, {layers} layers, compiled={compile_step}: {len(kernels)} kernels, "
          f"{sum(e.device_time for e in kernels) / 1e3:.2f} ms of kernel time")
    by = Counter()
    t = Counter()
    for e in kernels:
        by[e.name[:90]] += 1
        t[e.name[:90]] += e.device_time
    for name, n in by.most_common(25):
        print(f"{n:5d} x {t[name] / n:7.1f} us  {name}")


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    profile(DRAFT, 1, True)
    profile(TARGET, 0, True)
