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
# ChatML as Qwen2.5 writes it, tools included (its template, without the default system prompt, so
# a plain conversation renders exactly as before): tools in a system block, assistant tool calls as
# <tool_call> JSON, tool results as <tool_response> in a user turn. Applied at every load
# (decoding.loader), so tiny models built before it gained tools render tools too.
CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\n<tools>' }}{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments"
    " within <tool_call></tool_call> XML tags.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\n<tool_call>\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

TINY = {
    # name: (hidden, layers, heads, kv_heads, intermediate, seed)
    "tiny-random": (64, 2, 4, 2, 128, 0),
    "tiny-random-draft": (32, 1, 2, 1, 64, 1),
    "tiny-random-padded": (64, 2, 4, 2, 128, 0),  # see PADDED
}
# name: (the model it extends, its logits). tiny-random with rows past its tokenizer's ids that no
# token maps to, as Qwen2.5-7B's 152,064 logits beside its 0.5B draft's 151,936 (issue 53): a target
# tiny-random drafts for, agreeing on every real token. The extra rows are random, so they take mass.
PADDED = {"tiny-random-padded": ("tiny-random", 320)}


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


def _padded(model: Qwen2ForCausalLM, vocab: int) -> Qwen2ForCausalLM:
    """``model`` with ``vocab`` rows of embeddings and logits: its own, then random ones."""
    config = Qwen2Config.from_dict({**model.config.to_dict(), "vocab_size": vocab})
    out = Qwen2ForCausalLM(config).eval()
    state = model.state_dict()
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        w = state[key]  # [V, hidden]
        state[key] = torch.cat([w, torch.randn(vocab - w.shape[0], w.shape[1]) * config.initializer_range])
    out.load_state_dict(state)
    return out


def build(name: str, out_dir: Path) -> Path:
    """Write a deterministic random model ``name`` (see TINY) with the byte tokenizer to ``out_dir``."""
    base, vocab = PADDED.get(name, (name, 0))
    hidden, layers, heads, kv, inter, seed = TINY[base]
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
        if vocab:
            model = _padded(model, vocab)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir
