"""The sampling distribution stays a distribution for every parameter the API admits."""

from __future__ import annotations

import pytest
import torch

from decoding.params import SamplingParams
from decoding.sampling import probs_from_logits

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.0, -1e-3, 5.0, 1e-40]])  # [T=2, V=4], row 0 has a tie


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-38, 1e-6])
def test_tiny_temperature_is_greedy_not_nan(temperature: float) -> None:
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=temperature))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]]))


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-9])
def test_tiny_top_p_keeps_the_most_likely_token(top_p: float) -> None:
    for temperature in (1.0, 1e-45):
        probs = probs_from_logits(LOGITS, SamplingParams(temperature=temperature, top_p=top_p, top_k=3))
        assert torch.isfinite(probs).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(2))
        assert probs[1].argmax() == 2 and probs[1, 2] == 1.0


def test_ordinary_temperature_is_unchanged() -> None:
    probs = probs_from_logits(LOGITS, SamplingParams(temperature=0.7))
    torch.testing.assert_close(probs, (LOGITS / 0.7).softmax(-1))
