"""Structured outputs and Predicted Outputs on the CPU, real pair (Qwen2.5-Coder 1.5B + 0.5B draft, bf16).

1. The grammar engine (llguidance) alone: tokenizer build, grammar compile, and mask time per token
   (one position, and k+1 positions along a draft path in one call), on the tiny byte tokenizer and
   on Qwen's 151K vocabulary; set against the target's measured decode step.
2. JSON-schema-constrained generation, greedy: tok/s without speculation, with the draft model and
   with prompt lookup (outputs checked identical, and valid JSON).
3. Predicted Outputs on code edits whose prediction is the original code: tokens per target forward
   pass and wall time, against no prediction and against prompt lookup (outputs checked identical).

    python -m bench.structured [--new 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from bench.cpu_engine import load_pair
from bench.report import stamp, write_section
from decoding import tiny
from decoding.constraints import Constraint
from decoding.engine import Engine
from decoding.grammar import ll_tokenizer
from decoding.loader import cpu_bf16_features
from decoding.params import GenerationRequest, GrammarSpec, SamplingParams, SpecMode, SpecParams
from gateway.grammars import tool_grammar

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "language": {"enum": ["python", "rust", "go", "java"]},
        "stars": {"type": "integer", "minimum": 0},
        "topics": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "license": {"type": "object", "properties": {"spdx": {"type": "string"}, "osi": {"type": "boolean"}},
                    "required": ["spdx", "osi"], "additionalProperties": False},
    },
    "required": ["name", "language", "stars", "topics", "license"],
    "additionalProperties": False,
}  # fmt: skip
JSON_PROMPTS = [
    "Describe the requests Python library as a JSON record.",
    "Give a JSON record for the ripgrep project.",
    "Return a JSON record describing the Go project hugo.",
]
CODE_A = (
    "def calc(items):\n    t = 0\n    for name, price, q in items:\n        if q <= 0:\n            continue\n"
    "        t += price * q\n    return t\n\n\ndef report(items):\n    total = calc(items)\n"
    "    print(f'{len(items)} items, total {total:.2f}')\n    return total\n"
)
CODE_B = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
    "        self.items.append(x)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def size(self):\n        return len(self.items)\n"
)
EDITS = [
    (
        "Rename the function `calc` to `total_price` in this code and return the whole code, no commentary:",
        CODE_A,
    ),
    ("Add a docstring to the `pop` method in this code and return the whole code, no commentary:", CODE_B),
]


def grammar_costs(models: dict[str, Any]) -> dict[str, Any]:
    """llguidance alone: build, compile, and masks along a real JSON output's tokens."""
    out: dict[str, Any] = {}
    target = models["target"]
    qwen, V = target.tokenizer, target.vocab_size
    record = json.dumps({"name": "requests", "language": "python", "stars": 51000,
                         "topics": ["http", "client"], "license": {"spdx": "Apache-2.0", "osi": True}})  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip
    for name, tok, vocab in (
        ("tiny (259 tokens)", tiny.byte_tokenizer(), 259),
        ("Qwen2.5 (151,936)", qwen, V),
    ):
        eos = (int(tok.eos_token_id),)
        t0 = time.perf_counter()
        ll_tokenizer(tok, vocab, eos)
        build = time.perf_counter() - t0
        compiles = {}
        for gname, spec in (
            ("record schema", GrammarSpec("json_schema", json.dumps(RECORD))),
            ("tool call", GrammarSpec("lark", tool_grammar(tools, True), param="tools")),
        ):
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                Constraint(spec, tok, vocab, eos)
                ts.append(time.perf_counter() - t0)
            compiles[gname] = statistics.median(ts)
        c = Constraint(GrammarSpec("json_schema", json.dumps(RECORD)), tok, vocab, eos)
        ids = tok.encode(record, add_special_tokens=False)
        one, path = [], []
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            c.masks([])
            one.append(time.perf_counter() - t0)
            drafts = ids[i : i + 4]
            t0 = time.perf_counter()
            c.masks(drafts)
            path.append(time.perf_counter() - t0)
            c.commit([t])
        out[name] = {
            "tokenizer_build_s": build,
            "compile_s": compiles,
            "mask_1_ms": 1e3 * statistics.mean(one),
            "mask_path5_ms": 1e3 * statistics.mean(path),
            "tokens": len(ids),
        }
    return out


def run(engine: Engine, ids: list[int], mode: SpecMode, new: int, **kw: Any) -> dict[str, Any]:
    req = GenerationRequest(
        "b", "target", ids, SamplingParams(max_tokens=new, temperature=0), SpecParams(mode, max_k=8), **kw
    )
    t0 = time.perf_counter()
    tokens, stats, _ = engine.generate(req)
    wall = time.perf_counter() - t0
    print(f"  {mode.value}{' +prediction' if kw.get('prediction') else ''}: {len(tokens)} tokens, {stats.steps} "
          f"passes, {wall:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    return {"tokens": tokens, "wall_s": wall, "tok_s": len(tokens) / wall, "per_pass": stats.tokens_per_step,
            "steps": stats.steps, "decode_step_ms": 1e3 * stats.decode_s / max(stats.steps, 1)}  # fmt: skip


