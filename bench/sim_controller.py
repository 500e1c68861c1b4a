"""The speculation controller in a batch, against a cost model instead of a GPU: the engine's own
choice of k (``Engine.ks_for``, ``batch_controller.choose_ks``: per-request SpecControllers alone, the
batch's BatchCosts from two rows) driven with step times from a table of measured graph replays, as
the engine would measure them.

    python -m bench.sim_controller [--a 0.8] [--seeds 32]

It prints, per N, the tokens per second of plain decoding, of a fixed k and of the controller, and the
controller's p99 inter-token gap, so a change to the controller can be judged in seconds on a CPU
before a GPU run confirms it (bench.gpu_batch).

What it models of a real step, beyond the table: acceptance as bench.gpu_batch's replay drafter makes
it (each output position kept with probability ``a``, drawn once per request, so every mode sees the
same text); the host's time around a step, which no CUDA event sees; the GPU idle while the host
launches a phase's first kernel, which the event timing does see (the draft's first pass, a plain
step's verification); and the draft's catch-up, outside the timed draft (its prompt at the first
proposal, in passes of ``CATCH_UP_PASS`` tokens, and a backlog longer than
``DraftModelDrafter.INLINE_GPU`` after plain steps), and the batch's prefill step. Means over
``seeds`` runs (one run at N = 1 is a single draw of 128 positions: its acceptance is 0.8 +- 0.03).

Against bench.gpu_batch on the H200 (exact mode unpadded, 2026-12-04): plain within 1% of the 15:46
run at every N; on bench.gpu_batch's own nine draws (``--draws 9``) fixed k = 4 / plain within 2% of
the 17:45 run's draw by draw at N = 1 and 4, and auto's medians within 1.5%.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

import torch

from decoding.batch_controller import BatchCosts
from decoding.controller import SpecController, expected_tokens
from decoding.drafters import DraftModelDrafter
from decoding.engine import Engine
from decoding.graphs import batch_bucket
from decoding.params import RequestStats, SamplingParams

# H200, Qwen2.5-7B-shaped target / 0.5B-shaped draft, bf16, compiled, graphs, exact mode as it runs
# since 58a17c3 (each row at its own width where the device showed it rounds as a one-token row:
# every width of every bucket but width 1 at bucket 1, which runs at 2): device seconds of a graph
# replay by (batch bucket, width), the start-up table `python -m bench.probe_graph_memory` printed
# (2026-12-04 17:52 UTC; decoding.graphs.time_replays). The target's by width 1..9, the draft's one
# token a row. A step's wall time adds HOST_S and LAUNCH_S below.
H200_TARGET_EXACT = {
    1: (4.287, 4.287, 4.258, 4.281, 4.293, 4.286, 4.296, 4.298, 4.368),
    2: (4.220, 4.276, 4.287, 4.305, 4.325, 4.334, 4.349, 4.353, 4.369),
    4: (4.245, 4.297, 4.335, 4.345, 4.374, 4.385, 4.399, 4.425, 4.461),
    8: (4.277, 4.356, 4.388, 4.435, 4.442, 4.469, 4.515, 4.556, 4.582),
    16: (4.326, 4.439, 4.474, 4.550, 4.627, 4.740, 4.715, 4.844, 4.954),
    24: (4.437, 4.513, 4.614, 4.752, 4.817, 4.990, 5.180, 6.454, 6.007),
    32: (4.475, 4.581, 4.765, 4.838, 5.469, 6.460, 6.430, 6.508, 7.509),
    48: (4.472, 4.778, 4.984, 6.530, 6.636, 7.557, 7.840, 9.491, 10.242),
    64: (4.716, 4.941, 6.633, 7.135, 9.083, 9.590, 11.438, 11.426, 15.619),
}
H200_DRAFT = {1: 0.938, 2: 0.935, 4: 0.934, 8: 0.936, 16: 0.959, 24: 0.966, 32: 0.966, 48: 0.994, 64: 1.027}
# bench.gpu_batch's traced steps the same hour (`--quick --ns 1,2,4 --repeats 9`, 17:45 UTC): a plain
# exact step 4.49 / 4.33 ms at N = 1 / 4 against replays of 4.29 / 4.25 (plain steps queue back to
# back, hiding the host's work: about 0.15 ms of the GPU idle while the host launches a phase's first
# kernel, which a timed phase sees), a k = 4 step 8.75 / 8.9-9.1 ms against 8.05 / 8.11 of replays: a
# speculative step also waits for the step before's read-back, commit and planning, ~0.6 ms. The
# draft's prompt and its backlogs replay prompt-chunk graphs since fa58035: bench.probe_auto_fast on
# the H200 (2026-12-02 06:20 UTC) timed a k = 2 probe step at N = 4 / 16 (a backlog of 16-64 tokens
# a row) 3.5 / 4.9 ms over a plain step, of which two draft passes are 2.8 / 2.9 ms, and the first
# speculative step (the 128-token prompt) about 2 ms over a later one; at N = 16 (the nosync probe,
# 10:05 UTC) the first speculative step took 24 ms against 9-10 ms for a later one: the prompts'
# catch-up runs in passes of up to 512 tokens (drafters.catch_up_many), 2-3.5 ms each.
HOST_S = 0.6e-3  # a speculative step's, outside its timed phases
LAUNCH_S = 0.15e-3
# the batch's prefill step (every 128-token prompt in one, exact mode) in the same traced runs
# (2026-12-04 15:46 UTC at N = 8..64): on every mode's clock, as on bench.gpu_batch's
PREFILL_S = {1: 5.3e-3, 2: 7.0e-3, 4: 11.3e-3, 8: 34e-3, 16: 44e-3, 32: 86e-3, 64: 175e-3}
DRAFT_PREFILL_S = 2.5e-3  # per catch-up pass of the draft's prompts
CATCH_UP_PASS = 512  # tokens a catch-up pass holds
CATCH_UP_S = 1.5e-3
PROMPT = 128


def target_seconds(rows: int, width: int) -> float:
    """Seconds of a target replay of ``rows`` rows (in their graph bucket) at ``width`` tokens."""
    return 1e-3 * H200_TARGET_EXACT[batch_bucket(rows)][width - 1]


def draft_seconds(rows: int) -> float:
    """Seconds of a draft pass of ``rows`` rows (in their graph bucket)."""
    return 1e-3 * H200_DRAFT[batch_bucket(rows)]


@dataclass
class _Request:
    params: SamplingParams


@dataclass
class _Target:
    name: str = "target"


@dataclass
class _Model:
    """A runner's model as ``Engine.costs_of`` reads it: its start-up step table (seconds by
    (batch, width); (0, W): a W-token prompt chunk alone), as ``StaticModel.time_steps`` gives it,
    and exact mode's padding (none: the H200 showed every verification width, ``exact_padding``)."""

    step_costs: dict[tuple[int, int], float]
    exact: bool = False
    exact_padding: int = 0


