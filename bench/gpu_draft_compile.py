"""GPU probe: does torch.compile (inductor's fused kernels) under our CUDA graphs cut the draft step?

The draft's 1-token step is ~1000 small kernels at batch 1; fusing the elementwise chains is what
would lower c. Compiles the 0.5B-shaped draft for T = 1 only (the full 7B compile outran a call).

    python -m bench.gpu_draft_compile --out r.json
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.gpu import DRAFT, MAX_LEN, TARGET, build, cuda_time, save
from decoding.static import StaticModel


def step_time(m: StaticModel, ids: torch.Tensor) -> float:
    r = m.runner()
    with torch.inference_mode():
        m._forward(r.slot, ids, m.positions[: ids.shape[0]])  # prefill uncompiled: no compile for T=128
    r._length = ids.shape[0]
    tok = torch.tensor([5], device="cuda")
    L = r.length
    t = cuda_time(lambda: (r.forward(tok), r.crop(L)), 50)
    r.release()
    return t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ids = torch.randint(0, 150000, (128,), device="cuda")
    target, draft = build(TARGET, 0), build(DRAFT, 1)
    R = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    R["target_graphs_s"] = step_time(StaticModel(target, MAX_LEN, graphs=True), ids)
    R["draft_graphs_s"] = step_time(StaticModel(draft, MAX_LEN, graphs=True), ids)
    print(f"graphs: target {R['target_graphs_s'] * 1e3:.2f} ms, draft {R['draft_graphs_s'] * 1e3:.2f} ms", flush=True)
    save(R, args.out)
    t0 = time.perf_counter()
    R["draft_compiled_graphs_s"] = step_time(StaticModel(draft, MAX_LEN, graphs=True, compile_step=True), ids)
    R["draft_compile_s"] = time.perf_counter() - t0
    R["c_graphs"] = R["draft_graphs_s"] / R["target_graphs_s"]
    R["c_compiled"] = R["draft_compiled_graphs_s"] / R["target_graphs_s"]
    print(f"compiled draft {R['draft_compiled_graphs_s'] * 1e3:.2f} ms (compile {R['draft_compile_s']:.0f}s): "
          f"c {R['c_graphs']:.3f} -> {R['c_compiled']:.3f}", flush=True)
    save(R, args.out)


if __name__ == "__main__":
    main()
