"""GPU benchmark (H200): real architectures at real sizes with random weights, bf16, batch 1.

Imports only ``decoding/`` and ``bench/`` (the device image has torch and transformers, not the web
stack). One process, one run; writes every number to ``--out`` (JSON), then docs/benchmarks.md's GPU
section and its plot (``bench/report_gpu.py``, which can also re-render a saved JSON).

    python -m bench.gpu [--quick] [--no-compile]

Measured, in order:
  1. device copy bandwidth (bytes read + written) and the bandwidth roofline of a target step;
  2. step times for both models on every backend: transformers eager, our static cache eager, CUDA
     graphs, and inductor-compiled layers under CUDA graphs; kernels per step; target-only decode
     tok/s for each, as a fraction of the roofline, plain and in exact mode (padded steps);
  3. draft cost c = draft step / target step and verification cost c_v(k), k = 1..8;
  4. speculative tok/s vs target-only at acceptance a in {0.6, 0.7, 0.8, 0.9} with a replay drafter
     (the real draft model runs its k steps for their cost, but proposes the target's reference
     continuation corrupted at random to acceptance a), checking that the output equals the
     target-only output token for token, against the prediction (1 - a^(k+1)) / ((1 - a)(k c + c_v)).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from decoding.drafters import DraftModelDrafter, Proposal
from decoding.engine import Engine, LoadedModel
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.runner import EagerRunner
from decoding.static import StaticModel, without_split_k

# Qwen2.5-7B and Qwen2.5-0.5B shapes (their config.json), vocabularies included: 152,064 logits beside
# 151,936, one tokenizer, the target's extra rows padding (decoding.vocab.VocabFit; issue 53).
TARGET = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    rope_theta=1e6,
    max_position_embeddings=32768,
)
DRAFT = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    rope_theta=1e6,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)
PROMPT, NEW = 128, 256
MAX_LEN = 1024
ACCEPTANCE = (0.6, 0.7, 0.8, 0.9)
REPEATS = 3


def build(shape: dict[str, Any], seed: int, default_cublas: bool = False) -> Qwen2ForCausalLM:
    """A model of ``shape`` with random weights. Unless ``default_cublas``, cuBLAS is asked for no
    split-K first, as the engine's loader asks (decoding.static.without_split_k): it holds for the
    whole process, so a baseline that should run as torch configures it runs in a process of its own."""
    if not default_cublas:
        without_split_k()
    torch.manual_seed(seed)
    cfg = Qwen2Config(**shape, torch_dtype=torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def save(results: dict[str, Any], path: str) -> None:
    """Written after every stage: a run cut short by its time limit still leaves its numbers."""
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def cuda_time(fn, iters: int, warmup: int = 3) -> float:  # type: ignore[no-untyped-def]
    """Median seconds per call, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    n = 2 << 30  # 2 GiB of bf16 read, 2 GiB written: far past the 60 MB L2
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), 20)
    return 2 * n / t


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kernels_per_step(static: StaticModel, ids: list[int]) -> int:
    """GPU operations one uncaptured 1-token step launches (what a CUDA graph replays); -1 where
    the profiler cannot run."""
    try:
        return _kernels_per_step(static, ids)
    except RuntimeError as exc:
        print(f"profiler: {exc!r}"[:200], flush=True)
        return -1


def _kernels_per_step(static: StaticModel, ids: list[int]) -> int:
    r = static.runner(exact=False)
    r.forward(ids, logits=False)
    tok = torch.tensor([5], device="cuda")
    r.forward(tok)  # warm (compilation)
    torch.cuda.synchronize()
    saved, static.graphs_enabled = static.graphs_enabled, False
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            r.forward(tok)
            torch.cuda.synchronize()
    finally:
        static.graphs_enabled = saved
        r.release()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@dataclass
