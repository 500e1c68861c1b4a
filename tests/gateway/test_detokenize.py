"""Incremental detokenizer and stop matcher on the tiny byte-level tokenizer."""

from __future__ import annotations

import random

import pytest

from decoding.tiny import byte_tokenizer
from gateway.detokenize import IncrementalDetokenizer, StopMatcher, logprob_bytes, token_texts

TOK = byte_tokenizer()


def ids(text: str) -> list[int]:
    return list(TOK(text)["input_ids"])


def stream(token_ids: list[int], prompt: list[int] | None = None) -> list[str]:
    d = IncrementalDetokenizer(TOK, prompt)
    return [d.add(t) for t in token_ids] + [d.flush()]


def test_multibyte_characters_are_held_until_complete() -> None:
    text = "aé€😀z"
    pieces = stream(ids(text), ids("prompt "))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["a", "", "é"]  # the two bytes of é: nothing, then the character


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_never_crash_and_match_a_whole_decode(seed: int) -> None:
    rng = random.Random(seed)
    byte_ids = [rng.randrange(256) for _ in range(300)]  # mostly invalid UTF-8
    pieces = stream(byte_ids)
    assert "".join(pieces) == TOK.decode(byte_ids)


def test_special_tokens_are_skipped() -> None:
    im_end = TOK.convert_tokens_to_ids("<|im_end|>")
    assert "".join(stream([*ids("ab"), im_end, *ids("c")])) == "abc"


def feed_all(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


def test_stop_across_pieces_never_leaks_a_prefix() -> None:
    out, stopped = feed_all(["STOP"], ["abc S", "T", "O", "P tail"])
    assert stopped and "".join(out) == "abc " and out == ["abc ", "", "", ""]


def test_false_start_is_released() -> None:
    out, stopped = feed_all(["STOP"], ["a ST", "x", "y"])
    assert not stopped and "".join(out) == "a STxy" and out[0] == "a "


def test_earliest_of_several_stops_wins() -> None:
    out, stopped = feed_all(["world", "lo w"], ["hello world"])
    assert stopped and "".join(out) == "hel"


def test_held_tail_released_at_end() -> None:
    out, stopped = feed_all(["</end>"], ["x</e"])
    assert not stopped and out == ["x", "</e"]


def test_no_stops_passes_through() -> None:
    assert feed_all([], ["a", "b"]) == (["a", "b", ""], False)


def test_a_stop_beginning_within_min_tokens_and_ending_after_them_ends_the_output() -> None:
    """vLLM's min_tokens: a stop counts where it ends after the first ``after`` pieces, even begun
    among them, and cuts where it begins (that text is held back meanwhile); one ending among them is
    output. The stop beginning in the 2nd piece of 3 was missed and the output ran on past it."""
    m = StopMatcher(["STOP"], after=3)
    out = [m.feed(p) for p in ["ab", "ST", "O", "P", "tail"]]
    assert m.stopped and out == ["ab", "", "", "", ""]
    m = StopMatcher(["STOP", "b"], after=2)
    out = [m.feed(p) for p in ["STOP", "ab", "c"]] + [m.flush()]
    assert not m.stopped and "".join(out) == "STOPabc"
    m = StopMatcher(["aa"], after=2)  # ends in the 3rd piece, begins in the 2nd: cut there
    out = [m.feed(p) for p in ["a", "a", "a"]]
    assert m.stopped and "".join(out) == "a"


class _PieceTokenizer:
    """A SentencePiece-style vocabulary: byte-fallback pieces ``<0xNN>`` beside whole words."""

    def __init__(self) -> None:
        self.pieces = {1: "<0xE4>", 2: "<0xB8>", 3: "<0x96>", 4: "▁hello", 5: "<0xZZ>"}

    def batch_decode(self, ids: list[list[int]], **kwargs: object) -> list[str]:
        return [" hello" if i == [4] else "\ufffd" for i in ids]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.pieces[i] for i in ids]


def test_token_texts_show_a_split_character_by_its_bytes() -> None:
    """Byte-fallback pieces of "世" (E4 B8 96) decode alone to U+FFFD; logprobs show their bytes, which
    read back to the character. A piece of no known form keeps its decoded text."""
    texts = token_texts(_PieceTokenizer(), [1, 2, 3, 4, 5, 1])
    assert texts == {1: "bytes:\\xe4", 2: "bytes:\\xb8", 3: "bytes:\\x96", 4: " hello", 5: "\ufffd"}
    assert b"".join(logprob_bytes(texts[i]) for i in (1, 2, 3)).decode() == "世"
    assert logprob_bytes(" hello") == b" hello" and logprob_bytes("bytes: x") == b"bytes: x"
