"""The batched engine on the CPU with the real pair: what a B-row step costs against B one-row steps on
this CPU (it differs between CPUs: bf16 matrix instructions decide it), and 1 and 4 concurrent requests
through ``AsyncEngine`` (aggregate tok/s, time to first token), speculation off and auto.

    python -m bench.cpu_batch [--new 48]

Writes bench/results_cpu_batch_<kind>.json and docs/benchmarks.md's ``cpu-batch-<kind>`` section, one
per CPU kind (bench.report.cpu_kind: amx, avx512-bf16, avx2), since their multi-row costs differ.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.cpu_engine import encode_prompts
from bench.report import cpu_kind, k_steps, stamp, write_section
from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from decoding.loader import ModelSpec, cpu_bf16_features, load_all
from decoding.params import GenerationRequest, RequestStats, SamplingParams, SpecMode, SpecParams
from decoding.warmup import freeze_heap

KIND = cpu_kind()
RESULTS = Path(__file__).with_name(f"results_cpu_batch_{KIND}.json")
BATCHES = (1, 2, 4)


def step_costs(engine: Engine, ids: list[int]) -> dict[int, float]:
    """Seconds of one decode step of B rows (one token each), median of 5, for B in BATCHES."""
    target = engine.model("target")
    runners = [target.runner_factory(target.model) for _ in range(max(BATCHES))]
    try:
        for r in runners:
            r.forward(ids, logits=False)
        model = runners[0].batch_model  # type: ignore[attr-defined]
        out = {}
        for B in BATCHES:
            rs = runners[:B]
            tok = torch.full((B, 1), 7, dtype=torch.long)
            times = []
            for _ in range(6):
                starts = [r.advance(1) for r in rs]
                t = time.perf_counter()
                model.forward_batch([r.slot for r in rs], starts, tok, bool(getattr(rs[0], "exact", False)))
                times.append(time.perf_counter() - t)
                for r, s in zip(rs, starts, strict=True):
                    r.crop(s)
            out[B] = statistics.median(times[1:])
        return out
    finally:
        for r in runners:
            r.release()


async def concurrent(ae: AsyncEngine, reqs: list[GenerationRequest]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first: list[float] = []
    tokens = 0
    stats: list[RequestStats] = []

    async def one(r: GenerationRequest) -> None:
        nonlocal tokens
        t = time.perf_counter()
        seen = False
        async for out in ae.generate(r):
            if out.token_ids and not seen:
                first.append(time.perf_counter() - t)
                seen = True
            tokens += len(out.token_ids)
            if out.stats is not None and out.finish_reason is not None:
                stats.append(out.stats)

    await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - t0
    return {
        "aggregate_tps": tokens / wall,
        "ttft_p50_s": statistics.median(first),
        "tokens": tokens,
        # row-steps by the k drafted (0: plain): on this VM one run's choices follow its timings
        "k_steps": k_steps(stats),
    }


def load_pair(dtype: str = "auto") -> dict[str, Any]:
    """The real pair as a CPU server's default loads it: bf16 where it pays (``dtype: auto``), the static backend."""
    common = dict(dtype=dtype, device="cpu", backend="static", slots=6, exact=False)
    return load_all(
        [
            ModelSpec("target", "qwen2.5-coder-1.5b", draft="draft", **common),  # type: ignore[arg-type]
            ModelSpec("draft", "qwen2.5-coder-0.5b", **common),  # type: ignore[arg-type]
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    models = load_pair()
    R: dict[str, Any] = {
        "load_s": time.perf_counter() - t0,
        "new": args.new,
        "bf16": cpu_bf16_features(),
        "dtype": str(models["target"].model.dtype).removeprefix("torch."),
    }
    engine = Engine(models)
    prompts = list(encode_prompts(models["target"].tokenizer).values())
    costs = step_costs(engine, prompts[0])
    R["frozen"] = freeze_heap()  # as the server does once its models are loaded
    R["step_s"] = costs
    print("step costs", costs, flush=True)
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    R["runs"] = {}
    for mode in (SpecMode.OFF, SpecMode.AUTO):
        for N in (1, 4):
            ae = AsyncEngine(engine, max_active=N, max_queued=N)
            try:
                reqs = [
                    GenerationRequest(f"{mode.value}-{N}-{i}", "target", prompts[i], params, SpecParams(mode))
                    for i in range(N)
                ]
                res = asyncio.run(concurrent(ae, reqs))
            finally:
                ae.shutdown()
            R["runs"][f"{mode.value} N={N}"] = res
            print(mode.value, N, res, flush=True)
    RESULTS.write_text(json.dumps(R, indent=1))
    write_section(f"cpu-batch-{KIND}", render(R))


def render(R: dict[str, Any]) -> str:
    step = {int(b): t for b, t in R["step_s"].items()}
    lines = [
        f"## The batched engine on the CPU (real pair), {KIND} CPU",
        "",
        f"{stamp()} bf16 matrix instructions: {', '.join(R['bf16']) or 'none'}. Qwen2.5-Coder-1.5B target "
        "with the 0.5B draft, "
        f"{R.get('dtype', 'bfloat16')} (`dtype: auto` on this CPU: bf16 where its 8-row matmul is no slower than "
        "float32's, decoding/loader.py), `backend: static` (exact mode off, as `auto` runs a CPU without the llamacpp extra), chat prompts of the CPU engine benchmark, "
        f"{R['new']} new tokens each, greedy, through `AsyncEngine`.",
        "",
        "| rows in a decode step | 1 | 2 | 4 |",
        "|---|---|---|---|",
        "| one B-row step, ms | " + " | ".join(f"{1e3 * step[b]:.0f}" for b in BATCHES) + " |",
        "| B one-row steps, ms | " + " | ".join(f"{1e3 * b * step[1]:.0f}" for b in BATCHES) + " |",
        "| B-row step / B one-row steps | "
        + " | ".join(f"{step[b] / (b * step[1]):.2f}" for b in BATCHES)
        + " |",
        "",
        "| requests at once | speculation | aggregate tok/s | TTFT p50 s |",
        "|---|---|---|---|",
    ]
    for name, r in R["runs"].items():
        mode, n = name.split(" N=")
        lines.append(f"| {n} | {mode} | {r['aggregate_tps']:.2f} | {r['ttft_p50_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
