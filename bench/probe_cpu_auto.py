"""CPU probe: where speculation auto gains or loses at N concurrent requests with the real pair
(bench.cpu_batch's ``auto N=4`` row). Runs speculation off, then auto, timing every engine step and
printing what it held (rows decoding and prefilling, drafted tokens, the drafts' catch-up backlog)
with the batch's choice of k and the costs it chose by.

    python -m bench.probe_cpu_auto [N] [--new 48] [--dtype auto|bfloat16|float32]

An AVX2-only CPU's kernels can be run on a newer one: ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2`` (torch's and oneDNN's dispatch; bf16 then costs what it costs without bf16
instructions: a 1-row matmul less than float32's, a 64-row one about twice).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.cpu_batch import concurrent, load_pair
from bench.cpu_engine import encode_prompts
from decoding.async_engine import AsyncEngine
from decoding.batch_controller import BatchCosts
from decoding.engine import Engine
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=4)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    models = load_pair(args.dtype)
    engine = Engine(models)
    prompts = list(encode_prompts(models["target"].tokenizer).values())[: args.n]
    print("prompt tokens", [len(p) for p in prompts], "dtype", models["target"].model.dtype, flush=True)
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    inner, best_k = Engine.step_batch, BatchCosts.best_k
    choice: list[str] = []

    def logged(self, rows, prior, probe, **kw):  # type: ignore[no-untyped-def]
        k = best_k(self, rows, prior, probe, **kw)
        B = len(rows)
        choice.append(
            f"best_k={k} probe={probe} a={[round(a, 2) for a, _, _ in rows]} plain {fmt(self.t_plain(B))} "
            f"verify k=1..3 {[fmt(self.t_target(B * (j + 1), B)) for j in (1, 2, 3)]} draft {fmt(self.t_draft(B))} "
            f"catch-up/token {fmt(self.catch_up_token)} {kw} realised {self.realised}"
        )
        return k

    def timed(self, seqs, budget=None, joining=False):  # type: ignore[no-untyped-def]
        backlog = [len(s.tokens) - s.drafter.runner.length if s.drafter is not None else 0 for s in seqs]
        prefilling = sum(not s.prefilled for s in seqs)
        choice.clear()
        t = time.perf_counter()
        outs = inner(self, seqs, budget, joining)
        dt = time.perf_counter() - t
        drafted = [o.drafted if o is not None else "-" for o in outs]
        got = [len(o.token_ids) if o is not None else "-" for o in outs]
        print(
            f"{dt * 1e3:8.0f} ms  rows {len(seqs)} prefilling {prefilling} drafted {drafted} tokens {got} "
            f"backlog {backlog} {' '.join(choice)}",
            flush=True,
        )
        return outs

    Engine.step_batch = timed  # type: ignore[method-assign]
    BatchCosts.best_k = logged  # type: ignore[method-assign,assignment]
    try:
        for mode in (SpecMode.OFF, SpecMode.AUTO):
            ae = AsyncEngine(engine, max_active=args.n, max_queued=args.n)
            try:
                reqs = [
                    GenerationRequest(f"{mode.value}-{i}", "target", p, params, SpecParams(mode))
                    for i, p in enumerate(prompts)
                ]
                print(f"--- {mode.value} N={args.n}", flush=True)
                print(mode.value, asyncio.run(concurrent(ae, reqs)), flush=True)
            finally:
                ae.shutdown()
    finally:
        Engine.step_batch, BatchCosts.best_k = inner, best_k  # type: ignore[method-assign]


def fmt(t: float | None) -> str:
    return "?" if t is None else f"{t * 1e3:.0f}ms"


if __name__ == "__main__":
    main()
