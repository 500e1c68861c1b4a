"""The fused attention kernels (decoding/kernels.py) on a GPU: they compute causal attention of each
row over its own slot, and a decode query's result does not depend on the rest of the step.

With Triton installed, ``TRITON_INTERPRET=1`` runs them on the CPU in Triton's interpreter (float32)."""

from __future__ import annotations

import os

import pytest
import torch

from decoding import kernels

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and kernels.triton is not None
DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (INTERPRET or kernels.available(torch.device("cuda"), 128)), reason="needs CUDA and Triton"
    ),
]

S, LC, KV, G, HD = 6, 96, 2, 4, 128


def _pool(dtype: torch.dtype, gen: torch.Generator, length: int = LC) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(S, length, KV, HD, generator=gen).to(DEVICE, dtype)
    v = torch.randn(S, length, KV, HD, generator=gen).to(DEVICE, dtype)
    return k, v


def _run(q, k, v, slots, starts, tile):  # type: ignore[no-untyped-def]
    W = q.shape[1]
    pos = (torch.tensor(starts)[:, None] + torch.arange(W)[None]).reshape(-1).to(DEVICE)
    return kernels.decode_attention(q, k, v, torch.tensor(slots).to(DEVICE), pos, HD**-0.5, tile)


def _reference(q, k, v, slots, starts):  # type: ignore[no-untyped-def]
    """Row by row in float64: each query attends to its slot's keys 0..its position."""
    B, W, H, _ = q.shape
    out = torch.empty(B, W, H, HD, dtype=torch.float64)
    for b in range(B):
        for w in range(W):
            p = starts[b] + w
            kk = k[slots[b], : p + 1].double().cpu().repeat_interleave(G, dim=1)  # [p+1, H, hd]
            vv = v[slots[b], : p + 1].double().cpu().repeat_interleave(G, dim=1)
            s = torch.einsum("hd,phd->hp", q[b, w].double().cpu(), kk) * HD**-0.5
            out[b, w] = torch.einsum("hp,phd->hd", s.softmax(-1), vv)
    return out.view(B, W, H * HD)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("W", [1, 4, 9])
def test_matches_reference(dtype, W):
    gen = torch.Generator().manual_seed(W)
    k, v = _pool(dtype, gen)
    slots, starts = [4, 1, 2], [10, 0, 70]
    q = torch.randn(3, W, KV * G, HD, generator=gen).to(DEVICE, dtype)
    got = _run(q, k, v, slots, starts, kernels.block_m(9, G)).double().cpu()
    ref = _reference(q, k, v, slots, starts)
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), err


@pytest.mark.skipif(INTERPRET, reason="the interpreter's numpy matmul rounds a row by its neighbours")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_computes_the_same_bits_whatever_else_is_in_the_step(dtype):
    gen = torch.Generator().manual_seed(0)
    k, v = _pool(dtype, gen)
    tile = kernels.block_m(9, G)
    q = torch.randn(3, 9, KV * G, HD, generator=gen).to(DEVICE, dtype)
    batch = _run(q, k, v, [4, 1, 2], [10, 0, 70], tile)  # [3, 9, H * hd]
    alone = _run(q[1:2], k, v, [1], [0], tile)  # the same row as the batch of one
    assert torch.equal(batch[1], alone[0])
    for w in (0, 3, 8):  # each query as a 1-token step at its own position
        one = _run(q[2:3, w : w + 1], k, v, [2], [70 + w], tile)
        assert torch.equal(batch[2, w], one[0, 0])


def _chunks(chunks: list[tuple[int, int, int]], P: int) -> torch.Tensor:
    """The chunk kernel's row table for (slot, start, tokens) chunks laid out one after another."""
    table, at = [], 0
    for slot, start, T in chunks:
        table.append([slot, start, at, T])
        at += T
    assert at <= P
    return torch.tensor([*table, [0, 0, 0, 0]], dtype=torch.long, device=DEVICE)  # + an unused row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [LC, 1100])  # keys in one span, and across three (CHUNK_SPAN)
@pytest.mark.parametrize("P", [64, 256])  # two chunk buckets
def test_chunks_match_reference(dtype, length, P):
    gen = torch.Generator().manual_seed(1)
    k, v = _pool(dtype, gen, length)
    far = length - 60
    # a whole prompt, a later chunk, a one-token chunk, a chunk straddling spans at the cache's end
    chunks = [(3, 0, 40), (0, 50, 17), (5, 20, 1)] + ([(2, far - 5, 5)] if length > LC else [])
    q = torch.randn(P, KV * G, HD, generator=gen).to(DEVICE, dtype)
    got = kernels.chunk_attention(q, k, v, _chunks(chunks, P), HD**-0.5).double().cpu()
    at = 0
    for slot, start, T in chunks:
        ref = _reference(q[None, at : at + T], k, v, [slot], [start])[0]
        err = ((got[at : at + T] - ref).norm() / ref.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), (slot, err)
        at += T
    assert torch.count_nonzero(got[at:]) == 0  # padding tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_caches_take_longer_spans(dtype, monkeypatch):
    """Past CHUNK_MAX_SPANS spans a cache's spans lengthen (here 2 of 1,024 keys over 1,100): the
    result is still the reference's."""
    monkeypatch.setattr(kernels, "CHUNK_MAX_SPANS", 2)
    gen = torch.Generator().manual_seed(3)
    k, v = _pool(dtype, gen, 1100)
    chunks = [(1, 1000, 30), (4, 0, 600)]
    q = torch.randn(640, KV * G, HD, generator=gen).to(DEVICE, dtype)
    got = kernels.chunk_attention(q, k, v, _chunks(chunks, 640), HD**-0.5).double().cpu()
    at = 0
    for slot, start, T in chunks:
        ref = _reference(q[None, at : at + T], k, v, [slot], [start])[0]
        assert ((got[at : at + T] - ref).norm() / ref.norm()).item() < (
            1e-6 if dtype == torch.float32 else 1e-2
        )
        at += T


@pytest.mark.skipif(INTERPRET, reason="the interpreter's numpy matmul rounds a row by its neighbours")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chunk_query_computes_the_same_bits_whatever_the_chunking(dtype):
    """Exact mode prefills a prompt in whatever chunks a step has room for: a query's result may
    depend on its position and keys alone, not on the chunk bucket, its place in the chunk or the
    other chunks of the step (keys past one span included)."""
    gen = torch.Generator().manual_seed(2)
    k, v = _pool(dtype, gen, 1100)
    q = torch.randn(64, KV * G, HD, generator=gen).to(DEVICE, dtype)
    whole = kernels.chunk_attention(q[:40], k, v, _chunks([(2, 900, 40)], 40), HD**-0.5)
    cut = [(2, 900, 13), (2, 913, 27)]  # the same 40 queries in two chunks, beside another, in a wider bucket
    rows = _chunks([(4, 0, 20), *cut], 64)
    mixed = kernels.chunk_attention(torch.cat([q[40:60], q[:40], q[60:]]), k, v, rows, HD**-0.5)
    assert torch.equal(mixed[20:60], whole)
    one = kernels.chunk_attention(q[17:18], k, v, _chunks([(2, 917, 1)], 1), HD**-0.5)
    assert torch.equal(one[0], whole[17])