@dataclass
class _Runner:
    batch_model: _Model
    length: int = 0  # tokens in the cache

    @property
    def exact(self) -> bool:
        return self.batch_model.exact


# The start-up tables the engine seeds its cost model from, the tables above, and a draft's
# 512-token prompt chunk a catch-up pass.
TARGET_TABLE = _Model(
    {(B, W + 1): 1e-3 * t for B, ts in H200_TARGET_EXACT.items() for W, t in enumerate(ts)}, exact=True
)
DRAFT_TABLE = _Model(
    {(B, 1): 1e-3 * t for B, t in H200_DRAFT.items()} | {(0, CATCH_UP_PASS): DRAFT_PREFILL_S}
)


class _Draft(DraftModelDrafter):
    """A row's draft as the engine reads it (its type, its cache length); it drafts nothing itself."""

    def __init__(self) -> None:  # no model: the simulation decides what is accepted
        self.inline = self.INLINE_GPU
        self.runner = _Runner(DRAFT_TABLE)


@dataclass(eq=False)
class _Seq:
    """What ``Engine.ks_for`` reads of a sequence."""

    controller: SpecController
    drafter: _Draft | None
    request: _Request
    keep: list[bool]  # [new + 16] whether the draft's token at each output position is accepted
    target: _Target = field(default_factory=_Target)
    runner: _Runner = field(default_factory=lambda: _Runner(TARGET_TABLE))
    completion_tokens: int = 0
    stats: RequestStats = field(default_factory=RequestStats)
    gaps: list[float] = field(default_factory=list)  # per token, as bench.gpu_batch counts them

    @property
    def tokens(self) -> range:  # the prompt and the output so far (only their count is read)
        return range(PROMPT + self.completion_tokens)

    @property
    def draft_seen(self) -> int:  # tokens in the draft's cache
        return self.drafter.runner.length if self.drafter is not None else 0


@dataclass
class Result:
    tps: float  # aggregate tokens per second
    itl_p99: float  # seconds, over every request's per-token gaps


