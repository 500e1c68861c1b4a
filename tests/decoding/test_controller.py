"""Adaptive k and the goodput check, driven with synthetic timings."""

from __future__ import annotations

import itertools
import random

import pytest

from decoding.batch_controller import BatchCosts, KRow, choose_ks
from decoding.controller import MIN_LEFT_TO_PROBE, Population, SpecController, expected_tokens


def drive(c: SpecController, steps: int, accept_all: bool, t_draft: float, t_target: float) -> list[int]:
    ks = []
    for _ in range(steps):
        k = c.choose_k()
        ks.append(k)
        if k == 0:
            c.observe(0, 0, 0.0, t_target)
        else:
            c.observe(k, k if accept_all else 0, k * t_draft, t_target)
    return ks


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5
    assert abs(expected_tokens(0.5, 1) - 1.5) < 1e-12


def test_cheap_draft_high_acceptance_climbs_to_k_max():
    c = SpecController(k_max=8)
    ks = drive(c, 30, accept_all=True, t_draft=0.01, t_target=0.1)
    assert ks[-1] == 8
    assert 0 not in ks[5:]


def test_rejected_drafts_switch_speculation_off_then_probes():
    # a cheap draft that is never accepted: off, but full acceptance would pay, so it keeps probing
    c = SpecController(k_max=8, probe_every=4, min_probe_every=4)
    ks = drive(c, 30, accept_all=False, t_draft=0.02, t_target=0.1)
    assert ks[10:].count(0) > len(ks[10:]) * 0.6
    assert any(k > 0 for k in ks[10:])  # it keeps probing in case acceptance improves


def test_draft_as_costly_as_target_is_hopeless():
    c = SpecController(k_max=8)
    ks = drive(c, 30, accept_all=True, t_draft=0.1, t_target=0.1)
    assert c.hopeless()
    assert ks[5:].count(0) == 25


def test_fixed_k_and_off():
    assert drive(SpecController(k_max=5, adaptive=False), 3, False, 1.0, 0.1) == [5, 5, 5]
    assert drive(SpecController(k_max=5, speculate=False), 3, True, 0.0, 0.1) == [0, 0, 0]


def test_verification_linear_in_k_is_hopeless_and_stops_probing():
    """A CPU without bf16 matrix units: verifying k+1 tokens costs k+1 steps, so no acceptance
    rate can make speculation pay; the controller stops probing for good."""
    c = SpecController(k_max=8, probe_every=4)
    ks = []
    for _ in range(60):
        k = c.choose_k()
        ks.append(k)
        c.observe(k, k, k * 0.04, 0.2 * (k + 1))  # every draft accepted, verification linear in k
    assert c.hopeless()
    assert ks[10:].count(0) == 50


def test_flat_verification_with_a_cheap_draft_is_not_hopeless():
    c = SpecController(k_max=8)
    drive(c, 10, accept_all=True, t_draft=0.01, t_target=0.1)
    assert not c.hopeless()


def test_before_drafting_a_cpu_without_matrix_units_is_judged_hopeless_from_prefill():
    """Prefill at half a step per token and a draft a third of the target: at a typical acceptance
    no k pays, so the request never prefills the draft (a real cost on such a CPU)."""
    c = SpecController(k_max=8, draft_cost_prior=0.35)
    c.observe_prefill(100, 100 * 0.1)
    assert c.choose_k() == 0
    c.observe(0, 0, 0.0, 0.186)
    assert c.hopeless()
    assert c.choose_k() == 0


def test_before_drafting_a_gpu_like_profile_speculates():
    c = SpecController(k_max=8, draft_cost_prior=0.07)
    c.observe_prefill(128, 0.0002 * 128)
    assert c.choose_k() == 0
    c.observe(0, 0, 0.0, 0.0068)
    assert not c.hopeless()
    assert c.choose_k() > 0


def test_a_drafter_that_stops_itself_gets_a_cap_and_is_judged_on_measured_steps():
    """With a draft-confidence stop, k is a cap: the controller offers k_max until a draft pass is
    measured, then where the cost model's goodput peaks (a cheap draft that is always right: k_max),
    and switches speculation off only when measured speculative steps deliver fewer tokens/s than
    plain ones."""
    good = SpecController(k_max=8, drafter_stops=True)
    ks = drive(good, 20, accept_all=True, t_draft=0.01, t_target=0.1)  # 9 tokens per 0.18 s
    assert ks[0] == 0 and set(ks[1:]) - {0} == {8} and ks[1:].count(0) <= 1
    bad = SpecController(k_max=8, drafter_stops=True, probe_every=4, min_probe_every=4)
    ks = drive(bad, 30, accept_all=False, t_draft=0.02, t_target=0.1)  # 1 token per 0.26 s
    assert ks[10:].count(0) > len(ks[10:]) * 0.6 and any(ks[10:])  # off, probing


def test_a_stopping_draft_is_not_switched_off_by_one_step_at_its_first_cap():
    """The measured rate of a confidence-stopping draft is the rate of the caps it drafted at: one
    step at k = 8 where the draft costs 0.45 of a target step (8 drafted, 3 kept: 4 tokens in 1.18 s
    against 0.25 s a plain token, the 0.5B on an AMX Xeon) must not switch speculation off where
    the cost model says a lower cap pays; and before any pass is measured the first cap is the cost
    model's at the draft's share of the parameters, not k_max."""
    c = SpecController(k_max=8, drafter_stops=True, draft_cost_prior=0.33)
    assert c.choose_k() == 0
    c.observe(0, 0, 0.0, 0.25)
    assert 0 < c.choose_k() < 8
    c = SpecController(k_max=8, drafter_stops=True)
    c.observe(0, 0, 0.0, 0.25)
    c.accepted_w, c.rejected_w = 8.0, 1.0  # a = 0.89 so far
    c.observe(8, 3, 8 * 0.114, 0.266)
    k = c.choose_k()
    assert not c.switched_off and 0 < k < 8


