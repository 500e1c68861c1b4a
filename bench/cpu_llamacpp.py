"""CPU benchmark: specgate on the llamacpp backend against llama.cpp's own server, on the real pair
(Qwen2.5-Coder 1.5B target, 0.5B draft, the pinned Q4_K_M GGUFs as they ship), greedy.

In one process, per prompt: specgate target-only, draft speculation and prompt lookup (one engine
on ``backend: llamacpp``), and llama.cpp's ``llama-server`` on the same GGUF files, target-only and
with its own draft speculation (``-md``), streamed, prompt cache off. Where no ``llama-server``
binary is found (``--llama-server``, ``$LLAMA_SERVER``, PATH), llama-cpp-python's high-level
``Llama`` stands in as the llama.cpp reference, and the section says so.

Time to first token is measured on a ~110-token chat prompt, once in the table's runs and again in
runs alternated with a llama-server started beside the engine (``--ttft-reps``; their medians are
the goal's figure); decode tok/s is the tokens after the first over the time after the first.
specgate's methods are interleaved per prompt; each llama.cpp configuration then runs every prompt in
a server process of its own. specgate's outputs are checked token-identical to its own
target-only output; llama.cpp's are compared too (it runs repacked kernels by default, which round
differently, so a difference there is reported, not a failure).

    python -m bench.cpu_llamacpp [--new 128] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from bench.cpu_engine import GROUNDED, PROMPTS
from bench.report import cpu_kind, stamp, write_section
from decoding import store
from decoding.engine import Engine, LoadedModel
from decoding.llamacpp import EXACT_STEP, HELD, _lib, amx_build, amx_works, cpu_threads
from decoding.loader import ModelSpec, load_all
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams

KIND = cpu_kind()
RESULTS = Path(__file__).with_name(f"results_cpu_llamacpp_{KIND}.json")
SECTION = f"cpu-llamacpp-{KIND}"
PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
# the time-to-first-token prompt: a system and a user turn, ~110 tokens with the chat template
TTFT_CHAT = [
    {"role": "system", "content": "You are a careful senior Python reviewer. Answer briefly and show code."},
    {
        "role": "user",
        "content": "Here is a function that is meant to return the n-th Fibonacci number, but it is slow "
        "for n above 30 and fails for negative n:\n\ndef fib(n):\n    if n < 2:\n        return n\n"
        "    return fib(n - 1) + fib(n - 2)\n\nMake it fast, keep the signature, and raise ValueError "
        "for negative input.",
    },
]
Run = dict[str, Any]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    ap.add_argument("--draft-max", type=int, default=8, help="llama-server's --spec-draft-n-max")
    ap.add_argument("--ttft-reps", type=int, default=7, help="alternated first-token runs, each side")
    ap.add_argument("--render", action="store_true", help="rewrite the section from the saved results")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(RESULTS.read_text())
        write_section(SECTION, render(saved.pop("results"), saved.pop("names"), saved))
        return
    threads = cpu_threads()
    t0 = time.perf_counter()
    models = load_pair()
    load_s = time.perf_counter() - t0
    engine = Engine(models)
    tok = models["target"].tokenizer
    encoded = {name: chat_ids(tok, [{"role": "user", "content": p}]) for name, p in PROMPTS.items()}
    ttft_ids = chat_ids(tok, TTFT_CHAT)
    gguf = {a: store.gguf_file(a) for a in PAIR}

    ours = {
        "specgate target-only": SpecMode.OFF,
        "specgate draft": SpecMode.DRAFT,
        "specgate prompt lookup": SpecMode.NGRAM,
    }
    methods: dict[str, Any] = {
        m: (lambda ids, mode=mode: engine_run(engine, ids, mode, args.new)) for m, mode in ours.items()
    }
    # each llama.cpp reference runs in a phase of its own, one server process at a time: two resident
    # servers beside the engine pushed the shared 24 GB box into evicting the mmapped weights
    phases: list[tuple[str, Any]] = []
    if args.llama_server:
        reference = "llama-server"
        draft_args = ["-md", str(gguf[PAIR[1]]), "--spec-type", "draft-simple"]
        for label, extra in (
            ("llama.cpp target-only", []),
            ("llama.cpp draft", [*draft_args, "--spec-draft-n-max", str(args.draft_max)]),
        ):
            phases.append((label, LlamaServer(args.llama_server, gguf[PAIR[0]], threads, extra)))
    else:
        reference = "llama-cpp-python Llama"
        phases.append(("llama.cpp target-only", HighLevel(gguf[PAIR[0]], threads)))
    names = list(methods) + [label for label, _ in phases]
    prompts = {"ttft chat": ttft_ids, **encoded}
    warm = encoded["haiku"][:24]
    results: dict[str, dict[str, Run]] = {p: {} for p in prompts}
    for m in methods:  # warm-up: page cache, thread pools, first-call allocations
        methods[m](warm)
    for i, (prompt, ids) in enumerate(prompts.items()):
        order = list(methods)[i % len(methods) :] + list(methods)[: i % len(methods)]  # none always first
        for m in order:
            results[prompt][m] = show(prompt, m, methods[m](ids))
    for label, ref in phases:
        if isinstance(ref, LlamaServer):
            ref.start()
        try:
            ref.run(warm, 8)
            for prompt, ids in prompts.items():
                results[prompt][label] = show(prompt, label, ref.run(ids, args.new))
        finally:
            if isinstance(ref, LlamaServer):
                ref.stop()
    ttft = None
    if args.llama_server and args.ttft_reps > 0:
        ttft = ttft_side_by_side(engine, ttft_ids, args.llama_server, gguf[PAIR[0]], threads, args.ttft_reps)
    for row in results.values():
        for m in names:
            row[m]["identical"] = row[m]["tokens"] == row["specgate target-only"]["tokens"]
    meta = {
        "stamp": stamp(),  # the run's machine, command, date and commit (a --render keeps them)
        "load_s": load_s,
        "threads": threads,
        "reference": reference,
        "llama_cpp_python": metadata.version("llama-cpp-python"),
        "ttft_prompt_tokens": len(ttft_ids),
        "server": args.llama_server,
        "ttft": ttft,
        "held": models["target"].model.llama.held,  # how the target's weights were held (EXACT_STEP)
    }
    RESULTS.write_text(json.dumps({"results": results, "names": names, **meta}))
    write_section(SECTION, render(results, names, meta))


def show(prompt: str, method: str, r: Run) -> Run:
    print(
        f"{prompt:22s} {method:24s} {len(r['tokens']):4d} tok ttft {r['ttft']:.2f}s "
        f"decode {r['decode_tps']:6.2f} tok/s {r.get('info', '')}",
        flush=True,
    )
    return r


def ttft_side_by_side(
    engine: Engine, ids: list[int], binary: str, gguf: Path, threads: int, reps: int
) -> dict[str, list[float]]:
    """Time to first token, specgate target-only and llama-server target-only, alternating request
    by request (which side goes first alternates too), after one warm-up each: seconds per run.
    Issue 14's shortfall was one run of each, minutes apart (specgate's phase, then the server's), on
    a VM whose speed drifts over minutes; side by side it was gone (docs/benchmarks.md)."""
    server = LlamaServer(binary, gguf, threads, [])
    server.start()
    out: dict[str, list[float]] = {"specgate": [], "llama-server": [], "server_prompt_ms": []}
    try:
        for r in range(reps + 1):
            for side in ("specgate", "llama-server") if r % 2 else ("llama-server", "specgate"):
                run = engine_run(engine, ids, SpecMode.OFF, 2) if side == "specgate" else server.run(ids, 1)
                if r:  # the first of each is a warm-up
                    out[side].append(run["ttft"])
                    if side == "llama-server":
                        out["server_prompt_ms"].append(run["info"]["prompt_ms"])
    finally:
        server.stop()
    print(
        "ttft side by side: "
        + ", ".join(
            f"{k} median {statistics.median(v):.3f}" for k, v in out.items() if k != "server_prompt_ms"
        ),
        flush=True,
    )
    return out


def load_pair() -> dict[str, LoadedModel]:
    return load_all(
        [
            ModelSpec("target", PAIR[0], draft="draft", backend="llamacpp", slots=2, max_context=2048),
            ModelSpec("draft", PAIR[1], backend="llamacpp", slots=2, max_context=2048),
        ]
    )


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


def engine_run(engine: Engine, ids: list[int], mode: SpecMode, new: int) -> Run:
    """One request through the engine's step loop, timing its first token and its end."""
    req = GenerationRequest(
        "b", "target", ids, SamplingParams(max_tokens=new, temperature=0), SpecParams(mode, max_k=8)
    )
    engine.check(req)
    t0 = time.perf_counter()
    seq = engine.start(req)
    out: list[int] = []
    first = None
    try:
        while True:
            step = engine.step(seq)
            if step.token_ids and first is None:
                first, n_first = time.perf_counter(), len(step.token_ids)
            out.extend(step.token_ids)
            if step.finish_reason is not None:
                break
    finally:
        seq.release()
    end = time.perf_counter()
    stats = seq.stats
    info = {
        "accept": stats.acceptance_rate,
        "per_step": stats.tokens_per_step,
        "off": stats.spec_disabled_steps,
    }
    return timing(out, t0, first, end, n_first if first else 0) | {"info": info}


