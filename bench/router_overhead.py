"""Router benchmark (not a test): routing overhead per request, and optionally `auto` vs always-large.

    .venv/bin/python -m bench.router_overhead            # overhead only (seconds, no models)
    .venv/bin/python -m bench.router_overhead --e2e      # + a real `specgate serve` on the default pair

Writes docs/benchmarks_router.md (the lead folds it into docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from router.config import RouterSettings  # noqa: E402
from router.policy import Router  # noqa: E402

EXAMPLES = ROOT / "router" / "examples.jsonl"
OUT = ROOT / "docs" / "benchmarks_router.md"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overhead(repeats: int) -> list[str]:
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    long_doc = ("def handler(event):\n    return process(event['body'])\n" * 1500) + "\nFix the bug above."
    cases = {
        "mixed prompts (router/examples.jsonl)": [[{"role": "user", "content": r["prompt"]}] for r in rows],
        "70 kB pasted code": [[{"role": "user", "content": long_doc}]],
        "12-turn conversation": [[{"role": "user" if i % 2 == 0 else "assistant", "content": rows[i]["prompt"]}
                                  for i in range(12)]],
    }
    router = Router(RouterSettings())
    out = ["| request set | requests timed | p50 (µs) | p99 (µs) | max (µs) |", "|---|---:|---:|---:|---:|"]
    for name, conversations in cases.items():
        times = []
        for _ in range(repeats):
            for msgs in conversations:
                t0 = time.perf_counter_ns()
                router.route("auto", msgs, max_tokens=256, temperature=0.0)
                times.append((time.perf_counter_ns() - t0) / 1e3)
        out.append(f"| {name} | {len(times)} | {pct(times, 0.5):.1f} | {pct(times, 0.99):.1f} | {max(times):.1f} |")
    return out


def e2e(n_per_tier: int, max_tokens: int, port: int) -> list[str]:
    import httpx

    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows if r["tier"] == "small"][:n_per_tier]
    prompts += [r["prompt"] for r in rows if r["tier"] == "large"][:n_per_tier]
    log = open(ROOT / "bench" / "router_e2e_server.log", "wb")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # loading the real pair on a small CPU box takes a while
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, "server did not become ready"
            time.sleep(1)
        results: dict[str, list[tuple[float, str]]] = {"auto": [], "qwen2.5-coder-1.5b": []}
        for model in results:
            for p in prompts:
                body = {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                        "temperature": 0}  # fmt: skip
                t0 = time.perf_counter()
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
                r.raise_for_status()
                results[model].append((time.perf_counter() - t0, r.headers.get("x-specgate-route", "")))
    finally:
        proc.kill()
        proc.wait()
        log.close()
    out = [f"{len(prompts)} prompts ({n_per_tier} labelled small, {n_per_tier} labelled large), greedy, "
           f"max_tokens={max_tokens}, one request at a time, non-streamed.", "",
           "| model requested | mean (s) | p50 (s) | max (s) | share per tier |", "|---|---:|---:|---:|---|"]  # fmt: skip
    for model, res in results.items():
        lat = [t for t, _ in res]
        tiers: dict[str, int] = {}
        for _, header in res:
            tier = header.split(";")[0].removeprefix("tier=")
            tiers[tier] = tiers.get(tier, 0) + 1
        share = ", ".join(f"{k} {v / len(res):.0%}" for k, v in sorted(tiers.items()))
        out.append(f"| `{model}` | {statistics.mean(lat):.2f} | {pct(lat, 0.5):.2f} | {max(lat):.2f} | {share} |")
    return out


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--e2e", action="store_true", help="also run auto vs always-large on the real pair")
    ap.add_argument("--per-tier", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = ["## Router", "", f"Machine: {machine}. `python -m bench.router_overhead`.", "",
             "### Routing overhead per request (feature extraction + score + strategy, in process)", ""]  # fmt: skip
    lines += overhead(args.repeats)
    lines += ["", "### End-to-end latency: `auto` vs always-large", ""]
    if args.e2e:
        lines += e2e(args.per_tier, args.max_tokens, args.port)
    else:
        lines.append("Not run here (`--e2e` starts `specgate serve` on the real Qwen2.5-Coder pair).")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)


if __name__ == "__main__":
    main()