def test_an_expensive_stopping_draft_is_capped_below_k_max():
    """A confidence-stopping draft whose pass costs 0.42 of a target step (the 0.5B against the
    1.5B on an AMX Xeon) and whose tokens are kept at ~0.6: k = 8 would draft 8 tokens a step of
    which ~1.5 are kept, slower than plain decoding; the cap is the cost model's k."""
    c = SpecController(k_max=8, drafter_stops=True)
    keep = text(0.6, seed=3)
    ks, _ = drive_text_costs(c, keep, t_draft=0.042, t_target=0.1)
    drafting = [k for k in ks[3:] if k]
    assert drafting and max(drafting) <= 3


def test_probes_come_a_period_after_speculation_went_off_and_space_out():
    costs = BatchCosts(probe_period=4)
    assert not any(costs.probe_turn() for _ in range(8))  # speculation not off: no probe turns
    for _ in range(3):
        costs.observe(4, 4, 0, 0.0, 0.005)
    costs.observe(4, 12, 2, 0.003, 0.0055)
    dead = [(0.05, True, 4)] * 4
    ks = [costs.best_k(dead, 0.1, probe=costs.probe_turn()) for _ in range(30)]
    # off at the first step; probes 4, then 8, then 16 steps after the one before (backoff doubling)
    assert [i for i, k in enumerate(ks) if k] == [4, 12, 28]


def test_a_batch_judged_off_is_not_judged_again_until_a_recheck_a_probe_or_other_rows():
    """Judging a large batch every plain step was host time on every step's path (fast auto at
    N = 64 on the H200: 0.947x of off, plain throughout). Off, the same rows skip the judgment
    (``BatchCosts.stays_off``) for up to off_recheck steps, but never a probe turn: the probes come
    at the steps they come without it, and other rows are judged at once."""

    def dead_rows() -> list[KRow]:
        out = []
        for _ in range(4):
            c = SpecController(k_max=8)
            c.accepted_w, c.rejected_w = 0.05, 0.95
            out.append(KRow(c, True, True, 40, 100))
        return out

    def run(shortcut: bool) -> tuple[list[int], list[int]]:
        costs = BatchCosts(probe_period=4, off_recheck=3)
        for _ in range(3):
            costs.observe(4, 4, 0, 0.0, 0.005)
        costs.observe(4, 12, 2, 0.003, 0.0055)
        rows = dead_rows()
        ids = [id(r.controller) for r in rows]
        ks, judged = [], []
        for i in range(40):
            if shortcut and costs.stays_off(ids):
                ks.append(0)
                continue
            judged.append(i)
            ks.append(max(choose_ks(rows, costs)))
        assert not costs.stays_off([id(r.controller) for r in dead_rows()])  # other rows: judged
        return ks, judged

    ks, judged = run(shortcut=True)
    assert ks == run(shortcut=False)[0] and [i for i, k in enumerate(ks) if k] == [4, 12, 28]
    assert len(judged) < 25 and all(b - a <= 3 for a, b in itertools.pairwise(judged))


def test_a_probe_measures_and_switches_speculation_on_only_past_the_margin():
    """While off, a probe turn drafts whatever the estimates say (it is how they get measured) but
    leaves speculation off unless it pays by on_margin, as any other step: a probe that paid on
    paper by a fraction of a percent (the H200, fast mode, N = 16: 16 rows at a prior of 0.33, k = 1)
    stayed on for four k = 1 steps that each cost ~3 ms more than a plain step."""
    costs = BatchCosts(probe_period=2)
    for _ in range(3):
        costs.observe(4, 4, 0, 0.0, 0.005)
    costs.observe(4, 8, 1, 0.0015, 0.005)
    assert costs.best_k([(0.05, True, 4)] * 4, 0.1, probe=False) == 0 and costs.off
    marginal = [(0.32, True, 4)] * 4  # k = 1: 1.32 tokens in 6.5 ms against 1 in 5: 1.015x
    ks = [costs.best_k(marginal, 0.1, probe=costs.probe_turn()) for _ in range(6)]
    assert [bool(k) for k in ks] == [False, True, False, False, False, True] and costs.off
    assert costs.best_k([(0.8, True, 4)] * 4, 0.1, probe=False) > 0 and not costs.off


