"""Our Llama/Qwen2-family decoder layer as free functions over fused weights: RMSNorm, q/k/v with RoPE,
attention over a row's cache, and the SiLU-gated MLP; plus the load-time fusion of q/k/v and gate/up
into one matmul each, and the check that a model fits the layer. ``decoding.static`` runs them over
its static KV cache, captured in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from decoding.errors import ModelLoadError

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


class Ops(NamedTuple):
    """The layer's two reductions over features: F.linear's signature and rms_norm's. Exact mode on
    CUDA swaps in kernels whose rows do not depend on the batch (decoding/invariant.py); everything
    else in the layer is per element and stays as it is."""

    linear: Callable[..., torch.Tensor]  # (x [..., K], w [N, K], bias [N] | None) -> [..., N]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


TORCH_OPS = Ops(F.linear, rms_norm)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_in(
    x: torch.Tensor,  # [N, D] every token of the step, flattened across rows
    cos: torch.Tensor,  # [N, hd]
    sin: torch.Tensor,
    w: LayerWeights,
    d: Dims,
    ops: Ops = TORCH_OPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, fused q/k/v projection and RoPE: per token, so rows of any lengths share one matmul."""
    N = x.shape[0]
    H, KV, hd = d.n_heads, d.n_kv, d.head_dim
    qkv = ops.linear(ops.rms_norm(x, w.ln1, d.eps), w.qkv, w.qkv_bias)
    q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
    q, k, v = q.view(N, H, hd), k.view(N, KV, hd), v.view(N, KV, hd)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = ops.rms_norm(q, w.q_norm, d.eps), ops.rms_norm(k, w.k_norm, d.eps)
    c, s = cos[:, None], sin[:, None]  # [N, 1, hd]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v


def attention_out(
    x: torch.Tensor,  # [N, D] the layer's input (residual)
    o: torch.Tensor,  # [N, H * hd] attention output
    w: LayerWeights,
    d: Dims,
    ops: Ops = TORCH_OPS,
) -> torch.Tensor:
    """Output projection, residual, RMSNorm and the SiLU-gated MLP: per token, like attention_in."""
    x = residual(x, ops.linear(o, w.o))
    gate, up = ops.linear(ops.rms_norm(x, w.ln2, d.eps), w.gate_up).chunk(2, dim=-1)
    return residual(x, ops.linear(F.silu(gate) * up, w.down))


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y, rounded once to x's dtype: the same numbers as ``x + y`` in eager (a bf16 add computes
    in float32), and so as HF's ``residual + o_proj(...)``, whose matmul output is rounded before the
    add (a fused addmm rounds only the sum). Spelled with casts so that inductor does not fold
    the add into the matmul before it (post_grad's add(mm) -> addmm pattern): cuBLAS's addmm first
    copies x into its output, a device copy per residual, 51 of a 0.5B draft's 330 kernels a step on
    the H200 (bench.profile_step --order), while left apart the add rides the next RMSNorm's kernel.
    In float32 the casts are no-ops and the fold happens as before; eager code adds as it is."""
    if torch.compiler.is_compiling():
        return (x.float() + y.float()).to(x.dtype)
    return x + y


def layer_entry(
    x: torch.Tensor,  # [N, D]
    cos: torch.Tensor,  # [N, hd]
    sin: torch.Tensor,
    w: LayerWeights,
    k_cache: torch.Tensor,  # [slots + 1, cache_len, KV, hd]
    v_cache: torch.Tensor,
    slot_of: torch.Tensor,  # [N] each token's slot
    pos: torch.Tensor,  # [N] each token's cache position
    d: Dims,
    ops: Ops = TORCH_OPS,
) -> torch.Tensor:
    """attention_in, and every token's K/V written into the pool (gpt-fast's KVCache.update, every
    row at once): in one compiled region the write is part of RoPE's kernel, not two more. -> q [N, H, hd]"""
    q, k, v = attention_in(x, cos, sin, w, d, ops)
    k_cache.index_put_((slot_of, pos), k)
    v_cache.index_put_((slot_of, pos), v)
    return q


def layer_boundary(
    x: torch.Tensor,  # [N, D] layer i's input (residual)
    o: torch.Tensor,  # [N, H * hd] layer i's attention output
    w: LayerWeights,  # layer i
    w_next: LayerWeights,  # layer i + 1
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # layer i + 1's
    v_cache: torch.Tensor,
    slot_of: torch.Tensor,
    pos: torch.Tensor,
    d: Dims,
    ops: Ops = TORCH_OPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything between two layers' attention: attention_out of layer i, then layer_entry of layer
    i + 1. One compiled region, so the residual add fuses into the next RMSNorm. -> (x, q)"""
    x = attention_out(x, o, w, d, ops)
    return x, layer_entry(x, cos, sin, w_next, k_cache, v_cache, slot_of, pos, d, ops)


def attend(
    q: torch.Tensor,  # [B, W, H, hd]
    k_cache: torch.Tensor,  # [B, L, KV, hd] (a view or a gather of the rows' slots)
    v_cache: torch.Tensor,
    mask: torch.Tensor,  # [B, 1, W, L] additive
    d: Dims,
) -> torch.Tensor:
    """Attention of each row's queries over its own cache: [B, W, H * hd]."""
    B, W = q.shape[:2]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k_cache.transpose(1, 2),
        v_cache.transpose(1, 2),
        attn_mask=mask,
        scale=d.scale,
        enable_gqa=d.gqa,
    )  # [B, H, W, hd]
    return o.transpose(1, 2).reshape(B, W, d.n_heads * d.head_dim)


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
