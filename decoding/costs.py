"""What a model's steps cost, by shape: measured as steps run (``StepCosts.observe``) and, where CUDA
graphs are captured, seeded from the start-up table of their replays (``StepCosts.seed``,
``StaticModel.time_steps``), with the host's share of a step that a replay misses. Which k pays over
these costs is decoding/batch_controller.py's (a request alone: decoding/controller.py's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K")

EMA = 0.3  # weight of the newest observation

# A sample this many times the estimate counts as this many times it: one stall (a graph captured on
# first use, a collector pause) must not outweigh the steps around it for the next dozen steps.
OUTLIER = 2.0

# Tokens of recent draft catch-ups that the per-token catch-up cost averages over (StepCosts.observe_catch_up):
# four batches of 64 128-token prompts
CATCH_UP_WINDOW = 32768


def ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * min(new, OUTLIER * old)


def pow2_bucket(n: int) -> int:
    """Power-of-two bucket of a count (the cost table's key)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class StepCosts:
    """A model's step costs by bucket: plain steps by batch, verifications by batch and target rows, draft
    passes by batch, measured as steps run; the start-up table stands for shapes not yet measured."""

    # Plain steps and verification steps are kept apart: on a GPU plain steps queue back to back and
    # cost their device time, verification steps their wall time, so a bucket both fill (4 plain
    # rows, 2 rows of k = 1) would swing between the two.
    plain: dict[int, float] = field(default_factory=dict)  # batch bucket -> seconds per plain step
    plain_samples: dict[int, int] = field(default_factory=dict)  # batch bucket -> plain steps observed
    # (batch bucket, rows bucket) -> seconds per verification. By batch as well as rows: the host's
    # work in a step is per row, so 128 target rows cost more at 64 rows of k = 1 than at 32 of k = 3
    # (a plain step's host time on the H200: 2.4 ms at 64 rows, 1.1 at 32). Keyed by rows alone,
    # bench.gpu_batch priced N = 64's verifications by the steps N = 32 had measured: fast auto ran
    # 0.95x plain there (2026-12-03 15:51 UTC), and 1.06x keyed per batch (16:41 UTC).
    target: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)  # batch bucket -> seconds per draft pass
    # The start-up cost table (``seed``): replayed graphs' device times by bucket, for shapes no step
    # has measured yet. Without it a batch's first steps are judged by guesses (a verification as a
    # plain step, a draft pass as its parameter share), and at N = 64 on the H200 the first guess
    # tried k = 1, which is break-even there, and paid the draft's catch-up over every prompt for it.
    seed_target: dict[int, float] = field(default_factory=dict)  # rows bucket -> seconds
    seed_draft: dict[int, float] = field(default_factory=dict)  # batch bucket -> seconds per pass
    # seconds per token of a draft's catch-up (None: not known), the ratio of ``catch_up_sums``:
    # (seconds, tokens) of the start-up table's largest prompt-chunk replay and of measured catch-ups
    # (``observe_catch_up``), summed over about the last CATCH_UP_WINDOW tokens
    catch_up_token: float | None = None
    catch_up_sums: tuple[float, float] = (0.0, 0.0)
    # batch bucket -> host seconds of a plain step (its launch and commit), measured where plain steps
    # queue ahead and hide it; a speculative step waits for it (its drafts and verification are
    # launched after the sync that reads the step before), so a seeded verification, a replay's
    # device time, is costed with it: at N = 64 on the H200 a 128-row verification replays in 5.0
    # ms and took 9.3 in a step
    host: dict[int, float] = field(default_factory=dict)
    # batch bucket -> what measured verifications took beyond their seeds: once known, a seeded
    # verification is costed with it rather than with a plain step's host time
    seed_gap: dict[int, float] = field(default_factory=dict)
    # the tables seeded from, held (not their ids, which a new table could reuse): one timed again reseeds
    seeded_from: tuple[object, object] = (None, None)
    # exact mode's width (0: none): every step runs each row at this many tokens, so a step's cost
    # is its batch's whatever its k (``verifications``)
    padded_width: int = 0

    def seed(self, target: dict[tuple[int, int], float], draft: dict[tuple[int, int], float] | None) -> None:
        """Start from the target's and the draft's step tables (``StaticModel.time_steps``: device
        seconds by (batch bucket, width)); cheap to call every step, it reads a table once. A
        plain step's seed counts as one sample of it (a replay's device time is what a plain step
        queued back to back costs); a verification's and a draft pass's stand only until a step of
        their shape is measured (a speculative step's wall time has the host's share in it, which a
        replay does not). Buckets are powers of two, as the measured tables'; a rows bucket a
        verification of several (batch, width) falls in takes the dearest of them."""
        seen_target, seen_draft = self.seeded_from
        if target is not seen_target:
            self.seed_target = {}
            for (B, W), t in target.items():
                if not B or pow2_bucket(B) != B:
                    continue  # prompt chunks; a graph bucket between powers of two (its table bucket is the next)
                if W == 1 and B not in self.plain:
                    self.plain[B], self.plain_samples[B] = t, 1
                elif W > 1:
                    r = pow2_bucket(B * W)
                    self.seed_target[r] = max(t, self.seed_target.get(r, 0.0))
        if draft is not None and draft is not seen_draft:
            for (B, W), t in draft.items():
                if W == 1 and pow2_bucket(B) == B:
                    self.seed_draft[B] = t
            chunks = [(W, t) for (B, W), t in draft.items() if B == 0]  # prompt chunks alone: W tokens
            if chunks and not self.catch_up_sums[1]:  # measured catch-ups stand (observe_catch_up)
                P, t = max(chunks)
                self.catch_up_sums, self.catch_up_token = (t, float(P)), t / P
            seen_draft = draft
        self.seeded_from = (target, seen_draft)

    def catch_up_cheap(self, backlog: int, batch: int) -> bool:
        """Whether catching drafts up on ``backlog`` tokens costs at most a plain step of ``batch``
        rows, by the start-up table (unknown: no). Then a row's first token may come from a
        speculative step: on the H200 a 128-token prompt's catch-up is ~0.4 ms of a 4.5 ms step,
        where a plain first step cost exact auto ~2% of a 128-token run against a fixed k."""
        t_plain = self.t_plain(batch)
        if self.catch_up_token is None or t_plain is None:
            return False
        return backlog * self.catch_up_token <= t_plain

    def observe(self, batch: int, rows: int, k: int, t_draft: float, t_target: float) -> None:
        """One decode step of ``batch`` rows and ``rows`` target rows in all (a step that prefilled
        too is no sample of either and is not observed)."""
        if k == 0:
            b = pow2_bucket(batch)
            self.plain[b] = ema(self.plain.get(b), t_target)
            self.plain_samples[b] = self.plain_samples.get(b, 0) + 1
            return
        r, b = pow2_bucket(rows), pow2_bucket(batch)
        fold_sample(self.target, (b, r), t_target, lambda: self.t_target(rows, batch))
        if r in self.seed_target:
            self.seed_gap[b] = ema(self.seed_gap.get(b), max(0.0, self.target[b, r] - self.seed_target[r]))
        if t_draft > 0:
            fold_sample(self.draft, pow2_bucket(batch), t_draft / k, lambda: self.t_draft(batch))

    def t_plain(self, batch: int) -> float | None:
        return lookup(self.plain, batch) or lookup(self.measured(), batch)

    def measured(self, batch: int | None = None) -> dict[int, float]:
        """Measured verifications by rows bucket: of ``batch``'s bucket, or (None) of any batch, the
        dearest where several measured one rows bucket."""
        b = None if batch is None else pow2_bucket(batch)
        out: dict[int, float] = {}
        for (bb, r), t in self.target.items():
            if b is None or bb == b:
                out[r] = max(t, out.get(r, t))
        return out

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """Drafts caught up on ``tokens`` tokens in ``seconds`` before a step (its lead-in): the cost
        a token from then on, folded into the seed as a sample. The seed, a 512-token chunk graph's
        replay, leaves out the passes' host work: on the H200 the catch-up of 64 prompts (~8,200
        tokens in passes of up to 8 rows and 512 tokens) took 35-42 ms of a batch's first step
        where the seed gave 26 (bench.probe_spec_host, 2026-12-03 14:04 and 14:11 UTC).

        Weighted by tokens, not folded in per catch-up: a pass costs its launch and host work
        whatever it holds, so a few tokens' catch-up (a row's plain steps) costs many times a
        prompt's a token, and as one sample of an average it would price the next prompt's wrong."""
        if tokens <= 0 or seconds <= 0:
            return
        s, n = self.catch_up_sums
        s, n = s + seconds, n + tokens
        if n > CATCH_UP_WINDOW:  # older catch-ups fade in proportion
            s, n = s * CATCH_UP_WINDOW / n, float(CATCH_UP_WINDOW)
        self.catch_up_sums, self.catch_up_token = (s, n), s / n

    def observe_host(self, batch: int, seconds: float) -> None:
        """A plain step's host seconds (``host``)."""
        b = pow2_bucket(batch)
        self.host[b] = ema(self.host.get(b), seconds)

    def t_target(self, rows: int, batch: int | None = None) -> float | None:
        """A verification step of ``rows`` target rows: measured (in a batch of ``batch``'s bucket;
        None: any), never less than a measured plain step of as many rows; else interpolated
        between the steps of either kind measured on both sides of it (a plain step of as many rows
        costs about what a verification does), and past
        the largest measured, as that one (optimistic, so an unmeasured shape is tried once and then
        known). The plain steps bound it from below: a verification of 128 rows in a batch of 64 is
        costed between the plain step of 64 and a measured verification of 256, not as the latter
        (which kept k = 1 from ever being tried at N = 64 on the H200). A seeded verification counts
        what measured ones of ``batch``'s bucket took beyond their seeds (``seed_gap``), or before any
        was measured the host's time of its plain steps (``host``): a measured one has it in it.
        Only then another bucket's: the host's work grows with the rows (at N = 64 on the H200 a
        plain step's was 2.4 ms, at 32 1.1), so 32 rows' gap stood for 64 too cheaply."""
        return lookup(self.verifications(batch), rows)

    def verifications(self, batch: int | None = None) -> dict[int, float]:
        """``t_target``'s table for ``batch``: seconds by target-rows bucket, to look up (``lookup``)
        several widths in, as ``best_k`` does every step, built once."""
        if self.padded_width and batch:
            return self._padded_verifications(batch)
        points = dict(self.plain)
        host = self.host_share(batch) if batch else 0.0
        seeded = {b: t + host for b, t in self.seed_target.items()}
        for b, t in (seeded | self.measured(batch)).items():  # measured over seeded
            points[b] = max(t, points.get(b, t))
        return points

    def _padded_verifications(self, batch: int) -> dict[int, float]:
        """``verifications`` where every row runs at ``padded_width`` (exact mode): a verification of
        ``batch`` rows computes what the batch's plain step does at any k, so it costs that step,
        with the host's share a speculative step waits for, where no verification of its shape was
        measured. By target rows alone, as outside exact mode, a plain step of 2B rows (2B rows x
        the width) priced a B-row k = 1 verification: 9.5 ms against 5.9 at 16 rows on the H200's
        exact table, once a server had captured and timed its 32-row graphs, so exact auto stayed
        plain at N = 16 there (bench.sim_controller: 0.99x; 1.6x priced by batch). The benchmark's
        runs capture only the buckets up to their N and did not show it."""
        t = self.t_plain(batch)
        if t is None:
            return {}
        base = t + self.host_share(batch)
        measured = self.measured(batch)
        rows = {pow2_bucket(batch * w) for w in range(2, self.padded_width + 1)}
        return {r: max(t, measured.get(r, base)) for r in rows}

    def host_share(self, batch: int) -> float:
        """What a seeded verification of ``batch`` rows takes beyond its replay (``t_target``): this
        bucket's measured gap, else its plain steps' host time, else another bucket's."""
        b = pow2_bucket(batch)
        own = self.seed_gap.get(b) or self.host.get(b)
        return own or lookup(self.seed_gap, batch) or lookup(self.host, batch) or 0.0

    def t_draft(self, batch: int) -> float | None:
        table = self.seed_draft | self.draft if self.seed_draft else self.draft
        if not table:
            return None
        b = pow2_bucket(batch)
        return table.get(b) or table[min(table, key=lambda x: abs(x - b))]


