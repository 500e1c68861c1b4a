"""Router benchmark (not a test): routing overhead per request, and optionally `auto` vs always-large.

    .venv/bin/python -m bench.router_overhead            # overhead only (seconds, no models)
    .venv/bin/python -m bench.router_overhead --e2e      # + a real `specgate serve` on the default pair
        [--per-tier 4] [--max-tokens 32] [--warmup 0]

Writes the `router` section of docs/benchmarks.md (bench/report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import stamp, write_section  # noqa: E402
from router.config import RouterSettings  # noqa: E402
from router.policy import Router  # noqa: E402

EXAMPLES = ROOT / "router" / "examples.jsonl"


# the two passes send the same prompts, and `auto`'s large tier resolves to the model the second pass
# names: without this the second pass would be answered from the response cache
NO_CACHE = {"Cache-Control": "no-cache, no-store"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def overhead(repeats: int) -> list[str]:
    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    long_doc = ("def handler(event):\n    return process(event['body'])\n" * 1500) + "\nFix the bug above."
    cases = {
        "mixed prompts (router/examples.jsonl)": [[{"role": "user", "content": r["prompt"]}] for r in rows],
        "70 kB pasted code": [[{"role": "user", "content": long_doc}]],
        "12-turn conversation": [
            [{"role": "user" if i % 2 == 0 else "assistant", "content": rows[i]["prompt"]} for i in range(12)]
        ],
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
        out.append(
            f"| {name} | {len(times)} | {pct(times, 0.5):.1f} | {pct(times, 0.99):.1f} | {max(times):.1f} |"
        )
    return out


def e2e(n_per_tier: int, max_tokens: int, port: int, warmup: int = 0) -> list[str]:
    import httpx

    rows = [json.loads(line) for line in EXAMPLES.read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] for r in rows if r["tier"] == "small"][:n_per_tier]
    prompts += [r["prompt"] for r in rows if r["tier"] == "large"][:n_per_tier]
    log_path = Path(tempfile.mkdtemp(prefix="router-e2e-")) / "server.log"
    print(f"server log: {log_path}", flush=True)
    log = open(log_path, "wb")  # noqa: SIM115 (the child keeps it)
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # loading the real pair on a small CPU box takes a while
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, "server did not become ready"
            time.sleep(1)
        print(f"server ready after {time.monotonic() - deadline + 600:.0f} s", flush=True)
        results: dict[str, list[tuple[float, str]]] = {"auto": [], "qwen2.5-coder-1.5b": []}
        cache_hits = 0
        for i in range(warmup):  # untimed, both served models, before either timed pass (not a timed prompt)
            for model in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
                body = {"model": model, "messages": [{"role": "user", "content": f"Say warm-up {i}."}],
                        "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
                httpx.post(
                    url + "/v1/chat/completions", json=body, headers=NO_CACHE, timeout=600
                ).raise_for_status()
        for model in results:
            for p in prompts:
                body = {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                        "temperature": 0}  # fmt: skip
                t0 = time.perf_counter()
                r = httpx.post(url + "/v1/chat/completions", json=body, headers=NO_CACHE, timeout=600)
                r.raise_for_status()
                results[model].append((time.perf_counter() - t0, r.headers.get("x-specgate-route", "")))
                cache_hits += not r.headers.get("x-specgate-cache", "miss").startswith("miss")
                print(
                    f"{model:20s} {results[model][-1][0]:7.2f} s  {results[model][-1][1]}  {p[:40]!r}",
                    flush=True,
                )
    finally:
        proc.kill()
        proc.wait()
        log.close()
    out = [f"{len(prompts)} prompts ({n_per_tier} labelled small, {n_per_tier} labelled large), greedy, "
           f"max_tokens={max_tokens}, one request at a time, non-streamed, "
           f"{f'after {warmup} untimed warm-up request(s) to each of the two models' if warmup else 'no warm-up'}; "
           f"served from the cache: {cache_hits} of {2 * len(prompts)}.", "",
           "| model requested | mean (s) | p50 (s) | max (s) | share per tier |", "|---|---:|---:|---:|---|"]  # fmt: skip
    for model, res in results.items():
        lat = [t for t, _ in res]
        tiers: dict[str, int] = {}
        for _, header in res:
            tier = header.split(";")[0].removeprefix("tier=")
            tiers[tier] = tiers.get(tier, 0) + 1
        share = ", ".join(f"{k} {v / len(res):.0%}" for k, v in sorted(tiers.items()))
        out.append(
            f"| `{model}` | {statistics.mean(lat):.2f} | {pct(lat, 0.5):.2f} | {max(lat):.2f} | {share} |"
        )
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
    ap.add_argument(
        "--warmup", type=int, default=0, help="untimed requests per model before the timed ones (--e2e)"
    )
    args = ap.parse_args()
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["## Router", "", stamp(), f"Load average (1/5/15 min) at start: {load}.", "",
             "### Routing overhead per request (feature extraction + score + strategy, in process)", ""]  # fmt: skip
    lines += overhead(args.repeats)
    lines += ["", "p99 and max include whatever else the machine was running (scheduler preemptions); "
              "p50 is the representative figure.", ""]  # fmt: skip
    lines += ["### End-to-end latency: `auto` vs always-large", ""]
    if args.e2e:
        lines += e2e(args.per_tier, args.max_tokens, args.port, args.warmup)
        lines += ["", "Same prompts sent once with `model: auto` and once with `model: qwen2.5-coder-1.5b` "
                  "(the default deployment: the 1.5B with the 0.5B as draft, the 0.5B also served as the small "
                  "tier); latency measured at the client, tier shares from `x-specgate-route`."]  # fmt: skip
    else:
        lines.append("Not run in this pass (`--e2e` starts `specgate serve` on the real Qwen2.5-Coder pair).")
    text = "\n".join(lines) + "\n"
    print(text)
    write_section("router", text)


if __name__ == "__main__":
    main()
