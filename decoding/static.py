"""The fast path: a static KV cache and our own decoder-layer forward for Llama/Qwen2-family models,
with each step shape captured once as a CUDA graph and, optionally, each layer compiled by inductor.

After gpt-fast: the cache is indexed by position, so a rejected draft's slots are simply overwritten
by the next step and "cutting back" is setting a length. Shapes never change, so the draft's 1-token
step and the target's (k+1)-token verification replay as CUDA graphs with no per-kernel launch cost.

At batch 1 a step's cost is its kernel count as much as its bytes (a small draft's weights stream
through memory faster than eager HF code launches its many kernels; docs/benchmarks.md has the
kernels per step), so the forward is written for few kernels rather than through the HF modules:
  - q/k/v and gate/up are each one matmul over weights concatenated once at load (as vLLM's
    QKVParallelLinear and MergedColumnParallelLinear do); the HF modules' parameters become views of
    the fused tensors, so memory is not doubled and the HF model still runs as before;
  - ``compile_step`` compiles one decoder layer (every layer shares the compiled code, so compile
    time is one layer's, not the model's): inductor fuses RMSNorm, RoPE, the SiLU gate and the
    residual adds into a few kernels. T = 1 is compiled static; T >= 2 (verification, prefill) once
    with T dynamic.

The layer's math and the weight fusion are ``decoding.layers``; the graphs (which one serves a step,
capturing them, their buffers and buckets) ``decoding.graphs``. This module holds the KV pool, the
forward pass, the batching of rows into one step, and each step's shape: ``StaticModel.step_shape``
is where exact mode's padding is decided.

    StaticModel   one model: fused weights, KV cache for ``slots`` sequences, RoPE tables, the forward
                  pass; its graphs are a GraphSet (``StaticModel.graphs``)
    StepShape     a step's short rows as they run: graph batch bucket, width, attended length
    StaticRunner  one sequence on one slot (the SequenceRunner the engine drives)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from decoding import invariant, kernels
from decoding.exact import ExactWidths
from decoding.graphs import GraphSet, batch_bucket, chunk_rows
from decoding.layers import (
    TORCH_OPS,
    Dims,
    Ops,
    attend,
    attention_out,
    check_supported,
    layer_boundary,
    layer_entry,
    layer_weights,
)
from decoding.runner import EXACT_WIDTH, FreeSlots, PooledSlots, Row, SlotRunner, StepRows, Tokens, as_ids

# cuBLAS runs a decode step's skinny GEMMs (M = the step's rows: a few to a few dozen) as split-K
# kernels where it has a workspace: a partial product and a reduce, two kernels a GEMM, and how K is split
# follows M, so a verification row (M = B x (k+1)) rounds apart from the same row in a 1-token step.
# Without a workspace cuBLAS cannot split K. On the H200 (bench.profile_step, bench.gpu_batch --quick,
# 2026-12-02 ~21:10 UTC) the 7B-shaped target's 1-token step went from 4.98 to 4.64 ms (355 -> 298
# kernels), the 0.5B draft's stayed at 1.32-1.34 ms, plain decode at N = 16 went from 3070 to 3140
# tok/s, and greedy speculation in fast mode came out identical to plain decoding at N = 4 and 16
# (before, 15 of 16 rows parted from it at bf16 ties, and the replay's drafts stopped matching).
NO_SPLIT_K = {"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"}


def without_split_k() -> dict[str, str]:
    """Ask cuBLAS for kernels without a workspace, so without split-K, unless the environment sizes
    the workspace itself. torch reads these once, at the process's first cuBLAS call: call this
    before any matmul on the GPU. Returns what it set."""
    unset = {k: v for k, v in NO_SPLIT_K.items() if k not in os.environ}
    os.environ.update(unset)
    return unset


# Dynamo settings for the compiled layer, applied only around our own calls:
#  - no automatic dynamic shapes: the draft and target share the layer's code, and a second model's
#    different hidden size must get its own static compile, not turn D into a symbol for both;
#  - a recompile limit that fits several models x {T=1, T dynamic}.
_DYNAMO: dict[str, Any] = dict(automatic_dynamic_shapes=False, recompile_limit=64)


class StepShape(NamedTuple):
    """A step's short rows as they run (``StaticModel.step_shape``); a graph's key is made of them."""

    bucket: int  # the graph batch that holds them (padding rows write to the scratch slot)
    width: int  # W tokens per row, padding included
    attn_len: int  # cache positions they attend over; 0 under the fused kernel (each row its own length)


class StaticModel(PooledSlots):
    """One model's weights, a KV pool of ``slots`` sequences (plus a scratch slot that padding rows
    write to), RoPE tables, and the forward pass over several sequences at once."""

    device_starts = True  # forward_batch places rows from a device tensor of starts too

    def __init__(
        self,
        model: PreTrainedModel,
        max_len: int,
        slots: int = 1,
        graphs: bool = True,
        max_graph_tokens: int = EXACT_WIDTH,
        compile_step: bool = False,
        exact: bool = False,
        batch_invariant: bool = False,
    ):
        check_supported(model, max_len)
        cfg = model.config
        self.model = model
        self.device = model.device
        self.dtype = next(model.parameters()).dtype
        self.max_len = max_len
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        attn0 = model.model.layers[0].self_attn
        self.dims = Dims(
            n_heads=cfg.num_attention_heads,
            n_kv=cfg.num_key_value_heads,
            head_dim=head_dim,
            eps=float(cfg.rms_norm_eps),
            scale=float(getattr(attn0, "scaling", head_dim**-0.5)),
            gqa=bool(cfg.num_key_value_heads != cfg.num_attention_heads),
        )
        with torch.inference_mode():
            self.weights = layer_weights(model)
        self.embed = model.model.embed_tokens.weight.detach()
        self.norm = model.model.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.slots = slots
        self.scratch = slots  # the slot padding rows of a batch write to
        # K and V per layer: [slots + 1, cache_len, kv_heads, head_dim]. A step writes every token's
        # K/V with one index_put_ per layer and reads a row's cache as a view (one row) or a gather
        # (a batch). cache_len leaves room for a padded step at the end of a full sequence and is a
        # multiple of 16 so attention's additive mask needs no padding copy.
        self.cache_len = -(-(max_len + max_graph_tokens) // 16) * 16
        shape = (slots + 1, self.cache_len, self.dims.n_kv, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.weights]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.weights]
        pos = torch.arange(self.cache_len, device=self.device)
        with torch.inference_mode():
            # the model's own rotary embedding: scaling variants (YaRN, linear, ...) come for free
            probe = torch.zeros(1, head_dim, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(probe, pos[None])  # [1, cache_len, hd]
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [cache_len, hd]
        self.positions = pos  # [cache_len]
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.max_graph_tokens = max_graph_tokens
        # exact mode: every short step of a row runs at one width, max_graph_tokens, or a narrower one
        # the device showed to round alike (decoding.exact; without the fused kernel, over the whole
        # cache; see step_shape and docs/architecture.md, Exact mode). Drafters never need it.
        self.exact = exact
        # batch-invariant exact mode (CUDA, opt-in): every matmul and RMSNorm through kernels whose rows
        # do not depend on the rest of the batch (decoding/invariant.py); else torch's (cuBLAS). Opt-in
        # as vLLM's and SGLang's are: on the 7B shape it halves exact mode's throughput at 16 rows
        # (docs/benchmarks.md, gpu-batch)
        self.batch_invariant = exact and batch_invariant and invariant.available(self.device)
        # exact mode: a graph step holds at least this many rows (padding to the scratch slot), so a
        # batch that shrinks below it keeps its GEMMs' M and with it cuBLAS's kernel choice (step_shape)
        self.exact_min_rows = 1
        # else torch's, with a small model's long-K projections split on CUDA (invariant.split_k_ops)
        self.ops: Ops = (
            invariant.OPS
            if self.batch_invariant
            else invariant.split_k_ops(self.device)
            if invariant.available(self.device)
            else TORCH_OPS
        )
        self._free = FreeSlots(slots)
        # short rows attend straight from the pool with one Triton kernel where it runs (CUDA):
        # no gather, no mask, no graph per attended length, and batch-invariant (decoding/kernels.py)
        self.fused_attention = kernels.available(self.device, head_dim)
        self.tile = (
            kernels.block_m(max_graph_tokens, self.dims.n_heads // self.dims.n_kv)
            if self.fused_attention
            else 0
        )
        self.graphs = GraphSet(self)  # after fused_attention: one-row graphs per slot without it
        self.widths = ExactWidths(self)  # exact mode's widths, shown through the graphs at capture
        self.compiled = compile_step
        self._entry: Callable[..., torch.Tensor] = layer_entry
        self._between: Callable[..., tuple[torch.Tensor, torch.Tensor]] = layer_boundary
        self._out: Callable[..., torch.Tensor] = attention_out
        if compile_step:
            # our CUDA graphs are the graphs: inductor's own (mode="reduce-overhead") are not used.
            # Attention stays outside the compiled code: its shapes vary by row, the rest is per token.
            # Between two attentions is one region (layer_boundary): the residual add fuses into the
            # next RMSNorm and the K/V write into RoPE's kernel.
            self._entry = torch.compile(layer_entry, fullgraph=True, dynamic=False)
            self._between = torch.compile(layer_boundary, fullgraph=True, dynamic=False)
            self._out = torch.compile(attention_out, fullgraph=True, dynamic=False)
        self.step_override: Callable[..., torch.Tensor] | None = (
            None  # another compiler's whole step for one row (trt.py)
        )
        # device seconds of a step of short rows by (batch bucket, width), timed at start-up
        # (``time_steps``); empty where nothing was timed (no graphs: a CPU)
        self.step_costs: dict[tuple[int, int], float] = {}

    # ---- slots (free_slots, acquire, release: PooledSlots) -------------------------------------

    def runner(self, _model: PreTrainedModel | None = None, exact: bool | None = None) -> StaticRunner:
        """The engine's runner factory (the argument is the HF model, already known here)."""
        return StaticRunner(self, self.acquire(), self.exact if exact is None else exact)

    def draft_runner(self, _model: PreTrainedModel | None = None) -> StaticRunner:
        """A drafter's runner: never padded (its rounding changes proposals, never the output)."""
        return self.runner(exact=False)

    # ---- a step's shape: exact mode's padding, decided here -----------------------------------

    def step_shape(self, rows: int, widest: int, last_start: int, exact: bool) -> StepShape:
        """The shape a step's short rows run at: ``rows`` of them, the widest ``widest`` tokens long,
        the largest start ``last_start``. Exact mode's padding is decided here (docs/architecture.md,
        Exact mode): every row at ``widths.width``, a graph of short rows alone at least
        ``exact_min_rows`` rows, attention over the whole cache."""
        bucket = batch_bucket(max(rows, self.exact_min_rows) if exact else rows)
        W = self.widths.width(bucket, widest) if exact else widest
        if self.fused_attention:  # it reads each row up to its own length: no graph per attended length
            return StepShape(bucket, W, 0)
        return StepShape(bucket, W, self.cache_len if exact else self._attn_len(last_start + W))

    @property
    def exact_padding(self) -> int:
        """What the engine's cost model reads (``engine._padded_width``): ``ExactWidths.padding``."""
        return self.widths.padding

    def _attn_len(self, end: int) -> int:
        """Cache positions a step attends over outside exact mode: the smallest power of two from 256
        that holds ``end``."""
        return min(self.cache_len, max(256, 1 << (end - 1).bit_length()))

    # ---- the forward pass ---------------------------------------------------------------------

    def _forward(self, step: StepRows) -> torch.Tensor:
        """Hidden states [N, D] of every token of ``step``; writes their K/V into the pool."""
        x = F.embedding(step.ids, self.embed)  # [N, D]
        cos, sin = self.cos[step.pos], self.sin[step.pos]  # [N, hd]
        slot_of, pos = step.slot_of, step.pos
        if self.compiled and step.ids.shape[0] > 1:
            # one compile serves every token count > 1 (N = 1 stays static)
            for t in (x, cos, sin, slot_of, pos):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        H, hd = self.dims.n_heads, self.dims.head_dim
        B, W, L = step.batch, step.width, step.attn_len
        keys = self.positions[:L]
        batch_mask = None
        if B and not self.fused_attention:  # [B, 1, W, L] additive: each query sees its row up to itself
            p = step.pos[: B * W].view(B, W)
            batch_mask = self._mask(keys[None, None, None, :] > p[:, None, :, None])
        masks: list[torch.Tensor] = []
        off = B * W
        for _, T, Lp in step.singles:
            p = step.pos[off : off + T]
            masks.append(self._mask(self.positions[:Lp][None, None, None, :] > p[None, None, :, None]))
            off += T
        n = len(self.weights)
        q = self._entry(
            x, cos, sin, self.weights[0], self.k_cache[0], self.v_cache[0], slot_of, pos, self.dims, self.ops
        )
        for i, (w, kc, vc) in enumerate(zip(self.weights, self.k_cache, self.v_cache, strict=True)):
            outs = []
            if B and self.fused_attention:
                qb = q[: B * W].view(B, W, H, hd)
                o_b = kernels.decode_attention(
                    qb, kc, vc, step.slots, step.pos[: B * W], self.dims.scale, self.tile
                )
                outs.append(o_b.flatten(0, 1))
            elif B:
                assert batch_mask is not None
                if step.one_slot is not None:  # one row: its cache as a view, no gather
                    s = step.one_slot
                    kr, vr = kc[s : s + 1, :L], vc[s : s + 1, :L]
                else:
                    kr, vr = kc[step.slots, :L], vc[step.slots, :L]  # [B, L, KV, hd]
                outs.append(attend(q[: B * W].view(B, W, H, hd), kr, vr, batch_mask, self.dims).flatten(0, 1))
            off = B * W
            if step.chunks is not None:
                outs.append(kernels.chunk_attention(q[off:], kc, vc, step.chunks, self.dims.scale))
            for (s, T, Lp), mask in zip(step.singles, masks, strict=True):
                qi = q[off : off + T][None]  # [1, T, H, hd]
                outs.append(attend(qi, kc[s : s + 1, :Lp], vc[s : s + 1, :Lp], mask, self.dims)[0])
                off += T
            o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H * hd]
            if self.compiled and o.shape[0] > 1:
                torch._dynamo.maybe_mark_dynamic(o, 0)  # a new tensor each layer: marked like x
            if i + 1 < n:  # q [N, H, hd] of the next layer, whose K/V are in its cache
                nxt = self.weights[i + 1], self.k_cache[i + 1], self.v_cache[i + 1]
                x, q = self._between(
                    x, o, w, nxt[0], cos, sin, nxt[1], nxt[2], slot_of, pos, self.dims, self.ops
                )
            else:
                x = self._out(x, o, w, self.dims, self.ops)
        return x

    def _mask(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(
            hidden, float("-inf")
        )

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.ops.rms_norm(h, self.norm, self.dims.eps), self.lm_head)  # [n, V]

    def _step(self, step: StepRows) -> torch.Tensor:
        """Logits of every token of a step [N, V], or of its first ``step.logit_rows`` (graphs
        capture this)."""
        if self.compiled:
            with torch._dynamo.config.patch(**_DYNAMO):
                h = self._forward(step)
        else:
            h = self._forward(step)
        return self._logits(h if step.logit_rows is None else h[: step.logit_rows])

    @torch.inference_mode()
    def forward_rows(self, rows: list[Row], exact: bool = False) -> list[torch.Tensor | None]:
        """One forward pass over several sequences. Rows of up to ``max_graph_tokens`` tokens (decode
        and verification) are batched at one width; longer ones (prefill chunks) attend on their own
        but share every matmul. Returns each row's logits as its ``Row.logits`` asks."""
        for r in rows:
            assert r.start + r.tokens.shape[0] <= self.max_len, (
                f"sequence of {r.start + r.tokens.shape[0]} tokens exceeds the static cache ({self.max_len})"
            )
        if self.step_override is not None:  # another compiler's one-row step (trt.py)
            return [self._override_row(r) for r in rows]
        short, long = self.graphs.split(rows)
        widest = max((r.tokens.shape[0] for r in short), default=0)
        shape = self.step_shape(len(short), widest, max((r.start for r in short), default=0), exact)
        logits = self.graphs.replay(short, long, shape)
        if logits is None:
            logits = self._step(self._plan(short, long, shape))
        return _split(rows, short, long, shape.width, logits)

    @torch.inference_mode()
    def forward_batch(
        self,
        slots: list[int],
        starts: list[int] | torch.Tensor,
        ids: torch.Tensor,
        exact: bool = False,
        last_start: int | None = None,
    ) -> torch.Tensor:
        """The decode-only step: ``ids`` [B, W] (on the device, or the host: a graph takes them in
        one copy with the rows' places) at cache positions ``starts[b] + j`` of ``slots[b]`` -> logits
        [B, W, V], valid until this model's next forward pass (the graph's buffer). ``starts`` may
        be a device tensor [B] (a pass queued before the host knows where its rows stand, as
        ``decoding.drafters.draft_first``'s), with ``last_start`` a bound on the largest."""
        B, T = ids.shape
        top = max(starts) if last_start is None else last_start
        shape = self.step_shape(B, T, int(top), exact)
        W = shape.width
        if W > T:  # exact: every row at the one width
            ids = F.pad(ids, (0, W - T))
        assert top + W <= self.cache_len, "a step past the end of the static cache"
        if self.step_override is not None or self.max_graph_tokens < W:
            if isinstance(starts, torch.Tensor):  # a host read: these paths place rows on the host
                starts = starts.tolist()
            ids = ids.to(self.device, non_blocking=True)
            rows = [Row(s, ids[b, :T], st) for b, (s, st) in enumerate(zip(slots, starts, strict=True))]
            return torch.stack([t for t in self.forward_rows(rows, exact) if t is not None])
        logits = self.graphs.run(shape, slots, starts, ids)
        if logits is not None:
            return logits[:, :T]
        slot_t = torch.tensor(slots).to(self.device, non_blocking=True)  # [B]
        start_t = (
            starts
            if isinstance(starts, torch.Tensor)
            else torch.tensor(starts).to(self.device, non_blocking=True)
        )
        step = StepRows(
            ids=ids.to(self.device, non_blocking=True).reshape(-1),
            pos=(start_t[:, None] + self.positions[None, :W]).view(-1),
            slot_of=slot_t.repeat_interleave(W),
            batch=B,
            width=W,
            slots=slot_t,
            attn_len=shape.attn_len,
            one_slot=slots[0] if B == 1 else None,
            singles=[],
        )
        return self._step(step).view(B, W, -1)[:, :T]

    def _plan(self, short: list[Row], long: list[Row], shape: StepShape) -> StepRows:
        W = shape.width
        ids, pos, slot_of = [], [], []
        for r in short:  # padded to W: the padding writes past the row's length, which nothing reads
            T = r.tokens.shape[0]
            ids.append(F.pad(r.tokens, (0, W - T)))
            pos.append(self.positions[r.start : r.start + W])
            slot_of.append(W * [r.slot])
        singles = []  # the SDPA path's long rows (the fused kernel takes them as ``chunks``)
        fused = bool(long) and self.fused_attention
        for r in long:
            T = r.tokens.shape[0]
            ids.append(r.tokens)
            pos.append(self.positions[r.start : r.start + T])
            slot_of.append(T * [r.slot])
            if not fused:
                singles.append((r.slot, T, self._attn_len(r.start + T)))
        flat_slots = [s for group in slot_of for s in group]
        B = len(short)
        return StepRows(
            ids=torch.cat(ids),
            pos=torch.cat(pos),
            slot_of=as_ids(flat_slots, self.device),
            batch=B,
            width=W,
            slots=as_ids([r.slot for r in short], self.device),
            attn_len=shape.attn_len if B else 0,
            one_slot=short[0].slot if B == 1 else None,
            singles=singles,
            chunks=chunk_rows(long, len(long), self.device) if fused else None,
            logit_rows=B * W if all(r.logits == "none" for r in long) else None,
        )

    def step_one(self, slot: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One row's logits [T, V] over the whole cache, with no host-side planning (trt.py
        compiles this as the step of one sequence)."""
        T = ids.shape[0]
        slot_of = torch.full((T,), slot, dtype=torch.long, device=self.device)
        empty = slot_of[:0]
        return self._step(StepRows(ids, pos, slot_of, 0, 0, empty, 0, None, [(slot, T, self.cache_len)]))

    def _override_row(self, r: Row) -> torch.Tensor | None:
        assert self.step_override is not None
        pos = self.positions[r.start : r.start + r.tokens.shape[0]]
        out = self.step_override(r.slot, r.tokens, pos)
        return _want(out, r.logits)

    def warm(self) -> None:
        """Run the step shapes requests will use once, ahead of them: with ``compile_step`` this
        compiles both halves of the layer for N = 1 and for N >= 2. Writes only to the scratch slot."""
        with torch.inference_mode():
            for n in (3, 1):
                ids = torch.zeros(n, dtype=torch.long, device=self.device)
                self.forward_rows([Row(self.scratch, ids, 0, "all")])

    # ---- graphs (decoding.graphs.GraphSet): the names the loader and benchmarks call ----------

    def capture(
        self, token_counts: range, batch_sizes: tuple[int, ...] = (1,), chunk_tokens: tuple[int, ...] = ()
    ) -> None:
        """``GraphSet.capture``: graphs ahead of the first request."""
        self.graphs.capture(token_counts, batch_sizes, chunk_tokens)

    def capture_serving(self, rows: int) -> int:
        """``GraphSet.capture_serving``: every graph a server's steps of up to ``rows`` rows use."""
        return self.graphs.capture_serving(rows)

    def time_steps(self) -> dict[tuple[int, int], float]:
        """``GraphSet.time_replays`` of the graphs captured so far, kept as ``step_costs``: the
        table the engine's batch cost model starts from (before requests: the replays write to the
        scratch slot through the graphs' own buffers)."""
        table = self.graphs.time_replays()
        if self.exact:  # a step of width w runs at widths.width's (step_shape): it costs that one
            buckets = {B for B, _ in table if B}
            widths = range(1, self.max_graph_tokens + 1)
            runs = {(B, w): (B, self.widths.width(B, w)) for B in buckets for w in widths}
            table = {k: t for k, t in table.items() if not k[0]} | {
                k: table[r] for k, r in runs.items() if r in table
            }
        self.step_costs = table
        return table


