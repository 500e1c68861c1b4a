"""RequestStats: what each speculation figure in ``usage.speculative`` counts."""

from __future__ import annotations

from decoding.params import RequestStats


def test_speculation_figures_count_what_they_name() -> None:
    # three verification steps (k = 4: 4, 1 and 0 accepted) and two plain ones: each step emits its
    # accepted drafts plus one corrected or bonus token
    stats = RequestStats(drafter="draft")
    for k, n in ((4, 4), (4, 1), (4, 0), (0, 0), (0, 0)):
        stats.record_step(k, n, 0.0)
        stats.completion_tokens += n + 1
    d = stats.as_dict()
    assert d["steps"] == 5 and d["spec_steps"] == 3
    assert d["drafted_tokens"] == 12 and d["accepted_tokens"] == 5
    assert d["accepted_tokens_per_spec_step"] == round(5 / 3, 4)  # drafts kept per verification
    assert d["tokens_per_step"] == round(10 / 5, 4)  # output per target pass, plain ones included
    assert d["mean_accepted_per_step"] == d["tokens_per_step"]  # the deprecated alias, old meaning


def test_speculation_off_accepts_nothing() -> None:
    # issue 51: speculation off reported 0.97 "accepted per step"; the precise name reports 0
    stats = RequestStats()
    for _ in range(3):
        stats.record_step(0, 0, 0.0)
        stats.completion_tokens += 1
    d = stats.as_dict()
    assert d["accepted_tokens_per_spec_step"] == 0.0 and d["spec_steps"] == 0
    assert d["tokens_per_step"] == 1.0
