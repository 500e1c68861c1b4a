"""CPU benchmark: prefix caching across requests on the llama.cpp backend (issue 50), on the real pair
(Qwen2.5-Coder 1.5B target, 0.5B draft, the pinned Q4_K_M GGUFs), through ``AsyncEngine`` as the
server runs it (64-token prompt chunks, speculation on auto, greedy).

  - the agent conversation: a system prompt and a ~700-token file, then short follow-ups, each turn
    resending the whole conversation with the 24 tokens answered before; time to first token per
    turn with the slots' KV kept (prefix caching on) and for the same turn with it off, turn by
    turn, interleaved;
  - a ~2,000-token tool-definition system prompt shared by two conversations: the second one's first
    turn, which reuses the first's prefix from another slot, against the same turn cold.

Outputs with the cache on are checked token-identical to those with it off. llama.cpp's own
``llama-server`` is not run here (``bench.cpu_llamacpp`` says how one was built; the issue has its
figures on this machine kind).

    python -m bench.cpu_prefix [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from bench.cpu_llamacpp import cpu_line
from bench.report import cpu_kind, stamp, write_section
from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from decoding.llamacpp import LlamaCppModel
from decoding.loader import ModelSpec, load_all
from decoding.params import GenerationRequest, SamplingParams

KIND = cpu_kind()
RESULTS = Path(__file__).with_name(f"results_cpu_prefix_{KIND}.json")
SECTION = f"cpu-prefix-{KIND}"
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
NEW = 24  # tokens answered a turn
SYSTEM = "You are a coding agent working in a Python repository. Be brief and precise."
FOLLOW_UPS = [
    "What does verify_greedy return when every drafted token is accepted?",
    "Why is u * p < q used instead of dividing?",
    "Which function would you test first, and how?",
    "Rename verify_greedy_batch to verify_rows and show the new signature.",
]


def file_excerpt(tok: Any, tokens: int = 700) -> str:
    """The first ``tokens`` or so of a source file of this repository, whole lines."""
    lines, n = [], 0
    for line in (Path(__file__).parent.parent / "decoding" / "verify.py").read_text().splitlines():
        n += len(tok(line + "\n")["input_ids"])
        if n > tokens:
            break
        lines.append(line)
    return "\n".join(lines)


def tools(n: int = 14) -> list[dict[str, Any]]:
    """Tool definitions of an agent (~2,000 tokens with the chat template)."""
    verbs = ["read", "write", "search", "list", "run", "patch", "diff", "test", "lint", "format", "blame",
             "grep", "fetch", "summarize"]  # fmt: skip
    return [
        {
            "type": "function",
            "function": {
                "name": f"{v}_files",
                "description": f"{v.capitalize()} files of the repository the agent works on. Paths are "
                "relative to the repository root; globs are expanded; results are truncated to the "
                "limit given, with a note saying how many were left out.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "paths": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "Paths or globs.",
                        },
                        "limit": {"type": "integer", "description": "The most results to return."},
                        "recursive": {"type": "boolean", "description": "Descend into directories."},
                        "encoding": {"type": "string", "enum": ["utf-8", "latin-1"]},
                    },
                    "required": ["paths"],
                },
            },
        }
        for v in verbs[:n]
    ]


def chat_ids(
    tok: Any, messages: list[dict[str, str]], tool_defs: list[dict[str, Any]] | None = None
) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tool_defs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"])


async def ttft(ae: AsyncEngine, ids: list[int], rid: str) -> tuple[float, list[int], int]:
    """Seconds to the first token, the NEW tokens answered, and the prompt tokens reused."""
    req = GenerationRequest(rid, "target", ids, SamplingParams(max_tokens=NEW, temperature=0))
    t0 = time.perf_counter()
    first: float | None = None
    out: list[int] = []
    cached = 0
    async for step in ae.generate(req):
        if step.token_ids and first is None:
            first = time.perf_counter() - t0
        out += step.token_ids
        cached = step.cached_tokens
    assert first is not None
    return first, out, cached


def caching(models: dict[str, Any], on: bool) -> None:
    for m in models.values():
        m.model.llama.prefix_cache = on


def forget(models: dict[str, Any]) -> None:
    """Every slot's KV dropped (between requests: all slots free), so the next request is cold."""
    for m in models.values():
        llama: LlamaCppModel = m.model.llama
        for slot in range(llama.slots):
            llama.cut(slot, 0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    models = load_all(
        [
            ModelSpec("target", PAIR[0], draft="draft", backend="llamacpp", slots=8, max_context=4096),
            ModelSpec("draft", PAIR[1], backend="llamacpp", slots=8, max_context=4096),
        ]
    )
    ae = AsyncEngine(Engine(models))
    tok = models["target"].tokenizer
    try:
        await ttft(ae, chat_ids(tok, [{"role": "user", "content": "hi"}]), "warm-up")
        forget(models)
        messages = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Here is decoding/verify.py:\n\n{file_excerpt(tok)}\n\n{FOLLOW_UPS[0]}",
            },
        ]
        turns = []
        for t in range(args.turns):
            ids = chat_ids(tok, messages)
            row: dict[str, Any] = {"prompt_tokens": len(ids)}
            for on in (True, False):  # on first: the first turn's is cold
                caching(models, on)
                row["on" if on else "off"], out, cached = await ttft(ae, ids, f"turn{t}-{on}")
                row["cached" if on else "cached_off"] = cached
                row["tokens_on" if on else "tokens_off"] = out
            row["identical"] = row.pop("tokens_on") == row.pop("tokens_off")
            print(f"turn {t + 1}: {row}", flush=True)
            turns.append(row)
            answer = str(tok.decode(out, skip_special_tokens=True))
            messages += [{"role": "assistant", "content": answer}]
            messages += [{"role": "user", "content": FOLLOW_UPS[(t + 1) % len(FOLLOW_UPS)]}]
        forget(models)
        caching(models, True)
        defs = tools()
        convs = [
            chat_ids(tok, [{"role": "user", "content": q}], defs)
            for q in ("List the Python files under decoding/.", "Run the tests of decoding/verify.py.")
        ]
        shared: dict[str, Any] = {"prompt_tokens": [len(c) for c in convs]}
        shared["first_cold"], _, _ = await ttft(ae, convs[0], "tools-a")
        shared["second_on"], out_on, shared["second_cached"] = await ttft(ae, convs[1], "tools-b")
        caching(models, False)
        shared["second_off"], out_off, _ = await ttft(ae, convs[1], "tools-b-cold")
        shared["identical"] = out_on == out_off
        print(f"shared tool prompt: {shared}", flush=True)
    finally:
        ae.shutdown()
    return {"turns": turns, "shared": shared}


