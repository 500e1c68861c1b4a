"""One sequence's view of a causal LM: a KV cache that grows with forward passes and is cut back
after a verification rejects drafted tokens.

The eager runner uses transformers' DynamicCache (``crop`` cuts it back). The CUDA fast path
(``decoding.static``) provides the same methods over a static cache captured in CUDA graphs.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

import torch
from transformers import DynamicCache, PreTrainedModel

from decoding.errors import NoFreeSlot

Tokens = list[int] | torch.Tensor  # [T] on any device


def as_ids(tokens: Tokens, device: torch.device) -> torch.Tensor:
    """[T] long tensor on ``device``. A host list is copied without waiting: ``torch.tensor(...,
    device=cuda)`` synchronises the stream, which would stall the host behind every queued kernel."""
    if isinstance(tokens, torch.Tensor):
        return tokens.to(device=device, dtype=torch.long)
    return torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)


# Which positions' logits a row returns: every position's, the last one's, none; "prompt": every
# position's, to score a prompt's tokens (StepOutput.prompt_logprobs), which are reported and never
# verified, so exact mode need not compute them as one-token steps would (decoding.llamacpp)
Want = Literal["all", "last", "none", "prompt"]


@dataclass
class Row:
    """One sequence's tokens in a batched step."""

    slot: int  # its KV slot
    tokens: torch.Tensor  # [T] long, on the model's device
    start: int  # cache position of tokens[0] (the sequence's length before the step)
    logits: Want = "all"


@dataclass
class StepRows:
    """A batched forward pass, flattened: ``batch`` short rows padded to ``width`` tokens first
    (decode and verification), then ``singles`` (prefill chunks), each attending on its own."""

    ids: torch.Tensor  # [N] token ids, N = batch * width + sum of the singles' T
    pos: torch.Tensor  # [N] cache position of each token
    slot_of: torch.Tensor  # [N] KV slot of each token
    batch: int  # B short rows
    width: int  # W tokens per short row (padding included)
    slots: torch.Tensor  # [B] KV slot of each short row
    attn_len: int  # cache positions the short rows attend over
    one_slot: int | None  # B == 1: that row's slot (its cache is read as a view, not gathered)
    singles: list[tuple[int, int, int]]  # (slot, T, attended length) per long row (SDPA)
    # the long rows for the fused chunk kernel instead of ``singles``: [R, 4] (slot, start, index of
    # the first token after the short rows, T); rows with T = 0 are unused (a captured graph's spares)
    chunks: torch.Tensor | None = None
    logit_rows: int | None = None  # logits of the first this many tokens only (None: every token)


class FreeSlots:
    """The free KV slots of a pool, taken and given back from the engine's thread and others."""

    def __init__(self, n: int):
        self._free = list(range(n))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._free)

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise NoFreeSlot
            return self._free.pop()

    def give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class PooledSlots:
    """The slot bookkeeping of a batched model's KV pool (``decoding.static``, ``decoding.llamacpp``):
    its free slots, taken by a runner and given back when the sequence ends."""

    _free: FreeSlots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        return self._free.take()

    def release(self, slot: int) -> None:
        self._free.give_back(slot)


class SlotPool(Protocol):
    device: torch.device

    def release(self, slot: int) -> None: ...


PoolT = TypeVar("PoolT", bound=SlotPool)


class SlotRunner(Generic[PoolT]):
    """One sequence's handle on a batched model's KV pool (``decoding.static``, ``decoding.llamacpp``):
    its slot and its length. Several runners of one model run one forward pass through the model's
    ``forward_rows`` / ``forward_batch``; ``exact`` groups them (rows of one step share the mode)."""

    def __init__(self, model: PoolT, slot: int, exact: bool):
        self.m = model
        self.slot = slot
        self.exact = exact
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch_model(self) -> PoolT:
        return self.m

    def advance(self, n: int) -> int:
        """The cache position of this sequence's next token, before ``n`` more are appended."""
        start = self._length
        self._length += n
        return start

    def row(self, tokens: Tokens, logits: Want = "all") -> Row:
        """This sequence's next ``tokens`` as a row of a batched step; the length moves on."""
        ids = as_ids(tokens, self.m.device)
        r = Row(self.slot, ids, self._length, logits)
        self._length += int(ids.shape[0])
        return r

    def crop(self, length: int) -> None:
        assert 0 <= length <= self._length, f"crop to {length} outside cache of {self._length}"
        self._length = length  # stale positions past it are overwritten before they are read

    def reuse(self, tokens: list[int], exact: bool, salt: str | None = None, chunk: int | None = None) -> int:
        return 0  # no prefix kept across requests (decoding.llamacpp's runner keeps them)

    def release(self) -> None:
        if self.slot >= 0:
            self.m.release(self.slot)
            self.slot = -1


