"""The fast path: a static KV cache over a Hugging Face Llama/Qwen2-family model's own modules, with
each step shape captured once as a CUDA graph.

After gpt-fast: the cache is indexed by position, so a rejected draft's slots are simply overwritten
by the next step and "cutting back" is setting a length. Shapes never change, so the draft's 1-token
step and the target's (k+1)-token verification replay as CUDA graphs with no per-kernel launch cost
(at batch 1 a 7B step is ~700 small kernels: launch overhead, not bandwidth, is what eager loses to).

The weights are the HF model's parameters, used in place: q/k/v/o projections, norms and MLPs are
called as modules; only attention and RoPE are written here, because they are where the cache lives.

    StaticModel   one model: KV cache for ``slots`` sequences, RoPE tables, graphs per (slot, T)
    StaticRunner  one sequence on one slot (the SequenceRunner the engine drives)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from decoding.runner import Tokens, as_ids


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class StaticModel:
    def __init__(
        self,
        model: PreTrainedModel,
        max_len: int,
        slots: int = 1,
        graphs: bool = True,
        max_graph_tokens: int = 9,
        compile_step: bool = False,
    ):
        cfg = model.config
        self.model = model
        self.device = model.device
        self.dtype = next(model.parameters()).dtype
        self.max_len = max_len
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.gqa = bool(self.n_kv != self.n_heads)  # a plain bool: torch.compile must not trace it
        self.layers = model.model.layers
        L = len(self.layers)
        # [slots, layers, kv_heads, max_len + scratch, head_dim]: graph warm-up and capture write
        # K/V at the scratch tail, never over a live sequence's positions
        self.scratch = max_graph_tokens
        shape = (slots, L, self.n_kv, max_len + self.scratch, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        pos = torch.arange(max_len + self.scratch, device=self.device)
        with torch.inference_mode():
            # the model's own rotary embedding: scaling variants (YaRN, linear, ...) come for free
            cos, sin = model.model.rotary_emb(self.k_cache[0, 0, 0, :1], pos[None])  # [1, max_len, hd]
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [max_len, hd]
        self.positions = pos  # [max_len + scratch]
        self.graphs_enabled = graphs and self.device.type == "cuda"
        self.max_graph_tokens = max_graph_tokens
        self._graphs: dict[tuple[int, int], _Graph] = {}
        # one memory pool for this model's graphs: they never run concurrently. Not shared across
        # models: freeing one model's graphs must not pull memory from under another's.
        self.pool = torch.cuda.graph_pool_handle() if self.graphs_enabled else None
        self._free = list(range(slots))
        self._lock = threading.Lock()
        step: Callable[..., torch.Tensor] = self._forward
        if compile_step:
            # inductor fuses the elementwise chains (RMSNorm, RoPE, SiLU-gate, residuals) into a few
            # kernels; at batch 1 kernel count, not bytes, bounds a small draft model's step. The
            # CUDA graphs above are our own, so inductor's are off; T is dynamic so one compile
            # serves every verification length (T=1 is specialised by dynamo anyway).
            step = torch.compile(self._forward, fullgraph=True, dynamic=True)
        self._step = step

    # ---- slots ------------------------------------------------------------------------------

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("no free KV-cache slot: raise `slots` to the engine's max_active")
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def runner(self, _model: PreTrainedModel | None = None) -> StaticRunner:
        """The engine's runner factory (the argument is the HF model, already known here)."""
        return StaticRunner(self, self.acquire())

    # ---- the forward pass ---------------------------------------------------------------------

    def _forward(self, slot: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids, pos: [T] -> logits [T, V]. Writes K/V for ``pos`` into the slot's cache."""
        T = ids.shape[0]
        x = self.model.model.embed_tokens(ids)  # [T, D]
        cos, sin = self.cos[pos][None], self.sin[pos][None]  # [1, T, hd]
        mask = self.positions[None, :] <= pos[:, None]  # [T, max_len] causal over the whole cache
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(T, self.n_heads, self.head_dim).transpose(0, 1)  # [H, T, hd]
            k = attn.k_proj(h).view(T, self.n_kv, self.head_dim).transpose(0, 1)  # [KV, T, hd]
            v = attn.v_proj(h).view(T, self.n_kv, self.head_dim).transpose(0, 1)
            if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kc, vc = self.k_cache[slot, i], self.v_cache[slot, i]  # [KV, max_len, hd]
            kc.index_copy_(1, pos, k)
            vc.index_copy_(1, pos, v)
            o = F.scaled_dot_product_attention(
                q[None], kc[None], vc[None], attn_mask=mask, enable_gqa=self.gqa
            )  # [1, H, T, hd]
            x = x + attn.o_proj(o[0].transpose(0, 1).reshape(T, self.n_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(self.model.model.norm(x))  # [T, V]

    @torch.inference_mode()
    def forward(self, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        T = ids.shape[0]
        assert start + T <= self.max_len, f"sequence of {start + T} tokens exceeds the static cache ({self.max_len})"
        if self.graphs_enabled and self.max_graph_tokens >= T:
            key = (slot, T)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._graphs[key] = _Graph(self, slot, T)
            return graph.replay(ids, start)
        pos = self.positions[start : start + T]
        return self._step(slot, ids, pos)

    def capture(self, token_counts: range) -> None:
        """Capture graphs ahead of the first request (otherwise on first use)."""
        for slot in range(self.k_cache.shape[0]):
            for T in token_counts:
                if self.graphs_enabled and (slot, T) not in self._graphs:
                    self._graphs[(slot, T)] = _Graph(self, slot, T)


class _Graph:
    """One CUDA graph for (slot, T): static input buffers in, a static logits buffer out."""

    def __init__(self, m: StaticModel, slot: int, T: int):
        self.ids = torch.zeros(T, dtype=torch.long, device=m.device)
        self.start = torch.full((1,), m.max_len, dtype=torch.long, device=m.device)  # the scratch tail
        self.offsets = torch.arange(T, device=m.device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (cuBLAS handles, autotuning)
                m._step(slot, self.ids, self.start + self.offsets)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=m.pool):
            self.out = m._step(slot, self.ids, self.start + self.offsets)

    def replay(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        self.ids.copy_(ids, non_blocking=True)
        self.start.fill_(start)
        self.graph.replay()
        return self.out.clone()  # the buffer is overwritten by the next replay


class StaticRunner:
    def __init__(self, model: StaticModel, slot: int):
        self.m = model
        self.slot = slot
        self._length = 0
        self.prefill_chunk = 512

    @property
    def length(self) -> int:
        return self._length

    def forward(self, tokens: Tokens, logits: bool = True) -> torch.Tensor | None:
        ids = as_ids(tokens, self.m.device)
        outs = []
        for s in range(0, ids.shape[0], self.prefill_chunk):
            chunk = ids[s : s + self.prefill_chunk]
            outs.append(self.m.forward(self.slot, chunk, self._length))
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
