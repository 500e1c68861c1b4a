"""What a request looks like to the cache: its keys, its semantic eligibility, its controls.

The exact key hashes everything that can change the output. Rather than list the parameters that
matter, it drops the few that provably do not (transport and bookkeeping fields, and ``speculative``,
which is lossless) and keeps every other field of the body: a parameter added to the API later splits
the key instead of silently sharing answers across it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Endpoint = Literal["chat", "completions"]
# bump when the key layout or normalisation changes: old entries stop matching (v2, 2026-12-05:
# text is no longer NFC-normalised, nor nulls inside values dropped, so entries keyed by another
# form's text or by a schema without its nulls are not served)
KEY_VERSION = "v2"

# Body fields that never change the generated text. `speculative` is lossless (verification
# reproduces the target's distribution exactly), so speculative and plain requests share entries.
_NOT_OUTPUT = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "speculative",
        "cache",
        "user",
        "metadata",
        "store",
    }
)
# Values equal to the API's documented neutral value are dropped so `n: 1` and no `n` share a key.
# temperature is not here: its default is the gateway's choice, so absent and 1.0 stay distinct.
_NEUTRAL: dict[str, Any] = {
    "n": 1.0,
    "top_p": 1.0,
    "top_k": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0.0,
    "ignore_eos": False,
    "stop": [],
    "logit_bias": {},
    "echo": False,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template_kwargs": {},
}


class CacheControlError(ValueError):
    """A malformed ``cache`` body field; the gateway answers 400 with ``param="cache"``."""

    param = "cache"


@dataclass(frozen=True)
class CacheControls:
    no_cache: bool = False  # skip the lookup (still store the fresh answer)
    no_store: bool = False  # do not store this answer
    ttl_s: int | None = None


@dataclass
class CacheQuery:
    """One request as the cache sees it. Build with ``build_query``; the cache fills ``embedding``
    during lookup so that storing the answer afterwards does not embed the text twice."""

    tenant: str
    model: str
    exact_key: str  # hex digest
    scope_key: str  # hex digest: everything but the final user text (semantic neighbours share it)
    semantic_text: str | None  # None: exact tier only
    controls: CacheControls = CacheControls()
    prompt_tokens: int | None = None  # the gateway's count for this request, used in a hit's usage
    embedding: np.ndarray | None = field(default=None, repr=False)  # [dim] float32, unit norm

    @property
    def tenant_tag(self) -> str:
        """Hash tag shared by all of a tenant's keys: one Redis Cluster slot per tenant."""
        return _digest(self.tenant)[:16]


def _digest(s: str) -> str:
    return hashlib.blake2b(s.encode("utf-8"), digest_size=16).hexdigest()


