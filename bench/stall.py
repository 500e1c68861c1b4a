"""Streams' pace while adversarial requests are prepared (issue 48): four streamed chat requests run
back to back on the tiny model through ``specgate serve`` while, one at a time, requests arrive whose
grammar or prediction is costly to prepare (a 230 KB schema of 6,000 required properties at n = 8, a
618 KB one, a 950 KB prediction, a 4,000-rule Lark chain, a 1,000-deep ``$defs`` chain at n = 8). Measured per adversary: its answer and latency, and the streams' longest gap
between content chunks while it was being prepared, against the same streams' longest gap with
nothing else arriving.

    .venv/bin/python -m bench.stall [--gateway-root DIR]

``--gateway-root`` serves from another checkout (an earlier commit, for a before/after on one
machine). Writes the `stall` section of docs/benchmarks.md through bench/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cache_latency import free_port
from bench.proxy_overhead import wait_ready
from bench.report import cpu_kind, stamp, write_section

ROOT = Path(__file__).resolve().parents[1]
TINY = [{"name": "tiny", "source": "tiny-random", "dtype": "float32", "device": "cpu", "max_context": 2048}]
BASE = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _defs_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _props(n: int) -> dict[str, Any]:
    names = [f"p{i}" for i in range(n)]
    return {"type": "object", "properties": {p: {"type": "integer"} for p in names}, "required": names}


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


# the two that crashed the process last, so that a run against an earlier commit measures the rest
ADVERSARIES: list[tuple[str, dict[str, Any]]] = [
    ("6,000 required properties (230 KB), n = 8", {**_schema(_props(6000)), "n": 8}),
    ("16,000 required properties (618 KB)", _schema(_props(16000))),
    (
        "950 KB prediction",
        {"prediction": {"type": "content", "content": ("x = f(y) * 2\n" * 80_000)[:950_000]}},
    ),
    (
        "Lark chain of 4,000 rules",
        {
            "guided_grammar": "start: r0\n"
            + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(4000))
            + 'r4000: "b"\n'
        },
    ),
    ("$defs chain 1,000 deep, n = 8", {**_schema(_defs_chain(1000)), "n": 8}),
]


async def stream(client: httpx.AsyncClient, url: str, arrivals: list[float], stop: asyncio.Event) -> None:
    body = {**BASE, "max_tokens": 256, "ignore_eos": True, "stream": True, "messages": [
        {"role": "user", "content": "Write a long story."}]}  # fmt: skip
    while not stop.is_set():
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    arrivals.append(time.perf_counter())


def longest_gap(arrivals: list[list[float]], start: float, end: float) -> float:
    """The longest wait between a stream's chunks over any stretch of [start, end]."""
    worst = 0.0
    for times in arrivals:
        inside = [t for t in times if start <= t <= end]
        before = [t for t in times if t < start][-1:]
        after = [t for t in times if t > end][:1]
        edges = before + inside + after
        worst = max([worst, *(b - a for a, b in itertools.pairwise(edges))])
    return worst


async def run(url: str, baseline_s: float) -> dict[str, Any]:
    arrivals: list[list[float]] = [[] for _ in range(4)]
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.create_task(stream(client, url, a, stop)) for a in arrivals]
        await asyncio.sleep(3)  # every stream under way
        t0 = time.perf_counter()
        await asyncio.sleep(baseline_s)
        result: dict[str, Any] = {
            "baseline_gap_s": longest_gap(arrivals, t0, time.perf_counter()),
            "rows": [],
        }
        for name, extra in ADVERSARIES:
            start = time.perf_counter()
            try:
                r = await client.post(url + "/v1/chat/completions", json={**BASE, **extra}, timeout=600)
                answer = f"{r.status_code}" + (
                    f" {r.json()['error']['message'][:60]}" if r.status_code != 200 else ""
                )
            except httpx.HTTPError as exc:
                answer = f"no answer ({type(exc).__name__}: the server died)"
            end = time.perf_counter()
            await asyncio.sleep(1.0)  # the gap that spans the end is seen once the next chunk lands
            result["rows"].append((name, answer, end - start, longest_gap(arrivals, start, end)))
            print(result["rows"][-1], flush=True)
            if answer.startswith("no answer"):
                break
        stop.set()
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway-root", type=Path, default=ROOT)
    ap.add_argument("--baseline-s", type=float, default=10.0)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="stall-bench-"))
    config = {"models": TINY, "cache": {"enabled": False}, "limits": {"max_body_bytes": 2_000_000, "max_n": 8,
              "max_active": 16}}  # fmt: skip
    (work / "specgate.yaml").write_text(json.dumps(config))
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    log = (work / "gateway.log").open("wb")
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "specgate.yaml"), "--port",
         str(port)], cwd=args.gateway_root, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    header = stamp()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.gateway_root, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    try:
        wait_ready(url + "/ready", gw)
        result = asyncio.run(run(url, args.baseline_s))
    finally:
        gw.terminate()
        gw.wait(30)
    other = commit if args.gateway_root != ROOT else None
    write_section(f"stall-{commit}" if other else "stall", render(result, header, other))


def render(result: dict[str, Any], header: str, other: str | None) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    out = [
        "## Streams' pace while costly grammars and predictions are prepared"
        + (f" (gateway at {other}, for comparison)" if other else ""),
        "",
        header,
        f"CPU kind: {cpu_kind()}. Load average (1/5/15 min) at the end: {load}.",
        "",
        "Four streamed chat requests (tiny model, float32, 256 tokens each, back to back) run while each",
        "adversarial request below is sent and answered, one at a time. The streams' longest gap between",
        f"content chunks with nothing else arriving: **{result['baseline_gap_s'] * 1000:.0f} ms**.",
        "",
        "| adversarial request | answer | its latency (s) | streams' longest gap meanwhile (ms) | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for name, answer, latency, gap in result["rows"]:
        if answer.startswith("no answer"):  # the streams died with the server: no gap to report
            out.append(f"| {name} | {answer} | {latency:.2f} | - | - |")
            continue
        ratio = gap / result["baseline_gap_s"]
        out.append(f"| {name} | {answer} | {latency:.2f} | {gap * 1000:.0f} | {ratio:.1f}x |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
