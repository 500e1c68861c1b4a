"""CPU probe: where the llamacpp backend's time to first token goes (issue 14), on the real 1.5B
target's Q4_K_M GGUF and the ~110-token chat prompt of ``bench.cpu_llamacpp``.

    python -m bench.probe_ttft [--reps 5] [--parts tokenise,kernel,engine]

tokenise: the chat template and tokeniser (the gateway's part, before the engine sees ids).
kernel:   llama.cpp alone, per context setting (KV type, flash attention, threads): the prompt as the
          engine feeds it (all but the last token without logits, then a one-token step), in one
          decode as llama-server does, and in chunks of the async engine's CPU prefill budget.
engine:   the engine's own first token (start, prefill steps, first step), target-only and draft,
          whole-prompt prefill and the async engine's budget.
server:   specgate target-only against llama-server (``--llama-server``), alternating request by
          request: the only comparison this drifting VM supports (bench.cpu_llamacpp).
Prints medians of ``--reps`` runs in ms; the machine is shared, so compare within a run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.cpu_llamacpp import PAIR, TTFT_CHAT, chat_ids, cpu_line, load_pair, ttft_side_by_side
from decoding import store
from decoding.async_engine import default_prefill_budget
from decoding.engine import Engine
from decoding.llamacpp import LlamaCppModel, cpu_threads
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.runner import Row


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def tokenise(reps: int) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(store.home() / "models" / PAIR[0])
    text = tok.apply_chat_template(TTFT_CHAT, add_generation_prompt=True, tokenize=False)
    ms = median_ms(
        lambda: tok.apply_chat_template(TTFT_CHAT, add_generation_prompt=True, tokenize=False), reps
    )
    print(f"chat template (text)          {ms:8.2f} ms", flush=True)
    ms = median_ms(lambda: tok(text, add_special_tokens=False)["input_ids"], reps)
    print(f"tokenise ({len(chat_ids(tok, TTFT_CHAT))} tokens)           {ms:8.2f} ms", flush=True)


def kernel(ids: list[int], reps: int, budget: int) -> None:
    path = store.gguf_file(PAIR[0])
    T = torch.tensor(ids)
    n = len(ids)
    configs: list[tuple[str, dict[str, Any]]] = [
        ("exact (fa, q8_0 KV)", {}),
        ("fa, f16 KV", {"kv_type": "f16"}),
        ("exact, 1 thread", {"threads": 1}),
    ]
    print(f"{'setting':24s} {'engine: n-1 + 1':>16s} {'of it: 1-token':>15s} {'one decode':>11s} "
          f"{'chunks of ' + str(budget):>13s}   (ms, {n} tokens)", flush=True)  # fmt: skip
    models = [LlamaCppModel(path, max_len=2048, slots=2, **kw) for _, kw in configs]
    try:
        # every setting's runs interleaved rep by rep: this VM's speed drifts over minutes
        times: list[list[list[float]]] = [[[] for _ in range(4)] for _ in configs]
        for r in range(reps + 1):
            for c, m in enumerate(models):
                for v, fn in enumerate(ways(m, T, budget)):
                    t0 = time.perf_counter()
                    fn()
                    if r:  # the first is a warm-up: first-call allocations, pages of the weights
                        times[c][v].append(1e3 * (time.perf_counter() - t0))
        for (label, _), cells in zip(configs, times, strict=True):
            meds = [statistics.median(t) for t in cells]
            print(
                f"{label:24s} "
                + " ".join(f"{x:>{w}.1f}" for x, w in zip(meds, (16, 15, 11, 13), strict=True)),
                flush=True,
            )
    finally:
        for m in models:
            m.close()


def ways(m: LlamaCppModel, T: torch.Tensor, budget: int) -> list[Callable[[], Any]]:
    """The prompt as the engine feeds it, its last one-token step alone, in one decode, in chunks."""
    n = int(T.shape[0])

    def engine_way() -> None:
        m.forward_rows([Row(0, T[:-1], 0, "none")], exact=True)
        m.forward_rows([Row(0, T[-1:], n - 1, "all")], exact=True)

    def one_token() -> None:
        m.forward_rows([Row(0, T[-1:], n - 1, "all")], exact=True)

    def one_decode() -> None:
        m.forward_rows([Row(0, T, 0, "last")], exact=True)

    def chunked() -> None:
        for s in range(0, n - 1, budget):
            m.forward_rows([Row(0, T[s : min(s + budget, n - 1)], s, "none")], exact=True)
        m.forward_rows([Row(0, T[-1:], n - 1, "all")], exact=True)

    return [engine_way, one_token, one_decode, chunked]


def engine_first_token(reps: int) -> None:
    models = load_pair()
    engine = Engine(models)
    ids = chat_ids(models["target"].tokenizer, TTFT_CHAT)
    budget = default_prefill_budget(engine)
    print(f"engine, {len(ids)} tokens: start / prefill / first step / ttft (ms)", flush=True)
    for mode in (SpecMode.OFF, SpecMode.DRAFT):
        for b in (None, budget):
            parts: list[list[float]] = [[], [], [], []]
            for r in range(reps + 1):
                req = GenerationRequest(
                    "p", "target", ids, SamplingParams(max_tokens=4, temperature=0), SpecParams(mode, max_k=8)
                )
                engine.check(req)
                t0 = time.perf_counter()
                seq = engine.start(req)
                t1 = time.perf_counter()
                out = engine.step_batch([seq], b)[0]
                while out is None:  # prefill chunks
                    t2 = time.perf_counter()
                    out = engine.step_batch([seq], b)[0]
                t3 = time.perf_counter()  # the first token
                while out is None or out.finish_reason is None:
                    out = engine.step_batch([seq], b)[0]
                seq.release()
                if r:  # the first is a warm-up
                    for p, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                        p.append(1e3 * v)
            cells = " / ".join(f"{statistics.median(p):.1f}" for p in parts)
            print(f"  {mode.value:6s} prefill budget {b!s:5s}: {cells}", flush=True)


def against_server(binary: str, reps: int) -> None:
    """specgate target-only and llama-server, alternating request by request (bench.cpu_llamacpp)."""
    models = load_pair()
    engine = Engine(models)
    ids = chat_ids(models["target"].tokenizer, TTFT_CHAT)
    side = ttft_side_by_side(engine, ids, binary, store.gguf_file(PAIR[0]), cpu_threads(), reps)
    ours, theirs = statistics.median(side["specgate"]), statistics.median(side["llama-server"])
    print(
        f"ttft, {len(ids)} tokens, medians of {reps}: specgate {1e3 * ours:.0f} ms, llama-server "
        f"{1e3 * theirs:.0f} ms (its own prompt_ms {statistics.median(side['server_prompt_ms']):.0f}); "
        f"ratio {theirs / ours:.2f}x",
        flush=True,
    )
    for k in ("specgate", "llama-server"):
        print(f"  {k:12s} " + " ".join(f"{1e3 * t:.0f}" for t in side[k]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="tokenise,kernel,engine")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="adds the part 'server'")
    args = ap.parse_args()
    parts = args.parts.split(",")
    print(f"CPU: {cpu_line()}; {cpu_threads()} threads", flush=True)
    if "tokenise" in parts:
        tokenise(args.reps)
    if "kernel" in parts:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(store.home() / "models" / PAIR[0])
        kernel(chat_ids(tok, TTFT_CHAT), args.reps, 64)
    if "engine" in parts:
        engine_first_token(args.reps)
    if "server" in parts and args.llama_server:
        against_server(args.llama_server, args.reps)


if __name__ == "__main__":
    main()
