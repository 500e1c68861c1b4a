"""The batch's choice of k: one k for every adaptive row of a step, the one that maximises the
batch's expected tokens per second (``BatchCosts.best_k``, over the step costs of decoding/costs.py
and every row's acceptance estimate), with its probes, hysteresis and realised-goodput discount;
``choose_ks`` gives each row its k for a step (alone, a request's own SpecController decides,
decoding/controller.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from decoding.controller import CATCH_UP_HORIZON, MIN_LEFT_TO_PROBE, SpecController
from decoding.costs import OUTLIER, StepCosts, lookup, pow2_bucket


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
    # While off, a batch of the same adaptive rows is judged again only every ``off_recheck`` steps
    # and on probe turns (``stays_off``): no row drafts, so no verification moves an acceptance
    # estimate or a verification's cost, and what does move (rows' tokens left, their drafts'
    # backlogs) only makes speculation pay less. Judging every step was host time on the path of
    # every plain step: fast auto at N = 64 on the H200 stayed plain at 0.947x of off, its
    # inter-token p50 4.89 against 4.72 ms (bench.gpu_batch, 2026-12-04 02:48 UTC); on a 2-core
    # AVX512-BF16 EPYC, choosing 64 rows' k took 0.18 ms a step against 0.07 for rows that are off.
    off_recheck: int = 8
    off_rows: list[int] | None = None  # the rows last judged off (their controllers' ids), with
    off_judged: int = 0  # ... the step they were judged at
    off_models: int = 0  # ... and how many of them draft with a model (their probe period)

    def probe_turn(self, catching_up: int = 0) -> bool:
        """True once speculation has been off for ``probe_period`` x ``backoff`` batched steps since
        it went off or was last probed, that times ``catching_up / probe_rows`` where more rows than
        that draft with a model: a step that may probe. (Counted from then, not by the step count's
        residue, which put a probe as soon as one step after speculation went off.)"""
        self.steps += 1
        if not self.off:
            return False
        self.off_steps += 1
        return self.off_steps >= self._probe_period(catching_up)

    def _probe_period(self, catching_up: int) -> float:
        return self.probe_period * self.backoff * max(1.0, catching_up / self.probe_rows)

    def stays_off(self, rows: list[int]) -> bool:
        """Whether a step of ``rows`` (their controllers' ids) is plain without judging it again:
        speculation is off, these rows, each adaptive and past its first token, were judged off
        within ``off_recheck`` steps (``choose_ks`` notes them), and this step is no probe turn.
        Counts the step as ``probe_turn`` does. A row that joined in the place of one that left
        under a reused id is judged at the next recheck (it was plain for its first token anyway)."""
        if (
            not self.off
            or self.steps + 1 - self.off_judged >= self.off_recheck
            or self.off_steps + 1 >= self._probe_period(self.off_models)
            or rows != self.off_rows
        ):
            return False
        self.steps += 1
        self.off_steps += 1
        return True

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
        catch_up_prior: float = 0.0,
    ) -> int:
        """rows: (acceptance estimate, drafts with a model, the most it may draft) per adaptive row.
        With nothing measured yet, the step is plain (it measures what speculation must beat); when
        no k pays, 0, except on a probe turn, which drafts 2 to refresh the estimates.

        ``backlog``: tokens the rows' drafts have not seen (a prompt, plain steps' tokens), which the
        first speculative step catches up on; ``left``: tokens the rows may still emit. A k pays
        only if it repays the catch-up's cost over what is left: at N = 64 on the H200 k = 1 gains
        ~4% a step, and catching up on 64 prompts cost ~40 ms, more than the whole run's gain. The
        cost a token is ``catch_up_token`` (the start-up table's, then measured), else
        ``catch_up_prior`` (seconds a token: ``catch_up_estimate``). Without it a CPU, which has no
        start-up table, judged its first speculative step as if the catch-up were free: with AVX2
        kernels 4 rows took a k = 1 step that caught 498 prompt tokens up in 12.5 s, where the whole
        plain run took 71 s, and never drafted again (bench.probe_cpu_auto)."""
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
        catch_up = backlog * (self.catch_up_token or catch_up_prior) if model else 0.0
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


def acceptance(row: KRow, untried: bool) -> float:
    """The acceptance a row's k is chosen by: its estimate, but where no draft model has drafted for
    this target yet (``untried``: no draft pass or catch-up measured, none in a start-up table;
    every such row's estimate is then the default prior, a = 0.5) at least its controller's
    optimistic prior, as a request alone is judged before it drafts (``SpecController.hopeless``,
    ``repays``). The first try then pays its catch-up where speculation could repay it: on a 2-core
    AVX512-BF16 EPYC, 4 fresh requests judged at 0.5 never drafted (0.92x off), where drafting
    gains ~1.2x (bench.probe_cpu_auto)."""
    a = row.controller.acceptance
    return max(a, row.controller.prior_acceptance) if untried and row.model else a


def catch_up_cost(costs: BatchCosts, rows: list[KRow]) -> float:
    """Seconds a token of the rows' drafts' catch-up: the start-up table's or measured
    (``catch_up_token``), else ``catch_up_estimate``'s."""
    return costs.catch_up_token or catch_up_estimate(rows)


def catch_up_estimate(rows: list[KRow]) -> float:
    """Seconds a token of a draft's catch-up, before one is measured: the target's prefill a token
    (each row's own, measured as its prompt went in) times the draft's share of its parameters. A
    catch-up is a prompt chunk through the draft, and a chunk's cost is its compute: in bf16 with
    AVX2 kernels (an AVX512 EPYC run with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) the
    1.5B prefilled at ~86 ms a token and the 0.5B caught up at 24, where its parameters give ~28
    (bench.probe_cpu_auto). The dearest row's; 0 where no row has both."""
    return max(
        (
            r.controller.prefill_per_token * r.controller.draft_cost_prior
            for r in rows
            if r.model and r.controller.prefill_per_token is not None
        ),
        default=0.0,
    )


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
            untried = costs.catch_up_token is None and not costs.draft
            k_shared = costs.best_k(
                [(acceptance(r, untried), r.model, r.controller.k_max) for r in sharing],
                max(r.controller.draft_cost_prior for r in sharing),
                probe=probe,
                backlog=backlog,
                left=sum(min(r.left, CATCH_UP_HORIZON) for r in sharing),
                catch_up_prior=catch_up_cost(costs, sharing),
            )
    if costs.off and not k_shared and all(shared) and not any(first) and not waits:
        costs.off_rows, costs.off_judged = [id(r.controller) for r in rows], costs.steps
        costs.off_models = sum(r.model for r in rows)
    else:
        costs.off_rows = None
    ks = []
    for r, on, f in zip(rows, shared, first, strict=True):
        if not r.drafts or f:
            k = 0
        elif on:
            k = min(k_shared, r.controller.k_max)
        else:
            catch_up = r.backlog * catch_up_cost(costs, [r]) if r.model and r.backlog else 0.0
            k = r.controller.choose_k(r.left, catch_up)
        ks.append(max(0, min(k, r.left - 1)))
    return ks
