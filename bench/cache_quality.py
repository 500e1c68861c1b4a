"""Semantic cache quality on labelled pairs (bench/cache_pairs.jsonl): true-hit and false-hit rates.

For each pair, a fresh tenant stores an answer for ``a`` and looks up ``b`` through the real
``ResponseCache`` (in-process backend, MiniLM embedder, guard), exactly as the gateway does.
Paraphrases should hit; negation, number, entity and polarity near misses must not.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.cache_quality [--threshold 0.9] [--sweep] [--out FILE]

Writes the `cache-quality` section of docs/benchmarks.md (bench/report.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.report import stamp, write_section
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
        ok = guard.compatible(guard.key_terms(p["a"]), guard.key_terms(p["b"]))
        rows.append({**p, "similarity": round(sim, 4), "guard_ok": ok, "hit": hit is not None})
    embedder = cache.embedder.id
    await cache.close()
    return {**summarise(rows, threshold), "embedder": embedder}


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
    write_section("cache-quality", render(results, main_result))


def render(results: list[dict[str, Any]], main: dict[str, Any]) -> str:
    labels = main["near_miss_by_label"]
    th = main["threshold"]
    lines = [
        "## Cache quality: paraphrases vs near misses",
        "",
        stamp(),
        "",
        f"`bench/cache_pairs.jsonl` holds {main['paraphrase_pairs'] + main['near_miss_pairs']} labelled pairs: "
        f"{main['paraphrase_pairs']} paraphrases and {main['near_miss_pairs']} near misses ("
        + ", ".join(f"{d['pairs']} {k}" for k, d in labels.items())
        + "). For each pair a fresh tenant stores an answer to `a` and looks up `b` through the real "
        f"`ResponseCache` (embedder `{main['embedder']}`, LSH index, exact re-ranking, guard), with temperature 0.",
        "",
        "| threshold | paraphrase true hits | near-miss false hits | near misses above threshold (no guard) |",
        "|---|---|---|---|",
    ]
    for r in results:
        above = sum(d["above_threshold"] for d in r["near_miss_by_label"].values())
        cells = [f"{r['threshold']:.2f}", f"{r['true_hit_rate']:.1%} of {r['paraphrase_pairs']}",
                 f"{r['false_hit_rate']:.1%} of {r['near_miss_pairs']}"]  # fmt: skip
        if r is main:
            cells = [f"**{c}**" for c in cells]
            cells[0] = f"**{r['threshold']:.2f} (this run's threshold)**"
        lines.append("| " + " | ".join(cells) + f" | {above} |")
    above = sum(d["above_threshold"] for d in labels.values())
    met = main["false_hit_rate"] == 0 and main["true_hit_rate"] >= 0.7
    lines += [
        "",
        f"Goal (0 false hits, >= 70% true hits) at {th:.2f}: {'met' if met else 'NOT met'}. "
        f"The last column is why the guard exists: at {th:.2f}, {above} near misses are at least as similar to "
        "their partner as the threshold asks ("
        + ", ".join(f"{d['above_threshold']} of {d['pairs']} {k}" for k, d in labels.items())
        + f"); similarity alone would have served those {above} wrong answers.",
        "",
        f"Paraphrases missed at {th:.2f} (similarity; guard_ok = False means the guard refused on purpose):",
    ]
    lines += [
        f"- {a!r} ~ {b!r}: {sim:.3f}, guard_ok={ok}" for a, b, sim, ok in main["missed_paraphrases"]
    ] or ["- none"]
    lines += ["", f"False hits at {th:.2f}:"]
    lines += [f"- {a!r} ~ {b!r}: {sim:.3f}" for a, b, sim in main["false_hits"]] or ["- none"]
    s = CacheSettings()
    p_bit = 1 - math.acos(s.semantic_threshold) / math.pi  # random-hyperplane LSH: P(one sign bit agrees)
    p_bucket = 1 - (1 - p_bit**s.lsh_bits) ** s.lsh_bands
    lines += [
        "",
        "Caveats: the pairs and the guard's word lists were written by the same person, so read these as an "
        "upper bound on real traffic. Entity differences in lowercase (pandas/polars, numpy/scipy, pytest/"
        "unittest) are not caught by the guard; they stay out only while the embedder puts them below the "
        "threshold. A different threshold or embedder needs this benchmark re-run.",
        "",
        f"Settings: `cache.semantic_threshold` ({s.semantic_threshold:.2f}), `semantic_max_temperature` "
        f"({s.semantic_max_temperature:g}), `semantic_max_chars` ({s.semantic_max_chars}), `lsh_bands` x "
        f"`lsh_bits` ({s.lsh_bands} x {s.lsh_bits}: a {s.semantic_threshold:.2f} neighbour shares a bucket with "
        f"probability {p_bucket:.3f}, computed) and `embedder_threads` ({s.embedder_threads}: two OpenMP threads "
        "contending with the engine made MiniLM 4-7x slower on the 2-core box, seen while building the cache, "
        "not measured by this script).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
