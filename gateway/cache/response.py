"""What the cache stores and returns: the generated choices and token counts, nothing of the prompt."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

# Only finished generations are reusable: "abort"/"error" (or a stream cut by a disconnect) are not.
STORABLE_FINISH = frozenset({"stop", "length", "tool_calls"})
_ZLIB_ABOVE = 1024  # bytes; short answers stay plain JSON (readable in redis-cli, nothing to gain)


@dataclass(frozen=True)
class CachedChoice:
    index: int
    text: str
    finish_reason: str
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class CachedResponse:
    choices: tuple[CachedChoice, ...]
    prompt_tokens: int
    completion_tokens: int
    created: int = 0  # unix seconds of the generation that produced it (informational)
    prediction_tokens: tuple[int, int] | None = None  # Predicted Outputs' (accepted, rejected), if any

    @property
    def storable(self) -> bool:
        return bool(self.choices) and all(c.finish_reason in STORABLE_FINISH for c in self.choices)

    def to_bytes(self) -> bytes:
        raw = json.dumps(
            {
                "c": [[c.index, c.text, c.finish_reason, c.tool_calls] for c in self.choices],
                "p": self.prompt_tokens,
                "n": self.completion_tokens,
                "t": self.created,
                **({"q": list(self.prediction_tokens)} if self.prediction_tokens else {}),
            },
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8")
        return b"z" + zlib.compress(raw, 6) if len(raw) > _ZLIB_ABOVE else raw

    @classmethod
    def from_bytes(cls, blob: bytes) -> CachedResponse:
        raw = zlib.decompress(blob[1:]) if blob[:1] == b"z" else blob
        d = json.loads(raw)
        choices = tuple(CachedChoice(int(i), str(t), str(f), tc) for i, t, f, tc in d["c"])
        q = d.get("q")
        prediction = (int(q[0]), int(q[1])) if q else None
        return cls(choices, int(d["p"]), int(d["n"]), int(d.get("t", 0)), prediction)


@dataclass(frozen=True)
class CacheHit:
    tier: Literal["exact", "semantic"]
    similarity: float  # 1.0 for exact hits; cosine of the embeddings for semantic ones
    response: CachedResponse = field(repr=False)

    @property
    def header(self) -> str:
        return header_value(self)


def header_value(hit: CacheHit | None) -> str:
    """The ``x-specgate-cache`` response header: ``exact; similarity=1.0000``,
    ``semantic; similarity=0.9731`` or ``miss`` (one shape for both tiers: clients parse one format)."""
    if hit is None:
        return "miss"
    return f"{hit.tier}; similarity={hit.similarity:.4f}"
