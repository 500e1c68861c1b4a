"""The fast path: a static KV cache and our own decoder-layer forward for Llama/Qwen2-family models,
with each step shape captured once as a CUDA graph and, optionally, each layer compiled by inductor.

After gpt-fast: the cache is indexed by position, so a rejected draft's slots are simply overwritten
by the next step and "cutting back" is setting a length. Shapes never change, so the draft's 1-token
step and the target's (k+1)-token verification replay as CUDA graphs with no per-kernel launch cost.

At batch 1 a step's cost is its kernel count as much as its bytes (a 0.5B draft moves 1 GB in a
quarter of a millisecond, but runs ~1000 kernels in eager HF code), so the forward is written for few
kernels rather than through the HF modules:
  - q/k/v and gate/up are each one matmul over weights concatenated once at load (as vLLM's
    QKVParallelLinear and MergedColumnParallelLinear do); the HF modules' parameters become views of
    the fused tensors, so memory is not doubled and the HF model still runs as before;
  - ``compile_step`` compiles one decoder layer (every layer shares the compiled code, so compile
    time is one layer's, not the model's): inductor fuses RMSNorm, RoPE, the SiLU gate and the
    residual adds into a few kernels. T = 1 is compiled static; T >= 2 (verification, prefill) once
    with T dynamic.

    StaticModel   one model: fused weights, KV cache for ``slots`` sequences, RoPE tables, graphs
    StaticRunner  one sequence on one slot (the SequenceRunner the engine drives)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from decoding.errors import ModelLoadError
from decoding.runner import EXACT_WIDTH, Tokens, as_ids

SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


class Dims(NamedTuple):
    """A model's constants: compiled code specialises on them (one compile per model, not per call)."""

    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    scale: float
    gqa: bool


