"""The CUDA graphs of ``decoding.static``: one per step shape (batch bucket, width, attended length,
slot, prompt-chunk bucket), captured on first use or ahead (``StaticModel.capture``), with the step's
inputs in static buffers that each replay refills. Shapes are bucketed so that a handful of graphs
serve every batch: padding rows and padding chunk tokens write to the pool's scratch slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from decoding.runner import Row, StepRows

if TYPE_CHECKING:
    from decoding.static import StaticModel

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# prompt-chunk tokens a graph has room for, and its most chunks (more, or longer, run eagerly)
CHUNK_BUCKETS = (32, 64, 128, 256, 512)
CHUNK_ROWS = 8


def batch_bucket(n: int) -> int:
    """The graph batch size that holds ``n`` rows (padding rows write to the scratch slot)."""
    return next((b for b in BATCH_BUCKETS if b >= n), n)


def chunk_bucket(n: int) -> int:
    return next(b for b in CHUNK_BUCKETS if b >= n)


def chunk_rows(long: list[Row], n: int, device: torch.device) -> torch.Tensor:
    """The fused chunk kernel's [n, 4] row table of ``long`` (rows past them unused), on ``device``."""
    table, at = [], 0
    for r in long:
        table.append([r.slot, r.start, at, r.tokens.shape[0]])
        at += r.tokens.shape[0]
    table += [[0, 0, 0, 0]] * (n - len(long))
    return torch.tensor(table, dtype=torch.long).to(device, non_blocking=True)


class _Graph:
    """One CUDA graph for a step of B short rows of W tokens (batch bucket, width, attended length,
    slot for a one-row graph else -1) and room for P tokens of prompt chunks after them (up to
    CHUNK_ROWS chunks; their tokens get no logits). Static input buffers in, a static logits buffer
    out: [B * W, V]."""

    def __init__(self, m: StaticModel, B: int, W: int, L: int, slot: int, P: int = 0):
        self.m, self.B, self.W, self.P = m, B, W, P
        with torch.inference_mode():  # as every step's tensors are: compiled code guards on the kind
            self.step = self._buffers(m, B, W, L, m.scratch if slot < 0 else slot, P)
            # the short rows' starts, slots and ids, [2B + B * W]: a replay copies them in (ids from the
            # host in the same copy) and the graph derives each token's position and slot. Each small
            # copy or kernel before a launch costs the host 10-60 us; at the start of a speculative
            # step, after its one sync, the device waits for all of them (bench.probe_host, the H200)
            self.rows = torch.tensor(
                [0] * B + [m.scratch] * B + [0] * B * W, dtype=torch.long, device=m.device
            )
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (compilation, cuBLAS handles, autotuning)
                self._derive()
                m._step(self.step)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=m.pool):
            self._derive()
            self.out = m._step(self.step)

    def _derive(self) -> None:
        """Inside the graph: the short rows' ids, token positions and slots from ``rows``."""
        B, W = self.B, self.W
        if not B:
            return
        starts, slots = self.rows[:B], self.rows[B : 2 * B]
        self.step.ids[: B * W].copy_(self.rows[2 * B :])
        self.step.pos[: B * W].copy_((starts[:, None] + self.m.positions[None, :W]).view(-1))
        if B > 1 or not self.m.per_slot_graphs:  # a one-row graph per slot has its slot baked in
            self.step.slots.copy_(slots)
        self.step.slot_of[: B * W].copy_(slots[:, None].expand(B, W).reshape(-1))

    def _set_rows(self, starts: list[int], slots: list[int], ids: torch.Tensor) -> None:
        """The short rows' starts, slots and ``ids`` [n, W] (host or device); padding rows start at 0
        in the scratch slot. A row shorter than W keeps stale ids after its tokens: they write past
        its length, which nothing reads, and no other row's result depends on them."""
        B, W, n = self.B, self.W, len(starts)
        pad = B - n
        host = torch.tensor([*starts, *([0] * pad), *slots, *([self.m.scratch] * pad)], dtype=torch.long)
        if ids.device.type == "cpu" and ids.shape[1] == W:  # one copy for all of it
            self.rows.copy_(torch.cat([host, ids.reshape(-1), host.new_zeros(pad * W)]), non_blocking=True)
            return
        self.rows[: 2 * B].copy_(host, non_blocking=True)
        self.rows[2 * B :].view(B, W)[:n, : ids.shape[1]].copy_(ids, non_blocking=True)

    @staticmethod
    def _buffers(m: StaticModel, B: int, W: int, L: int, s: int, P: int) -> StepRows:
        N = B * W + P
        step = StepRows(
            ids=torch.zeros(N, dtype=torch.long, device=m.device),
            # warm-up and capture: the scratch slot's start
            pos=torch.cat([m.positions[:W].repeat(B), m.positions[:P]]).clone(),
            slot_of=torch.full((N,), m.scratch, dtype=torch.long, device=m.device),
            batch=B,
            width=W,
            slots=torch.full((B,), m.scratch, dtype=torch.long, device=m.device),
            attn_len=L,
            one_slot=s if B == 1 else None,
            singles=[],
            chunks=torch.zeros(CHUNK_ROWS, 4, dtype=torch.long, device=m.device) if P else None,
            logit_rows=B * W if P else None,
        )
        if B == 1:  # reads the slot's cache as a view; warm-up and capture still write to the scratch slot
            step.slots.fill_(s)
        return step

    def run(self, slots: list[int], starts: list[int], ids: torch.Tensor) -> torch.Tensor:
        """ids [B, W] (host or device), B <= the graph's batch -> logits [B, W, V], a view of the
        graph's buffer."""
        B = ids.shape[0]
        self._set_rows(starts, slots, ids)
        self.graph.replay()
        return self.out.view(self.B, self.W, -1)[:B]

    def replay(self, rows: list[Row], chunks: tuple[Row, ...] | list[Row] = ()) -> torch.Tensor:
        W, n = self.W, len(rows)
        if self.B:
            ids = pad_sequence([r.tokens for r in rows], batch_first=True)  # [n, T]
            self._set_rows([r.start for r in rows], [r.slot for r in rows], ids)
        if self.P:
            self._fill_chunks(chunks)
        self.graph.replay()
        return self.out[: n * W].clone()  # the buffer is overwritten by the next replay

    def _fill_chunks(self, chunks: tuple[Row, ...] | list[Row]) -> None:
        """The chunk region: each chunk's tokens at its positions in its slot, then padding tokens
        that write to the scratch slot; the kernel's row table."""
        m, BW = self.m, self.B * self.W
        used = sum(r.tokens.shape[0] for r in chunks)
        assert used <= self.P and len(chunks) <= CHUNK_ROWS
        pad = self.P - used
        ids = torch.cat([*(r.tokens for r in chunks), m.positions.new_zeros(pad)])
        pos = torch.cat(
            [*(torch.arange(r.start, r.start + r.tokens.shape[0]) for r in chunks), torch.arange(pad)]
        )
        slot_of = torch.cat(
            [*(torch.full((r.tokens.shape[0],), r.slot) for r in chunks), torch.full((pad,), m.scratch)]
        )
        self.step.ids[BW:].copy_(ids)
        self.step.pos[BW:].copy_(pos.to(m.device, non_blocking=True))
        self.step.slot_of[BW:].copy_(slot_of.to(m.device, non_blocking=True))
        assert self.step.chunks is not None
        self.step.chunks.copy_(chunk_rows(list(chunks), CHUNK_ROWS, m.device))
