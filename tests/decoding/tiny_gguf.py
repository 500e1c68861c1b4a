"""A tiny random model as a GGUF, for llama.cpp tests that need no pulled weights: the tiny-random
Qwen2 (decoding/tiny.py) written tensor by tensor in float32 under llama.cpp's names for ``qwen2``.

llama.cpp needs a vocabulary to load, so the byte tokenizer goes in as a ``gpt2`` one, with one
merge (it refuses none); tests feed token ids, so llama.cpp's own tokenizer never runs.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from decoding.sequence import LoadedModel

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_TOP["lm_head.weight"] = "output.weight"
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
for _x in "qkv":
    _LAYER[f"self_attn.{_x}_proj.weight"] = f"attn_{_x}.weight"
    _LAYER[f"self_attn.{_x}_proj.bias"] = f"attn_{_x}.bias"


def write_gguf(model: LoadedModel, path: Path) -> Path:
    """``model`` (a transformers Qwen2 on the CPU) as a float32 GGUF at ``path``."""
    cfg, tok = model.model.config, model.tokenizer
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = set(tok.all_special_tokens)
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    # logits past the tokenizer's ids (tiny-random-padded) get placeholders, as llama.cpp's converter
    # writes Qwen2.5-7B's
    pads = [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]
    w.add_token_list(tokens + pads)
    w.add_token_types(types + [gguf.TokenType.UNUSED] * len(pads))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(cfg.eos_token_id)
    names = dict(_TOP)
    for i in range(cfg.num_hidden_layers):
        names |= {f"model.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in _LAYER.items()}
    for name, t in model.model.state_dict().items():
        w.add_tensor(names[name], t.detach().float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