def test_speculation_that_is_off_is_not_probed_for_rows_near_their_ends():
    """A probe from off pays the draft's catch-up over every plain step since the last one (22 ms at
    N = 32 on the H200, five plain steps); rows with fewer than MIN_LEFT_TO_PROBE tokens left could
    not repay it, so the probe turn waits for rows that can (a request joining), and a request alone
    does the same."""
    costs = BatchCosts(probe_period=2)
    for _ in range(3):
        costs.observe(4, 4, 0, 0.0, 0.005)
    costs.observe(4, 12, 2, 0.003, 0.0055)

    def rows(left: int) -> list[KRow]:
        out = []
        for _ in range(4):
            c = SpecController(k_max=8)
            c.accepted_w, c.rejected_w = 0.05, 0.95
            out.append(KRow(c, True, True, 40, left))
        return out

    ending = rows(MIN_LEFT_TO_PROBE - 1)
    assert choose_ks(ending, costs) == [0] * 4 and costs.off
    assert [choose_ks(ending, costs) for _ in range(6)] == [[0] * 4] * 6  # probe turns come and pass
    young = rows(100)
    assert choose_ks(young, costs) == [2] * 4  # the turn, waiting, goes to rows that can repay it

    alone = SpecController(k_max=8, probe_every=2, min_probe_every=2)
    alone.observe(0, 0, 0.0, 0.005)
    alone.observe(2, 0, 0.003, 0.0055)
    for _ in range(4):
        alone.observe(2, 0, 0.003, 0.0055)
    assert [alone.choose_k(left=10) for _ in range(6)] == [0] * 6 and alone.switched_off
    assert alone.choose_k(left=100) > 0  # the probe, due since the third of those steps


# GPU-like costs of one request alone (bench.sim_controller's H200 table): a draft pass costs about a
# quarter of a verification, and verification is flat in k (exact mode pads every step to one width)
T_DRAFT, T_TARGET = 1.3e-3, 5.0e-3


def drive_text(c: SpecController, keep: list[bool]) -> tuple[list[int], float]:
    """Decode ``keep``'s positions (True: the draft's token there is accepted) with injected costs;
    the k chosen per step and the tokens per second of the whole run."""
    return drive_text_costs(c, keep, T_DRAFT, T_TARGET)


def drive_text_costs(
    c: SpecController, keep: list[bool], t_draft: float, t_target: float
) -> tuple[list[int], float]:
    """``drive_text`` at the given costs."""
    ks, done, seconds = [], 0, 0.0
    while done < len(keep) - 16:
        k = c.choose_k()
        n = 0
        while n < k and keep[done + n]:
            n += 1
        c.observe(k, n, k * t_draft, t_target)
        ks.append(k)
        done += n + 1
        seconds += k * t_draft + t_target
    return ks, done / seconds


def text(a: float, seed: int, n: int = 400) -> list[bool]:
    rng = random.Random(seed)
    return [rng.random() < a for _ in range(n + 16)]


def best_fixed_k(a: float) -> int:
    return max(range(1, 9), key=lambda k: expected_tokens(a, k) / (k * T_DRAFT + T_TARGET))


