"""How many requests a deployment runs at once when its configuration does not say
(``limits.max_active``): on a CPU a fixed 4, on a GPU what every model's KV slots fit in the device's
free memory, from each model's config alone (nothing is loaded to size it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from decoding.loader import ModelSpec, pick_device, pick_dtype, resolve, serving_context, unreadable

log = logging.getLogger("specgate.loader")

# limits.max_active when unset: on a CPU, 4 (a B-row step there costs up to B one-row steps, so more
# rows buy little; docs/benchmarks.md, cpu-batch); on a GPU, as many requests as every model's KV slots
# (two per request and model: a target's and a draft's) fit in the device's free memory once the
# weights are in, less a reserve for what grows with the batch: activations, each captured graph's
# logits buffer, the graph pool. At most MAX_ACTIVE_GPU: twice that is the largest batch bucket.
CPU_MAX_ACTIVE = 4
MAX_ACTIVE_GPU = 64
GPU_RESERVE = 0.1  # of the device's total memory, and GPU_RESERVE_BYTES more
GPU_RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class Footprint:
    """What a model holds on its device: weights, and KV cache bytes per slot at its context."""

    weight_bytes: int
    slot_bytes: int


def max_active_for(free: int, total: int, footprints: list[Footprint]) -> int:
    """Requests whose slots fit in ``free`` bytes of a ``total``-byte device (see MAX_ACTIVE_GPU)."""
    room = free - sum(f.weight_bytes for f in footprints) - GPU_RESERVE * total - GPU_RESERVE_BYTES
    per_request = 2 * sum(f.slot_bytes for f in footprints)
    return max(1, min(MAX_ACTIVE_GPU, int(room // per_request) if per_request else MAX_ACTIVE_GPU))


def footprint(spec: ModelSpec, device: torch.device, pull: bool = True) -> Footprint:
    """``spec``'s weights and KV bytes per slot from its config alone (parameters counted on the
    meta device: nothing is allocated or read but the config)."""
    where, gguf = resolve(spec.source, pull=pull)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        config = AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as exc:  # as load() reports it
        raise unreadable(spec, exc) from exc
    dtype = pick_dtype(spec.dtype, device)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * size
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * size
    context = serving_context(spec, text)
    # a static cache leaves room for one more padded step, rounded to 16 (StaticModel.cache_len)
    return Footprint(weights, per_token * -(-(context + 16) // 16) * 16)


def default_max_active(specs: list[ModelSpec], pull: bool = True) -> int:
    """limits.max_active when the configuration leaves it unset (see CPU_MAX_ACTIVE)."""
    by_device: dict[torch.device, list[Footprint]] = {}
    for s in specs:
        device = pick_device(s.device)
        if device.type == "cuda":
            device = torch.device(
                "cuda", torch.cuda.current_device() if device.index is None else device.index
            )
            by_device.setdefault(device, []).append(footprint(s, device, pull))
    if not by_device:
        return CPU_MAX_ACTIVE
    sizes = []
    for device, prints in by_device.items():  # every device must hold its models' slots
        free, total = torch.cuda.mem_get_info(device)
        sizes.append(max_active_for(free, total, prints))
        log.info(
            "max_active %d on %s: %.1f of %.1f GiB free, weights %.1f GiB, %.0f MiB of KV cache a request",
            sizes[-1],
            torch.cuda.get_device_name(device),
            free / 2**30,
            total / 2**30,
            sum(f.weight_bytes for f in prints) / 2**30,
            2 * sum(f.slot_bytes for f in prints) / 2**20,
        )
    return min(sizes)