class SequenceRunner(Protocol):
    @property
    def length(self) -> int:
        """Tokens held in the KV cache."""
        ...

    def forward(self, tokens: Tokens, logits: bool = True) -> torch.Tensor | None:
        """Append ``tokens`` to the cache; return their next-token logits [len(tokens), V]
        (``logits=False``: prefill, nothing returned and no [T, V] tensor built). A device tensor
        of tokens is used where it is, without a host sync."""
        ...

    @property
    def max_step_tokens(self) -> int | None:
        """The most tokens one step may take (exact mode: more would round differently); None: any."""
        ...

    def crop(self, length: int) -> None:
        """Forget everything after the first ``length`` cached tokens."""
        ...

    def reuse(self, tokens: list[int], exact: bool, salt: str | None = None, chunk: int | None = None) -> int:
        """Before the first step of a sequence starting with ``tokens``: keep the longest prefix of
        them that a finished sequence left in the model's KV (prefix caching; ``exact``: only what
        recomputes to the same bits, on the grid of ``chunk``-token prompt chunks; ``salt``: only
        what was cached under the same salt); the tokens kept, now in the cache (0: none)."""
        ...

    def release(self) -> None: ...


# Exact mode's step width (static backends): every step of up to this many tokens (a decode, a
# verification of k <= 8 drafted tokens) runs as this many rows; see docs/architecture.md, Exact mode
# (also why the eager runner has no exact mode).
EXACT_WIDTH = 9


class EagerRunner:
    def __init__(self, model: PreTrainedModel, prefill_chunk: int = 512):
        self.model = model
        self.device = model.device
        self.cache = DynamicCache(config=model.config)
        self._length = 0
        self.prefill_chunk = prefill_chunk
        self._cache_kw = cache_kwarg(model)

    @property
    def length(self) -> int:
        return self._length

    @property
    def max_step_tokens(self) -> int | None:
        return None  # no exact mode here (see EXACT_WIDTH)

    def reuse(self, tokens: list[int], exact: bool, salt: str | None = None, chunk: int | None = None) -> int:
        return 0  # a fresh DynamicCache per sequence

    @torch.inference_mode()
    def forward(self, tokens: Tokens, logits: bool = True) -> torch.Tensor | None:
        ids_all = as_ids(tokens, self.device)
        outs = []
        # Chunked prefill bounds peak activation memory on long prompts, and a prefill keeps one
        # row of logits: [T, 151936] float32 for a long prompt would be gigabytes.
        for start in range(0, ids_all.shape[0], self.prefill_chunk):
            ids = ids_all[None, start : start + self.prefill_chunk]  # [1, T]
            T = ids.shape[1]
            pos = torch.arange(self._length, self._length + T, device=self.device)[None]
            out = self.model(
                input_ids=ids,
                position_ids=pos,
                use_cache=True,
                logits_to_keep=0 if logits else 1,  # 0 keeps all
                **{self._cache_kw: self.cache},
            )
            self._length += T
            if logits:
                outs.append(out.logits[0])  # [T, V]
        if not logits:
            return None
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def crop(self, length: int) -> None:
        assert 0 <= length <= self._length, f"crop to {length} outside cache of {self._length}"
        if length < self._length:
            _crop_dynamic_cache(self.cache, length)
            self._length = length

    def release(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._length = 0


def _crop_dynamic_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer.

    Written here because ``DynamicCache.crop`` changed meaning within transformers 5.x (an absolute
    length before, a negative count of tokens to drop in 5.2x); slicing the layers' tensors means
    the same thing in every version that has ``cache.layers``.
    """
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is not None and values is not None and keys.numel():
            layer.keys = keys[..., :length, :]  # type: ignore[union-attr]
            layer.values = values[..., :length, :]  # type: ignore[union-attr]


def cache_kwarg(model: PreTrainedModel) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in 5.2x; pass whichever this one takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_many(
    runners: list[SequenceRunner], tokens: list[torch.Tensor], wants: list[Want]
) -> list[torch.Tensor | None]:
    """Append each runner's tokens and return its logits as ``wants`` asks: one forward pass where
    the runners share a batched model (``decoding.static``), one per sequence otherwise (the eager
    runner: transformers' DynamicCache cannot cut one row back without the others)."""
    out: list[torch.Tensor | None] = [None] * len(runners)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, r in enumerate(runners):
        model = getattr(r, "batch_model", None)
        if model is None:
            logits = r.forward(tokens[i], logits=wants[i] != "none")
            out[i] = None if logits is None else (logits[-1:] if wants[i] == "last" else logits)
        else:
            groups.setdefault((id(model), bool(getattr(r, "exact", False))), []).append(i)
    for (_, exact), idx in groups.items():
        model = runners[idx[0]].batch_model  # type: ignore[attr-defined]
        rows = [runners[i].row(tokens[i], wants[i]) for i in idx]  # type: ignore[attr-defined]
        for i, logits in zip(idx, model.forward_rows(rows, exact), strict=True):
            out[i] = logits
    return out