def timing(tokens: list[int], t0: float, first: float | None, end: float, n_first: int) -> Run:
    first = first if first is not None else end
    rest = len(tokens) - n_first
    return {
        "tokens": tokens,
        "ttft": first - t0,
        "total": end - t0,
        "decode_tps": rest / (end - first) if rest > 0 and end > first else 0.0,
    }


class LlamaServer:
    """llama.cpp's llama-server on one GGUF, one slot, queried on /completion with token ids."""

    def __init__(self, binary: str, model: Path, threads: int, extra: list[str]):
        self.port = _free_port()
        self.cmd = [
            binary, "-m", str(model), "-t", str(threads), "-c", "4096", "-np", "1",
            "--host", "127.0.0.1", "--port", str(self.port), "--no-webui", *extra,
        ]  # fmt: skip
        lib = _lib()
        # built from the same sources and flags as the library (docs/architecture.md): where the
        # library's AMX kernels crash, the server's would too
        if amx_build(lib) and not amx_works(lib, model):
            self.cmd.append("--no-repack")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(f"/tmp/llama-server-{self.port}.log")

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 180 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def run(self, ids: list[int], new: int) -> Run:
        body = {
            "prompt": ids,
            "n_predict": new,
            "temperature": 0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": True,
        }
        tokens: list[int] = []
        first, n_first, final = None, 0, {}
        t0 = time.perf_counter()
        with httpx.stream("POST", f"http://127.0.0.1:{self.port}/completion", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                got = chunk.get("tokens") or []
                if got and first is None:
                    first, n_first = time.perf_counter(), len(got)
                tokens.extend(got)
                if chunk.get("stop"):
                    final = chunk
        end = time.perf_counter()
        t = final.get("timings", {})
        info = {
            "draft_n": t.get("draft_n"),
            "draft_accepted": t.get("draft_n_accepted"),
            "prompt_ms": t.get("prompt_ms"),
        }
        return timing(tokens, t0, first, end, n_first) | {"info": info}


class HighLevel:
    """llama-cpp-python's own ``Llama`` generate, streamed: the llama.cpp reference where no
    llama-server binary is available (the same library and kernels, default settings)."""

    def __init__(self, model: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(str(model), n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(self, ids: list[int], new: int) -> Run:
        self.llm.reset()
        tokens: list[int] = []
        first = None
        t0 = time.perf_counter()
        for t in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            if t == self.llm.token_eos() or t in (151645, 151643):  # <|im_end|>, <|endoftext|>
                break
            tokens.append(int(t))
            if len(tokens) >= new:
                break
        return timing(tokens, t0, first, time.perf_counter(), 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_line() -> str:
    text = Path("/proc/cpuinfo").read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split() for ln in text.splitlines() if ln.startswith("flags")), [])
    shown = [
        f
        for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
        if f in flags
    ]
    return f"{name}; flags: {', '.join(shown)}" + ("" if "amx_bf16" in flags else "; no AMX")


def render(results: dict[str, dict[str, Run]], names: list[str], meta: dict[str, Any]) -> str:
    held = meta.get("held", "repacked")  # runs before it was recorded held repacked weights
    ref = "llama.cpp target-only"
    lines = [
        f"## CPU: specgate on llama.cpp against llama.cpp's server (real pair), {KIND} CPU",
        "",
        meta.get("stamp") or stamp(),
        "",
        f"CPU: {cpu_line()}. llama-cpp-python {meta['llama_cpp_python']} (llama.cpp vendored in it, built "
        f"from the sdist with the Makefile's `LLAMACPP_CMAKE_ARGS`), {meta['threads']} threads. This VM's speed drifts between "
        "runs, so compare within a run; specgate's methods are interleaved per prompt, each llama.cpp "
        "configuration runs after them in its own server process.",
        "",
        "Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft, the pinned Q4_K_M GGUFs as they ship, greedy, up to "
        "128 new tokens, chat template. specgate: `backend: llamacpp` in exact mode ("
        f"{HELD[held]}, flash attention, q8_0 KV, steps of at most {EXACT_STEP[held]} "
        "tokens; decoding/llamacpp.py). "
        + (
            f"Reference: llama.cpp's `llama-server` ({meta['server']}) built from the same vendored sources, "
            "default settings (repacked kernels), one slot, `cache_prompt: false`, streamed; its draft run adds "
            "`-md` with the 0.5B GGUF."
            if meta["reference"] == "llama-server"
            else "Reference: no llama-server binary was available, so llama-cpp-python's high-level `Llama` "
            "(same library and kernels, default settings, repacked) generated target-only as llama.cpp."
        ),
        f" Models loaded in {meta['load_s']:.1f} s. Decode tok/s = tokens after the first / time after the "
        "first; `differs` = not token-identical to specgate target-only.",
        "",
        "| prompt | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for prompt, row in results.items():
        base = row[ref]["decode_tps"] or 1e-9
        cells = []
        for m in names:
            r = row[m]
            cell = f"{r['decode_tps']:.2f}" + ("" if m == ref else f" ({r['decode_tps'] / base:.2f}x)")
            info = r.get("info") or {}
            if info.get("accept") and m != "specgate target-only":
                cell += f", acc {info['accept']:.0%}"
            if not r["identical"]:
                cell += " *differs*"
            cells.append(cell)
        lines.append(f"| {prompt} | " + " | ".join(cells) + " |")
    chat = results["ttft chat"]
    lines += [
        "",
        f"Time to first token, {meta['ttft_prompt_tokens']}-token chat prompt: "
        + ", ".join(f"{m} {chat[m]['ttft']:.2f} s" for m in names)
        + ".",
    ]
    prompts = [p for p in results if p != "ttft chat"]

    def med(m: str, ps: list[str]) -> float:
        return statistics.median(
            results[p][m]["decode_tps"] / (results[p][ref]["decode_tps"] or 1e-9) for p in ps
        )

    side = meta.get("ttft")  # alternated runs (absent from results saved before them)
    if side:
        ours, theirs = statistics.median(side["specgate"]), statistics.median(side["llama-server"])
        ttft_ratio = theirs / ours
        lines += [
            "",
            f"Time to first token side by side (the table's runs are one each, minutes apart, so they say "
            f"little of it): specgate target-only and llama-server target-only alternating request by request, "
            f"{len(side['specgate'])} each after a warm-up, medians: specgate {ours:.2f} s, llama-server "
            f"{theirs:.2f} s (its own prompt_ms {statistics.median(side['server_prompt_ms']) / 1e3:.2f} s); "
            f"runs {', '.join(f'{t:.2f}' for t in side['specgate'])} against "
            f"{', '.join(f'{t:.2f}' for t in side['llama-server'])}.",
        ]
    else:
        ttft_ratio = chat[ref]["ttft"] / chat["specgate target-only"]["ttft"]
    spec = {m: med(m, prompts) for m in ("specgate draft", "specgate prompt lookup")}
    grounded = {m: med(m, [p for p in prompts if p in GROUNDED]) for m in spec}
    best = max(spec, key=lambda m: spec[m])
    best_g = max(grounded, key=lambda m: grounded[m])
    ours = [m for m in names if m.startswith("specgate")]
    identical = all(results[p][m]["identical"] for p in results for m in ours)
    lines += [
        "",
        "Goals (issue 14), ratios from this one run:",
        f"- time to first token vs llama.cpp{', side by side, medians' if side else ''}: {ttft_ratio:.2f}x "
        f"(goal >= 1.0x): {_met(ttft_ratio >= 1.0)}",
        f"- target-only decode vs llama.cpp, median: {med('specgate target-only', prompts):.2f}x (goal >= 1.0x): "
        f"{_met(med('specgate target-only', prompts) >= 1.0)}",
        f"- with speculation vs llama.cpp target-only, median: draft {spec['specgate draft']:.2f}x, prompt lookup "
        f"{spec['specgate prompt lookup']:.2f}x (goal >= 1.3x): {_met(spec[best] >= 1.3)}",
        f"- on the input-grounded prompts ({', '.join(GROUNDED)}): draft {grounded['specgate draft']:.2f}x, prompt "
        f"lookup {grounded['specgate prompt lookup']:.2f}x (goal >= 3x): {_met(grounded[best_g] >= 3.0)}",
        f"- every specgate output token-identical to specgate target-only: {'yes' if identical else 'NO'}",
        "",
        'Why (docs/architecture.md, "The llama.cpp backend", has the step-cost probe by CPU kind): '
        + (
            "with the AMX kernels a step of several tokens costs far less than as many one-token steps "
            "(4 tokens 1.55x, 8 tokens 2.15x one token on the 2-core AMX Xeon), so verification pays; "
            "the draft's one-token steps are what a proposal costs. "
            if held == "amx"
            else "on this CPU llama.cpp's Q4_K steps are compute-bound, so verifying k+1 tokens costs about k+1 "
            "one-token steps' worth less a little, and the controller keeps speculation off most of the time "
            "(`acc` is over the few steps it drafted). "
        )
        + "In a target-only engine step, "
        "`llama_decode` is 97% of the time (cProfile on the 1.5B); torch keeps one intra-op thread where "
        "llama.cpp runs every CPU model, since its OpenMP threads spun on the cores llama.cpp needs (26 to "
        "31 tok/s when that was fixed). llama.cpp's own draft "
        "speculation is slower than its target-only decode on every prompt here, for the same reason. "
        "Time to first token (`bench.probe_ttft`, same CPU, 103 tokens, medians of 7 with the settings "
        "interleaved run by run): llama.cpp's prefill is ~97% of it and the one-token step after it the rest "
        "(~75 ms of ~2.4 s); a q8_0 against an f16 KV cache moved it by ~1%, and chunks of 64 (the async "
        "engine's CPU budget; this bench prefills whole prompts) cost 3-6% against one decode, while run to "
        "run it moves by 15% and over minutes by a third, which is why the goal's figure comes from "
        "alternated runs. "
        "llama.cpp outputs marked `differs` are its own numerics (f16 KV) against ours (q8_0 KV), not a "
        "speculation error: on some prompts its draft output also differs from its own target-only output.",
    ]
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


if __name__ == "__main__":
    main()
