"""CPU benchmark on the real pair (Qwen2.5-Coder 1.5B target, 0.5B draft), bf16, greedy, 128 new tokens.

In one process, interleaved per prompt after a warm-up: target-only, our draft-model speculation,
our prompt lookup, and what a user would pick instead: transformers' ``generate(assistant_model=)``
and ``generate(prompt_lookup_num_tokens=)``. Every output is checked token-identical to target-only.
Tok/s is new tokens over wall time of the whole call (prefill included, for every method alike).

    python -m bench.cpu_engine [--new 128] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.report import stamp, write_section
from decoding.engine import Engine, LoadedModel
from decoding.loader import ModelSpec, cpu_bf16_features, load_all
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams

PROMPTS = {
    "palindrome code": "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "hash-map explanation": "Explain how a hash map handles collisions, with separate chaining and open addressing.",
    "code edit": (
        "Rename the function `calc` to `total_price` and the variable `q` to `quantity` in this code, and "
        "return the whole code:\n\n```python\ndef calc(items):\n    t = 0\n    for name, price, q in items:\n"
        "        if q <= 0:\n            continue\n        t += price * q\n    return t\n\n\ndef report(items):\n"
        "    total = calc(items)\n    print(f'{len(items)} items, total {total:.2f}')\n    return total\n```"
    ),
    "extraction": (
        "From this log, list every line that has level ERROR, exactly as written:\n\n"
        "2026-11-01 10:00:01 INFO server started on port 8080\n2026-11-01 10:00:05 ERROR database connection refused: "
        "host=db.internal port=5432\n2026-11-01 10:00:06 INFO retrying in 5s\n2026-11-01 10:00:11 ERROR database "
        "connection refused: host=db.internal port=5432\n2026-11-01 10:00:16 WARN falling back to read replica\n"
        "2026-11-01 10:00:17 ERROR replica lag too high: 42s > 30s\n2026-11-01 10:00:20 INFO serving read-only"
    ),
    "haiku": "Write a haiku about autumn rain on a city street.",
    "arithmetic": "What is 17 * 23 + 144 / 12? Show the steps.",
}
GROUNDED = ("code edit", "extraction")
RESULTS = Path(__file__).with_name("results_cpu.json")  # every number, outputs included


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    models = load_pair()
    load_s = time.perf_counter() - t0
    engine = Engine(models)
    tok = models["target"].tokenizer
    target, draft = models["target"].model, models["draft"].model

    def ours(mode: SpecMode) -> Callable[[list[int]], tuple[list[int], dict[str, Any]]]:
        def run(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
            req = GenerationRequest(
                "b",
                "target",
                ids,
                SamplingParams(max_tokens=args.new, temperature=0),
                SpecParams(mode, max_k=8),
            )
            out, stats, _ = engine.generate(req)
            return out, {
                "accept": stats.acceptance_rate,
                "per_step": stats.tokens_per_step,
                "off": stats.spec_disabled_steps,
            }

        return run

    def hf(**kw: Any) -> Callable[[list[int]], tuple[list[int], dict[str, Any]]]:
        def run(ids: list[int]) -> tuple[list[int], dict[str, Any]]:
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = target.generate(
                    x, attention_mask=torch.ones_like(x), max_new_tokens=args.new, do_sample=False, **kw
                )
            new = out[0, len(ids) :].tolist()
            eos = set(models["target"].eos_token_ids)
            cut = next((i for i, t in enumerate(new) if t in eos), len(new))
            return new[:cut], {}

        return run

    methods = {
        "target-only": ours(SpecMode.OFF),
        "specgate draft": ours(SpecMode.DRAFT),
        "specgate prompt lookup": ours(SpecMode.NGRAM),
        "transformers assisted": hf(assistant_model=draft),
        "transformers prompt lookup": hf(prompt_lookup_num_tokens=10),
    }
    encoded = encode_prompts(tok)
    costs = step_costs(models, encoded["haiku"])
    print("step costs", costs, flush=True)
    warm = encoded["haiku"][:20]
    for run in methods.values():  # warm-up: first-call allocations and thread pools stay out of the numbers
        run(warm)

    results: dict[str, dict[str, dict[str, Any]]] = {}
    names = list(methods)
    for i, (prompt, ids) in enumerate(encoded.items()):
        results[prompt] = {}
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate so no method always runs first
        for m in order:
            t = time.perf_counter()
            out, info = methods[m](ids)
            dt = time.perf_counter() - t
            results[prompt][m] = {"tokens": out, "tps": len(out) / dt, **info}
            print(f"{prompt:22s} {m:28s} {len(out):4d} tok {len(out) / dt:6.2f} tok/s {info}", flush=True)
        ref = results[prompt]["target-only"]["tokens"]
        for m in names:
            results[prompt][m]["identical"] = results[prompt][m]["tokens"] == ref
    ours_names = [m for m in names if m.startswith("specgate")]
    differed = [p for p, row in results.items() if not all(row[m]["identical"] for m in ours_names)]
    exact = exact_check(models, {p: encoded[p] for p in differed}, args.new)
    RESULTS.write_text(
        json.dumps({"results": results, "names": names, "load_s": load_s, "costs": costs, "exact": exact})
    )
    write_section("cpu-engine", render(results, names, load_s, costs, exact))


def load_pair() -> dict[str, LoadedModel]:
    """The real pair in bf16 on the CPU, the target drafting with the 0.5B."""
    return load_all(
        [
            ModelSpec("target", "qwen2.5-coder-1.5b", draft="draft", dtype="bfloat16", device="cpu"),
            ModelSpec("draft", "qwen2.5-coder-0.5b", dtype="bfloat16", device="cpu"),
        ]
    )


def encode_prompts(tok: Any) -> dict[str, list[int]]:
    """PROMPTS as chat-templated token ids."""
    return {
        name: list(
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for name, p in PROMPTS.items()
    }


def exact_check(
    models: dict[str, Any], prompts: dict[str, list[int]], new: int
) -> dict[str, dict[str, bool]]:
    """The prompts where eager speculation left target-only, again on ``backend: static`` in exact mode
    (1K context): is every speculative output token-identical to that backend's target-only output?"""
    from dataclasses import replace

    from decoding.static import StaticModel

    exact_models = {}
    for name in ("target", "draft"):
        static = StaticModel(models[name].model, max_len=1024, slots=2, graphs=False, exact=True)
        exact_models[name] = replace(
            models[name],
            max_context=1024,
            runner_factory=static.runner,
            draft_runner_factory=static.draft_runner,
        )
    engine = Engine(exact_models)
    out: dict[str, dict[str, bool]] = {}
    for prompt, ids in prompts.items():
        p = SamplingParams(max_tokens=new, temperature=0)
        ref, _, _ = engine.generate(GenerationRequest("r", "target", ids, p, SpecParams(SpecMode.OFF)))
        out[prompt] = {}
        for mode in (SpecMode.DRAFT, SpecMode.NGRAM):
            got, _, _ = engine.generate(GenerationRequest("s", "target", ids, p, SpecParams(mode, max_k=8)))
            out[prompt][mode.value] = got == ref
        print(f"exact mode on {prompt}: {out[prompt]}", flush=True)
    return out


