"""CPU probe: the garbage collector under the gateway's own work, with the server's default models
loaded as `specgate serve` loads them (``gateway.server._build_engine``), requests sent in process
through the app (httpx's ASGI transport), 8 at a time, half of them streamed.

    python -m bench.probe_gc [REQUESTS] [--no-freeze]

Prints the collections by generation during the requests, with each generation's longest pause.
``--no-freeze``: the server's ``freeze_heap`` left out, to see what a full collection costs then.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time

import httpx

import decoding.warmup
from bench.report import GcPauses
from gateway.app import create_app
from gateway.server import _build_engine
from gateway.settings import load_settings


async def send(app: object, n: int, model: str) -> float:
    """Seconds to answer ``n`` short chat requests, 8 at a time."""
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://probe", timeout=120) as client:
        gate = asyncio.Semaphore(8)

        async def one(i: int) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Say a number near {i}."}],
                "max_tokens": 3,
                "stream": i % 2 == 0,
            }
            async with gate:
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("requests", type=int, nargs="?", default=400)
    ap.add_argument("--no-freeze", action="store_true")
    args = ap.parse_args(argv)
    settings = load_settings(env={"SPECGATE_CACHE__ENABLED": "false"})  # every request generates
    if args.no_freeze:
        decoding.warmup.freeze_heap = lambda: 0  # type: ignore[assignment]  # the server's call, left out
    engine = _build_engine(settings)
    print(f"objects tracked {len(gc.get_objects())}, frozen {gc.get_freeze_count()}", flush=True)
    try:
        app = create_app(settings, engine=engine)
        pauses = GcPauses()
        wall = asyncio.run(send(app, args.requests, settings.models[0].name))
    finally:
        engine.shutdown()  # type: ignore[attr-defined]
    by_gen: dict[int, list[float]] = {}
    for g, t in pauses.pauses:
        by_gen.setdefault(g, []).append(t)
    print(f"{args.requests} requests in {wall:.1f} s; collections by generation (count, longest ms):")
    for g, ts in sorted(by_gen.items()):
        print(f"   gen {g}: {len(ts)}, {1e3 * max(ts):.1f} ms")


if __name__ == "__main__":
    main()
