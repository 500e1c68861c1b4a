"""The verifiers on hand-made logits, with literal expected tokens, and the distribution they produce."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from decoding.verify import verify_greedy, verify_sampling

V = 8


def emitted(result: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, list[int]]:
    n, tokens = result
    return int(n), tokens[: int(n) + 1].tolist()


def logits_for(argmaxes: list[int]) -> torch.Tensor:
    x = torch.zeros(len(argmaxes), V)
    for i, t in enumerate(argmaxes):
        x[i, t] = 5.0
    return x


def test_greedy_accepts_all_and_adds_bonus():
    n, out = emitted(verify_greedy(torch.tensor([3, 1, 4]), logits_for([3, 1, 4, 7])))
    assert n == 3
    assert out == [3, 1, 4, 7]


def test_greedy_stops_at_first_disagreement_and_corrects():
    n, out = emitted(verify_greedy(torch.tensor([3, 1, 4]), logits_for([3, 2, 4, 7])))
    assert n == 1
    assert out == [3, 2]  # the later agreement at position 2 must not count


def test_greedy_with_no_draft_is_plain_decoding():
    assert emitted(verify_greedy(torch.zeros(0, dtype=torch.long), logits_for([5]))) == (0, [5])


def one_hot_probs(rows: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(rows), V).float()


def test_sampling_accepts_when_target_agrees_with_certainty():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([2, 6])
    n, out = emitted(verify_sampling(draft, one_hot_probs([2, 6]), one_hot_probs([2, 6, 1]), g))
    assert n == 2
    assert out == [2, 6, 1]  # bonus token from q at position k


def test_sampling_rejects_a_token_the_target_never_picks():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([2, 6])
    target = one_hot_probs([2, 3, 1])  # q(6) = 0 at position 1
    n, out = emitted(verify_sampling(draft, one_hot_probs([2, 6]), target, g))
    assert n == 1
    assert out == [2, 3]  # recovered token from norm(max(0, q - p)) = one-hot(3)


def test_sampling_residual_excludes_the_rejected_token():
    # q uniform over {0, 1}, p certain of 0: on rejection the residual is exactly one-hot(1)
    q = torch.zeros(2, V)
    q[0, :2] = 0.5
    q[1, 4] = 1.0
    p = one_hot_probs([0])
    for seed in range(20):
        n, out = emitted(verify_sampling(torch.tensor([0]), p, q, torch.Generator().manual_seed(seed)))
        assert out in ([0, 4], [1])
        assert n == (1 if out == [0, 4] else 0)


def test_deterministic_drafter_is_verified_as_one_hot():
    q = torch.zeros(2, V)
    q[0, 5] = 1.0
    q[1, 0] = 1.0
    assert emitted(verify_sampling(torch.tensor([5]), None, q, torch.Generator().manual_seed(0))) == (
        1,
        [5, 0],
    )
    assert emitted(verify_sampling(torch.tensor([3]), None, q, torch.Generator().manual_seed(0))) == (0, [5])


def _first_token_histogram(p: torch.Tensor, q: torch.Tensor, draws: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    hist = torch.zeros(V)
    for _ in range(draws):
        d = torch.multinomial(p[0], 1, generator=g)
        _, out = emitted(verify_sampling(d, p[:1], q, g))
        hist[out[0]] += 1
    return hist


def test_rejection_sampling_reproduces_the_target_distribution():
    """Chi-square: the first emitted token follows q whatever p proposes (Leviathan et al., thm. 1)."""
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(2, V) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V) * 1.5, -1)
    draws = 20000
    hist = _first_token_histogram(p, q, draws)
    expected = (q[0] * draws).numpy()
    stat = chisquare(hist.numpy(), expected)
    assert stat.pvalue > 1e-3, f"emitted tokens do not follow q: {hist.tolist()} vs {expected.tolist()}"
    # and they clearly do not follow p (the test has power)
    assert chisquare(hist.numpy(), (p[0] * draws).numpy()).pvalue < 1e-6


def test_seeded_verification_is_deterministic():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(4, V), -1)
    q = torch.softmax(torch.randn(5, V), -1)
    d = torch.tensor([1, 2, 3, 4])
    a = emitted(verify_sampling(d, p, q, torch.Generator().manual_seed(7)))
    b = emitted(verify_sampling(d, p, q, torch.Generator().manual_seed(7)))
    assert a == b
