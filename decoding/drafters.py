"""Proposers of draft tokens. The engine verifies whatever a drafter proposes, so a drafter can only
cost speed, never correctness.

Both drafters see the whole committed sequence (prompt + generated) on every call and keep their
own state in step with it: the draft model's KV cache catches up on tokens it has not seen (the
bonus token, tokens from plain steps) and is cut back to what verification kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from decoding.params import SamplingParams
from decoding.runner import SequenceRunner
from decoding.sampling import apply_penalties, probs_from_logits, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k'] with k' <= k; may be empty
    probs: torch.Tensor | None  # [k', V] draft distribution p; None for a deterministic drafter


class Drafter(Protocol):
    name: str

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,  # [V] completion-token counts, for penalties
        generator: torch.Generator | None,
    ) -> Proposal: ...

    def catch_up(self, tokens: list[int]) -> None:
        """Absorb a backlog of unseen tokens (the prompt, tokens from plain steps) ahead of a proposal,
        so that the proposal's own cost is what it costs in steady state."""
        ...

    def rollback(self, valid: int) -> None:
        """Only the first ``valid`` tokens of the sequence seen so far are still right."""
        ...

    def release(self) -> None: ...


class DraftModelDrafter:
    """A small causal LM sharing the target's vocabulary, sampled autoregressively k times."""

    name = "draft"

    INLINE = 2  # unseen tokens a proposal feeds itself (after a full acceptance: d_k and the bonus)

    def __init__(self, runner: SequenceRunner, device: torch.device, min_confidence: float = 0.0):
        self.runner = runner
        self.device = device
        # Stop drafting after a token the draft itself gave less than this probability (as
        # transformers' assisted generation does): past such a token the next ones are rarely
        # accepted, and their draft steps are wasted. Reading the probability is a host sync per
        # drafted token, which a CPU does anyway and a GPU pays as a launch gap (see Engine).
        self.min_confidence = min_confidence

    def catch_up(self, tokens: list[int]) -> None:
        if len(tokens) - self.runner.length > self.INLINE:
            self.runner.forward(tokens[self.runner.length : -1], logits=False)

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Proposal:
        assert self.runner.length < len(tokens), "draft cache ran ahead of the sequence"
        logits = self.runner.forward(tokens[self.runner.length :])
        assert logits is not None
        row = logits[-1:]  # [1, V]
        counts = counts.clone() if params.penalised else counts  # counts exist for penalties alone
        drafted: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            row = apply_penalties(row, counts, row.new_zeros(0, dtype=torch.long), params)
            check = i < k - 1 and self.min_confidence > 0  # is there a next draft step to skip?
            if params.greedy:
                tok = row.argmax(-1)  # [1]
                confidence = row.float().softmax(-1).max() if check else None
            else:
                p = probs_from_logits(row, params)  # [1, V]
                tok = sample(p, generator)
                probs.append(p[0])
                confidence = p[0, tok] if check else None
            drafted.append(tok)
            if params.penalised:
                counts[tok] += 1
            if confidence is not None and float(confidence) < self.min_confidence:
                break  # the unsure token is still proposed: verifying it costs a row, not a step
            if i < k - 1:
                out = self.runner.forward(tok)  # stays on the device (no sync unless min_confidence)
                assert out is not None
                row = out[-1:]
        toks = torch.cat(drafted) if drafted else torch.zeros(0, dtype=torch.long, device=self.device)
        return Proposal(toks, torch.stack(probs) if probs else None)

    def rollback(self, valid: int) -> None:
        self.runner.crop(min(self.runner.length, valid))

    def release(self) -> None:
        self.runner.release()


class PromptLookupDrafter:
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the sequence's last
    n tokens (n from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.
    Deterministic, so verification treats its proposal as p = one-hot."""

    name = "ngram"

    def __init__(self, device: torch.device, max_ngram: int = 3, min_ngram: int = 1):
        self.device = device
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Proposal:
        found = lookup_ngram(np.asarray(tokens, dtype=np.int64), k, self.max_ngram, self.min_ngram)
        return Proposal(torch.tensor(found, dtype=torch.long, device=self.device), None)

    def catch_up(self, tokens: list[int]) -> None:
        pass

    def rollback(self, valid: int) -> None:
        pass

    def release(self) -> None:
        pass


def lookup_ngram(seq: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching suffix n-gram."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = seq[L - n :]
        # windows starting at 0..L-n-1: every n-gram that is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []
