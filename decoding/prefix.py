"""The KV slots of one llama.cpp context as a prefix cache across requests (issue 50): what each slot's
KV holds, and which slot a new request's prompt should take.

A finished request's slot keeps its KV and the tokens it holds. A new request takes the free slot that
shares the longest *reusable* prefix with its prompt and prefills only the rest; where a longer one
sits in a slot it should not take (a running request's, or a free one holding more of another
conversation), that prefix is copied into a free slot instead (``Take.source``). Without a useful
prefix, the least recently used free slot. A slot a running request owns is never handed out.

Reusable, in exact mode (``strict``): only whole prefill pieces, each ``unit`` tokens at a multiple of
``unit`` and decoded alone, contiguous from position 0, up to the largest such boundary within the
common prefix. llama.cpp rounds a position's KV by the width of the batch it was computed in, so
only pieces that a cold prefill of the new prompt computes identically (same tokens, same positions,
same width, same cache before them) give the same bits; the rest is prefilled again on the same grid
(``Engine.prefill_chunks``). Loose (a draft whose bits cannot change the output): the whole common
prefix. docs/architecture.md, "Prefix caching", says why and what it leaks.

A request's ``salt`` (vLLM's ``cache_salt``) keys what it may reuse: a slot written under another
salt (or under none, for a salted request) offers it nothing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

from decoding.errors import NoFreeSlot


@dataclass
class Held:
    """What one slot's KV holds."""

    tokens: list[int] = field(default_factory=list)  # the token at each cached position
    exact: int = 0  # positions [0, exact) were computed in whole pieces of ``unit`` tokens, each alone
    unit: int | None = None  # the piece width of the slot's owner (None: its pieces are not tracked)
    salt: str | None = None
    used: int = 0  # when it was last given back (least recently used goes first)


class Take(NamedTuple):
    """A slot for a request: its KV keeps positions [0, reuse) (from ``source``'s first, when set)."""

    slot: int
    reuse: int
    source: int | None = None


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = max(0, min(len(a), len(b), limit))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotCache:
    """The slots of one context: free or owned, and what each one holds. Taken and given back from
    the engine's thread (others read ``free``); every method holds the lock."""

    def __init__(self, slots: int, min_copy: int = 64):
        self.held = [Held() for _ in range(slots)]
        self._free = set(range(slots))
        self._lock = threading.Lock()
        self._tick = 0
        # a copy moves a whole KV stream (llama_memory_seq_cp between streams): worth it from this
        # many tokens more than the best free slot offers
        self.min_copy = min_copy

    def __len__(self) -> int:
        return len(self._free)

    def reusable(self, slot: int, tokens: list[int], unit: int | None, strict: bool, salt: str | None) -> int:
        """Positions of ``slot``'s KV a request for ``tokens`` may keep (at most all but the last
        token, which its first step feeds)."""
        h = self.held[slot]
        if h.salt != salt:
            return 0
        n = common_prefix(h.tokens, tokens, len(tokens) - 1)
        if not strict:
            return n
        if unit is None or h.unit != unit:
            return 0
        return min(n, h.exact) // unit * unit

    def take(
        self,
        tokens: list[int] | None = None,
        unit: int | None = None,
        strict: bool = True,
        salt: str | None = None,
        mine: int | None = None,
    ) -> Take:
        """A free slot for a request whose prompt is ``tokens`` and the prefix it keeps; the slot
        now holds that prefix under ``salt`` and ``unit``, the width of the prefill pieces its runner
        computes. ``tokens`` None: the least recently used slot, reserved as it is (its record
        stays until it is written over; ``take`` with the prompt then chooses again); [] keeps
        nothing. ``mine``: the slot the caller owns now, given back (in its old place in the LRU
        order) to be chosen among the free ones."""
        with self._lock:
            if mine is not None:
                self._free.add(mine)
            if not self._free:
                raise NoFreeSlot
            lru = min(self._free, key=lambda s: self.held[s].used)
            if tokens is None:
                self._free.discard(lru)
                return Take(lru, 0)

            def offer(s: int) -> int:
                return self.reusable(s, tokens, unit, strict, salt)

            best = max(sorted(self._free, key=lambda s: self.held[s].used), key=offer)  # ties: LRU
            found = max(range(len(self.held)), key=lambda s: (offer(s), s in self._free))
            if found not in self._free and offer(found) >= offer(best) + self.min_copy:
                # a running request holds it: copied into the least recently used free slot
                return self._own(Take(lru, offer(found), found), unit, salt)
            others = self._free - {best}
            if offer(best) and others and self._kept(best, strict) - offer(best) >= self.min_copy:
                # taking it would cut another conversation short: its prefix goes to the LRU slot
                victim = min(others, key=lambda s: self.held[s].used)
                return self._own(Take(victim, offer(best), best), unit, salt)
            return self._own(Take(best, offer(best)), unit, salt)

    def _kept(self, slot: int, strict: bool) -> int:
        """What a slot offers at most: its exact prefix (strict), or all it holds."""
        h = self.held[slot]
        return h.exact if strict else len(h.tokens)

    def _own(self, take: Take, unit: int | None, salt: str | None) -> Take:
        self._free.discard(take.slot)
        src = self.held[take.source if take.source is not None else take.slot]
        exact = min(src.exact, take.reuse) if src.unit == unit else 0
        self.held[take.slot] = Held(src.tokens[: take.reuse], exact, unit, salt, self.held[take.slot].used)
        return take

    def give_back(self, slot: int) -> None:
        """``slot`` is free, its KV kept, and counts as used now (least recently used goes first)."""
        with self._lock:
            self._tick += 1
            self.held[slot].used = self._tick
            self._free.add(slot)

    def wrote(self, slot: int, start: int, tokens: list[int], alone: bool) -> None:
        """``tokens`` went into ``slot``'s KV at positions from ``start`` (the slot held exactly
        ``start`` before); ``alone``: in a llama_decode of their own. A whole piece on the grid,
        right after the exact prefix, extends it."""
        h = self.held[slot]
        assert start <= len(h.tokens), f"a write at {start} past the {len(h.tokens)} held positions"
        del h.tokens[start:]
        h.tokens += tokens
        h.exact = min(h.exact, start)
        u = h.unit
        if alone and u is not None and start == h.exact and start % u == 0 and len(tokens) == u:
            h.exact += u

    def cut(self, slot: int, length: int) -> None:
        h = self.held[slot]
        del h.tokens[length:]
        h.exact = min(h.exact, length)

    def forget(self, slot: int) -> None:
        """Its KV is gone or in doubt (a failed decode): it holds nothing."""
        self.held[slot].tokens.clear()
        self.held[slot].exact = 0
