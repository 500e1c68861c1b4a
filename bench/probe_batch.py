# ruff: noqa: B023  (closures are timed at once, inside their loop iteration)
"""Device probe for the batched engine: where a batched step's time goes.

    python -m bench.probe_batch

On the H200 shapes of ``bench.gpu`` (random weights, bf16, compiled layer halves under CUDA graphs):
  1. which SDPA kernels accept our attention call (GQA, additive mask) and what each costs, with the
     grouped-query heads folded into the query length as the alternative;
  2. T(B, W): device time and host time per graph replay of the target (and the draft) by batch size
     and width, the table a batch-aware controller needs;
  3. the engine loop under cProfile at N = 1 and 4 with speculation on: host time by function, so a
     stall (a host sync, a recapture) shows up by name.
Prints tables only; nothing is written to docs/.
"""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.gpu import DRAFT, TARGET, build
from bench.gpu_batch import corrupt, replay_engine, run_requests
from decoding.async_engine import AsyncEngine
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.static import StaticModel

MAX_LEN = 1024


def event_time(f, n: int = 20) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(median device ms, median host ms per call) of ``f``."""
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        a.record()
        f()
        b.record()
        host.append(1e3 * (time.perf_counter() - t))
        b.synchronize()
        dev.append(a.elapsed_time(b))
    return statistics.median(dev), statistics.median(host)


def sdpa_table() -> None:
    print("== SDPA on a decode row: q [B, 28, W, 128], kv [B, 4, L, 128], additive mask", flush=True)
    for B, W, L in ((1, 1, 256), (16, 1, 256), (64, 1, 256), (4, 9, 512)):
        q = torch.randn(B, 28, W, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, 4, L, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.zeros(B, 1, W, L, device="cuda", dtype=torch.bfloat16)
        mask[..., L // 2 :] = float("-inf")
        ref = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask.float(), enable_gqa=True
        )
        line = [f"B={B} W={W} L={L}:"]
        for name, be in (
            ("default", None),
            ("flash", SDPBackend.FLASH_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("math", SDPBackend.MATH),
        ):
            try:

                def f(be=be):  # type: ignore[no-untyped-def]
                    if be is None:
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    with sdpa_kernel(be):
                        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

                err = (f().float() - ref).norm() / ref.norm()
                line.append(f"{name} {event_time(f)[0] * 1e3:.1f}us (err {err:.0e})")
            except Exception as exc:
                line.append(f"{name} no ({str(exc).splitlines()[0][:40]})")
        # grouped heads folded into the query length: no GQA, so the fused kernels take it
        G = 7
        qf = q.view(B, 4, G, W, 128).transpose(2, 3).reshape(B, 4, W * G, 128)
        mf = mask.repeat_interleave(G, dim=2)

        def fold():  # type: ignore[no-untyped-def]
            return F.scaled_dot_product_attention(qf, k, v, attn_mask=mf)

        of = fold().view(B, 4, W, G, 128).transpose(2, 3).reshape(B, 28, W, 128)
        err = (of.float() - ref).norm() / ref.norm()
        line.append(f"fold {event_time(fold)[0] * 1e3:.1f}us (err {err:.0e})")
        print("  " + "; ".join(line), flush=True)


def replay_table(m: StaticModel, name: str, shapes: list[tuple[int, int]], exact: bool = False) -> None:
    print(f"== {name}: graph replay, device ms / host ms per step (exact={exact})", flush=True)
    for B, W in shapes:
        slots = list(range(B))
        starts = [192] * B
        ids = torch.randint(0, 1000, (B, W), device="cuda")
        t0 = time.perf_counter()
        m.forward_batch(slots, starts, ids, exact)  # capture
        cap = time.perf_counter() - t0
        d, h = event_time(lambda: m.forward_batch(slots, starts, ids, exact))
        print(f"  B={B:3d} W={W}: {d:7.3f} ms device, {h:6.3f} ms host (capture {cap:.2f}s)", flush=True)


def engine_profile(tm: StaticModel, dm: StaticModel, target, draft) -> None:  # type: ignore[no-untyped-def]
    e = replay_engine(target, draft, tm, dm, MAX_LEN, MAX_LEN)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    for N, mode in ((1, "on"), (4, "on"), (4, "auto"), (4, "off")):
        spec = {
            "on": SpecParams(SpecMode.DRAFT, max_k=4, adaptive=False),
            "auto": SpecParams(SpecMode.DRAFT, max_k=8, adaptive=True),
            "off": SpecParams(SpecMode.OFF),
        }[mode]
        reqs = [
            GenerationRequest(
                f"{mode}{N}-{r}-{i}", "target", torch.randint(0, 150000, (128,)).tolist(), params, spec
            )
            for r in range(2)
            for i in range(N)
        ]
        for r in reqs:
            e.references[r.request_id] = corrupt([0] * 96, 0.8, gen)
        ae = AsyncEngine(e, N, N, 256)
        try:
            asyncio.run(run_requests(ae, reqs[:N]))  # warm: captures
            steps0 = e.total_steps
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.enable()
            _, chunks, _, _ = asyncio.run(run_requests(ae, reqs[N:]))
            prof.disable()
            wall = time.perf_counter() - t
            steps = e.total_steps - steps0
            toks = sum(n for c in chunks.values() for _, n in c)
            print(
                f"== engine N={N} {mode}: {toks / wall:.0f} tok/s, {steps} steps, "
                f"{1e3 * wall / max(1, steps):.2f} ms/step, {toks / max(1, steps):.2f} tokens/step",
                flush=True,
            )
            st = pstats.Stats(prof)
            st.sort_stats("tottime").print_stats(14)
        finally:
            ae.shutdown()


def main() -> None:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    sdpa_table()
    target, draft = build(TARGET, 0), build(DRAFT, 1)
    t = time.perf_counter()
    tm = StaticModel(target, MAX_LEN, slots=66, graphs=True, compile_step=True)
    dm = StaticModel(draft, MAX_LEN, slots=66, graphs=True, compile_step=True)
    tm.warm()
    dm.warm()
    print(f"setup {time.perf_counter() - t:.0f}s", flush=True)
    replay_table(tm, "target", [(1, 1), (4, 1), (16, 1), (64, 1), (1, 5), (4, 5), (16, 5), (16, 9)])
    replay_table(tm, "target", [(1, 9), (16, 9)], exact=True)
    replay_table(dm, "draft", [(1, 1), (4, 1), (16, 1), (64, 1), (4, 2)])
    engine_profile(tm, dm, target, draft)


if __name__ == "__main__":
    main()
