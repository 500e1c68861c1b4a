"""The decoding rows of one batched step, described once (after vLLM's ``SpecDecodeMetadata``):
built by the engine, read by the model runner and the verifier."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

PAD_DRAFT = -1  # a drafted-token slot past a row's k: equal to no token, so never accepted


@dataclass
class DecodeBatch:
    """B rows, each [pending, d_1..d_k_b] padded to W = 1 + max k_b tokens."""

    ids: torch.Tensor  # [B, W] token ids fed to the target (padding: 0)
    drafts: torch.Tensor  # [B, W-1] drafted tokens (padding: PAD_DRAFT)
    n_drafts: list[int]  # [B] k_b, drafted tokens per row (host)

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @classmethod
    def build(
        cls,
        pending: list[int],  # [B] each row's last committed token, not yet in its cache
        proposals: list[torch.Tensor | None],  # [k_b] drafted tokens per row (None: none)
        device: torch.device,
    ) -> DecodeBatch:
        B = len(pending)
        pend = torch.tensor(pending, dtype=torch.long).to(device, non_blocking=True)  # [B]
        n_drafts = [0 if p is None else int(p.shape[0]) for p in proposals]
        if max(n_drafts, default=0) == 0:
            return cls(pend[:, None], pend.new_zeros(B, 0), n_drafts)
        empty = pend.new_zeros(0)
        rows = [empty if p is None else p for p in proposals]
        drafts = pad_sequence(rows, batch_first=True, padding_value=PAD_DRAFT)  # [B, K]
        ids = torch.cat([pend[:, None], drafts.clamp_min(0)], dim=1)  # [B, K+1]
        return cls(ids, drafts, n_drafts)