def fold_sample(table: dict[K, float], b: K, t: float, guess: Callable[[], float | None]) -> None:
    """Fold one cost sample into ``table[b]``. A bucket's first sample counts at most ``OUTLIER``
    times what the tables predicted for it (``guess()``, asked only then, not every step; None:
    nothing to predict from), as later samples count at most that times the estimate: a shape's
    first step can pay one-off costs (a kernel loaded, memory allocated: bench.probe_auto_fast at
    N = 64 on the H200 recorded the first 256-row verification at 43.9 ms, the same shape's later
    samples at 7-9 ms), and a first sample is the whole estimate, which a batch it turns off then
    re-measures only at probes."""
    if b not in table and (predicted := guess()) is not None:
        t = min(t, OUTLIER * predicted)
    table[b] = ema(table.get(b), t)


def lookup(table: dict[int, float], n: int) -> float | None:
    """The cost at ``n``'s bucket: measured, interpolated between measured buckets, or past the
    largest (smallest) measured one taken as flat; None with nothing measured."""
    if not table:
        return None
    b = pow2_bucket(n)
    if b in table:
        return table[b]
    known = sorted(table)
    lower = [x for x in known if x < b]
    upper = [x for x in known if x > b]
    if lower and upper:
        lo, hi = lower[-1], upper[0]
        return table[lo] + (b - lo) / (hi - lo) * (table[hi] - table[lo])
    return table[lower[-1]] if lower else table[upper[0]]