def render(r: dict[str, Any]) -> str:
    lines = [
        f"## Prefix caching across requests on llama.cpp (CPU, {KIND})",
        "",
        f"{r['stamp']} CPU: {r['cpu']}. {r['load']}",
        "",
        "The issue 50 agent conversation through `AsyncEngine` as the server runs it (64-token prompt "
        f"chunks, speculation on auto, greedy, {NEW} tokens a turn), each turn with the slots' KV kept "
        "and the same turn with prefix caching off, interleaved; time to first token:",
        "",
        "| turn (prompt tokens) | "
        + " | ".join(f"{i + 1} ({t['prompt_tokens']})" for i, t in enumerate(r["turns"]))
        + " |",
        "|---" * (len(r["turns"]) + 1) + "|",
        "| prefix caching on | " + " | ".join(f"{t['on']:.2f} s" for t in r["turns"]) + " |",
        "| prompt tokens reused | " + " | ".join(str(t["cached"]) for t in r["turns"]) + " |",
        "| prefix caching off | " + " | ".join(f"{t['off']:.2f} s" for t in r["turns"]) + " |",
        "| on / off | " + " | ".join(f"{t['on'] / t['off']:.2f}x" for t in r["turns"]) + " |",
        "",
        f"Output identical with the cache on and off: {all(t['identical'] for t in r['turns'])}.",
        "",
    ]
    s = r["shared"]
    lines += [
        f"A tool-definition system prompt shared by two conversations (prompts of {s['prompt_tokens'][0]} and "
        f"{s['prompt_tokens'][1]} tokens): the first one's first turn took {s['first_cold']:.2f} s cold; the "
        f"second one's {s['second_on']:.2f} s with {s['second_cached']} prompt tokens copied from the first "
        f"one's slot, against {s['second_off']:.2f} s cold: **{s['second_on'] / s['second_off']:.2f}x** its cold "
        f"time to first token (goal: at most 0.3x). Output identical: {s['identical']}.",
        "",
        "Reuse stops at the last whole 64-token prompt chunk within the shared prefix (the rest, and the "
        "answer's tokens, are prefilled again), so that the cache holds the bits a cold prefill computes "
        "(docs/architecture.md, Prefix caching). llama-server was not run beside it: no binary on this "
        "machine, and building one is ~10 minutes of the 2 cores.",
        f"Other load on the machine during the run: {r['load_note']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--load-note", default="not recorded", help="what else ran on the machine meanwhile")
    ap.add_argument("--render", action="store_true", help="rewrite the section from the saved results")
    args = ap.parse_args(argv)
    if args.render:
        write_section(SECTION, render(json.loads(RESULTS.read_text())))
        return
    t0 = time.perf_counter()
    r = asyncio.run(run(args))
    r |= {"stamp": stamp(), "cpu": cpu_line(), "load": f"Run took {time.perf_counter() - t0:.0f} s."}
    r["load_note"] = args.load_note
    RESULTS.write_text(json.dumps(r))
    write_section(SECTION, render(r))


if __name__ == "__main__":
    main()
