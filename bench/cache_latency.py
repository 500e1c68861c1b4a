"""Cache hit latency through the gateway: exact and semantic hits vs a full generation.

Starts ``specgate serve`` in a subprocess (tiny random models by default, ``--real`` for the
Qwen2.5-Coder 1.5B + 0.5B draft pair in bf16), once with the in-process cache and once with a
redis-server of its own on a free port, and times sequential requests from one keep-alive client:

- exact hit: the same greedy request again;
- semantic hit: a paraphrase of a stored request (embedding + LSH read + re-rank + guard);
- semantic-eligible miss: a new greedy question (what the embedding adds to every such miss);
- full generation: the same request with ``Cache-Control: no-cache, no-store``.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.cache_latency [--real] [--n 200]

Writes the `cache-latency` section of docs/benchmarks.md (`cache-latency-real` with ``--real``, so the
two runs do not replace each other), through bench/report.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.report import stamp, write_section

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    {"name": "tiny", "source": "tiny-random", "dtype": "float32", "device": "cpu", "max_context": 512},
]
REAL = [
    {"name": "qwen2.5-coder-1.5b", "source": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b",
     "dtype": "bfloat16", "device": "cpu"},
    {"name": "qwen2.5-coder-0.5b", "source": "qwen2.5-coder-0.5b", "dtype": "bfloat16", "device": "cpu"},
]  # fmt: skip
QUESTION = "How do I reverse a list in Python?"
PARAPHRASE = "How can I reverse a list in Python?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
    )
    time.sleep(0.3)
    return proc, f"redis://127.0.0.1:{port}/0"


def start_gateway(
    workdir: Path, models: list[dict[str, Any]], cache: dict[str, Any]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    config = workdir / f"specgate-{port}.yaml"
    config.write_text(yaml.safe_dump({"models": models, "cache": cache}))
    log = (workdir / f"gateway-{port}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    raise RuntimeError("gateway did not become ready")


def body(model: str, text: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens}  # fmt: skip


def timed(c: httpx.Client, b: dict[str, Any], n: int, expect: str, **headers: str) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = c.post("/v1/chat/completions", json=b, headers=headers)
        out.append((time.perf_counter() - t0) * 1000)
        assert r.status_code == 200, r.text
        assert r.headers.get("x-specgate-cache", "").startswith(expect), r.headers.get("x-specgate-cache")
    return out


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def run(url: str, model: str, n: int, n_full: int, max_tokens: int) -> dict[str, list[float]]:
    with httpx.Client(base_url=url, timeout=600) as c:
        c.post("/v1/chat/completions", json=body(model, QUESTION, max_tokens))  # generate and store
        deadline = time.monotonic() + 120  # the embedder loads in the background after startup
        probe = {"cache-control": "no-store"}  # a missed paraphrase must not become an exact entry
        while (
            c.post("/v1/chat/completions", json=body(model, PARAPHRASE, max_tokens), headers=probe)
            .headers["x-specgate-cache"]
            .startswith("miss")
        ):
            assert time.monotonic() < deadline, "semantic tier never became ready"
            c.post(
                "/v1/chat/completions",
                json=body(model, QUESTION, max_tokens),
                headers={"cache-control": "no-cache"},
            )
            time.sleep(0.5)
        res = {
            "exact hit": timed(c, body(model, QUESTION, max_tokens), n, "exact"),
            "semantic hit": timed(c, body(model, PARAPHRASE, max_tokens), n, "semantic"),
        }
        misses = []
        for i in range(n_full):  # fresh greedy questions, not stored: lookup + embedding + generation
            misses += timed(c, body(model, f"What is item {i} of the list? ({time.time()})", max_tokens), 1,
                            "miss", **{"cache-control": "no-store"})  # fmt: skip
        res["semantic-eligible miss (incl. generation)"] = misses
        res["full generation (no-cache)"] = timed(
            c, body(model, QUESTION, max_tokens), n_full, "miss", **{"cache-control": "no-cache, no-store"}
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--real", action="store_true", help="Qwen2.5-Coder 1.5B + 0.5B draft (bf16) instead of tiny"
    )
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--n-full", type=int, default=0, help="generations per slow path (default 50, 3 with --real)"
    )
    args = ap.parse_args()
    models, model = (REAL, "qwen2.5-coder-1.5b") if args.real else (TINY, "tiny")
    n_full = args.n_full or (3 if args.real else 50)
    work = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    redis_proc, redis_url = start_redis(work) if shutil.which("redis-server") else (None, None)
    header = stamp()
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"# {header} model={model}, max_tokens={args.max_tokens}")
    print("| backend | path | n | p50 ms | p99 ms | mean ms |\n|---|---|---|---|---|---|")
    rows: list[tuple[str, str, list[float]]] = []
    try:
        for name, cache in (("in-process", {}), ("redis", {"redis_url": redis_url})):
            if cache.get("redis_url", "") is None:
                continue
            proc, url = start_gateway(work, models, cache)
            try:
                for path, xs in run(url, model, args.n, n_full, args.max_tokens).items():
                    rows.append((name, path, xs))
                    print(f"| {name} | {path} | {len(xs)} | {pct(xs, 50):.2f} | {pct(xs, 99):.2f} "
                          f"| {statistics.fmean(xs):.2f} |", flush=True)  # fmt: skip
            finally:
                proc.terminate()
                proc.wait(30)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(10)
    section = "cache-latency-real" if args.real else "cache-latency"
    write_section(section, render(rows, header, load, args, n_full, redis_proc is not None))


def render(rows: list[tuple[str, str, list[float]]], header: str, load: str, args: argparse.Namespace,
           n_full: int, redis: bool) -> str:  # fmt: skip
    version = ""
    if redis:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
        version = next((w.removeprefix("v=") for w in out if w.startswith("v=")), "")
    what = ("the real default deployment: Qwen2.5-Coder-1.5B with the 0.5B as draft, bf16 on CPU" if args.real
            else "tiny random model")  # fmt: skip
    lines = [
        f"## Cache latency through the gateway{' (real pair)' if args.real else ''}",
        "",
        header,
        f"Load average (1/5/15 min) at start: {load}."
        + (f" Redis {version}." if version else " No redis-server found: in-process only."),
        "",
        f"{what}; in-process cache and then a redis-server of the benchmark's own on localhost; one keep-alive "
        f"httpx client, sequential requests, non-streamed, `max_tokens` {args.max_tokens}, times in ms measured "
        f"at the client; {n_full} generations per slow path.",
        "",
        "| backend | path | n | p50 ms | p99 ms | mean ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, path, xs in rows:
        lines.append(
            f"| {name} | {path} | {len(xs)} | {pct(xs, 50):.2f} | {pct(xs, 99):.2f} | {statistics.fmean(xs):.2f} |"
        )
    p50 = {(n, p): pct(xs, 50) for n, p, xs in rows}
    exact = [v for (_, p), v in p50.items() if p == "exact hit"]
    sem = [v for (_, p), v in p50.items() if p == "semantic hit"]
    full = [v for (_, p), v in p50.items() if p.startswith("full generation")]
    if exact and sem:
        lines += [
            "",
            f"Goals: exact hit <= 3 ms p50 ({min(exact):.2f}-{max(exact):.2f} ms: "
            f"{'met' if max(exact) <= 3 else 'NOT met'}), semantic hit <= 25 ms p50 "
            f"({min(sem):.2f}-{max(sem):.2f} ms: {'met' if max(sem) <= 25 else 'NOT met'}).",
        ]
    if full and exact and sem:
        lines.append(
            f"A hit answers in about 1/{min(full) / max(exact):.0f} (exact) and 1/{min(full) / max(sem):.0f} "
            f"(semantic) of a {args.max_tokens}-token generation's p50."
        )
    lines += [
        "",
        "A greedy request that misses pays the embedding too, since the semantic tier must embed before it can "
        "miss; sampled or long requests skip the semantic tier. The miss rows use different, longer prompts "
        "than the full-generation rows, so their difference is the embedding plus prompt length.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
