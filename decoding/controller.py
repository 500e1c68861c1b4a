"""A request's choice of k, and the goodput check that turns speculation off when it does not pay;
a new request's acceptance prior (``Population``). In a batch one k is chosen for the batch
(decoding/batch_controller.py); what steps cost is decoding/costs.py.

Expected tokens per verification with per-token acceptance a and k drafts (Leviathan et al. 2023,
eq. 1): E(k) = (1 - a^(k+1)) / (1 - a). A step costs k * t_draft + t_verify(k), so speculation
with k is worth E(k) / (k * t_draft + t_verify(k)) tokens/s against 1 / t_plain for plain decoding.
All three times are measured on this request as it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from decoding.costs import ema, fold_sample

# Speculation that is off is not probed, nor switched on, for rows with fewer tokens than this left
# to emit (their mean, in a batch): what the probe would learn could not repay its cost. A probe from
# off runs the draft over the backlog of every plain step since the last one (on the H200 at N = 32,
# 255 tokens a row, a probe cost 22 ms, five plain steps), and even speculation found to pay 1.5x
# saves a third of the steps left. bench.probe_auto_fast nosync 32 (2026-12-02, 20:07 UTC): the run's
# one probe came 8 steps before its rows ended.
MIN_LEFT_TO_PROBE = 32

# The most tokens a row is counted on to emit when a draft's catch-up is weighed against what
# speculation would gain over them (SpecController.repays, BatchCosts.best_k): a request's max_tokens
# is an upper bound, often the context's, and most answers end well before it.
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

    def choose_k(self, left: int | None = None, catch_up: float = 0.0) -> int:
        """0 means a plain step; ``left``: tokens the request may still emit (None: unknown);
        ``catch_up``: seconds its draft would first spend catching up on tokens it has not seen."""
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
            if (
                self.off_steps < self.probe_every
                or near_end
                or not self.repays(catch_up, left)
                or self.hopeless()
            ):
                self.off_steps += 1
                return 0
            self.switched_off, self.off_steps = False, 0
            self.probing = True
            return self._best_k()[0]  # probe: measure speculation again
        if not self.repays(catch_up, left):
            return 0
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

    def repays(self, catch_up: float, left: int | None) -> bool:
        """Whether speculating over the tokens ``left`` (up to CATCH_UP_HORIZON; None: unknown, yes)
        could repay ``catch_up`` seconds of the draft's catch-up first, judged as ``hopeless`` is:
        with every draft accepted once a draft pass is measured, before that at the prior acceptance
        and the draft's share of the parameters. (Optimistic, so that a probe, which measures, is
        not refused for an estimate it would correct.) A request whose draft had not seen its
        prompt, or the tokens a batch decoded plainly, paid the catch-up blind: with AVX2 kernels on
        a CPU the last row of a batch drafted 1 with 3 tokens left and caught 298 tokens up for 2.9
        s (bench.probe_cpu_auto)."""
        if catch_up <= 0 or left is None or self.t_plain is None:
            return True
        if self.t_draft is not None:
            rate = self._model_k(1.0, self.t_draft)[1]
        elif self.draft_cost_prior:
            rate = self._model_k(self.prior_acceptance, self.draft_cost_prior * self.t_plain)[1]
        else:
            return True
        n = min(left, CATCH_UP_HORIZON)
        return n / rate + catch_up < n * self.t_plain

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
        """The k to draft at acceptance ``a`` (None: the estimate) and the rate (tokens/s) the
        goodput check judges it by."""
        a = self.acceptance if a is None else a
        t_draft = self.t_draft
        if t_draft is None and self.drafter_stops and self.t_plain is not None and self.draft_cost_prior:
            # before a pass is measured: its share of the parameters
            t_draft = self.draft_cost_prior * self.t_plain
        if t_draft is None:  # the first, measuring step: cheap if it turns out not to pay
            return (self.k_max if self.drafter_stops else min(2, self.k_max)), 0.0
        k, expected = self._model_k(a, t_draft)
        if self.drafter_stops:
            # k is a cap the draft's confidence stop cuts within, at the model's peak: on an AMX Xeon
            # the 0.5B's pass cost 0.42 of the 1.5B's step, and a cap of k_max = 8 drafted 8 tokens
            # and kept 3, a step slower than plain (docs/benchmarks.md, the AMX batched run). E(k)
            # misjudges a stop that drops unsure tokens, so the measured rate counts, but it is the
            # old caps': one k = 8 step (4 tokens in 1.18 s against 0.25 s a plain token) switched
            # speculation off where k = 3 gave ~1.35x, so what the model expects of its cap counts too
            measured = self.spec_tokens_w / self.spec_seconds_w if self.spec_seconds_w else 0.0
            return k, max(measured, expected)
        return k, expected

    def _model_k(self, a: float, t_draft: float) -> tuple[int, float]:
        """The k whose expected tokens per second, at a draft pass of ``t_draft`` and the measured
        verifications, is highest, and that rate."""
        best_k, best_rate = 1, -1.0
        for k in range(1, self.k_max + 1):
            tv = self._t_verify(k) or 0.0
            cost = k * t_draft + tv
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
