"""A model's speculative steps, run once before any request (the server does, for each CUDA model).

CUDA graphs and the compiled layer are captured at load, but the host's verification and proposal
ops (argmax, cumprod, gather, the rejection sampler's) load their kernels on first use. In a fresh
process on the H200 (bench.probe_spec_host k=4 1 cold, 2026-12-03 21:26 UTC) the first speculative
step took 112 ms against ~9 ms, clamp_min, sum, gather, argmax and cumprod's first calls 10-30 ms
each; after ``warm_up`` it took 13.5-14.9 ms (``... warmed``).
"""

from __future__ import annotations

import gc

import torch

from decoding.engine import Engine
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams


@torch.inference_mode()
def warm_up(engine: Engine, name: str) -> int:
    """Run model ``name``'s speculative steps once: two batches of two rows drafting 4 (its draft
    model, else prompt lookup), greedy and greedy (the lockstep argmax path), then greedy beside seeded
    sampling (rejection sampling), on a 16-token prompt; then forget what they measured (the batch
    costs go back to the start-up tables, the acceptance prior to none), so that the first request is
    served as it would be without them. Returns the steps run."""
    mode = SpecMode.DRAFT if engine.model(name).draft else SpecMode.NGRAM
    prompt = list(range(1, 9)) * 2  # repeats: prompt lookup proposes too

    def request(i: int, temperature: float) -> GenerationRequest:
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=0, ignore_eos=True)
        return GenerationRequest(f"warm-up-{i}", name, prompt, params, SpecParams(mode, 4, adaptive=False))

    steps = engine.total_steps
    for batch in ([request(0, 0.0), request(1, 0.0)], [request(2, 0.0), request(3, 1.0)]):
        for r in batch:
            engine.check(r)
        for _ in engine.steps_to_end([engine.start(r) for r in batch]):
            pass
    engine.costs.pop(name, None)
    for key in [k for k in engine.population if k[0] == name]:
        del engine.population[key]
    return engine.total_steps - steps


def freeze_heap() -> int:
    """Collect once, then move every object alive now into the collector's permanent generation
    (``gc.freeze``), once models are loaded, compiled, captured and warmed. What loading leaves
    (dynamo's and inductor's graphs, the captured graphs' bookkeeping, the weights' wrappers) lives as
    long as the process, yet every full collection walked it: on the H200 at N = 64 one timed run in
    30 held a full collection of 418 ms, and no row got a token for 440 ms; with ~600,000 objects
    frozen, 30 runs held no pause over 2 ms (bench.gpu_batch ``--no-freeze``, 2026-12-04 06:16 UTC).
    vLLM and SGLang freeze after capturing their graphs for the same reason. Returns the objects
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
