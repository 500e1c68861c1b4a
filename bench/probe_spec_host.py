"""Device probe: what a large batch's speculative step costs in fast mode beyond its graphs' replays,
the host's share and a process's first use, as bench.gpu_batch's ``auto_fast`` row meets them at N = 64.

    python -m bench.probe_spec_host [k=K ...] [N ...] [cold] [warmed]   (default k=1 k=4, N = 16 64)

``cold``: also the host functions the first speculative run spent the most time in; ``warmed``:
``decoding.warmup.warm_up`` first, as the server runs it at load.

For each N: a plain run (the replay's reference and the plain step's time), then for each k a first
speculative run (a fresh process's first use of that shape: its first steps' times), a second run
timed, and a third under cProfile and the torch profiler: per decode step, the wall time, the
device's kernel-busy time and the host functions that took the most of it. The engine is driven
directly on this thread (no AsyncEngine), every prompt prefilled in one step, so cProfile sees the
whole step.

On the H200 (2026-12-03, 13:56 UTC, at cc899bd): a 64-row k = 1 step took 10.6 ms against a plain
step's 4.9 and its graphs' ~5.9 ms of replays (4.84 verification, 1.05 draft pass); the host fed each
pass and proposal row by row (`pad_sequence` and `cat`, a copy kernel a row) while the device
waited. With greedy rows of one k drafting in lockstep (471e9a8; 14:11 UTC): 7.9 ms at 64 rows
(k = 1), 6.4 ms at 16 (7.1 before). The batch's first speculative step also caught 64 prompts' drafts
up, 35-42 ms. The kernels-busy figure counts the profiled run's prefill and catch-up too, spread
over its decode steps.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from bench.gpu import DRAFT, TARGET, build
from bench.gpu_batch import MAX_LEN, NEW, PROMPT, corrupt, replay_engine
from bench.probe_host import gaps
from decoding.graphs import BATCH_BUCKETS, batch_bucket
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.static import StaticModel
from decoding.warmup import warm_up


def drive(e, reqs, ref=None):  # type: ignore[no-untyped-def]
    """Every request to its end, stepped on this thread: (per-step seconds of decode steps, outputs)."""
    if ref is not None:
        for i, r in enumerate(reqs):
            e.references[r.request_id] = corrupt(ref[i], 0.8, torch.Generator().manual_seed(i))
    outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    times: list[float] = []
    t = time.perf_counter()
    for pairs in e.steps_to_end([e.start(r) for r in reqs]):
        now = time.perf_counter()
        if all(o is not None for _, o in pairs):
            times.append(now - t)
        t = now
        for _, o in pairs:
            if o is not None:
                outs[o.request_id] += o.token_ids
    return times, outs


def main() -> None:
    ks = [int(a[2:]) for a in sys.argv[1:] if a.startswith("k=")] or [1, 4]
    ns = [int(a) for a in sys.argv[1:] if a.isdigit()] or [16, 64]
    target, draft = build(TARGET, 0), build(DRAFT, 1)
    tm = StaticModel(target, MAX_LEN, slots=max(ns) + 2, graphs=True, compile_step=True)
    dm = StaticModel(draft, MAX_LEN, slots=max(ns) + 2, graphs=True, compile_step=True)
    tm.warm()
    dm.warm()
    buckets = tuple(b for b in BATCH_BUCKETS if b <= batch_bucket(max(ns)))
    tm.capture(range(1, tm.max_graph_tokens + 1), buckets)
    dm.capture(range(1, dm.max_graph_tokens + 1), buckets)
    dm.capture(range(0), (), chunk_tokens=(128, 256, 512))
    e = replay_engine(target, draft, tm, dm, MAX_LEN, MAX_LEN)
    if "warmed" in sys.argv[1:]:  # as the server does at load
        print(f"warm-up: {warm_up(e, 'target')} steps", flush=True)
    prompts = torch.randint(0, 150000, (max(ns), PROMPT), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    ms = lambda xs: f"{1e3 * sum(xs) / max(1, len(xs)):.2f}"  # noqa: E731
    for N in ns:

        def reqs(tag: str, spec: SpecParams, n: int = N) -> list[GenerationRequest]:
            return [
                GenerationRequest(f"{tag}{i}", "target", prompts[i].tolist(), params, spec) for i in range(n)
            ]

        plain, outs = drive(e, reqs(f"off{N}-", SpecParams(SpecMode.OFF)))
        plain2, _ = drive(e, reqs(f"off{N}b-", SpecParams(SpecMode.OFF)))
        ref = [outs[f"off{N}-{i}"] for i in range(N)]
        print(
            f"N={N} plain: {len(plain2)} steps, mean {ms(plain2)} ms (first run's first 3: "
            f"{[round(1e3 * x, 1) for x in plain[:3]]})",
            flush=True,
        )
        for k in ks:
            spec = SpecParams(SpecMode.DRAFT, max_k=k, adaptive=False)
            cold_prof = cProfile.Profile()
            cold_prof.enable()
            cold, _ = drive(e, reqs(f"cold{N}.{k}-", spec), ref)
            cold_prof.disable()
            if "cold" in sys.argv[1:]:  # where a process's first speculative steps spend their time
                print(f"N={N} k={k} cold run, host functions by own time:")
                cst = pstats.Stats(cold_prof)
                for (f, line, name), (_, calls, tt, ct, _) in sorted(
                    cst.stats.items(),  # type: ignore[attr-defined]
                    key=lambda kv: -kv[1][2],
                )[:25]:
                    print(
                        f"   {1e3 * tt:8.1f} ms own, {1e3 * ct:8.1f} cum, {calls:6d} calls  {f.split('/')[-1]}:{line} {name}"
                    )
            warm, _ = drive(e, reqs(f"warm{N}.{k}-", spec), ref)
            prof = cProfile.Profile()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
                prof.enable()
                timed, _ = drive(e, reqs(f"prof{N}.{k}-", spec), ref)
                prof.disable()
                torch.cuda.synchronize()
            _, busy, idle = gaps(tp)
            steps = len(timed) + 1
            print(
                f"N={N} k={k}: {len(warm)} decode steps, mean {ms(warm)} ms (cold run: mean {ms(cold)}, first 3 "
                f"{[round(1e3 * x, 1) for x in cold[:3]]}, warm run's first 3 {[round(1e3 * x, 1) for x in warm[:3]]}); profiled: kernels busy {1e3 * busy / steps:.2f} ms, "
                f"idle {1e3 * sum(idle) / steps:.2f} ms a step",
                flush=True,
            )
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:22]  # type: ignore[attr-defined]
            for (f, line, name), (_, calls, tt, ct, _) in rows:
                print(
                    f"   {1e3 * tt / steps:6.3f} ms/step own, {1e3 * ct / steps:6.3f} cum, {calls / steps:6.1f} calls/step  "
                    f"{f.split('/')[-1]}:{line} {name}"
                )


if __name__ == "__main__":
    main()
