"""Semantic cache quality on labelled pairs (bench/cache_pairs.jsonl): true-hit and false-hit rates.

For each pair, a fresh tenant stores an answer for ``a`` and looks up ``b`` through the real
``ResponseCache`` (in-process backend, MiniLM embedder, guard), exactly as the gateway does.
Paraphrases should hit; negation, number, entity and polarity near misses must not.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.cache_quality [--threshold 0.9] [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from gateway.cache import CacheSettings, ResponseCache, guard, response_from_texts

PAIRS = Path(__file__).with_name("cache_pairs.jsonl")


def _body(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 64}


async def run(threshold: float) -> dict[str, Any]:
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines() if line.strip()]
    cache = ResponseCache(CacheSettings(semantic_threshold=threshold))
    await cache.start()
    assert cache.embedder is not None
    await cache.embedder.start()  # type: ignore[attr-defined]
    rows = []
    for i, p in enumerate(pairs):
        tenant = f"bench-{i}"
        qa = cache.query(_body(p["a"]), tenant=tenant, endpoint="chat")
        qb = cache.query(_body(p["b"]), tenant=tenant, endpoint="chat")
        assert qa is not None and qb is not None
        await cache.store(qa, response_from_texts([f"answer to {p['a']}"], ["stop"], 10, 5))
        hit = await cache.lookup(qb)
        assert qa.embedding is not None and qb.embedding is not None
        sim = float(qa.embedding @ qb.embedding)
        ok = guard.compatible(guard.features(p["a"]), guard.features(p["b"]))
        rows.append({**p, "similarity": round(sim, 4), "guard_ok": ok, "hit": hit is not None})
    await cache.close()
    return summarise(rows, threshold)


def summarise(rows: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    para = [r for r in rows if r["label"] == "paraphrase"]
    near = [r for r in rows if r["label"] != "paraphrase"]
    by_label: dict[str, dict[str, int]] = {}
    for r in near:
        d = by_label.setdefault(r["label"], {"pairs": 0, "false_hits": 0, "above_threshold": 0})
        d["pairs"] += 1
        d["false_hits"] += r["hit"]
        d["above_threshold"] += r["similarity"] >= threshold  # what similarity alone would have served
    return {
        "threshold": threshold,
        "paraphrase_pairs": len(para),
        "true_hit_rate": sum(r["hit"] for r in para) / len(para),
        "near_miss_pairs": len(near),
        "false_hit_rate": sum(r["hit"] for r in near) / len(near),
        "near_miss_by_label": by_label,
        "missed_paraphrases": [
            (r["a"], r["b"], r["similarity"], r["guard_ok"]) for r in para if not r["hit"]
        ],
        "false_hits": [(r["a"], r["b"], r["similarity"]) for r in near if r["hit"]],
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threshold", type=float, default=CacheSettings().semantic_threshold)
    ap.add_argument("--sweep", action="store_true", help="also report thresholds 0.80..0.95")
    ap.add_argument("--out", help="write the full result (per-pair rows) as JSON")
    args = ap.parse_args()
    t0 = time.perf_counter()
    thresholds = [0.80, 0.85, 0.88, 0.90, 0.92, 0.95] if args.sweep else [args.threshold]
    results = [asyncio.run(run(t)) for t in thresholds]
    print(
        "| threshold | paraphrase true hits | near-miss false hits | near misses above threshold (no guard) |"
    )
    print("|---|---|---|---|")
    for r in results:
        above = sum(d["above_threshold"] for d in r["near_miss_by_label"].values())
        print(
            f"| {r['threshold']:.2f} | {r['true_hit_rate']:.1%} of {r['paraphrase_pairs']} "
            f"| {r['false_hit_rate']:.1%} of {r['near_miss_pairs']} | {above} |"
        )
    main_result = next((r for r in results if r["threshold"] == args.threshold), results[-1])
    print(f"\nby label at {main_result['threshold']}: {json.dumps(main_result['near_miss_by_label'])}")
    for a, b, s, g in main_result["missed_paraphrases"]:
        print(f"  missed paraphrase  sim={s:.3f} guard_ok={g}: {a!r} ~ {b!r}")
    for a, b, s in main_result["false_hits"]:
        print(f"  FALSE HIT          sim={s:.3f}: {a!r} ~ {b!r}")
    print(f"({time.perf_counter() - t0:.1f}s)")
    if args.out:
        Path(args.out).write_text(json.dumps(main_result, indent=1))


if __name__ == "__main__":
    main()
