"""Token ids in, text out, safely: an incremental detokenizer and a stop-string matcher.

``IncrementalDetokenizer`` decodes a sliding window of tokens (the approach vLLM takes in
``detokenizer_utils``) so each new token costs a short decode rather than a decode of the whole
output, and it holds text back while the window ends in U+FFFD: a multi-byte character split
across byte-level tokens decodes to U+FFFD until its last byte arrives. Bytes that never become a
character (random weights emit them) are released as U+FFFD once a later token proves them invalid,
or at ``flush``; they never raise.

``StopMatcher`` finds stop strings across token boundaries and never releases text that could be the
start of a stop string: it holds back the longest tail of the pending text that is a prefix of any
stop, so a stop's first characters cannot leak into a stream.

Streaming and non-streaming responses both run text through these two classes, so the streamed
deltas concatenate to exactly the non-streamed text by construction.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
# Tokens of prompt context decoded with the output. Sentencepiece-style tokenizers drop a leading
# space when a window starts at a word, so the window starts a few tokens back in the prompt.
PROMPT_CONTEXT = 4


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], **kwargs: object) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT:]
        self.tokens: list[int] = context
        self.prefix_offset = 0  # window start
        self.read_offset = len(context)  # tokens before this were already released as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` completes (often "", while a character is still incomplete)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # nothing new, or a character still incomplete: hold back
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix) :]

    def flush(self) -> str:
        """Whatever is held back (bytes that never completed a character come out as U+FFFD)."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix) :]


class StopMatcher:
    """Feed text pieces (one a token); get back what is safe to send and whether a stop string ended
    the output. A stop counts only where it ends in a piece after the first ``after`` (vLLM's
    min_tokens: no stop before them), so a stop string ending among them is output, while one that
    begins among them and ends after them ends the output where it begins, as vLLM cuts it: their
    text is held back like any other that could start a stop."""

    def __init__(self, stops: list[str], after: int = 0):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False
        self.unarmed = after  # pieces still to pass before stops count

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        searched = len(self.pending)  # a stop must end after this: in ``text``
        self.pending += text
        if self.unarmed > 0:
            self.unarmed -= 1
            searched = len(self.pending)
        starts = (self.pending.find(s, max(0, searched - len(s) + 1)) for s in self.stops)
        cut = min((i for i in starts if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = self._held_tail()
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
        return out

    def flush(self) -> str:
        """End of output without a stop: the held tail was not a stop after all."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out

    def _held_tail(self) -> int:
        """Length of the longest tail of ``pending`` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(s[:n]):
                    best = n
                    break
        return best


# ---- one token as logprobs show it ---------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``), character -> byte: printable bytes
    stand for themselves, the rest for 256 + their rank. By hand because the gateway imports no
    transformers, and tokenizers exposes no byte table; the mapping is fixed by the format."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in table.values())
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


BYTE_LEVEL = _byte_level_alphabet()


def _raw_bytes(piece: str) -> bytes | None:
    """A vocabulary entry's bytes: byte-level BPE's (Qwen, Llama 3, GPT-2) or a SentencePiece byte
    token's (``<0xF0>``); None for any other."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if piece and all(c in BYTE_LEVEL for c in piece):
        return bytes(BYTE_LEVEL[c] for c in piece)
    return None


def token_texts(tok: object, ids: list[int], skip_special: bool = False) -> dict[int, str]:
    """Each id's text as logprobs show it: the token decoded alone (a special token as "" with
    ``skip_special``, as a completion's text leaves it out), or, where that is not whole
    UTF-8 (part of a character split across tokens, which decodes to U+FFFD), ``bytes:\\xNN...`` with
    its raw bytes, as OpenAI writes such tokens. ``logprob_bytes`` reads either back to the token's
    bytes, so a client can rebuild the characters; distinct pieces of one character stay distinct
    (they were all U+FFFD)."""
    distinct = sorted(set(ids))
    decode = tok.batch_decode  # type: ignore[attr-defined]
    texts = decode(
        [[t] for t in distinct], skip_special_tokens=skip_special, clean_up_tokenization_spaces=False
    )
    out = dict(zip(distinct, (str(t) for t in texts), strict=True))
    split = [t for t in distinct if REPLACEMENT in out[t]]
    if split:
        pieces = tok.convert_ids_to_tokens(split)  # type: ignore[attr-defined]
        for t, piece in zip(split, pieces, strict=True):
            raw = _raw_bytes(piece) if isinstance(piece, str) else None
            if raw is None:
                continue
            try:
                out[t] = raw.decode("utf-8")  # a real U+FFFD in the vocabulary, or whole after all
            except UnicodeDecodeError:
                out[t] = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return out


def logprob_bytes(token: str) -> bytes:
    """A logprob token's bytes (``token_texts``): ``bytes:\\xNN...`` read back, else its UTF-8."""
    if token.startswith("bytes:\\x"):
        try:
            return bytes(int(h, 16) for h in token[len("bytes:\\x") :].split("\\x"))
        except ValueError:
            pass
    return token.encode("utf-8", errors="replace")
