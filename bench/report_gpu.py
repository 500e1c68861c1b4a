"""Render a ``bench.gpu`` results JSON (made on the GPU machine) into docs/benchmarks.md and a plot.

    python -m bench.report_gpu bench/results_gpu.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.report import DOC, write_section

PLOT = DOC.parent / "speculative_gpu.png"


def plot(R: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for a in sorted({r["a"] for r in R["speculative"]}):
        rows = [r for r in R["speculative"] if r["a"] == a]
        ks = [r["k"] for r in rows]
        line = ax.plot(ks, [r["speedup"] for r in rows], "o-", label=f"measured, a={a}")[0]
        ax.plot(ks, [r["predicted"] for r in rows], "--", color=line.get_color(), alpha=0.6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over target-only (CUDA graphs)")
    ax.set_title(f"7B-shaped target, 0.5B-shaped draft, bf16, {R['device']}\n(dashed: (1-a^(k+1)) / ((1-a)(k c + c_v(k))))", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def render(R: dict[str, Any], source: str) -> str:
    B = R["backends"][R["spec_backend"]]
    bw = R["copy_bandwidth_Bps"]
    best = {a: max((r for r in R["speculative"] if r["a"] == a), key=lambda r: r["speedup"]) for a in (0.6, 0.7, 0.8, 0.9)}
    within = [abs(r["speedup"] / r["predicted"] - 1) for r in R["speculative"]]
    lines = [
        "## GPU: the fast path and speculation at controlled acceptance",
        "",
        f"Device: {R['device']} (the `device` tool's lent machine), torch {R['torch']}, transformers {R['transformers']}, "
        f"Python {R['python']}. Command: `{R['command']}` (results: `{source}`; this section: "
        f"`python -m bench.report_gpu {source}`). Date: {R['date']}.",
        "",
        "Qwen2.5-7B-shaped target and Qwen2.5-0.5B-shaped draft built from their configs with random weights "
        "(weights cannot reach the GPU machine; speed does not depend on their values), bf16, batch 1, "
        "128-token prompt, 256 new tokens, greedy.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| device copy bandwidth (read + write) | {bw / 1e12:.2f} TB/s |",
        f"| target weights | {R['target_weight_bytes'] / 1e9:.2f} GB, so the bandwidth roofline is {R['roofline_tps']:.0f} tok/s |",
        f"| transformers eager decode (HF DynamicCache) | {R['decode_tps']['transformers_eager']:.1f} tok/s |",
        f"| our static cache, eager | {R['decode_tps']['static_eager']:.1f} tok/s |",
        f"| our static cache + CUDA graphs | **{B['decode_tps']:.1f} tok/s = {B['roofline_fraction']:.0%} of roofline** (goal 70%: not met) |",
        f"| target step (1 token), graphs / static eager / transformers eager | {B['target_step_s'] * 1e3:.2f} / {R['eager_target_step_s'] * 1e3:.2f} / {R['hf_target_step_s'] * 1e3:.2f} ms |",
        f"| draft step (1 token), graphs / static eager / transformers eager | {B['draft_step_s'] * 1e3:.2f} / {R['eager_draft_step_s'] * 1e3:.2f} / {R['hf_draft_step_s'] * 1e3:.2f} ms |",
        f"| draft cost c = draft step / target step (graphs) | **{B['c']:.3f}** (eager: {R['eager_draft_step_s'] / R['eager_target_step_s']:.2f}) |",
        "| verification cost c_v(k) = (k+1)-token step / 1-token step, k = 1..8 | "
        + ", ".join(f"{v:.2f}" for v in B["c_v"].values()) + " |",
        "",
        "Speculation with the replay drafter (benchmark-only: the real draft model runs its k steps for their cost, "
        "the proposal is the target's own continuation, each token kept with probability a and otherwise replaced, "
        "so the target's verification is real). Speedup over target-only on CUDA graphs; prediction "
        "(1 - a^(k+1)) / ((1 - a)(k c + c_v(k))) with the measured c and c_v:",
        "",
        "| a | best k | tok/s | speedup | predicted | tokens per step |",
        "|---|---|---|---|---|---|",
    ]
    for a, r in best.items():
        lines.append(f"| {a} | {r['k']} | {r['tps']:.1f} | {r['speedup']:.2f}x | {r['predicted']:.2f}x | {r['tokens_per_step']:.2f} |")
    div = R["bf16_divergence"]
    lines += [
        "",
        f"![speedup vs k]({PLOT.name})",
        "",
        f"Across all {len(R['speculative'])} runs (a in 0.6..0.9, k = 1..8) the measured speedup is within "
        f"{max(within):.0%} of the prediction (median {sorted(within)[len(within) // 2]:.0%}): the cost model holds, "
        f"so the goal of 2.5x at a = 0.8 is out of reach while c = {B['c']:.2f}. It would need c near 0.05: the draft's "
        "24 layers are ~40 small kernels each, and at batch 1 their execution floor (not launch overhead, which the "
        "graphs removed: 14.3 ms eager to 2.7 ms) sets the draft step. Fusing them (torch.compile's inductor, or "
        "TensorRT) is the next step; `--compile` tries it, but compiling the 7B with dynamic T outran a 10-minute call "
        "here and was not measured. TensorRT could not be installed on the GPU machine (its wheels exceed what a call "
        "carries): the `tensorrt` backend is written but was not run.",
        "",
        f"Token identity in bf16: all {div['runs']} speculative runs left the 1-token-step reference somewhere "
        "(first differing positions: " + ", ".join(str(m["position"]) for m in div["margins"]) + "), with the target's "
        "top-2 logit margin there: " + ", ".join(f"{m['margin']:.3f}" for m in div["margins"]) + ". Random weights give "
        "near-uniform logits whose top two tie at bf16 resolution (a margin of 0.0 is an exact tie), so a "
        "(k+1)-token verification and a 1-token step round them differently; transformers' own 5-token step disagreed "
        "with five 1-token steps on 2 of 5 positions in the same setting (`bench/debug_graphs.py`). The engine's "
        "exactness is tested in float32 (CPU, tiny and real models) and on the GPU in float32 (`tests/decoding/test_gpu.py`, "
        "run on the H200: graph replays equal the eager static forward bit for bit, speculation output equals target-only).",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    args = ap.parse_args()
    R = json.loads(Path(args.results).read_text())
    plot(R)
    write_section("gpu", render(R, args.results))


if __name__ == "__main__":
    main()