def simulate(
    N: int,
    mode: str,
    a: float,
    new: int = 128,
    k_fixed: int = 4,
    seed: int = 0,
    collapse: float = 0.0,
    engine: Engine | None = None,
    keeps: list[list[bool]] | None = None,
) -> Result:
    """N requests decoding ``new`` tokens each from a shared start (after their prefill).
    ``collapse``: past a position drawn per request (geometric, this mean) no draft is accepted, as
    in bench.gpu_batch's fast-mode auto, where the replay's reference parts at a bf16 tie.
    ``engine``: one that ran before (its measured costs and acceptance carry over). ``keeps``: each
    request's kept positions, given (``draws``: bench.gpu_batch's own), not drawn."""
    rng = random.Random(seed)
    engine = engine or Engine({})

    def keep() -> list[bool]:
        end = new + 16
        if collapse:
            end = 1
            while rng.random() > 1 / collapse:
                end += 1
        return [i < end and rng.random() < a for i in range(new + 16)]

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    seqs = [
        _Seq(
            SpecController(
                k_max=k_fixed if mode == "on" else 8,
                adaptive=mode == "auto",
                speculate=mode != "off",
                draft_cost_prior=0.07,
            ),
            _Draft() if mode != "off" else None,
            _Request(params),
            keeps[i] if keeps is not None else keep(),
        )
        for i in range(N)
    ]
    for s in seqs:
        if s.drafter is not None:
            engine._population(s).seed(s.controller)  # type: ignore[arg-type]
    every = list(seqs)
    clock, tokens = PREFILL_S.get(N, 0.0), 0
    while seqs:
        ks = engine.ks_for(seqs)  # type: ignore[arg-type]
        K = max(ks)
        B = len(seqs)
        # the draft catches up outside its timed passes: its prompt at a row's first proposal, a
        # backlog past the inline limit after plain steps (one forward for every row that needs it)
        behind = [
            s
            for s, k in zip(seqs, ks, strict=True)
            if k and PROMPT + s.completion_tokens - s.draft_seen > DraftModelDrafter.INLINE_GPU
        ]
        t_catch = 0.0
        if behind:
            fresh = sum(s.draft_seen == 0 for s in behind)
            t_catch = DRAFT_PREFILL_S * -(-fresh * PROMPT // CATCH_UP_PASS) if fresh else CATCH_UP_S
        # (the target's step keeps the batch's starting bucket as rows finish, as bench.gpu_batch
        # runs exact mode: StaticModel.exact_min_rows; the draft's passes hold the rows drafting)
        t_draft = sum(draft_seconds(sum(k > j for k in ks)) for j in range(K))
        t_draft += LAUNCH_S if K else 0.0
        t_target = target_seconds(N, K + 1) + (0.0 if K else LAUNCH_S)
        ns = []
        for s, k in zip(seqs, ks, strict=True):
            n = 0
            while n < k and s.keep[s.completion_tokens + n]:
                n += 1
            ns.append(n)
        costs = engine.costs_of(seqs[0])  # type: ignore[arg-type]
        step = (HOST_S if K else 0.0) + t_catch + t_draft + t_target
        clock += step
        if K:  # the engine's wall time of a speculative step: its host work, less the catch-up ...
            wall = HOST_S + t_draft + t_target
            expected = sum(expected_tokens(s.controller.acceptance, k) for s, k in zip(seqs, ks, strict=True))
            costs.observe_goodput(B, K, True, expected, sum(n + 1 for n in ns), wall)
            # ... split between draft and target as their device times are (Engine.commit_step)
            t_draft, t_target = wall * t_draft / (t_draft + t_target), wall * t_target / (t_draft + t_target)
        costs.observe(B, B * (K + 1), K, t_draft, t_target)
        for s, k, n in zip(seqs, ks, ns, strict=True):
            s.controller.observe(k, n, t_draft * k / K if k else 0.0, t_target)
            if s.drafter is not None:
                engine._population(s).observe(k, n)  # type: ignore[arg-type]
            if k and s.drafter is not None:  # the draft's cache, cut back to the accepted drafts
                s.drafter.runner.length = PROMPT + s.completion_tokens + min(n, k - 1)  # (not its last)
            got = min(n + 1, new - s.completion_tokens)
            s.completion_tokens += got
            s.gaps += [step / got] * got
            tokens += got
        seqs = [s for s in seqs if s.completion_tokens < new]
    gaps = sorted(g for s in every for g in s.gaps[1:])  # the first token's gap is TTFT's
    return Result(tokens / clock, gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))])


def mean(N: int, mode: str, a: float, seeds: int, collapse: float, history: bool) -> Result:
    """Means over ``seeds`` runs; ``history``: the runs share one engine, as the runs of one mode
    at increasing N do in bench.gpu_batch (each learns from the runs before it)."""
    engine = Engine({}) if history else None
    runs = [simulate(N, mode, a, seed=s, collapse=collapse, engine=engine) for s in range(seeds)]
    return Result(sum(r.tps for r in runs) / seeds, sum(r.itl_p99 for r in runs) / seeds)