def _want(logits: torch.Tensor, want: str) -> torch.Tensor | None:
    if want == "none":
        return None
    return logits[-1:] if want == "last" else logits


def _split(
    rows: list[Row], short: list[Row], long: list[Row], W: int, logits: torch.Tensor
) -> list[torch.Tensor | None]:
    """Each row's logits out of a step's [N, V] (short rows first at width W, then long rows)."""
    at: dict[int, torch.Tensor | None] = {}
    off = 0
    for r in short:
        at[id(r)] = _want(logits[off : off + r.tokens.shape[0]], r.logits)
        off += W
    for r in long:
        T = r.tokens.shape[0]
        at[id(r)] = _want(logits[off : off + T], r.logits)
        off += T
    return [at[id(r)] for r in rows]


class StaticRunner(SlotRunner[StaticModel]):
    """One sequence's handle on a StaticModel: its slot and length (the SequenceRunner the engine
    drives). Several runners of one model run one forward pass through ``StaticModel.forward_rows``."""

    def __init__(self, model: StaticModel, slot: int, exact: bool = False):
        super().__init__(model, slot, exact)
        self.prefill_chunk = 512

    @property
    def max_step_tokens(self) -> int | None:
        """Exact mode: the most tokens one step can take and stay bit-identical to 1-token steps."""
        return self.m.max_graph_tokens if self.exact else None

    def forward(self, tokens: Tokens, logits: bool = True) -> torch.Tensor | None:
        ids = as_ids(tokens, self.m.device)
        outs = []
        for s in range(0, ids.shape[0], self.prefill_chunk):
            row = self.row(ids[s : s + self.prefill_chunk], "all" if logits else "none")
            outs.append(self.m.forward_rows([row], self.exact)[0])
        if not logits:
            return None
        return outs[0] if len(outs) == 1 else torch.cat([o for o in outs if o is not None])
