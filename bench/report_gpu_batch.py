"""Render a ``bench.gpu_batch`` results JSON (made on the GPU machine) into docs/benchmarks.md and a plot.

python -m bench.report_gpu_batch bench/results_gpu_batch.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench.report import DOC, write_section

PLOT = DOC.parent / "batched_gpu.png"


def plot(R: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in R["engine"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in ("off", "off_exact", "on", "auto", "auto_fast"):
        if any(mode not in R["engine"][str(n)] for n in ns):
            continue
        ax.plot(
            ns,
            [R["engine"][str(n)][mode]["aggregate_tps"] for n in ns],
            "o-",
            label=f"specgate, speculation {mode}",
        )
    hf = R.get("transformers_tps", {})
    pts = [(n, hf[str(n)]) for n in ns if isinstance(hf.get(str(n)), float)]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "s--", label="transformers static batched generate")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests N")
    ax.set_ylabel("aggregate tok/s")
    ax.set_title(f"7B-shaped target, 0.5B-shaped draft, bf16, random weights, {R['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _auto_fast(row: dict[str, Any]) -> str:
    a = row.get("auto_fast")
    if not a or "error" in a:
        return "-"
    return f"{a['aggregate_tps']:.0f}, {a['aggregate_tps'] / row['off']['aggregate_tps']:.2f}x"


def _invariant(path: Path, E: dict[int, Any]) -> list[str]:
    """The batch-invariant exact mode's run (the same command with every exact-mode matmul and RMSNorm
    through decoding/invariant.py), beside this run's cuBLAS exact mode."""
    if not path.exists():
        return []
    R = json.loads(path.read_text())
    lines = [
        "",
        f"Batch-invariant exact mode, {R['device']}, {R['date']} (`{R['command']}`"
        + ("" if "--batch-invariant" in R["command"] else " with the invariant kernels in exact mode")
        + "; exact mode's matmuls and RMSNorm through decoding/invariant.py, the kernels' own times are "
        "`python -m bench.probe_invariant`). Its cuBLAS column is this run's: where the two runs' dates differ "
        "the code did too, and the ratio compares across them:",
        "",
        "| N | exact off tok/s, cuBLAS | batch-invariant | ratio | batch-invariant: on, auto tok/s | identical on, auto |",
        "|---|---|---|---|---|---|",
    ]
    for n in sorted(int(k) for k in R["engine"]):
        inv, cub = R["engine"][str(n)], E.get(n)
        if cub is None:
            continue
        a, b = cub["off_exact"]["aggregate_tps"], inv["off_exact"]["aggregate_tps"]
        lines.append(
            f"| {n} | {a:.0f} | {b:.0f} | {b / a:.2f}x | {inv['on']['aggregate_tps']:.0f}, "
            f"{inv['auto']['aggregate_tps']:.0f} | {inv['on'].get('identical_to_off', '-')}, "
            f"{inv['auto'].get('identical_to_off', '-')} |"
        )
    return lines


def _exact_widths(R: dict[str, Any]) -> str:
    """How exact mode's rows ran: padded to one width, or at the widths the load showed."""
    shown = R.get("exact_widths")
    if not shown:
        return "every row padded to width 9"
    X = max(max(ws) for ws in shown.values())
    full = [int(B) for B, ws in shown.items() if len(ws) == X]
    part = {int(B): ws for B, ws in shown.items() if len(ws) < X}
    text = (
        "rows at the narrowest width the device showed to round as width 9 does (`decoding.exact`, from "
        f"2026-12-04 15:46 UTC): every width 1..{X} in batch buckets {', '.join(map(str, sorted(full))) or 'none'}"
    )
    for B, ws in sorted(part.items()):
        text += f"; in bucket {B} widths {', '.join(map(str, ws))} (the others pad to the next)"
    return text


