"""Tiny random models built from configs, for tests and for running the whole stack with no weights.

The tokenizer is a real byte-level BPE (the Qwen/GPT-2 byte alphabet, no merges) with Qwen's ChatML
template, so detokenisation meets the same hazards as a real model: a multi-byte character spans
several tokens, and random weights emit byte sequences that are not valid UTF-8 at all.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY = {
    # name: (hidden, layers, heads, kv_heads, intermediate, seed)
    "tiny-random": (64, 2, 4, 2, 128, 0),
    "tiny-random-draft": (32, 1, 2, 1, 64, 1),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML
    return fast


def build(name: str, out_dir: Path) -> Path:
    """Write a deterministic random model ``name`` (see TINY) with the byte tokenizer to ``out_dir``."""
    hidden, layers, heads, kv, inter, seed = TINY[name]
    tokenizer = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        # wide logits: random weights at the usual 0.02 give near-ties that float rounding flips
        initializer_range=0.5,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
