"""Per-request and per-batch choice of k, and the goodput check that turns speculation off when it
does not pay (what steps cost is decoding/costs.py).

Expected tokens per verification with per-token acceptance a and k drafts (Leviathan et al. 2023,
eq. 1): E(k) = (1 - a^(k+1)) / (1 - a). A step costs k * t_draft + t_verify(k), so speculation
with k is worth E(k) / (k * t_draft + t_verify(k)) tokens/s against 1 / t_plain for plain decoding.
All three times are measured on this request as it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from decoding.costs import OUTLIER, StepCosts, ema, fold_sample, lookup, pow2_bucket

# Speculation that is off is not probed, nor switched on, for rows with fewer tokens than this left
# to emit (their mean, in a batch): what the probe would learn could not repay its cost. A probe from
# off runs the draft over the backlog of every plain step since the last one (on the H200 at N = 32,
# 255 tokens a row, a probe cost 22 ms, five plain steps), and even speculation found to pay 1.5x
# saves a third of the steps left. bench.probe_auto_fast nosync 32 (2026-12-02, 20:07 UTC): the run's
# one probe came 8 steps before its rows ended.
MIN_LEFT_TO_PROBE = 32


# The most tokens a row is counted on to emit when a draft's catch-up is weighed against what
# speculation would gain over them (BatchCosts.best_k): a request's max_tokens is an upper bound,
# often the context's, and most answers end well before it.
CATCH_UP_HORIZON = 256


def expected_tokens(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass
class SpecController:
    k_max: int
    adaptive: bool = True
    speculate: bool = True  # False: the request asked for plain decoding
    min_speedup: float = 1.0  # speculate only when predicted goodput beats plain by this factor
    probe_every: int = 16  # while off, retry speculation after this many plain steps
    min_probe_every: int = 16
    max_probe_every: int = 128
    probing: bool = False
    prefill_per_token: float | None = None
    # not worth even trying when free drafts, all accepted, would gain less than this (a probe's
    # draft prefill and its first verification cost more than such a gain could return)
    hopeless_margin: float = 1.1
    remeasure_every: int = 32  # while speculating, one plain step in this many (_remeasure_period)
    remeasure_margin: float = 1.25  # ... unless speculation beats plain by this factor: then
    remeasure_slack: int = 4  # this many times fewer
    # the goodput check's optimism, in standard deviations of the acceptance estimate (_acceptance_high)
    doubt: float = 1.0
    draft_cost_prior: float = 0.0  # c before it is measured: draft / target parameters (0: prompt lookup)
    prior_acceptance: float = 0.8
    accepted_w: float = 1.0  # decayed counts behind the acceptance estimate (a prior of a = 0.5)
    rejected_w: float = 1.0
    t_draft: float | None = None  # seconds per drafted token
    t_plain: float | None = None  # seconds per 1-token target step
    t_verify: dict[int, float] = field(default_factory=dict)  # seconds per (k+1)-token verification
    # the drafter ends its own proposals (a draft-confidence stop): k is then only a cap, and whether
    # speculation pays is judged on measured speculative steps, not on E(k) for i.i.d. acceptance
    drafter_stops: bool = False
    spec_tokens_w: float = 0.0  # decayed tokens and seconds of speculative steps: their ratio is the
    spec_seconds_w: float = 0.0  # measured rate (a mean of per-step rates would be biased low)
    off_steps: int = 0  # plain steps since the goodput check switched speculation off
    switched_off: bool = False
    steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted_w / (self.accepted_w + self.rejected_w)

    def choose_k(self, left: int | None = None) -> int:
        """0 means a plain step; ``left``: tokens the request may still emit (None: unknown)."""
        self.steps += 1
        if not self.speculate:
            return 0
        if not self.adaptive:
            return self.k_max
        if self.t_plain is None:
            return 0  # the first step is plain: it measures what speculation must beat
        if self.hopeless():
            return 0
        if self.switched_off:
            near_end = left is not None and left < MIN_LEFT_TO_PROBE
            if self.off_steps < self.probe_every or near_end or self.hopeless():
                self.off_steps += 1
                return 0
            self.switched_off, self.off_steps = False, 0
            self.probing = True
            return self._best_k()[0]  # probe: measure speculation again
        k, rate = self._best_k()
        if self.steps % self._remeasure_period(rate) == 0:
            return 0  # refresh the plain-step time: one noisy sample must not keep speculation on
        if self.t_draft is not None and self._best_k(self._acceptance_high())[1] * self.min_speedup < (
            1.0 / self.t_plain
        ):
            # a probe that failed doubles the wait before the next one: where speculation does not
            # pay (a haiku), probing must cost next to nothing
            self.probe_every = (
                min(self.probe_every * 2, self.max_probe_every) if self.probing else self.probe_every
            )
            self.switched_off, self.probing = True, False
            self.off_steps = 1
            return 0
        if self.probing:
            self.probing, self.probe_every = False, self.min_probe_every
        return k

    def seed(self, target: dict[tuple[int, int], float], draft: dict[tuple[int, int], float] | None) -> None:
        """Start from the model's step tables (``StaticModel.time_steps``, as ``BatchCosts.seed``): a
        plain step, a verification of each k and a draft pass at one row, each as a first sample,
        so that the first steps choose k by costs, not by a measuring step at k = 2."""
        if self.t_plain is None:
            self.t_plain = target.get((1, 1))
        for k in range(1, self.k_max + 1):
            if (1, k + 1) in target:
                self.t_verify.setdefault(k, target[1, k + 1])
        if self.t_draft is None and draft:
            self.t_draft = draft.get((1, 1))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The prompt's prefill, timed: its cost per token is the slope of verification cost in k
        before any verification ran (flat where matrix units batch tokens, a whole step where not)."""
        if tokens >= 8:
            self.prefill_per_token = seconds / tokens

    def _t_verify(self, k: int) -> float | None:
        """Measured, or interpolated on the line through the plain step (k = 0) and the nearest
        measured k: on a GPU the line is nearly flat, on a CPU without bf16 matrix units it climbs
        by a whole step per token."""
        if k in self.t_verify:
            return self.t_verify[k]
        if not self.t_verify:
            if self.t_plain is not None and self.prefill_per_token is not None:
                return self.t_plain + k * min(self.prefill_per_token, self.t_plain)
            return self.t_plain
        nearest = min(self.t_verify, key=lambda j: abs(j - k))
        if self.t_plain is None:
            return self.t_verify[nearest]
        slope = (self.t_verify[nearest] - self.t_plain) / nearest
        return self.t_plain + slope * k

    def hopeless(self) -> bool:
        """Speculation cannot beat plain decoding here: once measured, not even with every draft
        accepted; before the first draft (whose prefill is itself a cost), not at a typical
        acceptance with the draft costing its share of the target's parameters."""
        if self.t_plain is None or (not self.t_verify and self.prefill_per_token is None):
            return False
        if self.t_draft is None:
            a, t_draft = self.prior_acceptance, self.draft_cost_prior * self.t_plain
        else:
            a, t_draft = 1.0, self.t_draft
        best = max(
            expected_tokens(a, k) / (k * t_draft + (self._t_verify(k) or 0.0))
            for k in range(1, self.k_max + 1)
        )
        return best < self.hopeless_margin / self.t_plain

    def _remeasure_period(self, rate: float) -> int:
        """Steps between plain steps while speculating: ``remeasure_every`` while the choice is
        close, ``remeasure_slack`` times that while speculation beats plain by ``remeasure_margin``
        (a plain step then costs a whole step's gain and could not change the choice)."""
        assert self.t_plain is not None
        close = rate * self.t_plain < self.remeasure_margin * self.min_speedup
        return self.remeasure_every * (1 if close or self.drafter_stops else self.remeasure_slack)

    def _acceptance_high(self) -> float:
        """The acceptance the goodput check judges by: the estimate plus ``doubt`` standard
        deviations of the Beta posterior over the decayed counts, so a few early rejections in a row
        do not switch speculation off, while a long run of them still does."""
        n = self.accepted_w + self.rejected_w
        a = self.acceptance
        return min(1.0, a + self.doubt * (a * (1 - a) / (n + 1)) ** 0.5)

    def _best_k(self, a: float | None = None) -> tuple[int, float]:
        if self.drafter_stops:
            return self.k_max, self.spec_tokens_w / self.spec_seconds_w if self.spec_seconds_w else 0.0
        if self.t_draft is None:
            return min(2, self.k_max), 0.0  # the first, measuring step: cheap if it turns out not to pay
        a = self.acceptance if a is None else a
        best_k, best_rate = 1, -1.0
        for k in range(1, self.k_max + 1):
            tv = self._t_verify(k) or 0.0
            cost = k * self.t_draft + tv
            rate = expected_tokens(a, k) / cost if cost > 0 else float("inf")
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def observe(self, k: int, accepted: int, t_draft: float, t_target: float, timed: bool = True) -> None:
        """One step's outcome: k drafted (0 for plain), accepted of them, and the two timings
        (``timed`` False: the step did other work too, a prompt chunk, so only acceptance counts)."""
        if k == 0:
            if timed:
                self.t_plain = ema(self.t_plain, t_target)
            return
        if timed:
            self.t_draft = ema(self.t_draft, t_draft / k)
            self.spec_tokens_w = 0.9 * self.spec_tokens_w + accepted + 1
            self.spec_seconds_w = 0.9 * self.spec_seconds_w + t_draft + t_target
            fold_sample(
                self.t_verify, k, t_target, lambda: self._t_verify(k)
            )  # a first sample too is bounded
        # decay old evidence so acceptance tracks the text being generated now
        self.accepted_w = 0.9 * self.accepted_w + accepted
        self.rejected_w = 0.9 * self.rejected_w + (1 if accepted < k else 0)