class LayerWeights(NamedTuple):
    ln1: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 KV) hd, D]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head norms
    k_norm: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor  # [2 I, D]
    down: torch.Tensor


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm, step for step (float32 statistics, weight applied in x's dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def decoder_layer(
    x: torch.Tensor,  # [T, D]
    cos: torch.Tensor,  # [T, hd]
    sin: torch.Tensor,
    mask: torch.Tensor,  # [T, cache_len] additive: 0 where a row may attend, -inf elsewhere
    pos: torch.Tensor,  # [T]
    kv: torch.Tensor,  # [2, KV, cache_len, hd], written at ``pos``
    w: LayerWeights,
    d: Dims,
) -> torch.Tensor:
    T = x.shape[0]
    H, KV, hd = d.n_heads, d.n_kv, d.head_dim
    qkv = F.linear(rms_norm(x, w.ln1, d.eps), w.qkv, w.qkv_bias)
    q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
    q = q.view(T, H, hd).transpose(0, 1)  # [H, T, hd]
    k = k.view(T, KV, hd).transpose(0, 1)
    v = v.view(T, KV, hd).transpose(0, 1)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = rms_norm(q, w.q_norm, d.eps), rms_norm(k, w.k_norm, d.eps)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    kv[:, :, pos] = torch.stack([k, v])  # one in-place index_put_ (gpt-fast's KVCache.update)
    o = F.scaled_dot_product_attention(
        q[None], kv[0][None], kv[1][None], attn_mask=mask, scale=d.scale, enable_gqa=d.gqa
    )[0]
    x = x + F.linear(o.transpose(0, 1).reshape(T, H * hd), w.o)
    gate, up = F.linear(rms_norm(x, w.ln2, d.eps), w.gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.down)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears on the same input; the modules are rebound to
    views of it, so there is one copy in memory. Idempotent: a second StaticModel over the same HF
    model finds the fused tensors already there."""
    cached = getattr(linears[0], "_specgate_fused", None)
    if cached is not None and all(_shares(m.weight, cached[0]) for m in linears):
        return cached  # (a copied or cast model has its own weights and is fused afresh)
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    if any(b is not None for b in biases) and bias is None:
        raise ModelLoadError("static backend: q/k/v projections mix biased and unbiased layers")
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    linears[0]._specgate_fused = (weight, bias)  # type: ignore[assignment]
    return weight, bias


def _shares(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.dtype == base.dtype and view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _norm_weight(module: nn.Module | None) -> torch.Tensor | None:
    if module is None:
        return None
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach()


def layer_weights(model: PreTrainedModel) -> list[LayerWeights]:
    out = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        if any(m.bias is not None for m in (a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            # the layer below has biases only on q/k/v (Qwen2); dropping others would be silently wrong
            raise ModelLoadError(
                "static backends support q/k/v biases only (attention_bias/mlp_bias): use backend 'eager'"
            )
        qkv, qkv_bias = _fuse([a.q_proj, a.k_proj, a.v_proj])
        gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        out.append(
            LayerWeights(
                ln1=layer.input_layernorm.weight.detach(),
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=_norm_weight(getattr(a, "q_norm", None)),
                k_norm=_norm_weight(getattr(a, "k_norm", None)),
                o=a.o_proj.weight.detach(),
                ln2=layer.post_attention_layernorm.weight.detach(),
                gate_up=gate_up,
                down=mlp.down_proj.weight.detach(),
            )
        )
    return out


def check_supported(model: PreTrainedModel, max_len: int) -> None:
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        raise ModelLoadError(
            f"static backends support {', '.join(SUPPORTED)} models, not '{cfg.model_type}': use backend 'eager'"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"static backends need a SiLU-gated MLP, not '{cfg.hidden_act}': use backend 'eager'"
        )
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    if window and window < max_len:
        raise ModelLoadError(
            f"static backends have no sliding-window attention ({window} < max_context {max_len}): use backend 'eager'"
        )


# Dynamo settings for the compiled layer, applied only around our own calls:
#  - no automatic dynamic shapes: the draft and target share the layer's code, and a second model's
#    different hidden size must get its own static compile, not turn D into a symbol for both;
#  - a recompile limit that fits several models x {T=1, T dynamic}.
_DYNAMO: dict[str, Any] = dict(automatic_dynamic_shapes=False, recompile_limit=64)


class StaticModel:
    def __init__(
        self,
        model: PreTrainedModel,
        max_len: int,
        slots: int = 1,
        graphs: bool = True,
        max_graph_tokens: int = EXACT_WIDTH,
        compile_step: bool = False,
        exact: bool = False,
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
        # one [2, kv_heads, cache_len, head_dim] K/V buffer per (slot, layer): separate tensors, so
        # compiled code sees the same input layout whichever slot runs. Graph warm-up and capture
        # write K/V at the scratch tail, never over a live sequence's positions.
        # cache_len is a multiple of 16 so attention's additive mask needs no padding copy per layer.
        cache_len = -(-(max_len + max_graph_tokens) // 16) * 16
        shape = (2, self.dims.n_kv, cache_len, head_dim)

        def cache() -> list[list[torch.Tensor]]:
            return [
                [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.weights]
                for _ in range(slots)
            ]

        self.kv_cache = cache()
        pos = torch.arange(cache_len, device=self.device)
        with torch.inference_mode():
            # the model's own rotary embedding: scaling variants (YaRN, linear, ...) come for free
            probe = torch.zeros(1, head_dim, dtype=self.dtype, device=self.device)
            cos, sin = model.model.rotary_emb(probe, pos[None])  # [1, max_len, hd]
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, hd]
        self.positions = pos  # [cache_len]
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.max_graph_tokens = max_graph_tokens
        # exact (decoding.runner.EXACT_WIDTH): every step of up to max_graph_tokens tokens runs as
        # max_graph_tokens rows, the rest dummies at the scratch tail. A row then meets the same
        # kernels, shapes and reduction orders whether it is a 1-token decode or one row of a
        # (k+1)-token verification (cuBLAS and attention pick different kernels for 1 row and 9).
        self.exact = exact  # the default for runners; a drafting runner never needs it
        self._graphs: dict[tuple[int, int], _Graph] = {}
        # one memory pool for this model's graphs: they never run concurrently. Not shared across
        # models: freeing one model's graphs must not pull memory from under another's.
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None
        self._free = list(range(slots))
        self._lock = threading.Lock()
        self.compiled = compile_step
        layer: Callable[..., torch.Tensor] = decoder_layer
        if compile_step:
            # our CUDA graphs are the graphs: inductor's own (mode="reduce-overhead") are not used
            layer = torch.compile(decoder_layer, fullgraph=True, dynamic=False)
        self._layer = layer
        self.step_override: Callable[..., torch.Tensor] | None = (
            None  # another compiler's whole step (trt.py)
        )

    # ---- slots ------------------------------------------------------------------------------

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("no free KV-cache slot: raise `slots` to the engine's max_active")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def runner(self, _model: PreTrainedModel | None = None, exact: bool | None = None) -> StaticRunner:
        """The engine's runner factory (the argument is the HF model, already known here)."""
        return StaticRunner(self, self.acquire(), self.exact if exact is None else exact)

    def draft_runner(self, _model: PreTrainedModel | None = None) -> StaticRunner:
        """A drafter's runner: never padded (its rounding changes proposals, never the output)."""
        return self.runner(exact=False)

    # ---- the forward pass ---------------------------------------------------------------------

    def _step(self, slot: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos: [T] -> logits [T, V]. Writes K/V for ``pos`` into the slot's cache."""
        if self.step_override is not None:
            return self.step_override(slot, ids, pos)
        if not self.compiled:
            return self._forward(slot, ids, pos)
        with torch._dynamo.config.patch(**_DYNAMO):
            return self._forward(slot, ids, pos)

    def _forward(self, slot: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)  # [T, D]
        cos, sin = self.cos[pos], self.sin[pos]  # [T, hd]
        # causal over the whole cache, built once per step for every layer
        mask = torch.zeros(pos.shape[0], self.positions.shape[0], dtype=self.dtype, device=self.device)
        mask.masked_fill_(self.positions[None, :] > pos[:, None], float("-inf"))  # [T, cache_len]
        if self.compiled and ids.shape[0] > 1:
            # one compile serves every verification length and prefill chunk (T = 1 stays static)
            for t in (x, cos, sin, mask, pos):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for w, kv in zip(self.weights, self.kv_cache[slot], strict=True):
            x = self._layer(x, cos, sin, mask, pos, kv, w, self.dims)
        return F.linear(rms_norm(x, self.norm, self.dims.eps), self.lm_head)  # [T, V]

    @torch.inference_mode()
    def forward(self, slot: int, ids: torch.Tensor, start: int, exact: bool = False) -> torch.Tensor:
        n = ids.shape[0]
        assert start + n <= self.max_len, (
            f"sequence of {start + n} tokens exceeds the static cache ({self.max_len})"
        )
        pos = self.positions[start : start + n]
        if n > self.max_graph_tokens:  # prefill chunks
            return self._step(slot, ids, pos)
        rows = self.max_graph_tokens if exact else n
        if rows > n:  # exact: dummy rows at the scratch tail, which no real row attends to
            pos = torch.cat([pos, self.positions[self.max_len + n : self.max_len + rows]])
            ids = F.pad(ids, (0, rows - n))
        if not self.graphs_enabled:
            return self._step(slot, ids, pos)[:n]
        graph = self._graphs.get((slot, rows))
        if graph is None:
            graph = self._graphs[(slot, rows)] = _Graph(self, slot, rows)
        return graph.replay(ids, pos, n)

    def warm(self) -> None:
        """Run the step shapes requests will use once, ahead of them: with ``compile_step`` this
        compiles the layer for T = 1 and for T >= 2 (verification, exact steps, prefill). Writes
        only at the scratch tail."""
        slot = self.acquire()
        try:
            with torch.inference_mode():
                for n in (3, 1):
                    pos = self.positions[self.max_len : self.max_len + n]
                    self._step(slot, torch.zeros(n, dtype=torch.long, device=self.device), pos)
        finally:
            self.release(slot)

    def capture(self, token_counts: range) -> None:
        """Capture graphs ahead of the first request (otherwise on first use)."""
        counts = set(token_counts) | ({self.max_graph_tokens} if self.exact else set())
        for slot in range(len(self.kv_cache)):
            for T in counts:
                if self.graphs_enabled and (slot, T) not in self._graphs:
                    self._graphs[(slot, T)] = _Graph(self, slot, T)


class _Graph:
    """One CUDA graph for (slot, rows): static input buffers in, a static logits buffer out."""

    def __init__(self, m: StaticModel, slot: int, rows: int):
        self.ids = torch.zeros(rows, dtype=torch.long, device=m.device)
        self.pos = m.positions[m.max_len : m.max_len + rows].clone()  # warm-up and capture: the scratch tail
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (compilation, cuBLAS handles, autotuning)
                m._step(slot, self.ids, self.pos)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=m.pool):
            self.out = m._step(slot, self.ids, self.pos)

    def replay(self, ids: torch.Tensor, pos: torch.Tensor, T: int) -> torch.Tensor:
        self.ids.copy_(ids, non_blocking=True)
        self.pos.copy_(pos)
        self.graph.replay()
        return self.out[:T].clone()  # the buffer is overwritten by the next replay


class StaticRunner:
    def __init__(self, model: StaticModel, slot: int, exact: bool = False):
        self.m = model
        self.slot = slot
        self.exact = exact
        self._length = 0
        self.prefill_chunk = 512

    @property
    def length(self) -> int:
        return self._length

    @property
    def max_step_tokens(self) -> int | None:
        """Exact mode: the most tokens one step can take and stay bit-identical to 1-token steps."""
        return self.m.max_graph_tokens if self.exact else None

    def forward(self, tokens: Tokens, logits: bool = True) -> torch.Tensor | None:
        ids = as_ids(tokens, self.m.device)
        outs = []
        for s in range(0, ids.shape[0], self.prefill_chunk):
            chunk = ids[s : s + self.prefill_chunk]
            outs.append(self.m.forward(self.slot, chunk, self._length, self.exact))
            self._length += chunk.shape[0]
        if not logits:
            return None
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def crop(self, length: int) -> None:
        assert 0 <= length <= self._length, f"crop to {length} outside cache of {self._length}"
        self._length = length  # stale slots past `length` are overwritten before they are read

    def release(self) -> None:
        if self.slot >= 0:
            self.m.release(self.slot)
            self.slot = -1
