"""A draft's vocabulary inside its target's: one tokenizer, logits of different widths (issue 53)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from decoding.sequence import LoadedModel


@dataclass(frozen=True)
class VocabFit:
    """A draft whose logits differ in width from its target's, or either's pass the tokenizer's ids
    (Qwen2.5-0.5B's 151,936 beside the 7B's 152,064 and the tokenizer's 151,665: the extra rows are
    padding no token maps to; issue 53). The draft proposes
    only ``shared`` ids, the real tokens both models have; its p is widened to the target's width with
    zeros past them; the target's own distribution is never narrowed (docs/architecture.md, "Draft and
    target vocabularies")."""

    draft: int  # the draft's logits width: the ids its embeddings hold
    target: int  # the target's logits width: what p must span for verification
    shared: int  # ids below it are tokens of both models' tokenizer; the draft proposes only these

    def narrow(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [..., draft] over the ids it may propose [..., shared] (a view)."""
        return logits[..., : self.shared] if self.shared < logits.shape[-1] else logits

    def widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits [..., draft] at the target's width [..., target], -inf past ``shared``:
        penalties, logit_bias and the grammar's mask (all sized for the target) then apply as they
        are, and p is zero at every id the draft may not propose."""
        if self.shared == self.draft == self.target:
            return logits
        pad = logits.new_full((*logits.shape[:-1], self.target - self.shared), float("-inf"))
        return torch.cat([logits[..., : self.shared], pad], -1)

    def feedable(self, tokens: list[int]) -> list[int]:
        """``tokens`` as the draft can embed them: a padding id of a wider target (random weights give
        them mass; the target's output keeps them) becomes the draft's own last row, which costs the
        draft's guesses a while, never correctness."""
        if self.target <= self.draft:
            return tokens
        top = self.draft - 1
        return [min(t, top) for t in tokens]

    def feedable_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``feedable`` for a tensor of ids on the device."""
        return ids if self.target <= self.draft else ids.clamp_max(self.draft - 1)


def vocab_fit(target: LoadedModel, draft: LoadedModel) -> VocabFit | None:
    """How ``draft``'s vocabulary sits in ``target``'s (None: the same width, every id a token).
    The draft proposes only the ids of real tokens that both have rows for; the target's logits stay
    as they are, padding included, so its distribution is its own (see VocabFit)."""
    shared = min(target.vocab_size, draft.vocab_size, target.token_ids)
    if target.vocab_size == draft.vocab_size == shared:
        return None
    return VocabFit(draft=draft.vocab_size, target=target.vocab_size, shared=shared)
