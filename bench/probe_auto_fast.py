"""Device probe: where speculation auto loses in fast mode at N = 16 (bench.gpu_batch's auto_fast row).
Runs fast off (the replay's reference), then auto, timing every engine step and printing the slow
ones with what they held: rows, drafted tokens, the draft's catch-up backlog, graphs captured during
the step, and dynamo recompiles (logged by torch).

    python -m bench.probe_auto_fast [exact] [nosync] [minrows=R] [on=R] [rounds=R] [N ...]   (default 16)

``exact``: the same in exact mode (bench.gpu_batch's auto row), every prompt in one prefill step.
``nosync``: no device sync around a step, so steps queued ahead overlap as they do in a server; a
step's time is then the interval between two calls' returns (the step each returns).
Each round prints where each request's output first parts from the replay's reference (past it, the
replay's drafts are all rejected), the step that was and how many rows it held, and the batch's rows
step by step. ``minrows=R``: exact-mode graph steps hold at least R rows (StaticModel.exact_min_rows).
``on=R``: R runs at a fixed k = 4 (the same replay) on the engine before each auto round, as
bench.gpu_batch's ``on`` runs come before its ``auto`` ones. ``rounds=R``: R rounds (default 2) on the
same engine, whose batch costs carry over, as bench.gpu_batch's repeats do.
"""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from bench.gpu import DRAFT, TARGET, build
from bench.gpu_batch import EXACT_LEN, MAX_LEN, NEW, PROMPT, corrupt, replay_engine, run_requests
from decoding.async_engine import AsyncEngine
from decoding.batch_controller import BatchCosts
from decoding.engine import Engine
from decoding.graphs import BATCH_BUCKETS, batch_bucket
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.static import StaticModel


def main() -> None:
    torch._logging.set_logs(recompiles=True)
    exact = "exact" in sys.argv[1:]
    nosync = "nosync" in sys.argv[1:]
    opts = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    ns = [int(a) for a in sys.argv[1:] if a not in ("exact", "nosync") and "=" not in a] or [16]
    target, draft = build(TARGET, 0), build(DRAFT, 1)
    if exact:
        tm = StaticModel(target, EXACT_LEN, slots=max(ns) + 2, graphs=True, compile_step=True, exact=True)
    else:
        tm = StaticModel(target, MAX_LEN, slots=max(ns) + 2, graphs=True, compile_step=True)
    dm = StaticModel(draft, MAX_LEN, slots=max(ns) + 2, graphs=True, compile_step=True)
    tm.exact_min_rows = int(opts.get("minrows", 1))
    tm.warm()
    dm.warm()
    for N in ns:
        probe(N, target, draft, tm, dm, exact, nosync, int(opts.get("on", 0)), int(opts.get("rounds", 2)))


def print_by_k(log: list) -> None:  # type: ignore[type-arg]
    """Steps by the most any row drafted in them (-1: a prefill step): count, mean and max time."""
    by_k: dict[int, list[float]] = {}
    for dt, _, drafted, _, _ in log:
        by_k.setdefault(max(drafted, default=-1), []).append(dt)
    for k, ts in sorted(by_k.items()):
        print(f"   k={k}: {len(ts)} steps, mean {1e3 * sum(ts) / len(ts):.1f} ms, max {1e3 * max(ts):.1f} ms")


def probe(
    N: int,
    target: torch.nn.Module,
    draft: torch.nn.Module,
    tm: StaticModel,
    dm: StaticModel,
    exact: bool,
    nosync: bool = False,
    on: int = 0,
    rounds: int = 2,
) -> None:
    buckets = tuple(b for b in BATCH_BUCKETS if b <= batch_bucket(N))
    if exact:
        tm.capture(range(1, 2), buckets)
        tm.capture(range(0), (), chunk_tokens=(128, 256, 512))
    else:
        tm.capture(range(1, 2), buckets, chunk_tokens=(256,))
        tm.capture(range(2, tm.max_graph_tokens + 1), buckets)
    dm.capture(range(1, dm.max_graph_tokens + 1), buckets)
    dm.capture(range(0), (), chunk_tokens=(128, 256, 512))
    for m in (tm, dm):  # the start-up cost table, as the loader times it (BatchCosts.seed)
        m.time_steps()
    fast = replay_engine(target, draft, tm, dm, tm.max_len if exact else MAX_LEN, MAX_LEN)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 150000, (N, PROMPT), generator=gen)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)

    def reqs(tag: str, spec: SpecParams) -> list[GenerationRequest]:
        return [GenerationRequest(f"{tag}{i}", "target", prompts[i].tolist(), params, spec) for i in range(N)]

    log: list[tuple[float, int, list[int], int, list]] = []  # type: ignore[type-arg]
    returned: list[float] = []
    emitted: dict[str, list[tuple[int, int]]] = {}  # request -> (step, tokens) per step it got tokens
    inner = Engine.step_batch
    choices: list[str] = []
    best_k = BatchCosts.best_k

    def logged(self, rows, prior, probe, **kw):  # type: ignore[no-untyped-def]
        k = best_k(self, rows, prior, probe, **kw)
        B = len(rows)
        t = [self.t_target(B * (j + 1)) for j in range(3)]
        choices.append(
            f"k={k} probe={probe} a={[round(a, 2) for a, _, _ in rows]} t_target(B(k+1)), k=0..2: "
            f"{[round(1e3 * x, 2) if x else None for x in t]} ms, t_draft {self.t_draft(B)}, {kw}, "
            f"host {self.host}, seed gap {self.seed_gap}, realised {self.realised}, verifications (ms) "
            f"{ {r: round(1e3 * v, 2) for r, v in sorted(self.verifications(B).items())} }"
        )
        return k

    b = batch_bucket(N)
    print(
        f"N={N} start-up table (ms): target {[(W, round(1e3 * tm.step_costs.get((b, W), 0), 2)) for W in range(1, 10)]}"
        f", draft pass {round(1e3 * dm.step_costs.get((b, 1), 0), 2)}"
        f", draft chunk of 512 {round(1e3 * dm.step_costs.get((0, 512), 0), 2)}",
        flush=True,
    )

    def timed(self, seqs, budget=None, joining=False):  # type: ignore[no-untyped-def]
        g0 = {("t", *k) for k in tm.graphs} | {("d", *k) for k in dm.graphs}
        backlog = max(
            (len(s.tokens) - s.drafter.runner.length for s in seqs if s.drafter is not None), default=0
        )
        if not nosync:
            torch.cuda.synchronize()
        t = time.perf_counter() if not nosync or not returned else returned[-1]
        outs = inner(self, seqs, budget, joining)
        if not nosync:
            torch.cuda.synchronize()
        returned.append(time.perf_counter())
        drafted = [o.drafted for o in outs if o is not None]
        for o in outs:
            if o is not None:
                emitted.setdefault(o.request_id, []).append((len(log), len(o.token_ids)))
        log.append(
            (
                returned[-1] - t,
                len(seqs),
                drafted,
                backlog,
                sorted(({("t", *k) for k in tm.graphs} | {("d", *k) for k in dm.graphs}) - g0),
            )
        )
        return outs

    for rnd in range(rounds):
        # exact mode as bench.gpu_batch runs it: every prompt in one prefill step
        ae = AsyncEngine(fast, 0, N, N * PROMPT) if exact else AsyncEngine(fast, N, N, 256)
        try:
            if exact:
                ae.max_active = 0
            t0 = time.perf_counter()
            _, _, outs, _ = asyncio.run(
                run_requests(ae, reqs(f"off{rnd}-", SpecParams(SpecMode.OFF)), hold=exact)
            )
            wall_off = time.perf_counter() - t0
            ref = [outs[f"off{rnd}-{i}"] for i in range(N)]
            auto = reqs(f"auto{rnd}-", SpecParams(SpecMode.DRAFT, max_k=8, adaptive=True))
            for i, r in enumerate(auto):
                fast.references[r.request_id] = corrupt(ref[i], 0.8, gen)
            for j in range(on):  # fixed k = 4 runs on the same engine first, as bench.gpu_batch's are
                fixed = reqs(f"on{rnd}.{j}-", SpecParams(SpecMode.DRAFT, max_k=4, adaptive=False))
                for i, r in enumerate(fixed):
                    fast.references[r.request_id] = fast.references[auto[i].request_id]
                if exact:
                    ae.max_active = 0
                Engine.step_batch = timed  # type: ignore[method-assign]
                log.clear()
                returned.clear()
                t0 = time.perf_counter()
                try:
                    asyncio.run(run_requests(ae, fixed, hold=exact))
                finally:
                    Engine.step_batch = inner  # type: ignore[method-assign]
                print(
                    f"N={N} round {rnd}: fixed k = 4 run {j}: {len(log)} steps, "
                    f"{sum(x[0] for x in log) * 1e3:.0f} ms in steps, {(time.perf_counter() - t0) * 1e3:.0f} ms wall"
                )
                print_by_k(log)
            Engine.step_batch = timed  # type: ignore[method-assign]
            BatchCosts.best_k = logged  # type: ignore[method-assign,assignment]
            log.clear()
            emitted.clear()
            choices.clear()
            returned.clear()
            if exact:
                ae.max_active = 0
            t0 = time.perf_counter()
            _, _, got, _ = asyncio.run(run_requests(ae, auto, hold=exact))
            wall = time.perf_counter() - t0
        finally:
            Engine.step_batch = inner  # type: ignore[method-assign]
            BatchCosts.best_k = best_k  # type: ignore[method-assign]
            ae.shutdown()
        total = sum(x[0] for x in log)
        print(
            f"N={N} round {rnd}: {len(log)} steps, {total * 1e3:.0f} ms in steps, {wall * 1e3:.0f} ms wall (off: {wall_off * 1e3:.0f} ms)"
        )
        parts = [
            next((j for j, (x, y) in enumerate(zip(got[r.request_id], ref[i], strict=False)) if x != y), None)
            for i, r in enumerate(auto)
        ]
        print("   output parts from the reference at:", parts)
        for i, r in enumerate(auto):
            done, at = 0, None
            for step, n in emitted.get(r.request_id, []):
                if parts[i] is not None and at is None and done + n > parts[i]:
                    at = step
                done += n
            last = emitted[r.request_id][-1][0] if emitted.get(r.request_id) else None
            rows_then = log[at][1] if at is not None else None
            print(f"   request {i}: parts at step {at} ({rows_then} rows in it), its last step {last}")
        runs: list[list[int]] = []
        for _, n, _, _, _ in log:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        print("   rows x steps:", " ".join(f"{n}x{c}" for n, c in runs))
        for i, c in enumerate(choices):
            if i < 12 or i % 16 == 0:
                print(f"   choice {i}: {c}")
        print("   k by step:", "".join(str(max(d, default=0)) if d else "." for _, _, d, _, _ in log))
        print_by_k(log)
        print(
            "   ms by step (k, draft backlog where drafting):",
            " ".join(
                f"{1e3 * dt:.1f}" + (f"[k{max(d)},b{b}]" if d and max(d) else "") for dt, _, d, b, _ in log
            ),
        )
        for i, (dt, n, drafted, backlog, captured) in enumerate(log):
            if dt > 0.02:
                print(
                    f"   step {i}: {dt * 1e3:.0f} ms, {n} rows, drafted {sorted(set(drafted))}, "
                    f"draft backlog {backlog}, graphs captured {captured}"
                )


if __name__ == "__main__":
    main()
