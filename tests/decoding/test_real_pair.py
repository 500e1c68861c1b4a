"""The real Qwen2.5-Coder pair (slow): greedy speculation token-identical to the target alone, float32."""

from __future__ import annotations

import pytest

from decoding.engine import Engine
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in two sentences how a hash map handles collisions.",
    "Rename the variable x to count in this code:\ndef f(x):\n    x = x + 1\n    return x * x\n",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_is_lossless(real_pair, prompt):
    """Draft speculation on every prompt; prompt lookup where it proposes most, the edit (each run
    of the 1.5B in float32 is ~30 s on a 2-core AVX2 CPU)."""
    engine = Engine(real_pair)
    tok = real_pair["target"].tokenizer
    ids = list(
        tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )

    def run(mode: str, k: int) -> tuple[list[int], float]:
        # fixed k: in float32 on a CPU the goodput check may (rightly) switch speculation off
        spec = SpecParams(SpecMode(mode), max_k=k, adaptive=False)
        req = GenerationRequest("r", "target", ids, SamplingParams(max_tokens=24, temperature=0), spec)
        out, stats, _ = engine.generate(req)
        return out, stats.acceptance_rate

    plain, _ = run("off", 1)
    draft, acceptance = run("draft", 4)
    assert draft == plain
    assert acceptance > 0.2  # a real draft of the same family agrees often; random would be ~0
    if prompt.startswith("Rename"):
        ngram, ngram_acceptance = run("ngram", 4)
        assert ngram == plain
        assert ngram_acceptance > 0  # the edit repeats the code: some lookups were accepted