def exact_line(exact: dict[str, dict[str, bool]] | None) -> str:
    if not exact:
        return "Every specgate output matched target-only, so the exact-mode check had nothing to rerun."
    checks = [ok for row in exact.values() for ok in row.values()]
    return (
        f"Where a specgate output left target-only ({', '.join(exact)}), it is at a rounding tie: this CPU "
        "computes 1-row and multi-row bf16 steps with different kernels. The same requests on `backend: static` "
        "in exact mode (docs/architecture.md, Exact mode) came out "
        f"token-identical to that backend's target-only output in {sum(checks)} of {len(checks)} runs "
        "(draft and prompt lookup)."
    )


def step_costs(models: dict[str, Any], ids: list[int]) -> dict[str, float]:
    """Median seconds of a 1-token target step, a (k+1)-token verification and a 1-token draft step:
    whether speculation can pay on this CPU at all is decided here (c and c_v)."""
    from decoding.runner import EagerRunner

    out: dict[str, float] = {}
    for name, sizes in (("target", (1, 3, 5)), ("draft", (1,))):
        r = EagerRunner(models[name].model)
        r.forward(ids, logits=False)
        L = r.length
        for T in sizes:
            times = []
            for _ in range(5):
                t = time.perf_counter()
                r.forward(list(range(100, 100 + T)))
                times.append(time.perf_counter() - t)
                r.crop(L)
            out[f"{name}_T{T}"] = statistics.median(times)
    return out


