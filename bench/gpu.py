"""GPU benchmark (H200): real architectures at real sizes with random weights, bf16, batch 1.

Imports only ``decoding/`` (the device image has torch and transformers, not the web stack).
Writes a JSON of every number to ``--out``; ``bench/report_gpu.py`` turns it into
docs/benchmarks.md's GPU section and a plot.

    python -m bench.gpu --out results.json [--quick]

Measured, in one process:
  1. device copy bandwidth (bytes read + written) and the bandwidth roofline of a target step;
  2. target-only decode tok/s: transformers eager, our static cache eager, our CUDA graphs;
  3. draft step cost c = draft step / target step and verification cost c_v(k), k = 1..8;
  4. speculative tok/s vs target-only at acceptance a in {0.6, 0.7, 0.8, 0.9} with a replay drafter
     (the real draft model runs for its cost, but proposes the target's reference continuation
     corrupted at random to acceptance a), checking the output equals target-only output, against
     the prediction (1 - a^(k+1)) / ((1 - a)(k c + c_v(k))).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

from decoding.drafters import Proposal
from decoding.engine import Engine, LoadedModel
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.runner import EagerRunner
from decoding.static import StaticModel

# Qwen2.5-7B and Qwen2.5-0.5B shapes (their config.json). The draft takes the target's vocabulary
# size (152064 vs 151936): a pair must share one, and the 128 extra rows change nothing measurable.
TARGET = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, max_position_embeddings=32768)
DRAFT = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=152064, rope_theta=1e6, max_position_embeddings=32768,
             tie_word_embeddings=True)
PROMPT, NEW = 128, 256
MAX_LEN = 1024


def build(shape: dict[str, Any], seed: int) -> Qwen2ForCausalLM:
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


@dataclass
class Replay:
    """Benchmark-only drafter: pays for the real draft model's k steps, but proposes the target's own
    greedy continuation of the current context (prepared by ``Shadow`` outside the timed step),
    each token kept with probability ``acceptance`` and otherwise replaced by a wrong one."""

    inner: Any  # DraftModelDrafter
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

    def rollback(self, valid: int) -> None:
        self.inner.rollback(valid)

    def release(self) -> None:
        self.inner.release()


def block_continuation(runner: Any, last: int, k: int) -> list[int]:
    """The target's greedy continuation *as its (k+1)-token verification computes it*, on the
    sequence's own cache (cut back afterwards, so the sequence is unchanged).

    Random weights leave logit margins at bf16 rounding size, so a 1-token step and a (k+1)-token
    step often disagree on argmax, and K/V written by differently shaped passes differ in the last
    bit. Iterating the verification's own shape on the same cache to a fixed point (row j depends
    only on block tokens <= j, so each pass fixes at least one more position) gives exactly the
    tokens the verification accepts: acceptance is then the chosen rate. Called outside the timer."""
    base = runner.length
    guess = [0] * k
    for _ in range(k + 1):
        am = runner.forward(torch.tensor([last, *guess], device="cuda")).argmax(-1).tolist()  # [k+1]
        runner.crop(base)
        if am[:k] == guess:
            break
        guess = am[:k]
    return guess


def decode_tps(engine: Engine, ids: list[int], new: int) -> tuple[float, list[int]]:
    req = GenerationRequest("b", "target", ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), SpecParams(SpecMode.OFF))
    out, stats, _ = engine.generate(req)
    return len(out) / stats.decode_s, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="also try torch.compile + CUDA graphs (compiling the 7B with dynamic T ran past 8 minutes here)")
    args = ap.parse_args()
    R: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.gpu" + (" --quick" if args.quick else ""),
    }
    # fp32 reductions inside bf16 GEMMs: fewer near-tie flips between 1-token and (k+1)-token steps
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    bw = copy_bandwidth()
    R["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    target, draft = build(TARGET, 0), build(DRAFT, 1)
    tb = weight_bytes(target)
    R["target_weight_bytes"], R["draft_weight_bytes"] = tb, weight_bytes(draft)
    R["roofline_tps"] = bw / tb
    ids = torch.randint(0, 150000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    new = 64 if args.quick else NEW

    def engine_with(t_factory, d_factory=None) -> Engine:  # type: ignore[no-untyped-def]
        tok = None
        models = {"target": LoadedModel("target", target, tok, draft="draft", max_context=MAX_LEN, runner_factory=t_factory)}
        if d_factory is not None:
            models["draft"] = LoadedModel("draft", draft, tok, max_context=MAX_LEN, runner_factory=d_factory)
        return Engine(models)

    # 2. target-only decode: transformers eager, our static cache eager, then the fast backends
    tps_hf, _ = decode_tps(engine_with(EagerRunner), ids, 16)
    t_static = StaticModel(target, MAX_LEN, slots=1, graphs=False)
    tps_static, _ = decode_tps(engine_with(t_static.runner), ids, 32)
    R["decode_tps"] = {"transformers_eager": tps_hf, "static_eager": tps_static}
    tok1 = torch.tensor([5], device="cuda")

    def one_step(model: StaticModel, T: int):  # type: ignore[no-untyped-def]
        r = model.runner()
        r.forward(ids, logits=False)
        L = r.length
        toks = torch.arange(T, device="cuda") + 7

        def f():  # type: ignore[no-untyped-def]
            r.forward(toks)
            r.crop(L)
        t = cuda_time(f, 30)
        r.release()
        return t

    backends: dict[str, tuple[StaticModel, StaticModel]] = {}
    variants = [("cuda_graphs", False)] + ([("compile+cuda_graphs", True)] if args.compile else [])
    for name, compile_step in variants:
        try:
            t0 = time.perf_counter()
            tm = StaticModel(target, MAX_LEN, slots=2, graphs=True, compile_step=compile_step)
            dm = StaticModel(draft, MAX_LEN, slots=1, graphs=True, compile_step=compile_step)
            tm.capture(range(1, 10))
            dm.capture(range(1, 10))  # the draft's catch-up after a full acceptance feeds 2 tokens
            setup = time.perf_counter() - t0
            decode_tps(engine_with(tm.runner), ids, 16)  # warm
            tps, ref = decode_tps(engine_with(tm.runner), ids, new)
        except Exception as exc:  # compile can fail on a new torch: record it, keep the rest
            R.setdefault("backend_errors", {})[name] = repr(exc)[:500]
            print(f"{name}: failed: {exc!r}"[:300], flush=True)
            continue
        t1, td = one_step(tm, 1), one_step(dm, 1)
        R.setdefault("backends", {})[name] = b = {
            "setup_s": setup, "decode_tps": tps, "roofline_fraction": tps / R["roofline_tps"],
            "target_step_s": t1, "draft_step_s": td, "c": td / t1,
            "c_v": {k: one_step(tm, k + 1) / t1 for k in range(1, 9)},
        }
        backends[name] = (tm, dm)
        if name == "cuda_graphs":
            reference = ref
        print(f"{name}: setup {setup:.0f}s, {tps:.1f} tok/s ({b['roofline_fraction']:.0%} of {R['roofline_tps']:.0f}); "
              f"target {t1 * 1e3:.2f} ms, draft {td * 1e3:.2f} ms, c = {b['c']:.3f}; "
              f"c_v = {', '.join(f'{v:.2f}' for v in b['c_v'].values())}", flush=True)
    de = StaticModel(draft, MAX_LEN, slots=1, graphs=False)
    R["eager_target_step_s"], R["eager_draft_step_s"] = one_step(t_static, 1), one_step(de, 1)
    hf_t, hf_d = EagerRunner(target), EagerRunner(draft)
    hf_t.forward(ids, logits=False)
    hf_d.forward(ids, logits=False)
    L = hf_t.length
    R["hf_target_step_s"] = cuda_time(lambda: (hf_t.forward(tok1), hf_t.crop(L)), 20)
    R["hf_draft_step_s"] = cuda_time(lambda: (hf_d.forward(tok1), hf_d.crop(L)), 20)
    print(f"eager steps: static target {R['eager_target_step_s'] * 1e3:.2f} ms draft {R['eager_draft_step_s'] * 1e3:.2f} ms; "
          f"hf target {R['hf_target_step_s'] * 1e3:.2f} ms draft {R['hf_draft_step_s'] * 1e3:.2f} ms", flush=True)
    save(R, args.out)
    best_name = min(backends, key=lambda n: R["backends"][n]["c"] * 4 + R["backends"][n]["c_v"][4])
    t_fast, d_fast = backends[best_name]
    B = R["backends"][best_name]
    R["spec_backend"] = best_name
    tps_graph = B["decode_tps"]

    # 4. speculation at controlled acceptance, every k; output must equal target-only output
    from decoding.drafters import DraftModelDrafter

    spec_engine = engine_with(t_fast.runner, d_fast.runner)
    rows = []
    ks = [2, 4, 6] if args.quick else list(range(1, 9))
    for a in (0.6, 0.7, 0.8, 0.9):
        for k in ks:
            gen = torch.Generator().manual_seed(int(a * 100) * 10 + k)
            seq = spec_engine.start(GenerationRequest(
                "s", "target", ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
                SpecParams(SpecMode.DRAFT, max_k=k, adaptive=False)))
            assert isinstance(seq.drafter, DraftModelDrafter)
            replay = Replay(seq.drafter, a, gen, [])
            seq.drafter = replay  # type: ignore[assignment]
            # prefill both caches outside the timer: tok/s here is decode speed, as for target-only
            seq.runner.forward(seq.tokens[:-1], logits=False)
            replay.inner.runner.forward(seq.tokens[:-1], logits=False)
            seq.prefilled = True
            out: list[int] = []
            elapsed = 0.0
            while True:
                kk = min(k, new - seq.completion_tokens - 1)  # as the engine clips k (untimed)
                replay.next_tokens = block_continuation(seq.runner, seq.tokens[-1], kk) if kk > 0 else []
                torch.cuda.synchronize()
                t = time.perf_counter()
                step = spec_engine.step(seq)  # ends in the step's one host sync
                elapsed += time.perf_counter() - t
                out.extend(step.token_ids)
                if step.finish_reason is not None:
                    break
            seq.release()
            tps = len(out) / elapsed
            st = seq.stats
            a_meas = st.acceptance_rate
            pred = (1 - a ** (k + 1)) / ((1 - a) * (k * B["c"] + B["c_v"][k]))
            pred_meas = (1 - a_meas ** (k + 1)) / ((1 - a_meas) * (k * B["c"] + B["c_v"][k])) if a_meas < 1 else float("nan")
            first_diff = next((i for i, (x, y) in enumerate(zip(out, reference, strict=False)) if x != y), None)
            rows.append(dict(a=a, k=k, tps=tps, speedup=tps / tps_graph, predicted=pred, predicted_at_measured=pred_meas,
                             measured_acceptance=a_meas, tokens_per_step=st.mean_accepted_per_step,
                             identical=out == reference, first_diff=first_diff))
            save({**R, "speculative": rows}, args.out)
            print(f"a={a} k={k}: {tps:.1f} tok/s, {tps / tps_graph:.2f}x (pred {pred:.2f}x; at measured a {pred_meas:.2f}x), "
                  f"accept {a_meas:.2f}, tok/step {st.mean_accepted_per_step:.2f}, identical={out == reference}", flush=True)
    R["speculative"] = rows
    R["bf16_divergence"] = _divergence_margins(t_fast, ids, reference, rows)
    with open(args.out, "w") as f:
        json.dump(R, f, indent=1)
    best = max((r for r in rows if r["a"] == 0.8), key=lambda r: r["speedup"])
    print(f"\nbest at a=0.8: k={best['k']} {best['speedup']:.2f}x (pred {best['predicted']:.2f}x)")


def _divergence_margins(t_graph: StaticModel, ids: list[int], reference: list[int], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """For runs that left the reference, the target's top-2 logit margin at the first differing
    position (1-token recomputation): a margin near bf16 rounding means a tie, not a bug."""
    diffs = [r["first_diff"] for r in rows if r["first_diff"] is not None]
    margins = []
    for pos in sorted(set(diffs))[:8]:
        r = t_graph.runner()
        logits = r.forward(ids + reference[:pos])[-1].float()
        top = torch.topk(logits, 2).values
        margins.append(dict(position=pos, margin=float(top[0] - top[1])))
        r.release()
    return {"runs": len(rows), "diverged": len(diffs), "margins": margins}


if __name__ == "__main__":
    main()
