"""Device debug: does a (k+1)-token step agree with k+1 one-token steps, in HF and in ours (bf16)?"""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from decoding.runner import EagerRunner
from decoding.static import StaticModel

torch.manual_seed(0)
cfg = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, rope_theta=1e6)
with torch.device("cuda"):
    m = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
ids = torch.randint(0, 150000, (128,)).tolist()
nxt = torch.randint(0, 150000, (5,)).tolist()


def seq_vs_block(r):
    r.forward(ids, logits=False)
    L = r.length
    block = r.forward(nxt).float()
    r.crop(L)
    rows = [r.forward([t]).float()[0] for t in nxt]
    one = torch.stack(rows)
    top2 = torch.topk(one, 2, -1).values
    return (block.argmax(-1) == one.argmax(-1)).float().mean().item(), (block - one).abs().max().item(), (top2[:, 0] - top2[:, 1]).tolist(), block


a, d, margins, hf_block = seq_vs_block(EagerRunner(m))
print("HF     block-vs-seq argmax agree", a, "maxdiff", d, "margins", [round(x, 3) for x in margins])
for graphs in (False, True):
    sm = StaticModel(m, 512, slots=1, graphs=graphs)
    a, d, margins, blk = seq_vs_block(sm.runner())
    print(f"static graphs={graphs} block-vs-seq agree", a, "maxdiff", d, "| vs HF block maxdiff", (blk - hf_block).abs().max().item(),
          "argmax eq HF", (blk.argmax(-1) == hf_block.argmax(-1)).float().mean().item())