class Replay:
    """Benchmark-only drafter: pays for the real draft model's k steps, but proposes the target's own
    reference continuation (``next_tokens``, set before each step), each token kept with probability
    ``acceptance`` and otherwise replaced by a wrong one."""

    inner: DraftModelDrafter
    acceptance: float
    gen: torch.Generator
    next_tokens: list[int]
    name: str = "replay"

    def propose(self, tokens, k, params, counts, generator):  # type: ignore[no-untyped-def]
        self.inner.propose(tokens, k, params, counts, generator)  # the cost, not the tokens
        out = []
        for t in self.next_tokens[:k]:
            keep = torch.rand(1, generator=self.gen).item() < self.acceptance
            out.append(t if keep else (t + 1 + int(torch.randint(1000, (1,), generator=self.gen))) % 150000)
        return Proposal(torch.tensor(out, dtype=torch.long, device="cuda"), None)

    def catch_up(self, tokens: list[int]) -> None:
        self.inner.catch_up(tokens)

    def rollback(self, valid: int) -> None:
        self.inner.rollback(valid)

    def release(self) -> None:
        self.inner.release()


class Bench:
    def __init__(self, target: Qwen2ForCausalLM, draft: Qwen2ForCausalLM, ids: list[int]):
        self.target, self.draft, self.ids = target, draft, ids

    def engine(self, t_factory: Any, d_factory: Any = None) -> Engine:
        models = {
            "target": LoadedModel(
                "target", self.target, None, draft="draft", max_context=MAX_LEN, runner_factory=t_factory
            )
        }
        if d_factory is not None:
            models["draft"] = LoadedModel(
                "draft",
                self.draft,
                None,
                max_context=MAX_LEN,
                runner_factory=d_factory,
                draft_runner_factory=d_factory,
            )
        return Engine(models)

    def decode(self, t_factory: Any, new: int) -> tuple[float, list[int]]:
        """Target-only greedy decode: tok/s over the decode phase (prefill excluded), and the tokens."""
        req = GenerationRequest(
            "b",
            "target",
            self.ids,
            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
            SpecParams(SpecMode.OFF),
        )
        out, stats, _ = self.engine(t_factory).generate(req)
        return len(out) / stats.decode_s, out

    def step_time(self, runner: Any, T: int, iters: int = 30) -> float:
        """One T-token step after the prompt, cut back each time (CUDA events, median)."""
        runner.forward(self.ids, logits=False)
        L = runner.length
        toks = torch.arange(T, device="cuda") + 7

        def f() -> None:
            runner.forward(toks)
            runner.crop(L)

        t = cuda_time(f, iters)
        runner.release()
        return t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results_gpu.json")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and k values (a smoke run)")
    ap.add_argument("--no-compile", action="store_true", help="skip the inductor-compiled backend")
    ap.add_argument("--no-doc", action="store_true", help="write the JSON only, not docs/benchmarks.md")
    args = ap.parse_args(argv)
    wall = time.perf_counter()
    R: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.gpu"
        + (" --quick" if args.quick else "")
        + (" --no-compile" if args.no_compile else ""),
    }
    # fp32 reductions inside bf16 GEMMs (cuBLAS's split-K would otherwise round partial sums to bf16)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    bw = copy_bandwidth()
    R["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    target, draft = build(TARGET, 0), build(DRAFT, 1)
    R["target_weight_bytes"], R["draft_weight_bytes"] = weight_bytes(target), weight_bytes(draft)
    R["roofline_tps"] = bw / R["target_weight_bytes"]
    ids = torch.randint(0, 150000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    new = 64 if args.quick else NEW
    R["new_tokens"] = new
    B = Bench(target, draft, ids)

    # 2. every backend: step times for both models, kernels per step, target-only decode
    R["transformers_eager"] = {
        "target_step_s": B.step_time(EagerRunner(target), 1, iters=10),
        "draft_step_s": B.step_time(EagerRunner(draft), 1, iters=10),
        "decode_tps": B.decode(EagerRunner, 16)[0],
    }
    variants = [("static_eager", False, False), ("cuda_graphs", True, False)]
    if not args.no_compile:
        variants.append(("compile+cuda_graphs", True, True))
    R["backends"] = {}
    statics: dict[str, tuple[StaticModel, StaticModel]] = {}
    references: dict[str, list[int]] = {}
    for name, graphs, compiled in variants:
        try:
            t0 = time.perf_counter()
            tm = StaticModel(target, MAX_LEN, slots=2, graphs=graphs, compile_step=compiled, exact=True)
            dm = StaticModel(draft, MAX_LEN, slots=2, graphs=graphs, compile_step=compiled)
            if graphs:
                tm.capture(range(1, 10))
                dm.capture(range(1, 3))  # the draft's 1-token step and its 2-token catch-up
            setup = time.perf_counter() - t0
            n_dec = new if graphs else 32
            B.decode(tm.runner, 8)  # warm both step widths (lazy CUDA module loading, cuBLAS heuristics)
            B.decode(functools.partial(tm.runner, exact=False), 8)
            tps_fast, _ = B.decode(functools.partial(tm.runner, exact=False), n_dec)
            tps_exact, ref = B.decode(tm.runner, n_dec)
        except Exception as exc:  # compile can fail on a new torch: record it, keep the rest
            R.setdefault("backend_errors", {})[name] = repr(exc)[:500]
            print(f"{name}: failed: {exc!r}"[:300], flush=True)
            continue
        t1 = B.step_time(tm.runner(exact=False), 1)
        td = B.step_time(dm.draft_runner(), 1)
        R["backends"][name] = b = {
            "setup_s": setup,
            "decode_tps": tps_fast,
            "roofline_fraction": tps_fast / R["roofline_tps"],
            "decode_tps_exact": tps_exact,
            "roofline_fraction_exact": tps_exact / R["roofline_tps"],
            "target_step_s": t1,
            "draft_step_s": td,
            "c": td / t1,
            "c_v": {k: B.step_time(tm.runner(exact=False), k + 1) / t1 for k in range(1, 9)},
            "exact_step_s": B.step_time(tm.runner(exact=True), 1),
            "target_kernels": kernels_per_step(tm, ids),
            "draft_kernels": kernels_per_step(dm, ids),
        }
        b["c_v_exact"] = b["exact_step_s"] / t1
        statics[name], references[name] = (tm, dm), ref
        save(R, args.out)
        print(
            f"{name}: setup {setup:.0f}s, {tps_fast:.1f} tok/s ({b['roofline_fraction']:.0%} of {R['roofline_tps']:.0f}), "
            f"exact {tps_exact:.1f}; target {t1 * 1e3:.2f} ms ({b['target_kernels']} kernels), draft {td * 1e3:.2f} ms "
            f"({b['draft_kernels']} kernels), c = {b['c']:.3f}; c_v = {', '.join(f'{v:.2f}' for v in b['c_v'].values())}; "
            f"exact step {b['c_v_exact']:.2f}x  [{time.perf_counter() - wall:.0f}s]",
            flush=True,
        )

    # 3-4. speculation on the backend with the best predicted speedup at a = 0.8
    def predicted(b: dict[str, Any], a: float, k: int) -> float:
        return (1 - a ** (k + 1)) / ((1 - a) * (k * b["c"] + b["c_v_exact"]))

    graph_backends = [n for n in statics if n != "static_eager"]
    best = max(graph_backends, key=lambda n: max(predicted(R["backends"][n], 0.8, k) for k in range(1, 9)))
    R["spec_backend"] = best
    tm, dm = statics[best]
    b = R["backends"][best]
    reference = references[best]
    spec_engine = B.engine(tm.runner, dm.draft_runner)
    rows = []
    ks = [2, 4, 6] if args.quick else list(range(1, 9))
    for a in ACCEPTANCE:
        for k in ks:
            # REPEATS runs with different corruption draws: one run's realised acceptance wanders
            r = merge([spec_run(spec_engine, ids, reference, a, k, new, seed) for seed in range(REPEATS)])
            rows.append(r)
            r["predicted"] = predicted(b, a, k)
            # the cost model alone, with the sampling noise of the realised acceptance taken out
            r["predicted_at_measured"] = r["tokens_per_step"] / (k * b["c"] + b["c_v_exact"])
            r["speedup"] = r["tps"] / b["decode_tps"]
            r["speedup_vs_exact"] = r["tps"] / b["decode_tps_exact"]
            save({**R, "speculative": rows}, args.out)
            print(
                f"a={a} k={k}: {r['tps']:.1f} tok/s, {r['speedup']:.2f}x (vs exact target-only {r['speedup_vs_exact']:.2f}x; "
                f"pred {r['predicted']:.2f}x), accept {r['measured_acceptance']:.2f}, tok/step {r['tokens_per_step']:.2f}, "
                f"identical={r['identical']}",
                flush=True,
            )
    R["speculative"] = rows
    R["wall_s"] = time.perf_counter() - wall
    save(R, args.out)
    top = max((r for r in rows if r["a"] == 0.8), key=lambda r: r["speedup"])
    print(
        f"\nbest at a=0.8: k={top['k']} {top['speedup']:.2f}x (pred {top['predicted']:.2f}x); "
        f"identical {sum(r['identical'] for r in rows)}/{len(rows)}; {R['wall_s']:.0f}s"
    )
    if not args.no_doc:
        from bench.report_gpu import write

        write(R, args.out)


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs at one (a, k) as one: tokens over time, acceptance over drafted tokens."""
    drafted = sum(r["drafted"] for r in runs)
    return dict(
        a=runs[0]["a"],
        k=runs[0]["k"],
        runs=len(runs),
        tps=sum(r["tokens"] for r in runs) / sum(r["elapsed_s"] for r in runs),
        measured_acceptance=sum(r["accepted"] for r in runs) / drafted if drafted else 0.0,
        tokens_per_step=sum(r["tokens"] for r in runs) / sum(r["steps"] for r in runs),
        identical=all(r["identical"] for r in runs),
        first_diff=[r["first_diff"] for r in runs],
    )


def spec_run(
    engine: Engine, ids: list[int], reference: list[int], a: float, k: int, new: int, seed: int
) -> dict[str, Any]:
    """One greedy speculative generation with the replay drafter at acceptance ``a``, fixed k."""
    gen = torch.Generator().manual_seed(int(a * 100) * 1000 + k * 10 + seed)
    seq = engine.start(
        GenerationRequest(
            "s",
            "target",
            ids,
            SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
            SpecParams(SpecMode.DRAFT, max_k=k, adaptive=False),
        )
    )
    assert isinstance(seq.drafter, DraftModelDrafter)
    replay = Replay(seq.drafter, a, gen, [])
    seq.drafter = replay  # type: ignore[assignment]
    # prefill both caches outside the timer: tok/s here is decode speed, as for target-only
    seq.runner.forward(seq.tokens[:-1], logits=False)
    replay.inner.runner.forward(seq.tokens[:-1], logits=False)
    seq.prefilled = True
    out: list[int] = []
    elapsed = 0.0
    steps = drafted = accepted = 0
    while True:
        done = seq.completion_tokens
        replay.next_tokens = reference[done : done + k]  # what the target will say after the pending token
        torch.cuda.synchronize()
        t = time.perf_counter()
        step = engine.step(seq)  # ends in the step's one host sync
        elapsed += time.perf_counter() - t
        out.extend(step.token_ids)
        steps, drafted, accepted = steps + 1, drafted + step.drafted, accepted + step.accepted
        if step.finish_reason is not None:
            break
    seq.release()
    first_diff = next((i for i, (x, y) in enumerate(zip(out, reference, strict=False)) if x != y), None)
    return dict(
        a=a,
        k=k,
        tokens=len(out),
        elapsed_s=elapsed,
        steps=steps,
        drafted=drafted,
        accepted=accepted,
        identical=out == reference,
        first_diff=first_diff,
    )


if __name__ == "__main__":
    main()
