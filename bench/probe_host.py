"""Device probe: where a speculative step's wall time goes besides the device's kernels, in exact mode
as bench.gpu_batch's ``on`` row runs it (replay drafter, k = 4, every prompt in one prefill step).

    python -m bench.probe_host [trace=DIR] [N ...]   (default 1 4)

``trace=DIR``: also write each profiled run's Chrome trace to DIR/probe_host_N.json.

For each N: a plain run (the replay's reference), one speculative run to warm up, three timed, and
one under the torch profiler: the device's idle time between kernels, per decode step.

On the H200 (2026-12-03, 04:40 UTC, at 294f453): idle 2.05 ms of each ~11 ms step at N = 1 and 1.64 ms
at N = 4, almost all of it after the step's one sync. The traces showed the host's commit and
planning (~0.35 ms at N = 1), then seven to sixteen small copies and kernels, each starting only when
the host issued it (20-80 us apart), then the first draft graph's launch. With a replay made one
copy and its launch (aba365e, 05:35 UTC): 1.41 / 1.22 ms a step; on (k = 4) 338 / 1265 tok/s at
N = 1 / 4 against plain's 213 / 823 in the same runs (601 / 622 ms for 128 tokens a row).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import torch

from bench.gpu import DRAFT, TARGET, build
from bench.gpu_batch import EXACT_LEN, K_ON, MAX_LEN, NEW, PROMPT, corrupt, replay_engine, run_requests
from decoding.async_engine import AsyncEngine
from decoding.graphs import BATCH_BUCKETS, batch_bucket
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.static import StaticModel


def gaps(prof: torch.profiler.profile) -> tuple[float, float, list[float]]:
    """(span, kernel-busy seconds, idle gaps over 20 us in seconds) of the profiled device timeline."""
    ks = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, idle, end = 0.0, [], None
    for s, e in ks:
        if end is not None and s - end > 20:
            idle.append((s - end) / 1e6)
        if end is None or e > end:
            busy += e - max(s, end if end is not None else s)
            end = e
    return (ks[-1][1] - ks[0][0]) / 1e6, busy / 1e6, idle


def run(
    e: Any, reqs: list[GenerationRequest], ref: list[list[int]] | None = None
) -> tuple[float, dict[str, list[int]]]:
    """Every request at once, admitted together (one prefill step); wall seconds and outputs.
    ``ref``: the plain outputs, which the replay drafter proposes at acceptance 0.8."""
    if ref is not None:
        for i, r in enumerate(reqs):
            e.references[r.request_id] = corrupt(ref[i], 0.8, torch.Generator().manual_seed(i))
    N = len(reqs)
    ae = AsyncEngine(e, 0, N, N * PROMPT)
    ae.max_active = 0
    try:
        t0 = time.perf_counter()
        _, _, outs, _ = asyncio.run(run_requests(ae, reqs, hold=True))
        return time.perf_counter() - t0, outs
    finally:
        ae.shutdown()


def main() -> None:
    trace = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("trace=")), None)
    ns = [int(a) for a in sys.argv[1:] if "=" not in a] or [1, 4]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    target, draft = build(TARGET, 0), build(DRAFT, 1)
    tm = StaticModel(target, EXACT_LEN, slots=max(ns) + 2, graphs=True, compile_step=True, exact=True)
    dm = StaticModel(draft, MAX_LEN, slots=max(ns) + 2, graphs=True, compile_step=True)
    tm.warm()
    dm.warm()
    buckets = tuple(b for b in BATCH_BUCKETS if b <= batch_bucket(max(ns)))
    tm.capture(range(1, 2), buckets)
    tm.capture(range(0), (), chunk_tokens=(128, 256, 512))
    dm.capture(range(1, dm.max_graph_tokens + 1), buckets)
    dm.capture(range(0), (), chunk_tokens=(128, 256, 512))
    e = replay_engine(target, draft, tm, dm, EXACT_LEN, MAX_LEN)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150000, (max(ns), PROMPT), generator=gen)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    for N in ns:

        def reqs(tag: str, spec: SpecParams, n: int = N) -> list[GenerationRequest]:
            return [
                GenerationRequest(f"{tag}{i}", "target", prompts[i].tolist(), params, spec) for i in range(n)
            ]

        on = SpecParams(SpecMode.DRAFT, max_k=K_ON, adaptive=False)
        wall_off, outs = run(e, reqs(f"off{N}-", SpecParams(SpecMode.OFF)))
        ref = [outs[f"off{N}-{i}"] for i in range(N)]
        run(e, reqs(f"warm{N}-", on), ref)
        walls = [run(e, reqs(f"on{N}.{j}-", on), ref)[0] for j in range(3)]
        steps0 = e.total_steps
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            wall, got = run(e, reqs(f"prof{N}-", on), ref)
            torch.cuda.synchronize()
        if trace:
            prof.export_chrome_trace(f"{trace}/probe_host_{N}.json")
        steps = e.total_steps - steps0
        span, busy, idle = gaps(prof)
        same = sum(got[f"prof{N}-{i}"] == ref[i] for i in range(N))
        print(
            f"N={N}: off {wall_off * 1e3:.0f} ms, on {min(walls) * 1e3:.0f} ms (best of 3: "
            f"{NEW * N / min(walls):.0f} tok/s), {wall * 1e3:.0f} ms profiled, {steps} steps, identical {same}/{N}"
        )
        print(
            f"   device span {span * 1e3:.0f} ms, kernels busy {busy * 1e3:.0f} ms, idle {sum(idle) * 1e3:.0f} ms "
            f"in {len(idle)} gaps over 20 us ({sum(idle) / steps * 1e3:.2f} ms a step); largest "
            + ", ".join(f"{g * 1e3:.2f}" for g in sorted(idle)[-8:])
        )


if __name__ == "__main__":
    main()