def _canon(value: Any) -> Any:
    """Numbers as floats (0 == 0.0; integers past 2**53 as their digits), mappings sorted later.
    A null inside a value is kept: ``{"const": null}`` in a schema pins the value where ``{}`` admits
    any, and a tool's schema is rendered into the prompt nulls and all (the callers drop the
    None-valued fields of the body and of each message, which mean "absent"). Strings stay as sent,
    not NFC-normalised: a composed and a decomposed "é" are other tokens to a tokenizer without an
    NFC step (byte-level BPE), so another prompt and maybe another answer, and a stop string
    matches the text in one form only."""
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, int) and abs(value) > 2**53:
        return str(value)  # past float64's integers: seeds 2**62 and 2**62 + 1 were one key
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _canon(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    return str(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _message_text(content: Any) -> str | None:
    """Plain text of a message's content, or None when it holds anything but text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


def _normalise_messages(messages: Any) -> list[Any]:
    out = []
    for m in messages if isinstance(messages, list) else []:
        m = {k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else {"content": m}
        m = _canon(m)
        text = _message_text(m.get("content"))
        if text is not None:
            m["content"] = text  # a single-text-part list and a string render the same prompt
        out.append(m)
    return out


def output_params(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's output-relevant parameters, canonical (neutral values and transport fields dropped)."""
    params = {k: _canon(v) for k, v in body.items() if k not in _NOT_OUTPUT and v is not None}
    if "max_completion_tokens" in params and "max_tokens" not in params:
        params["max_tokens"] = params.pop("max_completion_tokens")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    return {k: v for k, v in params.items() if not (k in _NEUTRAL and v == _NEUTRAL[k])}


def cacheable(body: Mapping[str, Any]) -> bool:
    """Logprobs are not stored, so requests that ask for them are neither looked up nor stored."""
    return not body.get("logprobs") and not body.get("top_logprobs")


def deterministic(body: Mapping[str, Any], default_temperature: float) -> bool:
    """Greedy or seeded: the same request gives the same answer, so replaying it is faithful. An
    unseeded sampled request asks for a fresh sample each time; a replay would silently break that."""
    temperature = body.get("temperature")
    temperature = default_temperature if temperature is None else float(temperature)
    return temperature == 0 or body.get("top_k") == 1 or body.get("seed") is not None


def build_query(
    body: Mapping[str, Any],
    *,
    tenant: str,
    endpoint: Endpoint,
    controls: CacheControls = CacheControls(),
    default_temperature: float = 1.0,
    semantic_max_temperature: float = 0.0,
    semantic_max_chars: int = 1000,
    embedder_id: str = "",
    prompt_tokens: int | None = None,
) -> CacheQuery:
    """A ``CacheQuery`` for a chat (``messages``) or legacy completions (``prompt``) request body.

    ``default_temperature`` is what the gateway uses when the body has none: it decides semantic
    eligibility (the key itself keeps "absent" distinct from any value).
    """
    model = str(body.get("model", ""))
    params = output_params(body)
    head = [KEY_VERSION, tenant, model, endpoint, params]
    # Only a question answered in a new assistant turn may hit by similarity. A continuation (a
    # legacy completion, a chat turn continued in place or left open without a generation prompt)
    # goes on from its text's last character: "x = [10, 20" and "x = [10, 20," embed at 0.99, and
    # the one's continuation after the other's prompt is broken code.
    text: Any = None
    if endpoint == "chat":
        messages = _normalise_messages(body.get("messages"))
        exact = _dumps([*head, messages])
        context, last = messages[:-1], (messages[-1] if messages else {})
        answers = body.get("add_generation_prompt", True) is not False and not body.get(
            "continue_final_message"
        )
        if last.get("role") == "user" and answers:
            text = last.get("content")
    else:
        prompt = _canon(body.get("prompt"))
        exact = _dumps([*head, prompt])
        context = []
    temperature = body.get("temperature")
    temperature = default_temperature if temperature is None else float(temperature)
    semantic_ok = (
        isinstance(text, str)
        and 0 < len(text.strip()) <= semantic_max_chars
        and temperature <= semantic_max_temperature
        and not body.get("tools")
        and not body.get("functions")
    )
    scope = _dumps([*head, context, "semantic", embedder_id])
    return CacheQuery(
        tenant=tenant,
        model=model,
        exact_key=_digest(exact),
        scope_key=_digest(scope),
        semantic_text=text if semantic_ok and isinstance(text, str) else None,
        controls=controls,
        prompt_tokens=prompt_tokens,
    )


def parse_controls(headers: Mapping[str, str], body: Mapping[str, Any], max_ttl_s: int) -> CacheControls:
    """``Cache-Control: no-cache|no-store`` request headers and the ``cache`` body field
    (``{"no_cache": bool, "no_store": bool, "ttl": seconds}``); either one can switch a control on."""
    value = ",".join(v for k, v in headers.items() if k.lower() == "cache-control")  # any case, repeated
    directives = {d.strip().split("=")[0].lower() for d in value.split(",")}
    raw = body.get("cache")
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise CacheControlError('`cache` must be an object like {"no_cache": true, "ttl": 60}')
    unknown = set(raw) - {"no_cache", "no_store", "ttl"}
    if unknown:
        # a client's names, quoted: a few, each cut (a body may hold thousands of them)
        names = ", ".join(repr(str(n)[:40]) for n in sorted(unknown)[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise CacheControlError(f"unknown `cache` field(s): {names}{more}")
    for name in ("no_cache", "no_store"):
        if name in raw and not isinstance(raw[name], bool):
            raise CacheControlError(f"`cache.{name}` must be a boolean")
    ttl = raw.get("ttl")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= max_ttl_s):
        raise CacheControlError(f"`cache.ttl` must be an integer number of seconds in [1, {max_ttl_s}]")
    return CacheControls(
        no_cache="no-cache" in directives or bool(raw.get("no_cache")),
        no_store="no-store" in directives or bool(raw.get("no_store")),
        ttl_s=ttl,
    )