def render(path: str) -> None:
    R = json.loads(Path(path).read_text())
    ns = sorted(int(n) for n in R["engine"])
    E = {int(n): v for n, v in R["engine"].items()}
    hf = {int(n): v for n, v in R.get("transformers_tps", {}).items()}
    lines = [
        "## GPU: the batched engine, N concurrent requests",
        "",
        f"Device: {R['device']}"
        + (f" (host CPU: {R['host_cpu']})" if R.get("host_cpu") else "")
        + f", torch {R['torch']}, transformers {R['transformers_version']}, Python {R['python']}. "
        f"Command: `{R['command']}`. Date: {R['date']}. Qwen2.5-7B-shaped target and 0.5B-shaped draft, "
        f"random weights, bf16, {'inductor-compiled layer halves under' if R['compiled'] else ''} CUDA graphs "
        f"keyed by (batch bucket, width), attention by the fused kernel (decoding/kernels.py); {R['prompt']}-token "
        f"prompts, {R['new']} new tokens, greedy, through `AsyncEngine` (prefill budget 256 tokens per step beside decoding rows, up to 2048 in a step "
        "with none: `burst_budget`, from 2026-12-03 20:50 UTC; prompts "
        "and prompt chunks of up to 512 tokens replay CUDA graphs too, attending with the fused chunk kernel). `off`: "
        "fast mode. Speculation is compared in exact mode (docs/architecture.md), where "
        "a verification row rounds as a 1-token row does: "
        + _exact_widths(R)
        + "; in fast mode random weights tie their top logits at bf16 "
        "resolution often enough that outputs part and the replay's reference stops matching. Speculation on: a "
        "replay drafter (the real draft model runs, batched, for its cost; it proposes the target's own continuation "
        f"corrupted to acceptance {R['acceptance']}), k = {R['k_on']}; auto: the same drafter with adaptive k and the "
        "batch-aware cap. Fast auto (from 2026-12-03 20:50 UTC): its replay reference is the run's own output, "
        "from untimed rehearsals each replaying the last one's output until one emits its reference (`rehearsals`), "
        "so that a bf16 tie does not leave the drafts proposing a continuation the target no longer follows; its "
        "identity is still judged against fast `off`. "
        + (
            f"Each engine mode: the median of {R['repeats']} timed runs at each N"
            + (
                f" ({R['small_repeats']} at N <= {R['small_n']}, where one draw moves a run by up to 14% and the "
                "auto goal's margin is ~2%)"
                if R.get("small_repeats", R["repeats"]) > R["repeats"]
                else ""
            )
            + " (every run's outputs checked"
            + (
                "; each speculative run on a replay draw of its own, the same for on, auto and auto fast). "
                if R.get("draws")
                else "). "
            )
            if R.get("repeats", 1) > 1
            else ""
        )
        + (
            f"Serving capture: every batch bucket up to {R['serving']} rows captured and timed before the first "
            "N, as a server's load does. "
            if R.get("serving")
            else ""
        )
        + ("transformers: the best of 3 timed runs at each N. " if R.get("transformers_runs") else "")
        + "Roofline: copy bandwidth / (weights + each row's KV bytes at the mean context) per step.",
        "",
        "| N | off tok/s | off decode, % roofline | exact: off tok/s | exact: on | exact: auto | on, auto / off (exact) | fast: auto tok/s, / off | transformers tok/s | off / transformers | ITL p50 / p99 ms (off) | TTFT p50 ms (off) | identical on, auto, auto fast |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in ns:
        off, offx, on, auto = E[n]["off"], E[n]["off_exact"], E[n]["on"], E[n]["auto"]
        if any("error" in m for m in (off, offx, on, auto)):
            lines.append(f"| {n} | " + " | ".join(m.get("error", "") for m in (off, offx, on, auto)) + " |")
            continue
        h = hf.get(n)
        hs = f"{h:.0f}" if isinstance(h, float) else "-"
        ratio = f"{off['aggregate_tps'] / h:.2f}x" if isinstance(h, float) else "-"
        lines.append(
            f"| {n} | {off['aggregate_tps']:.0f} | {off['decode_tps']:.0f}, {off['roofline_fraction']:.0%} | "
            f"{offx['aggregate_tps']:.0f} | {on['aggregate_tps']:.0f} | {auto['aggregate_tps']:.0f} | "
            f"{on['aggregate_tps'] / offx['aggregate_tps']:.2f}x, {auto['aggregate_tps'] / offx['aggregate_tps']:.2f}x | "
            f"{_auto_fast(E[n])} | "
            f"{hs} | {ratio} | {off['itl_p50_ms']:.1f} / {off['itl_p99_ms']:.1f} | {off['ttft_p50_ms']:.0f} | "
            f"{on.get('identical_to_off', '-')}, {auto.get('identical_to_off', '-')}, "
            f"{E[n].get('auto_fast', {}).get('identical_to_off', '-')} |"
        )
    lines += _partings(E, ns)
    P = R.get("prefill_interference")
    if P:
        lines += [
            "",
            f"While a {P['long_prompt']}-token prompt was prefilled in {P['prefill_budget']}-token chunks beside "
            f"{P['N']} decoding streams ({_ms(P['window_ms'])} ms from its submission to its first token): inter-token "
            f"latency p50 {_ms(P['itl_p50_during_prefill_ms'])} ms and max {_ms(P['itl_max_during_prefill_ms'])} ms "
            f"inside that window, against p50 {_ms(P['itl_p50_ms'])} / p99 {_ms(P['itl_p99_ms'])} ms over the whole run.",
        ]
    lines += [
        "",
        "Greedy outputs with speculation are compared with speculation off at the same N: in bf16 (fast mode) a "
        "verification row and a 1-token row may round apart where the top two logits tie, so a difference there is "
        "a tie, not a lost guarantee; the float32 tests (`tests/decoding/test_batch.py`, `test_gpu.py`) require "
        "identity. Exact mode is width-invariant, not batch-invariant: rows finish at different steps with "
        "speculation, and a batch that drops to a smaller graph bucket runs its GEMMs at another M, whose cuBLAS "
        "kernel rounds a row differently; the exact runs here keep their starting bucket as rows finish "
        "(`StaticModel.exact_min_rows`, the padding's cost in their times), so their rows compute as the plain "
        "run's do. `batch_invariant: true` makes a row's bits independent of the rest of the batch, at a price:",
    ]
    lines += _invariant(Path(path).with_name("results_gpu_batch_invariant.json"), E)
    lines += ["", f"![aggregate tok/s by N]({PLOT.name})"]
    write_section("gpu-batch", "\n".join(lines))
    plot(R)


def _partings(E: dict[str, Any], ns: list[str]) -> list[str]:
    """Where speculative outputs parted from speculation off, with the target's logits there
    (gpu_batch.parting): the two tokens' gap in units of bf16's spacing at their magnitude."""
    said = []
    for n in ns:
        for mode in ("on", "auto", "auto_fast"):
            parted = E[n].get(mode, {}).get("parted")
            if parted is None:
                continue
            if parted:
                worst = max(abs(p["gap"]) / p["spacing"] for p in parted)
                said.append(
                    f"N = {n} {mode.replace('_', ' ')}: {len(parted)} row(s), first at token "
                    f"{min(p['at'] for p in parted)}, gap at most {worst:.1f} spacing(s)"
                )
    if not said:
        return []
    return [
        "",
        "Outputs that parted from speculation off, and the target's logits where they did (a bf16 forward of the "
        "shared prefix; the gap between the two tokens' logits in units of bf16's spacing at their magnitude; a "
        "gap within a spacing or two is a rounding tie): " + "; ".join(said) + ".",
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    render(ap.parse_args().json)


if __name__ == "__main__":
    main()
