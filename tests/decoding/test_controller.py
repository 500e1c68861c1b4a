"""Adaptive k and the goodput check, driven with synthetic timings."""

from __future__ import annotations

from decoding.controller import BatchCosts, SpecController, expected_tokens


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


def test_a_drafter_that_stops_itself_gets_k_max_and_is_judged_on_measured_steps():
    """With a draft-confidence stop, k is a cap: the controller offers k_max, and switches
    speculation off only when measured speculative steps deliver fewer tokens/s than plain ones."""
    good = SpecController(k_max=8, drafter_stops=True)
    ks = drive(good, 20, accept_all=True, t_draft=0.01, t_target=0.1)  # 9 tokens per 0.18 s
    assert ks[0] == 0 and set(ks[1:]) - {0} == {8} and ks[1:].count(0) <= 1
    bad = SpecController(k_max=8, drafter_stops=True, probe_every=4, min_probe_every=4)
    ks = drive(bad, 30, accept_all=False, t_draft=0.02, t_target=0.1)  # 1 token per 0.26 s
    assert ks[10:].count(0) > len(ks[10:]) * 0.6 and any(k == 8 for k in ks[10:])  # off, probing


def test_the_probe_turn_comes_once_a_period():
    costs = BatchCosts(probe_period=4)
    assert [costs.probe_turn() for _ in range(8)] == [False, False, False, True] * 2
