"""Threshold calibration on labelled files, and the `specgate router calibrate` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from router.calibrate import Example, calibrate, confusion, fit
from router.config import RouterSettings

EXAMPLES = Path(__file__).parents[2] / "router" / "examples.jsonl"


def test_shipped_examples_calibrate_well() -> None:
    cal = calibrate(EXAMPLES, RouterSettings())
    assert cal.tiers == ["small", "large"] and cal.examples >= 50
    assert cal.accuracy >= 0.95 and cal.current_accuracy >= 0.9  # the defaults were set from this file
    assert 0.0 < cal.thresholds[1] < 0.5
    assert sum(map(sum, cal.matrix)) == cal.examples


def test_fit_is_exact_on_three_tiers() -> None:
    scores = {"a": [0.0, 0.1, 0.2, 0.45], "b": [0.3, 0.4, 0.5], "c": [0.7, 0.8, 0.35]}
    xs = [Example(s, t) for t, ss in scores.items() for s in ss]
    th = fit(xs, ["a", "b", "c"])
    assert th == [0.0, 0.25, 0.6]  # 0.45 (a) and 0.35 (c) cannot be placed without losing more
    m = confusion(xs, ["a", "b", "c"], th)
    assert m == [[3, 1, 0], [0, 3, 0], [0, 1, 2]]


def test_fit_never_splits_equal_scores() -> None:
    xs = [Example(0.0, "s")] * 3 + [Example(0.0, "l")] + [Example(0.5, "l")]
    assert fit(xs, ["s", "l"]) == [0.0, 0.25]


def test_cli_prints_thresholds_and_confusion_matrix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [{"prompt": "hi", "tier": "small"}, {"prompt": "Prove step by step that sqrt(2) is irrational.", "tier": "large"},
            {"messages": [{"role": "user", "content": "What is 2+2?"}], "tier": "small", "max_tokens": 8}]  # fmt: skip
    f = tmp_path / "ex.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["router", "calibrate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "large: 0." in out and "accuracy: 1.000" in out and "confusion matrix" in out


def test_cli_names_the_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "hi", "tier": "small"}\n{"prompt": "x", "tier": "huge"}\n')
    assert main(["router", "calibrate", str(f)]) == 1
    assert "bad.jsonl:2: tier 'huge'" in capsys.readouterr().err
