"""Attention of a batched decode/verification step straight from the KV pool, as one Triton kernel.

Why a kernel of our own: SDPA over the pool needs each row's cache gathered into a [B, L, ...] copy and an
additive [B, 1, W, L] mask (no fused SDPA kernel takes grouped-query heads with a mask, so it runs
cuDNN's or the math path), and at decode sizes that costs as much per layer as a small GEMM
(``bench.probe_batch`` measures both; docs/benchmarks.md). Here one program per (row, kv head) reads
its slot's keys in place, up to the row's own length, with every grouped query head of every query
token of the row in one tile, so a step needs no gather, no mask and no length bucket (CUDA graphs
need no key by attended length either).

Batch invariance: a query's result depends only on its own position and the keys up to it. Keys are
visited in fixed blocks from position 0, masked keys contribute exact zeros, and the tile shape is one
constant per model, so the same query computes the same bits whatever else is in the step (other rows,
its own row's width, the cache's size).

    decode_attention(q [B, W, H, hd], k_pool, v_pool [S, Lc, KV, hd], slots [B], pos [B * W]) -> [B, W, H * hd]

Flash-attention's online softmax (Dao et al. 2022), with flash-decoding's layout of grouped heads
(one kv head's queries share its loads). No split of long contexts across programs: at batch 1 a
program streams its row's whole cache alone, which serves the contexts this engine is sized for.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only torch builds ship no Triton: the static backend keeps SDPA there
    triton = None


def available(device: torch.device, head_dim: int) -> bool:
    """The kernel runs on CUDA with Triton, for power-of-two head sizes from 16 (tl.arange and
    tl.dot need them)."""
    return triton is not None and device.type == "cuda" and head_dim in (16, 32, 64, 128, 256)


if triton is not None:

    @triton.jit
    def _attn_kernel(
        Q,  # [B, W, H, hd]
        K,  # [S, Lc, KV, hd]
        V,
        Out,  # [B, W, H, hd]
        slots,  # [B] int64
        pos,  # [B * W] int64: cache position of each query token
        W,
        scale,
        sq_b,
        sq_w,
        sq_h,
        sk_s,
        sk_l,
        sk_h,
        so_b,
        so_w,
        so_h,
        G: tl.constexpr,  # query heads per kv head
        HD: tl.constexpr,
        BLOCK_M: tl.constexpr,  # >= W * G: every query of the row for this kv head
        BLOCK_N: tl.constexpr,  # keys per iteration
        PRECISION: tl.constexpr,  # "ieee" for float32 inputs (tl.dot would round them to tf32)
    ):
        b = tl.program_id(0)
        j = tl.program_id(1)  # kv head
        slot = tl.load(slots + b)
        start = tl.load(pos + b * W)
        m = tl.arange(0, BLOCK_M)
        w = m // G
        h = j * G + m % G
        valid = w < W
        d = tl.arange(0, HD)
        q = tl.load(
            Q + b * sq_b + w[:, None] * sq_w + h[:, None] * sq_h + d[None, :], mask=valid[:, None], other=0.0
        )
        qpos = start + w  # [BLOCK_M]
        end = start + W  # the step's own keys are in the pool already
        k_base = K + slot * sk_s + j * sk_h
        v_base = V + slot * sk_s + j * sk_h
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for n0 in range(0, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < end
            k = tl.load(k_base + n[None, :] * sk_l + d[:, None], mask=live[None, :], other=0.0)  # [HD, N]
            s = tl.dot(q, k, input_precision=PRECISION) * scale  # [M, N]
            s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sk_l + d[None, :], mask=live[:, None], other=0.0)  # [N, HD]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(
            Out + b * so_b + w[:, None] * so_w + h[:, None] * so_h + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=valid[:, None],
        )


def block_m(max_width: int, group: int) -> int:
    """The one query-tile height of a model: every query of a max_width-token row for one kv head."""
    return max(16, triton.next_power_of_2(max_width * group))


def decode_attention(
    q: torch.Tensor,  # [B, W, H, hd]
    k_pool: torch.Tensor,  # [S, Lc, KV, hd]
    v_pool: torch.Tensor,
    slots: torch.Tensor,  # [B] long
    pos: torch.Tensor,  # [B * W] long: each query token's cache position (rows are consecutive)
    scale: float,
    tile: int,  # block_m(...) of the model: one constant, so that results do not depend on W
) -> torch.Tensor:
    """Causal attention of each row's queries over its own slot's keys up to their positions."""
    B, W, H, hd = q.shape
    KV = k_pool.shape[2]
    G = H // KV
    assert tile >= W * G, f"a row of {W} tokens x {G} heads exceeds the query tile ({tile})"
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    o = torch.empty_like(q)
    _attn_kernel[(B, KV)](
        q,
        k_pool,
        v_pool,
        o,
        slots,
        pos,
        W,
        scale,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        G=G,
        HD=hd,
        BLOCK_M=tile,
        BLOCK_N=64,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return o.view(B, W, H * hd)


# ---- prompt chunks ---------------------------------------------------------------------------------
# A step that carries prompt chunks beside its decode rows attends each chunk with the kernels below: the
# chunk's own keys and every key before them, read from its slot of the pool like the decode kernel's,
# so such a step needs no mask tensor and no attended-length bucket, and is captured as a CUDA graph
# like a decode step (``GraphSet.get``). A chunk's queries (token-major, the kv head's grouped
# heads minor) are split into tiles, and its keys into spans of CHUNK_SPAN from position 0, one program
# per (chunk, kv head, tile, span); a second kernel merges the spans' partial softmaxes (flash-decoding's
# split, Dao et al. 2023). Without the split a program walked a 3,000-token context alone, 47 blocks in
# sequence. The spans start at fixed positions whatever the chunk, so a query's result depends on its
# position and its keys alone, not on the chunking (exact mode relies on it). The merge is one kernel:
# as ~14 small torch kernels a layer it cost ~1.2 ms of a 16-row step beside a 128-token chunk on the
# H200's 7B shape, nearly as much as the attention itself (bench.probe_prefill kernels).

CHUNK_TILE = 64  # query rows (token x grouped head) per program
CHUNK_SPAN = 512  # keys per program, at least
# spans per cache, at most: past CHUNK_SPAN x this many positions the spans lengthen (in powers of two),
# so the partials stay bounded (float32 [spans, P, H, hd]: 117 MB at 512 chunk tokens of a 7B) for a
# 32k-token cache; the span length is the model's, so results still do not depend on the chunking
CHUNK_MAX_SPANS = 16
CHUNK_WARPS = 4
CHUNK_STAGES = 3
MERGE_ROWS = 16  # (token, head) rows per merging program

if triton is not None:

    @triton.jit
    def _chunk_kernel(
        Q,  # [P, H, hd]: the step's chunk tokens, one chunk after another
        K,  # [S, Lc, KV, hd]
        V,
        Acc,  # [spans, P, H, hd] float32: each span's unnormalised output
        Max,  # [spans, P, H] float32: each span's running max (-inf, as filled: no key)
        Sum,  # [spans, P, H] float32: each span's softmax denominator
        rows,  # [R, 4] int64: slot, cache position of the chunk's first token, its index in Q, tokens
        scale,
        sp_n,  # P * H: one span's stride in Max and Sum
        sq_n,
        sq_h,
        sk_s,
        sk_l,
        sk_h,
        G: tl.constexpr,
        HD: tl.constexpr,
        H: tl.constexpr,
        SPAN: tl.constexpr,
        R: tl.constexpr,  # rows of the table
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        g = tl.program_id(0)  # a tile of the step's chunks, counted over every row in turn
        j = tl.program_id(1)  # kv head
        span = tl.program_id(2)
        # the row holding tile g, and its place among the row's tiles (none: a tile past the last)
        r = 0
        tile = 0
        found = g < 0
        before = 0
        for i in tl.static_range(R):
            tiles = (tl.load(rows + i * 4 + 3).to(tl.int32) * G + BLOCK_M - 1) // BLOCK_M
            hit = (g >= before) & (g < before + tiles)
            r = tl.where(hit, i, r)
            tile = tl.where(hit, g - before, tile)
            found = found | hit
            before += tiles
        slot = tl.load(rows + r * 4)
        # positions and offsets in 32 bits (the slot's base stays 64-bit): 64-bit index arithmetic on
        # every element of a [N, HD] tile was a large part of a key block's time
        start = tl.load(rows + r * 4 + 1).to(tl.int32)
        q0 = tl.load(rows + r * 4 + 2).to(tl.int32)
        T = tl.where(found, tl.load(rows + r * 4 + 3).to(tl.int32), 0)  # 0: no row's tile
        first = tile * BLOCK_M  # the tile's first query of this chunk and kv head
        m = first + tl.arange(0, BLOCK_M)
        w = m // G
        h = j * G + m % G
        # keys up to the tile's last query, within this program's span (none past the chunk's end)
        last = tl.minimum(T - 1, (first + BLOCK_M - 1) // G)
        end = tl.where(first < T * G, start + last + 1, 0)
        lo = span * SPAN
        hi = tl.minimum(end, lo + SPAN)
        valid = m < tl.where(lo < hi, T * G, 0)  # a program with no keys leaves its span's max at -inf
        d = tl.arange(0, HD)
        q = tl.load(
            Q + (q0 + w[:, None]) * sq_n + h[:, None] * sq_h + d[None, :], mask=valid[:, None], other=0.0
        )
        qpos = start + w
        k_base = K + slot * sk_s + j * sk_h
        v_base = V + slot * sk_s + j * sk_h
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HD], tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < hi
            k = tl.load(k_base + n[:, None] * sk_l + d[None, :], mask=live[:, None], other=0.0)  # [N, HD]
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where((n[None, :] <= qpos[:, None]) & live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a query whose keys all lie later
            p = tl.exp(s - m_use[:, None])
            alpha = tl.exp(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sk_l + d[None, :], mask=live[:, None], other=0.0)  # [N, HD]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        # this span's partials at [span, token, head]; the span's base in 64 bits (spans x P x H x HD
        # may pass 2**31 elements), the rest in 32
        at = (q0 + w) * H + h  # [BLOCK_M]
        stats = span.to(tl.int64) * sp_n
        tl.store(Max + stats + at, m_i, mask=valid)
        tl.store(Sum + stats + at, l_i, mask=valid)
        tl.store(Acc + stats * HD + at[:, None] * HD + d[None, :], acc, mask=valid[:, None])

    @triton.jit
    def _merge_kernel(
        Acc,  # [spans, P * H, hd] float32
        Max,  # [spans, P * H] float32
        Sum,
        Out,  # [P * H, hd]: each (token, head) row's attention, in the queries' dtype
        spans,
        sp_n,  # P * H
        HD: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) rows
        ok = i < sp_n
        d = tl.arange(0, HD)
        top = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for s in range(spans):
            top = tl.maximum(top, tl.load(Max + s * sp_n + i, mask=ok, other=float("-inf")))
        top = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, HD], tl.float32)
        # a pointer walks the spans, in 64 bits (spans x P x H x HD may pass 2**31 elements)
        part = Acc + i[:, None] * HD + d[None, :]
        for s in range(spans):  # in span order: a query's sum does not depend on the step around it
            mx = tl.load(Max + s * sp_n + i, mask=ok, other=float("-inf"))
            live = ok & (mx > float("-inf"))  # a span with no key weighs 0 (its Acc and Sum are unset)
            weight = tl.where(live, tl.exp(mx - top), 0.0)
            total += weight * tl.load(Sum + s * sp_n + i, mask=live, other=0.0)
            acc += weight[:, None] * tl.load(part, mask=live[:, None], other=0.0)
            part += sp_n * HD
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]  # no key at all (padding): zeros
        tl.store(Out + i[:, None] * HD + d[None, :], out.to(Out.dtype.element_ty), mask=ok[:, None])


def chunk_attention(
    q: torch.Tensor,  # [P, H, hd]: every chunk's tokens, in the order of ``rows``
    k_pool: torch.Tensor,  # [S, Lc, KV, hd]
    v_pool: torch.Tensor,
    rows: torch.Tensor,  # [R, 4] long: slot, start position, first index in q, tokens (0: unused)
    scale: float,
    tile: int = CHUNK_TILE,
    warps: int = CHUNK_WARPS,
    stages: int = CHUNK_STAGES,
) -> torch.Tensor:
    """Causal attention of each chunk's queries over its slot's keys up to their positions; tokens of
    ``q`` that no row covers come out as zeros. [P, H * hd]. ``tile``, ``warps``, ``stages``: the
    partial kernel's launch shape (bench.probe_prefill sweeps them)."""
    P, H, hd = q.shape
    KV = k_pool.shape[2]
    G = H // KV
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    span = max(CHUNK_SPAN, triton.next_power_of_2(triton.cdiv(k_pool.shape[1], CHUNK_MAX_SPANS)))
    spans = triton.cdiv(k_pool.shape[1], span)
    acc = q.new_empty(spans, P, H, hd, dtype=torch.float32)
    mx = q.new_full((spans, P, H), float("-inf"), dtype=torch.float32)
    sm = q.new_empty(spans, P, H, dtype=torch.float32)
    # the rows' tiles in all, at most: a grid of (row, tile of a row that fills q) launched ~10x the
    # programs that had work, and each held its shared memory (bench.probe_prefill kernels)
    R = rows.shape[0]
    grid = (triton.cdiv(P * G, tile) + R, KV, spans)
    _chunk_kernel[grid](
        q,
        k_pool,
        v_pool,
        acc,
        mx,
        sm,
        rows,
        scale,
        P * H,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        G=G,
        HD=hd,
        H=H,
        SPAN=span,
        R=R,
        BLOCK_M=tile,
        BLOCK_N=64,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    out = q.new_empty(P, H * hd)
    _merge_kernel[(triton.cdiv(P * H, MERGE_ROWS),)](
        acc, mx, sm, out, spans, P * H, HD=hd, BLOCK_R=MERGE_ROWS
    )
    return out