def spread(a: float, seeds: int, collapse: float) -> None:
    """auto / fixed k = 4 on each of ``seeds`` draws at each N: a run's rate ends with its last row,
    and which row ends last, by how many steps, follows the draw and the k each step took, so one
    draw compares two controllers' luck as much as the controllers (bench.gpu_batch replayed one
    draw per N until 2026-12-04: at N = 4 auto ran 0.94-0.99x of fixed k = 4 in six H200 runs)."""
    print(f"acceptance {a}, collapse {collapse or 'never'}: auto / on(k=4) per draw, {seeds} draws")
    print("   N     min  median     max     sd")
    for N in (1, 2, 4, 8, 16, 32, 64):
        r = [
            simulate(N, "auto", a, seed=s, collapse=collapse).tps
            / simulate(N, "on", a, seed=s, collapse=collapse).tps
            for s in range(max(4, seeds // max(1, N // 4)))
        ]
        print(f"{N:4d} {min(r):7.3f} {statistics.median(r):7.3f} {max(r):7.3f} {statistics.pstdev(r):6.3f}")


def draws(a: float, n_draws: int) -> None:
    """On bench.gpu_batch's own acceptance draws (``draw_generator``: the positions its replay keeps
    at each repeat), draw by draw: fixed k = 4 and auto against plain, each on a fresh engine."""
    from bench.gpu_batch import NEW, draw_generator  # (the GPU benchmark's module: only here)

    print(f"acceptance {a}: bench.gpu_batch's draws 0..{n_draws - 1}, on(k=4) / off and auto / off per draw")
    for N in (1, 2, 4, 8, 16):
        keeps = [
            [(torch.rand(NEW + 16, generator=draw_generator(N, i, d)) < a).tolist() for i in range(N)]
            for d in range(n_draws)
        ]
        off = [simulate(N, "off", a, keeps=k).tps for k in keeps]
        on = [simulate(N, "on", a, keeps=k).tps / o for k, o in zip(keeps, off, strict=True)]
        auto = [simulate(N, "auto", a, keeps=k).tps / o for k, o in zip(keeps, off, strict=True)]
        print(f"{N:4d} on  {' '.join(f'{x:.3f}' for x in on)}   median {statistics.median(on):.3f}")
        print(f"     auto {' '.join(f'{x:.3f}' for x in auto)}   median {statistics.median(auto):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=float, default=0.8)
    ap.add_argument("--seeds", type=int, default=32, help="runs per point at N = 1 (fewer at larger N)")
    ap.add_argument("--collapse", type=float, default=0.0, help="mean position where acceptance ends")
    ap.add_argument("--history", action="store_true", help="runs at one N share an engine")
    ap.add_argument(
        "--no-realised", action="store_true", help="best_k without its discount by realised goodput"
    )
    ap.add_argument(
        "--spread",
        action="store_true",
        help="auto / fixed k = 4 draw by draw (fresh engines, one draw each for both): its spread",
    )
    ap.add_argument(
        "--draws",
        type=int,
        default=0,
        metavar="D",
        help="bench.gpu_batch's first D acceptance draws, one by one",
    )
    args = ap.parse_args()
    if args.draws:
        draws(args.a, args.draws)
        return
    if args.spread:
        spread(args.a, args.seeds, args.collapse)
        return
    if args.no_realised:
        BatchCosts.observe_goodput = lambda self, *a: None  # type: ignore[method-assign]
    print(
        f"acceptance {args.a}, collapse {args.collapse or 'never'}, history {args.history}:"
        " aggregate tok/s (cost model of the H200 run, exact mode)"
    )
    print("   N      off   on(k=4)     auto   auto/off  auto/on   p99 ms: off    on  auto")
    for N in (1, 2, 4, 8, 16, 32, 64):
        seeds = max(2, args.seeds // N)
        off, on, auto = (
            mean(N, m, args.a, seeds, args.collapse, args.history) for m in ("off", "on", "auto")
        )
        print(
            f"{N:4d} {off.tps:8.0f} {on.tps:9.0f} {auto.tps:8.0f} {auto.tps / off.tps:9.2f}x"
            f" {auto.tps / on.tps:7.2f}x {1e3 * off.itl_p99:14.1f} {1e3 * on.itl_p99:5.1f}"
            f" {1e3 * auto.itl_p99:5.1f}"
        )


if __name__ == "__main__":
    main()