@dataclass
class Population:
    """Acceptance across the recent requests of one target and drafter kind: a new request's prior.

    A request's own estimate starts from a prior of two observations; at a fixed a = 0.5 a batch of
    new rows speculates from its first steps where the workload's drafts are rarely accepted, and
    drafts timidly where they mostly are. SmartSpec (Liu et al. 2024, "Optimizing Speculative
    Decoding for Serving LLMs Using Goodput") estimates acceptance as a moving average across
    requests for the same reason; here it only sets where each request's own evidence starts.
    """

    decay: float = 0.99  # per verification observed: about the last hundred rows' outcomes
    weight: float = 2.0  # the prior's strength, in observations (as the a = 0.5 prior's 1 + 1)
    accepted_w: float = 0.0
    rejected_w: float = 0.0

    def observe(self, k: int, accepted: int) -> None:
        """One row's verification of ``k`` drafts (the same counting as SpecController.observe)."""
        if k == 0:
            return
        self.accepted_w = self.decay * self.accepted_w + accepted
        self.rejected_w = self.decay * self.rejected_w + (1 if accepted < k else 0)

    def seed(self, c: SpecController) -> None:
        """Start ``c``'s acceptance counts at the population's estimate; with fewer than ``weight``
        observations behind it, as they were. (Not the hopeless check's prior: a request it judged
        hopeless would never draft, and a population of such requests would never learn again.)"""
        n = self.accepted_w + self.rejected_w
        if n < self.weight:
            return
        a = self.accepted_w / n
        c.accepted_w, c.rejected_w = self.weight * a, self.weight * (1 - a)


