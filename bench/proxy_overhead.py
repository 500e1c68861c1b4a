"""What the gateway adds in front of a remote OpenAI-compatible server (specgate as a proxy, the
LiteLLM-style deployment): the same streamed chat requests sent straight to an upstream and through
``specgate serve``, at 1 to 64 concurrent streams.

The upstream is a stand-in for vLLM on another machine, served here by uvicorn in a process of its
own: it streams ``--tokens`` content chunks ``--gap-ms`` apart (the default, 64 tokens 10 ms apart,
is a GPU server's pace per stream) in vLLM's chunk shapes, usage last where asked. Clients are
httpx streams in one asyncio process; each concurrent stream sends requests back to back. Measured
per request: time to first content chunk (TTFT), the gaps between content chunks, and the
gateway's CPU time per streamed token (``/proc/<pid>/stat``, utime + stime, over the run: what one
streamed token costs the proxy, the number that sets how many streams a core can carry).

Everything runs on this machine, so at high concurrency the client, the upstream and the gateway
share its cores: compare through-gateway with direct within a run, and read the CPU per token as
the gateway's own cost.

    .venv/bin/python -m bench.proxy_overhead [--streams 1,16,64] [--requests 64]

Writes the `proxy-overhead` section of docs/benchmarks.md through bench/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cache_latency import free_port, pct
from bench.report import cpu_kind, stamp, write_section

ROOT = Path(__file__).resolve().parents[1]
TINY = [{"name": "tiny", "source": "tiny-random", "dtype": "float32", "device": "cpu", "max_context": 512}]
UPSTREAM_MODEL = "stand-in-7b"


# ---- the upstream stand-in --------------------------------------------------------------------


def upstream_app(tokens: int, gap_s: float) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def chat(request: Request) -> Any:
        body = await request.json()
        rid, created = f"chatcmpl-{time.monotonic_ns()}", int(time.time())

        def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                   "choices": [choice], **extra}  # fmt: skip
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        async def events() -> Any:
            yield chunk({"role": "assistant", "content": ""})
            for _ in range(tokens):
                await asyncio.sleep(gap_s)
                yield chunk({"content": " tok"})
            yield chunk({}, "length")
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
                obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body["model"],
                       "choices": [], "usage": usage}  # fmt: skip
                yield b"data: " + json.dumps(obj).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream")
        await asyncio.sleep(gap_s * tokens)
        message = {"role": "assistant", "content": " tok" * tokens}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": body["model"],
                             "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                             "usage": {"prompt_tokens": 12, "completion_tokens": tokens,
                                       "total_tokens": 12 + tokens}})  # fmt: skip

    async def models(_: Request) -> Any:
        return JSONResponse({"object": "list", "data": [{"id": UPSTREAM_MODEL, "object": "model"}]})

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)]
    )


def serve_upstream(port: int, tokens: int, gap_s: float) -> None:
    import uvicorn

    uvicorn.run(upstream_app(tokens, gap_s), host="127.0.0.1", port=port, log_level="warning")


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


# ---- the client -------------------------------------------------------------------------------


async def one(client: httpx.AsyncClient, url: str, model: str, ttft: list[float], gaps: list[float]) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "Summarise the plot of Hamlet."}],
            "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    last, n = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not any((c.get("delta") or {}).get("content") for c in choices):
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                gaps.append(now - last)
            last, n = now, n + 1
    return n


async def load(url: str, model: str, streams: int, requests: int) -> dict[str, Any]:
    ttft: list[float] = []
    gaps: list[float] = []
    tokens = 0
    todo = iter(range(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal tokens
            for _ in todo:
                n = await one(client, url, model, ttft, gaps)
                tokens += n  # not `tokens += await ...`: that reads tokens before the await

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "ttft": ttft, "gaps": gaps}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# ---- the run ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--requests", type=int, default=64, help="requests per level (at least 4 per stream)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--gap-ms", type=float, default=10.0)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.tokens, args.gap_ms / 1000)
        return
    work = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    up_port, gw_port = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "bench.proxy_overhead", "--serve-upstream", str(up_port), "--tokens",
         str(args.tokens), "--gap-ms", str(args.gap_ms)], cwd=ROOT, env=env,
    )  # fmt: skip
    upstream_url = f"http://127.0.0.1:{up_port}"
    config = {
        "models": TINY,
        "upstreams": [{"name": "remote", "base_url": upstream_url + "/v1", "model": UPSTREAM_MODEL}],
        "cache": {"enabled": False},
    }
    (work / "specgate.yaml").write_text(json.dumps(config))
    log = (work / "gateway.log").open("wb")
    gw = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(work / "specgate.yaml"), "--port",
         str(gw_port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    gateway_url = f"http://127.0.0.1:{gw_port}"
    header = stamp()
    rows = []
    try:
        wait_ready(upstream_url + "/v1/models", up)
        wait_ready(gateway_url + "/ready", gw)
        asyncio.run(load(gateway_url, "remote", 4, 16))  # warm: connections, first-request paths
        for streams in (int(s) for s in args.streams.split(",")):
            requests = max(args.requests, 4 * streams)
            for path, url, model in (
                ("direct", upstream_url, UPSTREAM_MODEL),
                ("gateway", gateway_url, "remote"),
            ):
                cpu0 = cpu_seconds(gw.pid)
                r = asyncio.run(load(url, model, streams, requests))
                r["gateway_cpu_s"] = cpu_seconds(gw.pid) - cpu0
                rows.append((streams, path, r))
                print(line(streams, path, r), flush=True)
    finally:
        for p in (gw, up):
            p.terminate()
            p.wait(30)
    write_section("proxy-overhead", render(rows, header, args))


def line(streams: int, path: str, r: dict[str, Any]) -> str:
    ms = [1000 * x for x in r["ttft"]]
    gaps = [1000 * x for x in r["gaps"]]
    cpu = f"{1e6 * r['gateway_cpu_s'] / r['tokens']:.0f}" if path == "gateway" else "-"
    return (
        f"| {streams} | {path} | {r['tokens'] / r['wall_s']:.0f} | {pct(ms, 50):.1f} | {pct(ms, 99):.1f} "
        f"| {pct(gaps, 50):.1f} | {pct(gaps, 99):.1f} | {cpu} |"
    )


def render(rows: list[tuple[int, str, dict[str, Any]]], header: str, args: argparse.Namespace) -> str:
    load = "/".join(f"{x:.1f}" for x in os.getloadavg())
    out = [
        "## The gateway as a proxy: streamed chat through specgate against the upstream directly",
        "",
        header,
        f"CPU kind: {cpu_kind()}. Load average (1/5/15 min) at the end: {load}.",
        "",
        f"An upstream stand-in (uvicorn, vLLM's chunk shapes) streams {args.tokens} content chunks "
        f"{args.gap_ms:g} ms apart per request; httpx clients in one asyncio process keep N streams busy "
        f"({args.requests} requests or 4 per stream, whichever is more, per row), straight to the upstream "
        "and through `specgate serve` (cache off, the request naming the upstream). All three processes "
        "share this machine's cores. Gateway CPU per token: the gateway process's user + system CPU "
        "time over the row, per streamed content chunk.",
        "",
        "| concurrent streams | path | aggregate tok/s | TTFT p50 ms | TTFT p99 ms | gap p50 ms "
        "| gap p99 ms | gateway CPU µs/token |",
        "|---|---|---|---|---|---|---|---|",
        *(line(s, p, r) for s, p, r in rows),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    main()
