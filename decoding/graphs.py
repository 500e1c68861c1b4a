"""The CUDA graphs of ``decoding.static``: one per step shape (batch bucket, width, attended length,
slot, prompt-chunk bucket), captured on first use or ahead (``GraphSet.capture``), with the step's
inputs in static buffers that each replay refills. Shapes are bucketed so that a handful of graphs
serve every batch: padding rows and padding chunk tokens write to the pool's scratch slot.

    GraphSet  one model's graphs by shape: which one serves a step (else the step runs eagerly),
              and capturing them ahead of requests
    _Graph    one captured step shape: its static buffers and its replay

A step's shape (width, batch bucket, attended length; exact mode's padding) is decided by
``StaticModel.step_shape``, not here; which widths exact mode may run unpadded is shown with these
graphs by ``decoding.exact``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from decoding.runner import Row, StepRows

if TYPE_CHECKING:
    from decoding.static import StaticModel, StepShape

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# prompt-chunk tokens a graph has room for, and its most chunks (more, or longer, run eagerly)
CHUNK_BUCKETS = (32, 64, 128, 256, 512)
CHUNK_ROWS = 8

Key = tuple[int, int, int, int, int]  # (B, W, L, slot or -1, P): see _Graph


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


class GraphSet:
    """One StaticModel's CUDA graphs by step shape, and which one serves a step: ``replay`` and
    ``run`` return None where none does (graphs off, or prompt chunks a graph cannot hold), and the
    model runs the step eagerly. The model's ``graphs_enabled`` and ``fused_attention`` are read at
    every step (benchmarks switch graphs off and on)."""

    def __init__(self, m: StaticModel):
        self.m = m
        self.captured: dict[Key, _Graph] = {}
        # one memory pool for this model's graphs: they never run concurrently. Not shared across
        # models: freeing one model's graphs must not pull memory from under another's.
        self.pool = torch.cuda.graph_pool_handle() if m.graphs_enabled else None
        # a one-row step's graph per slot (``get``), unless the fused kernel reads its slot from a buffer
        self.per_slot = not m.fused_attention

    def __len__(self) -> int:
        return len(self.captured)

    def __iter__(self) -> Iterator[Key]:
        """The captured shapes' keys (B, W, L, slot, P)."""
        return iter(self.captured)

    def split(self, rows: list[Row]) -> tuple[list[Row], list[Row]]:
        """A step's short rows (decode and verification, batched at one width) and its long rows
        (prompt chunks, and rows that go with them)."""
        m = self.m
        # where prompt chunks run as graphs, a row that wants no logits (a prompt's last few tokens,
        # a draft's catch-up) goes with them whatever its length: among the decode rows it would set
        # the step's width, one more graph shape per width beside each chunk size, captured mid-stream
        chunked = m.graphs_enabled and m.fused_attention
        as_chunk = [r.tokens.shape[0] > m.max_graph_tokens or (chunked and r.logits == "none") for r in rows]
        short = [r for r, c in zip(rows, as_chunk, strict=True) if not c]
        long = [r for r, c in zip(rows, as_chunk, strict=True) if c]
        return short, long

    def replay(self, short: list[Row], long: list[Row], shape: StepShape) -> torch.Tensor | None:
        """``forward_rows``'s step as a graph: logits [N, V] (short rows first at ``shape.width``);
        None where no graph serves it."""
        if short and not long and self.m.graphs_enabled:
            return self.get(shape.bucket, shape.width, shape.attn_len, short[0].slot).replay(short)
        if long and self._chunks_fit(long):
            # prompt chunks beside decode rows, as a graph too: eager, such a step costs the host
            # several times what it costs the device (bench.probe_prefill)
            B = batch_bucket(len(short)) if short else 0  # the plain bucket: no exact_min_rows here
            P = chunk_bucket(sum(r.tokens.shape[0] for r in long))
            return self.get(B, shape.width if B else 0, 0, -1, P).replay(short, long)
        return None

    def run(
        self, shape: StepShape, slots: list[int], starts: list[int] | torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor | None:
        """``forward_batch``'s step as a graph: ids [B, W] -> logits [B, W, V], a view of the
        graph's buffer; None where graphs are off."""
        if not self.m.graphs_enabled:
            return None
        return self.get(shape.bucket, shape.width, shape.attn_len, slots[0]).run(slots, starts, ids)

    def get(self, B: int, W: int, L: int, first_slot: int, P: int = 0) -> _Graph:
        """The graph of a step shape, captured on first use: B short rows of W tokens and room for
        P tokens of prompt chunks. A one-row graph without the fused kernel reads its slot's cache
        as a view baked into the graph, so it is one graph per slot."""
        key = (B, W, L, first_slot if B == 1 and self.per_slot else -1, P)
        graph = self.captured.get(key)
        if graph is None:
            graph = self.captured[key] = _Graph(self, B, W, L, key[3], P)
        return graph

    def _chunks_fit(self, long: list[Row]) -> bool:
        """Whether a step's prompt chunks run in a captured graph: with the fused kernels, no
        logits wanted of them, and within the largest chunk bucket."""
        return (
            self.m.graphs_enabled
            and self.m.fused_attention
            and len(long) <= CHUNK_ROWS
            and all(r.logits == "none" for r in long)
            and sum(r.tokens.shape[0] for r in long) <= CHUNK_BUCKETS[-1]
        )

    def capture(
        self, token_counts: range, batch_sizes: tuple[int, ...] = (1,), chunk_tokens: tuple[int, ...] = ()
    ) -> None:
        """Capture graphs ahead of the first request (otherwise on first use): every width in
        ``token_counts`` (exact: the exact width) for each batch bucket, at the shortest context;
        and those steps with prompt chunks of every bucket up to the largest of ``chunk_tokens``."""
        m = self.m
        if not m.graphs_enabled:
            return
        # every bucket up to each size: a prompt's last chunk is shorter than the budget
        top = max((chunk_bucket(P) for P in chunk_tokens), default=0) if m.fused_attention else 0
        chunks = {b for b in CHUNK_BUCKETS if b <= top}
        for P in chunks:  # prompt chunks alone
            self.get(0, 0, 0, -1, P)
        for B in batch_sizes:
            if m.exact:  # exact mode: the widths its steps run at (step_shape), once they are shown
                m.widths.prove(B)
            for W in {m.widths.width(B, W) if m.exact else W for W in token_counts}:
                self.get(B, W, m.step_shape(B, W, 0, m.exact).attn_len, m.scratch)
                for P in chunks:
                    self.get(B, W, 0, -1, P)

    def capture_serving(self, rows: int) -> int:
        """Capture every graph a server's steps of up to ``rows`` rows use, ahead of its requests
        (on first use each is a stall mid-stream: 100-140 ms for the 7B-shaped target on the H200):
        one-token rows beside prompt chunks of every bucket (such rows decode plainly,
        Engine._plain_beside_prompts; in exact mode at the width a one-token step runs at), then
        every verification width alone, in each batch bucket up to ``rows``. Returns how many were
        captured."""
        before = len(self.captured)
        buckets = tuple(b for b in BATCH_BUCKETS if b <= batch_bucket(rows))
        self.capture(range(1, 2), buckets, chunk_tokens=(CHUNK_BUCKETS[-1],))
        self.capture(range(2, self.m.max_graph_tokens + 1), buckets)
        return len(self.captured) - before

    @torch.inference_mode()  # as every step's tensors are: the graphs' buffers are inference tensors
    def time_replays(self, reps: int = 5) -> dict[tuple[int, int], float]:
        """Device seconds of a replay of each captured step of short rows alone, by (batch bucket,
        width), and of prompt chunks alone, by (0, chunk tokens): the start-up cost table
        (``StaticModel.time_steps``). Each graph replays ``reps`` times on the scratch slot (its
        rows reset there first: a graph used in serving still holds a live row's slot and start,
        which a replay would overwrite) and counts its median. At the shortest context, so a long
        context's attention is not in it, nor is the host's work around a step: the engine's
        measured steps replace these as they run (``BatchCosts.seed``). Not while requests run:
        the replays share the graphs' buffers."""
        events: dict[tuple[int, int], list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        for (B, W, _, slot, P), g in self.captured.items():
            shape = (B, W) if B else (0, P)  # short rows, or prompt chunks alone (P tokens)
            if (B and P) or shape in events or slot not in (-1, self.m.scratch):
                continue  # rows beside chunks; a one-row graph per slot writes to its slot: the scratch one's
            if B:
                g._set_rows([], [], torch.zeros(0, W, dtype=torch.long))
            else:
                g._fill_chunks(())
            events[shape] = [_timed(g.graph.replay) for _ in range(reps)]
        torch.cuda.synchronize()
        return {
            shape: sorted(s.elapsed_time(e) for s, e in pairs)[reps // 2] / 1e3
            for shape, pairs in events.items()
        }


def _timed(work: Callable[[], None]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """``work`` queued between two timing events (read them after a sync)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    return start, end


class _Graph:
    """One CUDA graph for a step of B short rows of W tokens (batch bucket, width, attended length,
    slot for a one-row graph else -1) and room for P tokens of prompt chunks after them (up to
    CHUNK_ROWS chunks; their tokens get no logits). Static input buffers in, a static logits buffer
    out: [B * W, V]."""

    def __init__(self, owner: GraphSet, B: int, W: int, L: int, slot: int, P: int = 0):
        m = owner.m
        self.m, self.B, self.W, self.P = m, B, W, P
        self.per_slot = owner.per_slot
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
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=owner.pool):
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
        if B > 1 or not self.per_slot:  # a one-row graph per slot has its slot baked in
            self.step.slots.copy_(slots)
        self.step.slot_of[: B * W].copy_(slots[:, None].expand(B, W).reshape(-1))

    def _set_rows(self, starts: list[int] | torch.Tensor, slots: list[int], ids: torch.Tensor) -> None:
        """The short rows' starts (host, or device [n]), slots and ``ids`` [n, W] (host or device);
        padding rows start at 0 in the scratch slot. A row shorter than W keeps stale ids after its
        tokens: they write past its length, which nothing reads, and no other row's result depends on
        them."""
        B, W, n = self.B, self.W, len(starts)
        pad = B - n
        if isinstance(starts, torch.Tensor):  # the device's: copies on the device, the slots from the host
            self.rows[: 2 * B].copy_(
                torch.tensor([0] * B + [*slots, *([self.m.scratch] * pad)], dtype=torch.long),
                non_blocking=True,
            )
            self.rows[:n].copy_(starts)
            self.rows[2 * B :].view(B, W)[:n, : ids.shape[1]].copy_(ids)
            return
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

    def run(self, slots: list[int], starts: list[int] | torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
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
