"""The speculation controller in a batch, against a cost model instead of a GPU: the engine's own
choice of k (``Engine._choose_ks``: per-request SpecControllers and the batch's BatchCosts) driven with
step times from a table of measured graph replays and drafts accepted at random with probability ``a``.

    python -m bench.sim_controller [--a 0.8] [--table h200]

It prints, per N, the tokens per second of plain decoding, of a fixed k and of the controller, so a
change to the controller can be judged in seconds on a CPU before a GPU run confirms it. The model
leaves out host overheads and stalls, which only a real run measures (bench.gpu_batch).
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass, field

from decoding.controller import SpecController
from decoding.drafters import DraftModelDrafter
from decoding.engine import Engine
from decoding.params import RequestStats, SamplingParams

# H200, Qwen2.5-7B-shaped target / 0.5B-shaped draft, bf16, compiled, graphs (bench.probe_batch):
# seconds per target step by (batch, width) in exact mode (every row padded to 9), and per draft pass
# by batch (each pass also costs the host about 0.2 ms, which overlaps the GPU once no sync is left).
H200_TARGET_EXACT = {1: 5.04e-3, 4: 5.2e-3, 16: 5.9e-3, 32: 9.5e-3, 64: 16.0e-3}
H200_DRAFT = {1: 1.33e-3, 4: 1.41e-3, 16: 1.45e-3, 64: 1.60e-3}


def _interp(table: dict[int, float], n: int) -> float:
    keys = sorted(table)
    if n <= keys[0]:
        return table[keys[0]]
    for lo, hi in itertools.pairwise(keys):
        if n <= hi:
            return table[lo] + (n - lo) / (hi - lo) * (table[hi] - table[lo])
    return table[keys[-1]] * n / keys[-1]


@dataclass
class _Request:
    params: SamplingParams


@dataclass
class _Target:
    name: str = "target"


@dataclass
class _Seq:
    """What ``Engine._choose_ks`` reads of a sequence."""

    controller: SpecController
    drafter: object
    request: _Request
    target: _Target = field(default_factory=_Target)
    completion_tokens: int = 0
    stats: RequestStats = field(default_factory=RequestStats)


def simulate(N: int, mode: str, a: float, new: int = 128, k_fixed: int = 4, seed: int = 0) -> float:
    """Aggregate tokens per second of N requests decoding ``new`` tokens each."""
    rng = random.Random(seed)
    engine = Engine({})
    drafter = DraftModelDrafter.__new__(DraftModelDrafter)  # the type is what the engine checks
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    seqs = [
        _Seq(
            SpecController(
                k_max=k_fixed if mode == "on" else 8,
                adaptive=mode == "auto",
                speculate=mode != "off",
                draft_cost_prior=0.07,
            ),
            drafter if mode != "off" else None,
            _Request(params),
        )
        for _ in range(N)
    ]
    clock, tokens = 0.0, 0
    while seqs:
        ks = engine._choose_ks(seqs)  # type: ignore[arg-type]
        K = max(ks)
        B = len(seqs)
        t_draft = sum(_interp(H200_DRAFT, sum(k > j for k in ks)) for j in range(K))
        t_target = _interp(H200_TARGET_EXACT, B)
        engine._costs(seqs[0]).observe(B, B * (K + 1), K, t_draft, t_target)  # type: ignore[arg-type]
        done = []
        for s, k in zip(seqs, ks, strict=True):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            s.controller.observe(k, n, t_draft * k / K if k else 0.0, t_target)
            got = min(n + 1, new - s.completion_tokens)
            s.completion_tokens += got
            tokens += got
            if s.completion_tokens >= new:
                done.append(s)
        clock += t_draft + t_target
        seqs = [s for s in seqs if s not in done]
    return tokens / clock


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=float, default=0.8)
    args = ap.parse_args()
    print(f"acceptance {args.a}: aggregate tok/s (cost model of the H200 run, exact mode)")
    print("   N      off   on(k=4)     auto   auto/off  auto/on")
    for N in (1, 2, 4, 8, 16, 32, 64):
        off, on = simulate(N, "off", args.a), simulate(N, "on", args.a)
        auto = sum(simulate(N, "auto", args.a, seed=s) for s in range(3)) / 3
        print(f"{N:4d} {off:8.0f} {on:9.0f} {auto:8.0f} {auto / off:9.2f}x {auto / on:7.2f}x")


if __name__ == "__main__":
    main()