def render(
    results: dict[str, dict[str, dict[str, Any]]],
    names: list[str],
    load_s: float,
    costs: dict[str, float],
    exact: dict[str, dict[str, bool]] | None = None,
) -> str:
    lines = [
        "## Engine on the CPU: the real pair",
        "",
        stamp(),
        "",
        "Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft (both from the pinned GGUFs, converted to safetensors, bf16), "
        "greedy, up to 128 new tokens, chat template. Tok/s = new tokens / wall time of the call, prefill included. "
        f"Models loaded from the converted store in {load_s:.1f} s. `identical` = token-identical to target-only.",
        "",
        f"Step costs on this CPU (bf16, median of 5): target 1 token {costs['target_T1'] * 1e3:.0f} ms, "
        f"3 tokens {costs['target_T3'] * 1e3:.0f} ms, 5 tokens {costs['target_T5'] * 1e3:.0f} ms "
        f"(c_v(2) = {costs['target_T3'] / costs['target_T1']:.2f}, c_v(4) = {costs['target_T5'] / costs['target_T1']:.2f}); "
        f"draft 1 token {costs['draft_T1'] * 1e3:.0f} ms (c = {costs['draft_T1'] / costs['target_T1']:.2f}). "
        f"CPU bf16 features: {', '.join(cpu_bf16_features()) or 'none (AVX2 only)'}. "
        + (
            "Verifying k+1 tokens costs about one step here, so speculation pays wherever the draft is accepted."
            if costs["target_T5"] / costs["target_T1"] < 2
            else "Speculation pays only where verifying k+1 tokens costs little more than one step; here c_v(k) "
            "grows like k+1 (without bf16 matrix instructions torch runs bf16 GEMMs with M > 1 as M separate "
            "passes), no acceptance rate makes it pay, and the engine's goodput check keeps it off."
        ),
        "",
        "| prompt | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for prompt, row in results.items():
        base = row["target-only"]["tps"]
        cells = []
        for m in names:
            r = row[m]
            cell = f"{r['tps']:.2f}" if m == "target-only" else f"{r['tps']:.2f} ({r['tps'] / base:.2f}x)"
            if "accept" in r and m != "target-only":
                cell += f", acc {r['accept']:.0%}, {r['per_step']:.2f}/step"
            if not r["identical"]:
                cell += " **differs**"
            cells.append(cell)
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    med = {
        m: statistics.median(row[m]["tps"] / row["target-only"]["tps"] for row in results.values())
        for m in names
    }
    lines += [
        "",
        "Median speedup over target-only: "
        + ", ".join(f"{m} {v:.2f}x" for m, v in med.items() if m != "target-only")
        + ".",
    ]
    ratio = statistics.median(
        row["specgate draft"]["tps"] / row["transformers assisted"]["tps"] for row in results.values()
    )
    worst = min(
        min(row[m]["tps"] / row["target-only"]["tps"] for m in ("specgate draft",))
        for row in results.values()
    )
    grounded = [
        row["specgate prompt lookup"]["tps"] / row["transformers prompt lookup"]["tps"]
        for p, row in results.items()
        if p in GROUNDED
    ]
    ours = [m for m in names if m.startswith("specgate")]
    identical = all(row[m]["identical"] for row in results.values() for m in ours)
    theirs = [
        f"{m} on {p}"
        for p, row in results.items()
        for m in names
        if not m.startswith("specgate") and not row[m]["identical"]
    ]
    lines += [
        "",
        "Goals:",
        f"- draft-model speculation vs transformers' assisted generation, median: {ratio:.2f}x (goal >= 1.2x)",
        f"- slowest prompt under draft speculation vs target-only: {worst:.2f}x (goal >= 0.95x)",
        "- prompt lookup vs transformers' prompt lookup on input-grounded prompts: "
        + ", ".join(f"{g:.2f}x" for g in grounded)
        + " (goal >= 1.0x)",
        f"- every specgate output token-identical to target-only: {'yes' if identical else 'NO'}",
        "",
        exact_line(exact),
        "",
        "transformers' outputs that differ from target-only: "
        + (", ".join(theirs) or "none")
        + ". Its multi-token verification rounds differently from its single steps in bf16, so near-ties flip.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
