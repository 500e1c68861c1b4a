"""CPU probe: the host work of a plain step of N rows, speculation off against auto that stays plain
(the tiny random pair: its drafts are never accepted, so auto is off and probes rarely), under
cProfile, with the functions whose own time differs most.

    python -m bench.probe_plain_host [N]   (default 64)

Steps are queued ahead as on a GPU (``Engine.overlap``), so the path is the one a GPU server's
plain steps take; the model's own time is counted apart. On a 2-core AVX512-BF16 EPYC
(2026-12-04, at 355f193), 64 rows: choosing the batch's k took 0.18 ms a step for auto's rows
against 0.07 for rows that are off, and every plain row's draft was rolled back; on the H200 fast
auto stayed plain at N = 64 at 0.947x of off (bench.gpu_batch, 02:48 UTC). After 22f8926 the
difference left is the rare probe's draft passes.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from decoding.engine import Engine
from decoding.loader import ModelSpec, load_all
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams

STEPS = 50


def profile(models, mode: str, n: int) -> dict[str, tuple[int, float, float]]:
    """Per function (calls, own seconds, cumulative seconds) over STEPS steps of ``n`` decoding rows."""
    e = Engine(models)
    e.overlap = True
    spec = SpecParams(SpecMode.OFF) if mode == "off" else SpecParams(SpecMode.DRAFT, max_k=8, adaptive=True)
    params = SamplingParams(max_tokens=STEPS + 8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    seqs = [
        e.start(
            GenerationRequest(
                f"r{i}", "tiny", torch.randint(0, 200, (32,), generator=g).tolist(), params, spec
            )
        )
        for i in range(n)
    ]
    try:
        for _ in range(3):  # prefill, then warm
            e.step_batch(seqs, prefill_budget=None)
        p = cProfile.Profile()
        for _ in range(STEPS):
            p.enable()
            e.step_batch(seqs, prefill_budget=None)
            p.disable()
    finally:
        for s in seqs:
            s.runner.release()
            if s.drafter is not None:
                s.drafter.release()
    stats = pstats.Stats(p).stats  # type: ignore[attr-defined]
    return {
        f"{fn} ({f.split('/')[-1]}:{line})": (nc, tt, ct)
        for (f, line, fn), (_, nc, tt, ct, _) in stats.items()
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    models = load_all(
        [
            ModelSpec("tiny", "tiny-random", draft="tiny-draft", dtype="float32", device="cpu", slots=n + 2),
            ModelSpec("tiny-draft", "tiny-random-draft", dtype="float32", device="cpu", slots=n + 2),
        ]
    )
    torch.set_num_threads(1)
    runs = {}
    for mode in ("off", "auto", "off", "auto"):  # the second of each counts (the first warms)
        runs[mode] = d = profile(models, mode, n)
        total = max(ct for k, (_, _, ct) in d.items() if k.startswith("step_batch "))
        model = sum(ct for k, (_, _, ct) in d.items() if k.startswith("_step (static.py"))
        print(
            f"{mode}: {1e3 * total / STEPS:.2f} ms a step, of which host {1e3 * (total - model) / STEPS:.2f} ms"
        )
    off, auto = runs["off"], runs["auto"]
    diff = sorted(
        (auto.get(k, (0, 0.0, 0.0))[1] - off.get(k, (0, 0.0, 0.0))[1], k) for k in off.keys() | auto.keys()
    )
    print("own time a step, auto less off (profiled):")
    for t, k in reversed(diff[-12:]):
        print(f"  {1e3 * t / STEPS:+.3f} ms  {k}  calls {off.get(k, (0,))[0]} -> {auto.get(k, (0,))[0]}")


if __name__ == "__main__":
    main()