@dataclass
class BatchCosts(StepCosts):
    """What a step costs a model's whole batch, measured as steps run, and the k that pays for it.

    Alone, a request's own SpecController decides. In a batch the rows draft in lockstep (a step runs
    as many draft passes as its longest proposal) and share one verification, so the cost of a k is
    the batch's, not a row's: a row drafting 1 while others draft 4 costs nothing more, and a row
    switched off saves nothing while others draft. Verification also grows with B x (k+1) rows once
    the batch is large enough to be compute-bound, so speculation that pays at B = 1 loses at B = 64
    (vLLM reports it 1.4-1.8x slower than none at high request rates). ``best_k`` chooses one k for
    the adaptive rows, the one that maximises the batch's expected tokens per second from every
    row's acceptance estimate, the target's step time by rows in the step and the draft's by batch
    size (``StepCosts``, which it extends: the tables it decides by); 0 turns speculation off for the
    step.
    """

    # While no k pays, the batch still drafts 2 on a probe turn (every probe_period x backoff steps),
    # so the rows' acceptance estimates and the draft's cost follow the text being generated. A
    # probe catches every drafting row's draft model up on its backlog (its prompt, at the first),
    # so its cost grows with the rows, while a large batch is where speculation pays least: past
    # probe_rows such rows the period grows in proportion. At N = 64 on the H200 (bench.gpu_batch,
    # 12:20 UTC) the probes' catch-ups cost 8% of a 128-token run that stayed plain.
    probe_period: int = 16
    probe_rows: int = 8
    # ... and where the start-up table prices a probe (the catch-up it runs, its wider step), it is
    # run only if it costs at most this share of the time the rows would take to finish plainly (up
    # to CATCH_UP_HORIZON tokens a row): in bench.probe_auto_fast at N = 64 on the H200, a probe on a
    # new batch caught 64 prompts up for 45-72 ms of a ~1 s run, and could not have paid at 64 rows
    probe_share: float = 0.05
    # While some k pays, one step in this many is plain: the plain cost is what speculation must beat,
    # and a batch that speculates from its first steps on would otherwise judge by one cold sample.
    # Where speculation beats plain by remeasure_margin, remeasure_slack times fewer (as
    # SpecController._remeasure_period): such a plain step costs a whole step's gain (at a = 0.8 on
    # the H200, ~2 of the 3 tokens a step gives) and could not change the choice.
    remeasure_every: int = 32
    remeasure_margin: float = 1.25
    remeasure_slack: int = 4
    steps: int = 0
    backoff: int = 1  # the period's multiplier: doubles while probes find speculation still not paying
    max_backoff: int = 8
    # What speculative steps realised against what best_k predicted for them: decayed sums of tokens
    # emitted, tokens expected (the rows' acceptance estimates), seconds taken and seconds the tables
    # gave (``observe_goodput``). Their ratio below 1 means the model is optimistic: acceptance
    # estimates that lag a text the draft stopped following, costs the tables miss; best_k then
    # discounts speculation by it (never raises it). Sums, not an average of per-step ratios, whose
    # noise (a step gives 1 token or k + 1) would dip below 1 half the time; counted once they hold
    # ``realised_min`` steps' weight, and faded by plain steps, so an old workload stops counting.
    realised_sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])
    realised_decay: float = 0.9  # per speculative step
    realised_fade: float = 0.97  # per plain step
    realised_min: float = 3.0
    # Hysteresis: once no k paid (``off``), speculation turns on again only where it beats plain by
    # ``on_margin``, on a probe turn too (a probe drafts 2 to measure and stays off). While off no
    # speculative step updates the rows' acceptance estimates, and plain steps fade the realised
    # discount: a marginal gain on paper then rests on estimates that stopped being measured, and
    # switching on for it reset the probes' backoff (in bench.sim_controller's parted drafts, a k = 1
    # step every ~16 plain ones where the backoff would have spaced the probes 32-128 apart).
    on_margin: float = 1.1
    # (batch, target rows) buckets whose first measured step was held back as a first use (``first_use``)
    held: set[tuple[int, int]] = field(default_factory=set)
    off: bool = False
    off_steps: int = 0  # steps since speculation went off or was last probed

    def probe_turn(self, catching_up: int = 0) -> bool:
        """True once speculation has been off for ``probe_period`` x ``backoff`` batched steps since
        it went off or was last probed, that times ``catching_up / probe_rows`` where more rows than
        that draft with a model: a step that may probe. (Counted from then, not by the step count's
        residue, which put a probe as soon as one step after speculation went off.)"""
        self.steps += 1
        if not self.off:
            return False
        self.off_steps += 1
        return self.off_steps >= self.probe_period * self.backoff * max(1.0, catching_up / self.probe_rows)

    def first_use(self, batch: int, k: int, model: bool, seconds: float) -> bool:
        """Whether a speculative step of ``batch`` rows drafting up to ``k`` (``model``: with a draft
        model) that took ``seconds`` was its verification shape's first use, to be held back as no
        sample at all: a shape no step has measured yet, taking more than ``OUTLIER`` times what the
        tables predict for it. In a fresh process on the H200 (bench.probe_auto_fast exact 4,
        2026-12-03 15:39 UTC) the first speculative step of 4 rows took 53 ms against ~6 predicted
        (kernels loaded on first use); bounded to twice the prediction it still doubled the
        verification's cost and, in the realised-goodput sums, made speculation look 3x worse than
        the tables, so the batch went plain for 17 steps where k = 4 gains 1.5x. Only a shape's first
        such step is held back: if the shape costs that much, its next step says so."""
        key = (pow2_bucket(batch), pow2_bucket(batch * (k + 1)))
        if k == 0 or key in self.target or key in self.held:
            return False
        t = self.predicted(batch, k, model)
        if t is None or seconds <= OUTLIER * t:
            return False
        self.held.add(key)
        return True

    def predicted(self, batch: int, k: int, model: bool) -> float | None:
        """What the tables give a speculative step of ``batch`` rows drafting up to ``k``: its
        verification (or, with none known, a plain step), plus ``k`` draft passes where ``model``
        drafts (None: nothing measured or seeded)."""
        t = self.t_target(batch * (k + 1), batch) or self.t_plain(batch)
        if t is not None and model:
            t += k * (self.t_draft(batch) or 0.0)
        return t

    def observe(self, batch: int, rows: int, k: int, t_draft: float, t_target: float) -> None:
        """``StepCosts.observe``; a plain step also fades the realised discount."""
        if k == 0:
            self.realised_sums = [x * self.realised_fade for x in self.realised_sums]
        super().observe(batch, rows, k, t_draft, t_target)

    def observe_goodput(
        self, batch: int, k: int, model: bool, expected: float, tokens: int, seconds: float
    ) -> None:
        """A speculative step of ``batch`` rows drafting up to ``k``: ``tokens`` emitted in ``seconds``,
        against ``expected`` tokens (the rows' acceptance estimates before it) in the time the tables
        give it. Call before the step's own ``observe``."""
        t = self.predicted(batch, k, model)
        if t is None or k == 0 or expected <= 0 or seconds <= 0:
            return
        d = self.realised_decay
        self.realised_sums = [
            d * x + y
            for x, y in zip(self.realised_sums, (tokens / expected, 1.0, seconds / t, 1.0), strict=True)
        ]

    @property
    def realised(self) -> float | None:
        """Realised over predicted tokens per second (None: too few steps to say)."""
        got, n_got, took, n_took = self.realised_sums
        if n_got < self.realised_min:
            return None
        return (got / n_got) / (took / n_took)

    def best_k(
        self,
        rows: list[tuple[float, bool, int]],
        draft_cost_prior: float,
        probe: bool,
        backlog: int = 0,
        left: int = 0,
    ) -> int:
        """rows: (acceptance estimate, drafts with a model, the most it may draft) per adaptive row.
        With nothing measured yet, the step is plain (it measures what speculation must beat); when
        no k pays, 0, except on a probe turn, which drafts 2 to refresh the estimates.

        ``backlog``: tokens the rows' drafts have not seen (a prompt, plain steps' tokens), which the
        first speculative step catches up on; ``left``: tokens the rows may still emit. Where the
        catch-up's cost is known (``catch_up_token``), a k pays only if it repays that cost over
        what is left: at N = 64 on the H200 k = 1 gains ~4% a step, and catching up on 64 prompts
        cost ~40 ms, more than the whole run's gain."""
        B = len(rows)
        k_max = max((k for _, _, k in rows), default=0)
        t_plain = self.t_plain(B)
        if k_max == 0 or t_plain is None:
            return 0
        model = any(m for _, m, _ in rows)
        t_draft = self.t_draft(B)
        if t_draft is None:
            t_draft = draft_cost_prior * t_plain
        verify = self.verifications(B)  # t_target's table for this batch, looked up at each width
        realised = self.realised
        discount = min(1.0, realised) if realised is not None else 1.0
        catch_up = backlog * (self.catch_up_token or 0.0) if model else 0.0
        if probe and catch_up and left:  # a probe's cost, known: what it catches up, and its wider step
            extra = (lookup(verify, B * 3) or t_plain) - t_plain + 2 * t_draft
            probe = catch_up + extra <= self.probe_share * left * t_plain / B
        best_k, best_rate, modelled = 0, B / t_plain, 0.0
        # the rows' expected tokens at each k, summed as k grows (expected_tokens(a, k) is
        # 1 + a + ... + a^k): one product a row per k, not a power (~0.2 ms a step at 64 rows)
        accs = [min(a, 1.0) for a, _, _ in rows]
        caps = [cap for _, _, cap in rows]
        least = min(caps)
        powers, tokens = [1.0] * B, float(B)
        for k in range(1, k_max + 1):
            powers = [p * a for p, a in zip(powers, accs, strict=True)]
            if k <= least:
                tokens += sum(powers)
            else:
                tokens += sum(p for p, cap in zip(powers, caps, strict=True) if cap >= k)
            t = (lookup(verify, B * (k + 1)) or t_plain) + (k * t_draft if model else 0.0)
            rate = tokens / t
            if catch_up and left:  # left tokens at this rate, and the catch-up before them
                rate = left / (left / rate + catch_up)
            if rate * discount > best_rate * 1.0001:  # ties go to the smaller k: fewer wasted rows
                best_k, best_rate, modelled = k, rate * discount, rate
        if self.off and probe:  # a probe: the next one comes later, unless this one pays
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self.off_steps = 0
        if self.off and best_k > 0 and best_rate < self.on_margin * B / t_plain:
            best_k = 0  # a probe then drafts 2, below, and the batch stays off
        if best_k > 0:
            if self.off:  # switching on (a probe, or a clear gain): no plain re-measurement now
                self.off = False
                return best_k
            self.backoff = 1  # on for a second decision: the probe, if this began as one, paid
            # ... judged once the plain cost has two samples: a first one may be cold (a graph
            # captured, a cache warming) and make any speculation look clearly better; by the
            # model's own rate (the discount decides whether to speculate, not how often to check)
            trusted = self.plain_samples.get(pow2_bucket(B), 0) >= 2
            clear = trusted and modelled * t_plain >= self.remeasure_margin * B
            period = self.remeasure_every * (self.remeasure_slack if clear else 1)
            if self.steps and self.steps % period == 0:
                return 0
            return best_k
        if not self.off:
            self.off, self.off_steps = True, 0
        return min(2, k_max) if probe else 0


