"""Exact mode's step widths (docs/architecture.md, Exact mode): which widths a static model's steps
may run at and still round every row as the exact width (``max_graph_tokens``) does, shown on the
device by a probe through the model's CUDA graphs, bucket by bucket; a width not shown pads.

    ExactWidths  one model's shown widths: ``prove`` (at capture), ``width`` (every exact step),
                 ``padding`` (how the batch cost model prices verifications)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from decoding.static import StaticModel

# the probe (ExactWidths.prove): tokens each row decodes at every width, and logits compared of each
PROOF_TOKENS = 36
PROOF_LOGITS = 4096


def agrees(reference: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether a probe decoded at a narrower width gave the exact width's logits, bit for bit
    (``ExactWidths.prove``)."""
    return torch.equal(logits, reference)


class ExactWidths:
    """A StaticModel's exact-mode widths by batch bucket: those its graphs showed to compute each row
    as the exact width's do (``prove``); a bucket not shown pads every row to the exact width."""

    def __init__(self, m: StaticModel):
        self.m = m
        self.proven: dict[int, tuple[int, ...]] = {}

    def width(self, bucket: int, widest: int) -> int:
        """The width an exact step of ``bucket`` rows, the widest ``widest`` tokens, runs every row
        at: the narrowest shown to round as the exact width does, else the exact width. Eager steps
        (graphs off) always pad: what was shown is the graphs' kernels."""
        proven = self.proven.get(bucket, ()) if self.m.graphs_enabled else ()
        return min((w for w in proven if w >= widest), default=self.m.max_graph_tokens)

    def own_compile(self, rows: int, width: int) -> bool:
        """Whether a step of ``rows`` x ``width`` tokens runs compiled code of its own: one token in
        all is compiled for N = 1, every other count shares one dynamic compile
        (``StaticModel._forward``). Such a step is never taken as shown: on the H200 a one-token
        step matched a one-token probe and parted from verification rows at a tie."""
        return self.m.compiled and rows * width == 1

    @property
    def padding(self) -> int:
        """The width exact verifications are priced at whatever their k (``BatchCosts.padded_width``):
        0 where every bucket shown runs every verification width (2..``max_graph_tokens``)
        unpadded, else ``max_graph_tokens``."""
        X = self.m.max_graph_tokens
        every = set(range(2, X + 1))
        proven = self.proven.values()
        return 0 if proven and all(every <= set(ws) for ws in proven) else X

    @torch.inference_mode()
    def prove(self, B: int) -> tuple[int, ...]:
        """Exact mode's widths for steps of batch bucket ``B``: the exact width (``max_graph_tokens``,
        where every row of every step ran before), and each narrower width whose graph computes the
        same bits for every token, shown here by decoding one probe at both widths.

        Exact mode needs a verification row to round as a one-token row does, so that greedy
        speculation emits what plain decoding does. Padding every row to one width guarantees it
        at the price of computing the padding: at 16-64 rows on the H200's 7B shape exact mode
        decoded at 0.43-0.82x of fast mode (docs/benchmarks.md). Whether a narrower step rounds the
        same is a property of the kernels its shape selects (cuBLAS picks its GEMM by M), not of the
        numbers in it, so a probe per shape settles it for this device, library and model. The
        probe must be long: a kernel that sums in another order moves a float32 sum by an ulp or
        so, which changes a bf16 value only near a rounding boundary, and on the H200 a one-token
        probe matched where decoding later parted at a tie. So each row decodes PROOF_TOKENS
        tokens, in steps of the exact width and then of the narrower one, and the logits of every
        token must match (their first PROOF_LOGITS columns: a changed hidden state moves nearly
        every logit). Rows are on free slots and the scratch slot, rows sharing a slot the same
        tokens (they write the same K/V there). A width that is not shown keeps padding, to the
        narrowest wider width that is (``width``); one that runs other compiled code than the rest
        (``own_compile``) is never shown. Before requests: the replays use the graphs' buffers."""
        m = self.m
        X = m.max_graph_tokens
        if not (m.graphs_enabled and m.fused_attention):  # no graphs to show it with: pad
            return (X,)
        if B in self.proven:
            return self.proven[B]
        taken: list[int] = []
        try:
            while len(taken) + 1 < B and m.free_slots:
                taken.append(m.acquire())
            slots = [*taken, m.scratch]
            rows = [slots[b % len(slots)] for b in range(B)]
            L = min(PROOF_TOKENS, m.cache_len - X)
            gen = torch.Generator().manual_seed(B)
            ids = torch.randint(0, m.embed.shape[0], (len(slots), L + X), generator=gen)
            ids = ids[[b % len(slots) for b in range(B)]]  # [B, L + X]

            def decode(w: int) -> torch.Tensor:  # [B, L, PROOF_LOGITS]: the probe in steps of w
                g = m.graphs.get(B, w, 0, m.scratch)
                outs = [
                    g.run(rows, [s] * B, ids[:, s : s + w].contiguous())[..., :PROOF_LOGITS].clone()
                    for s in range(0, L, w)
                ]
                return torch.cat(outs, dim=1)[:, :L]

            ref = decode(X)
            shown = [w for w in range(1, X) if not self.own_compile(B, w) and agrees(ref, decode(w))]
        finally:
            for slot in taken:
                m.release(slot)
        self.proven[B] = (*shown, X)
        return self.proven[B]
