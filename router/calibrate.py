"""Fit tier thresholds to a labelled file of example prompts (`specgate router calibrate FILE`).

The file is JSON lines, one example each: `{"prompt": "...", "tier": "small"}` or
`{"messages": [...], "tier": "large", "max_tokens": 512}`; tiers are names from `router.tiers`.
The feature weights stay fixed; only the thresholds move. Tiers are ordered, so the best thresholds
cut the examples, sorted by score, into contiguous runs, one per tier: a small dynamic programme finds
the cuts that route the most examples to their labelled tier (exact, O(tiers * n^2)).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from router.config import RouterSettings
from router.features import DEFAULT_WEIGHTS, Weights, complexity, extract


@dataclass(frozen=True)
class Example:
    score: float
    tier: str  # the labelled tier


@dataclass(frozen=True)
class Calibration:
    tiers: list[str]
    thresholds: list[float]  # one per tier; the first is always 0.0
    accuracy: float
    matrix: list[list[int]]  # [labelled][routed]
    current_thresholds: list[float]
    current_accuracy: float
    current_matrix: list[list[int]]
    examples: int


def load(path: str | Path, tiers: list[str], weights: Weights = DEFAULT_WEIGHTS) -> list[Example]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
            tier = row.get("tier")
            if tier not in tiers:
                raise ValueError(f"{path}:{lineno}: tier {tier!r} is not one of {tiers}")
            if not isinstance(row.get("prompt"), str) and not isinstance(row.get("messages"), list):
                raise ValueError(f"{path}:{lineno}: needs a `prompt` string or a `messages` list")
            f = extract(row.get("messages"), row.get("prompt"), row.get("max_tokens"))
            out.append(Example(complexity(f, weights)[0], tier))
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def assign(score: float, thresholds: list[float]) -> int:
    """Index of the highest tier whose threshold the score reaches (the router's rule)."""
    return max(i for i, t in enumerate(thresholds) if score >= t or i == 0)


def confusion(examples: list[Example], tiers: list[str], thresholds: list[float]) -> list[list[int]]:
    m = [[0] * len(tiers) for _ in tiers]
    for ex in examples:
        m[tiers.index(ex.tier)][assign(ex.score, thresholds)] += 1
    return m


def fit(examples: list[Example], tiers: list[str]) -> list[float]:
    """Thresholds that maximise the examples routed to their labelled tier."""
    xs = sorted(examples, key=lambda e: e.score)
    n, m = len(xs), len(tiers)
    # prefix[j][i]: examples among the i lowest-scored that are labelled tier j
    prefix = [[0] * (n + 1) for _ in tiers]
    for i, ex in enumerate(xs):
        for j in range(m):
            prefix[j][i + 1] = prefix[j][i] + (ex.tier == tiers[j])
    # A cut before position p is only realisable between two different scores.
    cuts = [p for p in range(n + 1) if p in (0, n) or xs[p - 1].score < xs[p].score]
    neg = -1
    best = [[neg] * (n + 1) for _ in tiers]  # best[j][i]: most correct with the i lowest in tiers <= j
    back = [[0] * (n + 1) for _ in tiers]
    for i in cuts:
        best[0][i] = prefix[0][i]
    for j in range(1, m):
        for i in cuts:
            for p in cuts:
                if p > i:
                    break
                if best[j - 1][p] == neg:
                    continue
                v = best[j - 1][p] + prefix[j][i] - prefix[j][p]
                if v > best[j][i]:
                    best[j][i], back[j][i] = v, p
    starts, i = [], n
    for j in range(m - 1, 0, -1):
        i = back[j][i]
        starts.append(i)
    starts.reverse()  # starts[j-1]: sorted position where tier j begins
    thresholds = [0.0]
    for p in starts:
        if p == 0:
            t = 0.0
        elif p == n:
            t = min(1.0, (xs[-1].score + 1.0) / 2)  # above every example: the tier is never chosen
        else:
            t = (xs[p - 1].score + xs[p].score) / 2  # the middle of the gap generalises best
        thresholds.append(round(max(t, thresholds[-1]), 4))
    return thresholds


def calibrate(path: str | Path, settings: RouterSettings, weights: Weights = DEFAULT_WEIGHTS) -> Calibration:
    tiers = [t.name for t in settings.tiers]
    examples = load(path, tiers, weights)
    current = [t.threshold for t in settings.tiers]
    fitted = fit(examples, tiers)

    def acc(matrix: list[list[int]]) -> float:
        return sum(matrix[i][i] for i in range(len(tiers))) / len(examples)

    cm, cur = confusion(examples, tiers, fitted), confusion(examples, tiers, current)
    return Calibration(tiers, fitted, acc(cm), cm, current, acc(cur), cur, len(examples))


def _matrix(tiers: list[str], matrix: list[list[int]]) -> list[str]:
    w = max(8, *(len(t) + 1 for t in tiers))
    lines = [" " * (w + 2) + "".join(f"{t:>{w}}" for t in tiers)]
    lines += [f"  {t:<{w}}" + "".join(f"{v:>{w}}" for v in row) for t, row in zip(tiers, matrix, strict=True)]
    return lines


def render(c: Calibration) -> str:
    counts = ", ".join(f"{t} {sum(c.matrix[i])}" for i, t in enumerate(c.tiers))
    out = [f"examples: {c.examples} ({counts})", "thresholds (calibrated):"]
    out += [f"  {t}: {th:.4f}" for t, th in zip(c.tiers, c.thresholds, strict=True)]
    out.append(
        f"accuracy: {c.accuracy:.3f} (current thresholds {c.current_thresholds}: {c.current_accuracy:.3f})"
    )
    out.append("confusion matrix (rows: labelled tier, columns: routed tier):")
    out += _matrix(c.tiers, c.matrix)
    out.append("set in specgate.yaml under router.tiers[*].threshold")
    return "\n".join(out)