class KRow(NamedTuple):
    """What the choice of k reads of a decoding row."""

    controller: SpecController
    drafts: bool  # the row has a drafter
    model: bool  # it drafts with a model (whose passes cost; prompt lookup's do not)
    emitted: int  # tokens it has emitted, those of steps not yet read back included
    left: int  # tokens it may still emit before max_tokens, the same counted
    backlog: int = 0  # tokens its draft model has yet to catch up on before it drafts


def choose_ks(rows: list[KRow], costs: BatchCosts) -> list[int]:
    """Each row's k for one step, never past its max_tokens. Alone: its own controller's choice. In a
    batch: one k for every adaptive row, the one that pays for the batch as a whole
    (``BatchCosts.best_k``, which ``costs`` measures for the rows' target); rows with a fixed k keep
    it. A row drafting with a model drafts nothing in the step that gives its first token, alone or
    batched, unless the start-up table says its draft's catch-up on the prompt costs no more than a
    plain step (``BatchCosts.catch_up_cheap``): that token does not wait long for its draft to take in
    the prompt, and the draft catches up when it first drafts; nor does it wait for a costlier
    catch-up of the other rows' drafts (they decode plainly in that step). Speculation that is off
    stays off for rows near their ends (MIN_LEFT_TO_PROBE)."""
    batched = len(rows) >= 2
    adaptive = [r.drafts and r.controller.speculate and r.controller.adaptive for r in rows]
    shared = [batched and a for a in adaptive]
    first = [a and r.model and r.emitted == 0 for r, a in zip(rows, adaptive, strict=True)]
    if any(first) and costs.catch_up_cheap(
        sum(r.backlog for r, f in zip(rows, first, strict=True) if f), len(rows)
    ):
        first = [False] * len(rows)
    sharing = [r for r, on, f in zip(rows, shared, first, strict=True) if on and not f]
    # ... nor for the other rows' drafts: a step that gives any row its first token catches no
    # drafts up on more than a plain step's worth (on the H200 at N = 64, the first speculative step
    # after the batch's prompts caught 64 drafts up for ~40 ms, and the last rows' first tokens
    # waited for it: time to first token 415 ms against plain's 352, bench.gpu_batch 14:12 UTC)
    backlog = sum(r.backlog for r in sharing)
    waits = backlog > 0 and any(r.emitted == 0 for r in rows) and not costs.catch_up_cheap(backlog, len(rows))
    k_shared = 0
    if sharing and not waits:
        probe = costs.probe_turn(sum(r.model for r in sharing))
        if not costs.off or sum(r.left for r in sharing) >= MIN_LEFT_TO_PROBE * len(sharing):
            k_shared = costs.best_k(
                [(r.controller.acceptance, r.model, r.controller.k_max) for r in sharing],
                max(r.controller.draft_cost_prior for r in sharing),
                probe=probe,
                backlog=backlog,
                left=sum(min(r.left, CATCH_UP_HORIZON) for r in sharing),
            )
    ks = []
    for r, on, f in zip(rows, shared, first, strict=True):
        if not r.drafts or f:
            k = 0
        elif on:
            k = min(k_shared, r.controller.k_max)
        else:
            k = r.controller.choose_k(r.left)
        ks.append(max(0, min(k, r.left - 1)))
    return ks
