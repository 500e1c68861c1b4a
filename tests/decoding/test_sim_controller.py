"""bench.sim_controller drives the engine's own choice of k (Engine.ks_for, costs_of) with a table of
step times: it must keep running as the engine's interfaces move (it stopped at costs_of's rename)."""

from __future__ import annotations

from bench.sim_controller import simulate


def test_the_simulated_controller_speculates_where_it_pays_and_not_where_it_cannot():
    off, auto = simulate(1, "off", 0.8, new=64), simulate(1, "auto", 0.8, new=64)
    assert auto.tps > 1.3 * off.tps  # a = 0.8 alone on the H200's table: ~1.6x
    hopeless = simulate(1, "auto", 0.0, new=64)
    assert hopeless.tps > 0.9 * off.tps  # drafts never accepted: it turns off