def test_converges_to_the_k_that_pays_best_with_little_exploration():
    for a in (0.6, 0.8, 0.9):
        for seed in range(3):
            keep = text(a, seed)
            c = SpecController(k_max=8, draft_cost_prior=0.07)
            ks, rate = drive_text(c, keep)
            fixed = max(drive_text(SpecController(k_max=k, adaptive=False), keep)[1] for k in range(1, 9))
            assert rate >= 0.93 * fixed, (a, seed, ks)
            settled = ks[5:]
            assert abs(sorted(settled)[len(settled) // 2] - best_fixed_k(a)) <= 1, (a, ks)
            assert settled.count(0) <= 0.03 * len(settled), ks  # plain steps: remeasurement only


def test_early_rejections_do_not_switch_speculation_off():
    """Two whole rejections on the first two drafting steps, then text the draft predicts well: thin
    evidence must not turn speculation off for a probe period (16 plain steps at N = 1)."""
    for seed in range(20):
        keep = [True, False, False, *text(0.8, seed, 120)]  # position 0: the first, plain step
        c = SpecController(k_max=8, draft_cost_prior=0.07)
        ks, _ = drive_text(c, keep)
        assert not any(ks[i] == ks[i + 1] == 0 for i in range(1, len(ks) - 2)), (seed, ks)


def test_a_draft_never_accepted_is_still_switched_off_within_a_few_steps():
    c = SpecController(k_max=8, draft_cost_prior=0.07)
    ks, _ = drive_text(c, [False] * 200)
    first_off = next(i for i in range(2, len(ks)) if ks[i] == ks[i + 1] == 0)
    assert first_off <= 10, ks
    assert ks[20:].count(0) >= 0.9 * len(ks[20:])


def test_remeasurement_is_rarer_where_speculation_clearly_pays():
    clear = SpecController(k_max=8)  # every draft accepted: speculation pays several times over
    ks = drive(clear, 300, accept_all=True, t_draft=T_DRAFT, t_target=T_TARGET)
    assert ks[1:].count(0) <= 300 // 128
    close = SpecController(k_max=8)  # a draft nearly as costly as the target: a close call (1.2x)
    ks = drive(close, 300, accept_all=True, t_draft=0.8 * T_TARGET, t_target=T_TARGET)
    assert ks[1:].count(0) >= 300 // 32 - 1


def test_population_seeds_a_new_requests_acceptance_from_recent_ones():
    pop = Population()
    fresh = SpecController(k_max=4)
    pop.seed(fresh)
    assert fresh.acceptance == 0.5  # nothing observed yet: the a = 0.5 prior stands
    for _ in range(200):  # drafts almost never accepted
        pop.observe(2, 0)
    pop.observe(0, 0)  # a plain step is no observation
    low = SpecController(k_max=4)
    pop.seed(low)
    assert low.acceptance < 0.05
    assert low.accepted_w + low.rejected_w == pop.weight  # a prior, not the population's weight
    for _ in range(300):  # the workload changes: every draft accepted; old evidence decays
        pop.observe(4, 4)
    high = SpecController(k_max=4)
    pop.seed(high)
    assert high.acceptance > 0.9
    # the request's own evidence takes over within a few steps
    for _ in range(5):
        high.observe(4, 0, 0.01, 0.1)
    assert high.acceptance < 0.3


def test_a_low_population_prior_keeps_a_batch_from_speculating_until_a_probe():
    """Rows that start from the workload's low acceptance do not draft on their first steps (at the
    a = 0.5 prior they would, and on a workload whose drafts are rejected each such step is lost)."""
    costs = BatchCosts()
    costs.observe(4, 4, 0, 0.0, 5e-3)  # plain: 5 ms
    costs.observe(4, 12, 2, 2.8e-3, 5.2e-3)  # k = 2: 1.4 ms a draft pass, verification 5.2 ms
    prior = [(0.5, True, 8)] * 4
    assert costs.best_k(prior, 0.07, probe=False) > 0
    pop = Population()
    for _ in range(100):
        pop.observe(2, 0)
    rows = []
    for _ in range(4):
        c = SpecController(k_max=8)
        pop.seed(c)
        rows.append((c.acceptance, True, 8))
    assert costs.best_k(rows, 0.07, probe=False) == 0
    assert costs.best_k(rows, 0.07, probe=True) == 2  # probe turns still measure


def test_choose_ks_shares_one_k_and_keeps_each_rows_limits():
    """In a batch the adaptive rows share the k BatchCosts finds paying; a fixed-k row keeps its k, a
    row without a drafter and a model-drafting row's first token draft nothing, prompt lookup drafts
    from its first token, and no row drafts past its max_tokens (one token left: plain)."""
    costs = BatchCosts()
    for _ in range(3):
        costs.observe(5, 5, 0, 0.0, 0.005)
    costs.observe(5, 20, 3, 0.003, 0.0052)  # verification about a plain step, a cheap draft

    def adaptive() -> SpecController:
        c = SpecController(k_max=6, adaptive=True, speculate=True)
        c.accepted_w, c.rejected_w = 9.0, 1.0  # a = 0.9
        return c

    rows = [
        KRow(adaptive(), True, True, 10, 100),
        KRow(adaptive(), True, False, 0, 100),  # prompt lookup, first token
        KRow(SpecController(k_max=2, adaptive=False, speculate=True), True, True, 10, 100),
        KRow(adaptive(), False, False, 10, 100),  # no drafter
        KRow(adaptive(), True, True, 0, 100),  # a draft model's first token
    ]
    ks = choose_ks(rows, costs)
    assert ks[0] >= 3 and ks[1] == ks[0]
    assert ks[2:] == [2, 0, 0]
    near_end = choose_ks([r._replace(left=1) for r in rows[:3]] + [rows[0]._replace(left=3)], costs)
    assert near_end[:3] == [0, 0, 0] and near_end[3] == 2


def test_a_verification_between_measured_shapes_is_interpolated_from_plain_steps():
    """128 rows (k = 1 at 64) lie between the plain step of 64 and a verification of 256: costed
    between the two, not as the dearer one."""
    costs = BatchCosts()
    costs.observe(64, 64, 0, 0.0, 0.005)
    costs.observe(64, 256, 3, 0.0039, 0.009)
    assert costs.t_target(128) == pytest.approx(0.005 + (128 - 64) / (256 - 64) * 0.004)
    assert costs.t_target(256) == pytest.approx(0.009)
    assert costs.t_target(1024) == pytest.approx(0.009)  # past the largest: as it (tried, then known)


def test_a_shapes_stalled_first_sample_does_not_turn_the_batch_off():
    """The first 256-row verification at N = 64 on the H200 was recorded at 43.9 ms (a one-off stall)
    against 7-9 ms later: as the whole estimate it turned speculation off for the rest of the run,
    where k = 1 pays ~1.2x. A first sample counts at most OUTLIER times the tables' guess."""
    costs = BatchCosts()
    for _ in range(3):
        costs.observe(64, 64, 0, 0.0, 0.0046)
    costs.observe(64, 256, 3, 3 * 0.0013, 0.0439)
    assert costs.t_target(256) == pytest.approx(2 * 0.0046)
    assert costs.best_k([(0.75, True, 8)] * 64, 0.07, probe=False) == 1
    costs.observe(64, 128, 1, 0.0014, 0.0053)  # what k = 1 then measures
    assert costs.best_k([(0.75, True, 8)] * 64, 0.07, probe=False) == 1 and not costs.off


def test_a_request_alones_stalled_first_verification_does_not_switch_it_off():
    """The same bound for a request alone: its first verification, stalled at 10x a plain step, is
    counted at most OUTLIER times the plain step it was expected to cost, so drafts it keeps go on."""
    c = SpecController(k_max=4)
    c.observe(0, 0, 0.0, 0.005)
    k = c.choose_k()
    c.observe(k, k, k * 0.001, 0.05)
    assert c.t_verify[k] == 2 * 0.005
    assert c.choose_k() > 0


def _table(
    plain: dict[int, float], per_width: float, widths: range = range(1, 10)
) -> dict[tuple[int, int], float]:
    """A start-up step table (StaticModel.time_steps): a step of B rows at width W costs the plain
    step of B plus ``per_width`` x B x (W - 1)."""
    return {(B, W): t + per_width * B * (W - 1) for B, t in plain.items() for W in widths}


def test_a_batch_seeded_from_the_start_up_table_speculates_from_its_first_step_where_it_pays():
    """With the target's and draft's replay times, the first step of a batch chooses k by them (an
    unseeded batch's first step is plain, to measure what speculation must beat)."""
    rows = [(0.8, True, 8)] * 4
    assert BatchCosts().best_k(rows, 0.07, probe=False) == 0
    costs = BatchCosts()
    costs.seed(_table({4: 0.005}, 1e-5), {(4, 1): 0.0008})
    assert costs.best_k(rows, 0.07, probe=False) >= 3
    assert costs.t_draft(4) == 0.0008


def test_a_batch_seeded_where_verification_is_dear_does_not_try_it():
    """At 64 rows on the H200 a k = 1 step (a 128-row verification and a draft pass) is break-even
    against a plain step: seeded with such times, the batch does not draft before it has measured
    anything (unseeded, its first speculative step paid the draft's catch-up over every prompt)."""
    rows = [(0.5, True, 8)] * 64
    costs = BatchCosts()
    costs.observe(64, 64, 0, 0.0, 0.0047)  # plain: 4.7 ms
    assert costs.best_k(rows, 0.07, probe=False) > 0  # a verification costed as the plain step
    seeded = BatchCosts()
    seeded.seed(
        {(64, 1): 0.0047, (64, 2): 0.0062, (32, 4): 0.0062, (64, 3): 0.0075, (64, 4): 0.0085},
        {(64, 1): 0.0017},
    )
    assert seeded.best_k(rows, 0.07, probe=False) == 0


def test_a_measured_step_replaces_the_seed_and_a_new_table_reseeds():
    """A seed stands until a step of its shape is measured; the measurement's first sample is then
    the estimate (bounded by OUTLIER x the seed), not averaged with it. Seeding again from the same
    table changes nothing; a table timed again is read again."""
    costs = BatchCosts()
    table = _table({8: 0.005}, 0.0)
    costs.seed(table, {(8, 1): 0.001})
    assert costs.t_target(16) == pytest.approx(0.005)
    costs.observe(8, 16, 1, 0.0012, 0.0061)
    assert costs.t_target(16) == pytest.approx(0.0061)
    assert costs.t_draft(8) == pytest.approx(0.0012)
    costs.observe(8, 32, 3, 0.003, 0.5)  # a stalled first sample of 32 rows: at most twice its seed
    assert costs.t_target(32) == pytest.approx(
        2 * (0.005 + 0.0011)
    )  # ... and what 16 rows took beyond theirs
    costs.observe(8, 8, 0, 0.0, 0.006)
    plain, draft = costs.t_plain(8), costs.t_draft(8)
    costs.seed(table, None)
    assert costs.t_plain(8) == plain and costs.t_draft(8) == draft
    costs.seed(_table({8: 0.005, 16: 0.007}, 0.0), None)
    assert costs.t_plain(16) == pytest.approx(0.007) and costs.t_plain(8) == plain


def test_a_request_alone_seeded_chooses_k_by_costs_but_its_first_token_stays_plain():
    """Alone, a seeded controller's first drafting step picks k by the table (unseeded: a measuring
    step at k = 2); a row drafting with a model still gives its first token from a plain step, so
    the token does not wait for the draft to take in the prompt."""
    c = SpecController(k_max=8)
    c.accepted_w, c.rejected_w = 9.0, 1.0
    c.seed(_table({1: 0.005}, 1e-5), {(1, 1): 0.0003})
    row = KRow(c, True, True, 0, 100)
    assert choose_ks([row], BatchCosts()) == [0]
    assert choose_ks([row._replace(emitted=1)], BatchCosts())[0] >= 4
    lookup = SpecController(k_max=8)
    lookup.seed(_table({1: 0.005}, 1e-5), None)
    assert lookup.t_draft is None and choose_ks([KRow(lookup, True, False, 0, 100)], BatchCosts()) == [2]


def test_a_batch_speculates_only_where_the_gain_repays_its_drafts_catch_up():
    """The first speculative step of rows that decoded plainly catches their draft up on what it has
    not seen (a prompt each). With its cost known (the draft's prompt-chunk graphs, timed at start-up),
    a k that gains a little a step is not worth it over a few tokens left, and still is over many;
    a draft that is caught up pays nothing."""
    costs = BatchCosts()
    costs.seed({(64, 1): 0.0047, (64, 2): 0.0055}, {(64, 1): 0.0015, (0, 512): 0.0012})
    assert costs.catch_up_token == pytest.approx(0.0012 / 512)
    rows = [(0.8, True, 1)] * 64  # k = 1: 1.8 tokens a row in 7.0 ms against 1 in 4.7 (1.2x)
    assert costs.best_k(rows, 0.07, probe=False) == 1
    assert costs.best_k(rows, 0.07, probe=False, backlog=64 * 128, left=64 * 128) == 1
    assert costs.best_k(rows, 0.07, probe=False, backlog=64 * 128, left=64 * 16) == 0
    assert costs.best_k(rows, 0.07, probe=False, backlog=0, left=64 * 16) == 1
    lookup = [(0.8, False, 1)] * 64  # prompt lookup has nothing to catch up on
    assert costs.best_k(lookup, 0.07, probe=False, backlog=64 * 128, left=64 * 16) == 1


def _cpu_row(left: int, backlog: int, emitted: int = 5) -> KRow:
    """A row on a CPU without a start-up table: its plain step and its prompt's prefill measured, its
    draft a third of the target's parameters, no draft pass measured yet."""
    c = SpecController(k_max=4, draft_cost_prior=0.32)
    c.observe(0, 0, 0.0, 0.35)  # a 1-row plain step: 350 ms
    c.observe_prefill(250, 250 * 0.086)  # 86 ms a prompt token
    return KRow(c, True, True, emitted, left, backlog)


def test_a_catch_up_nothing_has_measured_is_priced_from_the_targets_prefill():
    """Without a start-up table (a CPU) a draft's catch-up is costed, until one is measured, at the
    target's measured prefill a token times the draft's share of the parameters. With AVX2 kernels 4
    rows caught 498 prompt tokens up in 12.5 s for a k = 1 step, in a 71 s run that stayed plain after
    it; priced, a batch with ~40 tokens a row left stays plain, and one with 256 a row and a small
    backlog drafts. Alone, the same: the last row of a batch with a few tokens left and hundreds of
    tokens its draft has not seen decodes plainly; with the catch-up done, it drafts."""
    costs = BatchCosts()
    costs.observe(4, 4, 0, 0.0, 0.667)  # a 4-row plain step
    costs.observe(4, 4, 0, 0.0, 0.667)
    rows = [_cpu_row(42, backlog) for backlog in (55, 52, 140, 255)]
    assert choose_ks(rows, costs) == [0, 0, 0, 0]
    assert costs.catch_up_token is None  # nothing measured: the estimate, not a guess of 0
    assert min(choose_ks([r._replace(left=400, backlog=8) for r in rows], costs)) > 0
    # an AVX512-BF16 CPU: a 4-row step 309 ms, prefill 14 ms a token. Untried, the rows' a = 0.5
    # prior is judged at the controllers' 0.8, so the batch tries (at 0.5 it never did)
    fast = BatchCosts()
    fast.observe(4, 4, 0, 0.0, 0.309)
    fast.observe(4, 4, 0, 0.0, 0.309)
    for r in rows:
        r.controller.observe_prefill(250, 250 * 0.0144)
    assert rows[0].controller.acceptance == 0.5
    assert min(choose_ks(rows, fast)) > 0
    fast.observe_catch_up(498, 2.3)  # tried: the estimates count from now on
    assert choose_ks(rows, fast) == [0, 0, 0, 0]
    ending = _cpu_row(4, 298)
    assert choose_ks([ending], costs) == [0]
    assert choose_ks([_cpu_row(200, 298)], costs)[0] > 0
    assert choose_ks([ending._replace(backlog=0)], costs)[0] > 0


def test_a_request_off_still_probes_with_a_catch_up_to_pay():
    """The catch-up check is optimistic (every draft accepted once a pass is measured), so a request
    whose goodput check switched speculation off still probes: its plain steps leave its draft a
    backlog, and an estimate from rejected drafts would otherwise refuse every probe."""
    c = SpecController(k_max=4, probe_every=4, min_probe_every=4)
    drive(c, 30, accept_all=False, t_draft=0.02, t_target=0.1)
    c.switched_off, c.off_steps, c.probing, c.probe_every = True, 0, False, 4
    assert c.acceptance < 0.2 and any(c.choose_k(200, catch_up=0.05) for _ in range(6))
    c.switched_off, c.off_steps, c.probing, c.probe_every = True, 0, False, 4
    assert not any(c.choose_k(40, catch_up=5.0) for _ in range(6))  # too few tokens left to repay it


def test_a_seeded_verification_is_costed_with_the_hosts_share_of_a_step():
    """A replay's device time misses the host's work, which plain steps queued ahead hide and a
    speculative step waits for: a seeded verification counts a plain step's host time until a
    measured verification shows what steps of that batch take beyond their seeds."""
    costs = BatchCosts()
    costs.seed({(64, 1): 0.0047, (64, 2): 0.005, (64, 4): 0.0071}, {(64, 1): 0.001})
    assert costs.t_target(128, 64) == pytest.approx(0.005)
    costs.observe_host(64, 0.002)
    assert costs.t_target(128, 64) == pytest.approx(0.007)
    assert costs.best_k([(0.5, True, 1)] * 64, 0.07, probe=False) == 0  # 1.5 tokens in 8 ms: < plain
    costs.observe(64, 128, 1, 0.0014, 0.0093)  # measured: 4.3 ms beyond the seed
    assert costs.t_target(128, 64) == pytest.approx(0.0093)
    assert costs.t_target(256, 64) == pytest.approx(0.0071 + 0.0043)


def test_a_large_batch_drafting_with_a_model_probes_less_often():
    """A probe catches every model-drafting row's draft up, so its cost grows with the batch: past
    probe_rows such rows the period between probes grows in proportion; prompt lookup (nothing to
    catch up) keeps the period."""

    def first_probe(rows: int) -> int:
        costs = BatchCosts()
        costs.off = True
        return next(i for i in range(1, 1000) if costs.probe_turn(rows))

    assert first_probe(0) == first_probe(4) == first_probe(8) == 16
    assert first_probe(32) == 64 and first_probe(64) == 128


def test_a_first_token_comes_from_a_speculative_step_only_where_the_drafts_catch_up_is_cheap():
    """With the draft's catch-up timed at start-up, a row's first step drafts when taking in the
    prompt costs at most a plain step (one 128-token prompt on the H200: ~0.4 ms of 4.5), and stays
    plain where it does not (64 prompts: ~25 ms)."""
    costs = BatchCosts()
    costs.seed(_table({1: 0.0045, 64: 0.0047}, 1e-5), {(1, 1): 0.001, (64, 1): 0.0011, (0, 512): 0.0016})
    c = SpecController(k_max=4)
    c.accepted_w, c.rejected_w = 8.0, 2.0
    c.seed(_table({1: 0.0045}, 1e-5), {(1, 1): 0.001})
    alone = KRow(c, True, True, 0, 100, backlog=128)
    assert choose_ks([alone], costs)[0] > 0
    assert choose_ks([alone], BatchCosts()) == [0]  # nothing timed: the first token stays plain
    many = [KRow(SpecController(k_max=4), True, True, 0, 100, backlog=128) for _ in range(64)]
    assert choose_ks(many, costs) == [0] * 64


def test_a_first_token_does_not_wait_for_the_other_rows_costly_catch_up(monkeypatch):
    """Rows joining a batch whose other rows' drafts have a long backlog (plain steps, a prompt): the
    step giving the new rows their first token catches nobody up for longer than a plain step, so
    the others decode plainly in it; with a short backlog they draft as before, and once no row is
    at its first token the catch-up runs."""
    costs = BatchCosts()
    costs.seed(_table({64: 0.0047}, 1e-5), {(64, 1): 0.0011, (0, 512): 0.0016})

    def rows(backlog: int, joining: int) -> list[KRow]:
        out = []
        for i in range(64):
            c = SpecController(k_max=4)
            c.accepted_w, c.rejected_w = 9.0, 1.0
            new = i < joining
            out.append(KRow(c, True, True, 0 if new else 10, 100, backlog=2 if new else backlog))
        return out

    monkeypatch.setattr(BatchCosts, "best_k", lambda self, r, prior, probe, **kw: 2)
    assert choose_ks(rows(128, 2), costs)[2:] == [0] * 62  # 62 x 128 tokens: ~25 ms of catch-up
    assert choose_ks(rows(1, 2), costs)[2:] == [2] * 62  # a short backlog
    assert choose_ks(rows(128, 0), costs) == [2] * 64  # no first token waits: it runs


def test_a_probe_runs_only_where_its_priced_cost_is_a_small_share_of_what_is_left():
    """A probe from off catches every drafting row's draft up: with that priced by the start-up
    table, a 64-row batch whose drafts have 64 prompts to take in skips its probe turn (~35 ms
    against ~600 ms of plain decoding left), while 4 rows with short backlogs probe as before."""
    costs = BatchCosts()
    h200_64 = (4.46, 4.82, 6.49, 6.42, 8.70, 9.08, 11.38, 11.22, 13.97)  # ms at width 1..9 (12:37 UTC)
    table = {(64, W): t / 1e3 for W, t in enumerate(h200_64, 1)} | _table({4: 0.0045}, 1e-5)
    costs.seed(table, {(4, 1): 0.001, (64, 1): 0.00105, (0, 512): 0.0016})
    costs.observe_host(64, 0.0017)
    costs.off, costs.off_steps = True, 1000
    many = [(0.6, True, 4)] * 64
    assert costs.best_k(many, 0.07, probe=True, backlog=64 * 144, left=64 * 112) == 0
    assert costs.backoff == 1  # no probe ran: the next turn may still probe
    few = [(0.3, True, 4)] * 4
    assert costs.best_k(few, 0.07, probe=True, backlog=4 * 16, left=4 * 112) == 2


def test_a_few_tokens_catch_up_does_not_reprice_a_prompts():
    """Catch-ups are averaged by tokens: one of 9 tokens that cost a whole pass (~1 ms) barely moves
    the cost a token that a 64-prompt catch-up measured, where as one sample of an average it
    would have raised it several-fold."""
    costs = BatchCosts()
    costs.seed({(64, 1): 0.0047}, {(64, 1): 0.0011, (0, 512): 0.0016})
    costs.observe_catch_up(8192, 0.037)  # 64 prompts on the H200: ~4.5 us a token
    big = costs.catch_up_token
    assert big is not None and 4e-6 < big < 5e-6
    costs.observe_catch_up(9, 0.001)  # ~110 us a token
    assert costs.catch_up_token is not None and costs.catch_up_token < 1.2 * big
    for _ in range(20):  # a window's worth of later catch-ups at another rate takes over
        costs.observe_catch_up(8192, 0.08)
    assert costs.catch_up_token == pytest.approx(0.08 / 8192, rel=0.05)


def test_only_a_shapes_first_step_far_over_its_prediction_is_held_back():
    """``first_use``: a speculative step of a shape not yet measured that takes more than OUTLIER
    times the tables' prediction (verification, plus the draft passes where a model drafts) is held
    back once; within the bound, of a measured shape, or a second time, it is a sample."""
    costs = BatchCosts()
    costs.seed(_table({4: 0.005}, 0.0), {(4, 1): 0.001})
    predicted = 0.005 + 3 * 0.001
    assert not costs.first_use(4, 3, True, 1.9 * predicted) and not costs.held
    assert costs.first_use(4, 3, False, 1.9 * predicted)  # no draft passes: over twice the 5 ms
    assert costs.held == {(4, 16)}
    assert not costs.first_use(4, 3, False, 1.9 * predicted)  # a second time: a sample
    costs.observe(4, 8, 1, 0.001, 0.006)
    assert not costs.first_use(4, 1, True, 1.0)  # measured already
    assert not costs.first_use(4, 0, False, 1.0)  # a plain step
    assert costs.held == {(4, 16)}


def test_a_verification_measured_in_a_smaller_batch_does_not_price_a_larger_ones():
    """bench.gpu_batch on the H200: N = 32 measured 128-row verifications (k = 3) at ~6 ms; at N = 64
    the same 128 rows (k = 1) cost more, the host's per-row work doubled (a plain step's host time
    1.1 -> 2.4 ms), and judged by N = 32's steps k = 1 looked 1.2x plain, so the batch switched on and
    paid the drafts' catch-up over 64 prompts (fast auto 0.95x). A batch's verification is priced
    by its own bucket's measurements: seed plus its own host time, where k = 1 does not pay."""
    costs = BatchCosts()
    costs.seed(
        {(32, 1): 0.0045, (32, 4): 0.0050, (64, 1): 0.0047, (64, 2): 0.00485},
        {(32, 1): 0.0010, (64, 1): 0.00107},
    )
    for _ in range(4):
        costs.observe(32, 128, 3, 3 * 0.0010, 0.0060)
        costs.observe(64, 64, 0, 0.0, 0.0047)
    costs.observe_host(32, 0.0011)
    costs.observe_host(64, 0.0024)
    assert costs.t_target(128, 32) == pytest.approx(0.006)
    assert costs.t_target(128, 64) == pytest.approx(0.0050 + 0.0024)  # the seed and 64 rows' host time
    assert costs.best_k([(0.8, True, 1)] * 64, 0.07, probe=False) == 0  # k = 1 at 64 rows
    assert costs.best_k([(0.8, True, 3)] * 32, 0.07, probe=False) == 3  # where it was measured to pay
    costs.observe(64, 128, 1, 0.00107, 0.0058)  # once 64 rows measure their own, those stand
    assert costs.t_target(128, 64) == pytest.approx(0.0058)


def test_best_k_sums_every_rows_expected_tokens_up_to_its_own_cap():
    """best_k's running sum of the rows' expected tokens matches expected_tokens(a, min(k, cap)) row by
    row, rows of different acceptance and caps (one at 1.0) included."""
    costs = BatchCosts()
    costs.seed(_table({4: 0.005, 8: 0.0052}, 2e-5), {(4, 1): 0.0004, (8, 1): 0.0005})
    rng = random.Random(0)
    for _ in range(50):
        B = rng.choice([4, 8])
        rows = [(rng.choice([0.2, 0.5, 0.8, 0.95, 1.0]), True, rng.randint(1, 8)) for _ in range(B)]
        t_plain, t_draft = costs.t_plain(B), costs.t_draft(B)
        assert t_plain is not None and t_draft is not None
        rates = {0: B / t_plain}
        for k in range(1, max(c for _, _, c in rows) + 1):
            tokens = sum(expected_tokens(a, min(k, c)) for a, _, c in rows)
            rates[k] = tokens / ((costs.t_target(B * (k + 1), B) or t_plain) + k * t_draft)
        best = 0
        for k in sorted(rates):
            if rates[k] > rates[best] * 1.0001:
                best = k
        costs.off = False  # no hysteresis from the case before
        assert costs.best_k(rows, 0.07, probe=False) == best


def test_exact_mode_prices_a_verification_as_its_batchs_plain_step():
    """Exact mode runs every row at one width, so a verification costs what its batch's plain step
    does at any k. By target rows alone, once a server had timed its 32-row graphs, a 16-row k = 1
    verification was priced as the 32-row plain step (9.5 ms against 5.9 on the H200's exact table)
    and exact auto stayed plain at 16 rows."""
    exact = {1: 5.04e-3, 4: 5.2e-3, 16: 5.9e-3, 32: 9.5e-3, 64: 16.0e-3}
    table = {(B, W): t for B, t in exact.items() for W in range(1, 10)}
    rows = [(0.8, True, 8)] * 16
    by_rows, padded = BatchCosts(), BatchCosts(padded_width=9)
    for c in (by_rows, padded):
        c.seed(table, {(16, 1): 1.45e-3, (0, 512): 2.5e-3})
    assert by_rows.t_target(32, 16) == pytest.approx(9.5e-3)
    assert padded.t_target(32, 16) == pytest.approx(5.9e-3) == padded.t_target(144, 16)
    assert by_rows.best_k(rows, 0.07, probe=False) == 0
    assert padded.best_k(rows, 0.07, probe=False) >= 3
    padded.observe(16, 48, 2, 0.003, 0.0071)  # a measured verification of its shape stands
    assert padded.t_target(48, 16) == pytest.approx(0.0071)


def test_the_padded_width_is_exact_modes_on_a_static_model_only():
    from types import SimpleNamespace as NS

    from decoding.engine import _padded_width

    static = NS(exact=True, exact_padding=9)  # a device that showed no narrower width (StaticModel)
    assert _padded_width(NS(runner=NS(exact=True, batch_model=static))) == 9  # type: ignore[arg-type]
    assert _padded_width(NS(runner=NS(exact=False, batch_model=static))) == 0  # type: ignore[arg-type]
    shown = NS(exact=True, exact_padding=0)  # one that showed every verification width
    assert _padded_width(NS(runner=NS(exact=True, batch_model=shown))) == 0  # type: ignore[arg-type]
    assert _padded_width(NS(runner=NS(exact=True, batch_model=NS(exact_step=3)))) == 0  # type: ignore[arg-type]