def chat(tok: Any, text: str) -> list[int]:
    return list(
        tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args(argv)
    models = load_pair()
    engine = Engine(models)
    tok = models["target"].tokenizer
    grammar = grammar_costs(models)
    print(json.dumps(grammar), file=sys.stderr, flush=True)
    g = GrammarSpec("json_schema", json.dumps(RECORD))
    run(engine, chat(tok, "hi"), SpecMode.OFF, 8, grammar=g)  # warm-up
    constrained: list[dict[str, Any]] = []
    for p in JSON_PROMPTS:
        ids = chat(tok, p)
        row = {
            m.value: run(engine, ids, m, args.new, grammar=g)
            for m in (SpecMode.OFF, SpecMode.DRAFT, SpecMode.NGRAM)
        }
        row["identical"] = len({tuple(r["tokens"]) for r in row.values()}) == 1
        text = tok.decode(row["off"]["tokens"], skip_special_tokens=True)
        try:
            json.loads(text)
            row["valid"] = True
        except ValueError:
            row["valid"] = False  # a record longer than --new tokens is cut (finish length)
        constrained.append(row)
    predicted: list[dict[str, Any]] = []
    for instruction, code in EDITS:
        ids = chat(tok, f"{instruction}\n\n```python\n{code}```")
        pred = tuple(tok.encode(f"```python\n{code}```", add_special_tokens=False))
        new = len(pred) + 16
        row = {
            "none": run(engine, ids, SpecMode.OFF, new),
            "ngram": run(engine, ids, SpecMode.NGRAM, new),
            "prediction": run(engine, ids, SpecMode.AUTO, new, prediction=pred),
        }
        row["identical"] = len({tuple(r["tokens"]) for r in row.values()}) == 1
        predicted.append(row)
    write_section("structured", render(grammar, constrained, predicted, args.new))


def render(
    grammar: dict[str, Any], constrained: list[dict[str, Any]], predicted: list[dict[str, Any]], new: int
) -> str:
    step_ms = statistics.median(r["off"]["decode_step_ms"] for r in constrained)
    lines = [
        "## Structured outputs and Predicted Outputs on the CPU (real pair)",
        "",
        f"{stamp()} bf16 matrix instructions: {', '.join(cpu_bf16_features()) or 'none'}. "
        "The 2 cores are shared with other work, so wall times are noisy; token counts are not.",
        "",
        "**Grammar engine (llguidance) alone.** Mask: allowed tokens at one position; path: the 5 masks "
        "of a 4-token draft path in one call. Per token of a real JSON record; compile: median of 5.",
        "",
        "| tokenizer | tokenizer build | compile: record schema | compile: tool call | mask, 1 position | masks, draft path of 5 |",
        "|---|---|---|---|---|---|",
    ]
    for name, g in grammar.items():
        lines.append(
            f"| {name} | {g['tokenizer_build_s'] * 1e3:.0f} ms | {g['compile_s']['record schema'] * 1e3:.2f} ms | "
            f"{g['compile_s']['tool call'] * 1e3:.2f} ms | {g['mask_1_ms']:.3f} ms | {g['mask_path5_ms']:.3f} ms |"
        )
    q = grammar["Qwen2.5 (151,936)"]
    lines += [
        "",
        f"Target decode step, constrained, no speculation (median over prompts): {step_ms:.0f} ms, so one mask "
        f"is {100 * q['mask_1_ms'] / step_ms:.2f}% of a step and a 5-position draft path "
        f"{100 * q['mask_path5_ms'] / step_ms:.2f}% (goal: <= 5%).",
        "",
        f"**JSON-schema-constrained generation**, greedy, up to {new} new tokens, a 5-field record schema "
        "(nested object, enum, integer range, bounded array):",
        "",
        "| prompt | off tok/s | draft tok/s | ngram tok/s | tokens/pass off / draft / ngram | identical | valid JSON |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(constrained):
        lines.append(
            f"| {i + 1} | {r['off']['tok_s']:.2f} | {r['draft']['tok_s']:.2f} | {r['ngram']['tok_s']:.2f} | "
            f"{r['off']['per_pass']:.2f} / {r['draft']['per_pass']:.2f} / {r['ngram']['per_pass']:.2f} | "
            f"{r['identical']} | {r['valid']} |"
        )
    lines += [
        "",
        "(Speculation off still takes one token per target pass; with a drafter, grammar-forced tokens are "
        "proposed as free drafts on top of the drafter's.)",
        "",
        "**Predicted Outputs** on code edits whose prediction is the original code (greedy):",
        "",
        "| edit | tokens | tokens/pass: none / prompt lookup / prediction | wall s: none / lookup / prediction | speedup over none | identical |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(predicted):
        n, g, p = r["none"], r["ngram"], r["prediction"]
        lines.append(
            f"| {i + 1} | {len(n['tokens'])} | {n['per_pass']:.2f} / {g['per_pass']:.2f} / {p['per_pass']:.2f} | "
            f"{n['wall_s']:.1f} / {g['wall_s']:.1f} / {p['wall_s']:.1f} | {n['wall_s'] / p['wall_s']:.2f}x | "
            f"{r['identical']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
