"""What a request becomes before its first step: the refusals that need no model work (``check``),
and its sequence (``new_sequence``): generator, slot, drafter, speculation controller and shaping.
The engine (decoding/engine.py) then only steps sequences.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import replace

import torch

from decoding.constraints import Constraint, Shaping, logit_bias_tensor
from decoding.controller import SpecController
from decoding.drafters import Drafter, DraftModelDrafter, PredictionDrafter, PromptLookupDrafter
from decoding.errors import InvalidParameter, PromptTooLong, UnknownModel
from decoding.grammar import CompiledGrammar, GrammarCompiler, ll_tokenizer, matcher
from decoding.params import GenerationRequest, GrammarSpec, SpecMode
from decoding.runner import SequenceRunner, as_ids
from decoding.sequence import LoadedModel, Sequence, ending_ids
from decoding.vocab import vocab_fit

# SpecParams.draft_confidence when a request leaves it unset, by the draft's device type. On a CPU
# the probability is read for free (every op is synchronous) and measured on the real pair it pays
# (docs/benchmarks.md). On a GPU reading it is a host sync per drafted token, a launch gap in the
# draft's queue; that trade was not measured here, so GPUs keep drafting the chosen k.
DRAFT_CONFIDENCE = {"cpu": 0.6}


def model_of(models: dict[str, LoadedModel], name: str) -> LoadedModel:
    if name not in models:
        raise UnknownModel(name, sorted(models))
    return models[name]


def check(
    models: dict[str, LoadedModel], request: GenerationRequest, grammars: GrammarCompiler
) -> GenerationRequest:
    """Everything that can refuse a request before any model work; the request with its grammar
    compiled (on ``grammars``' thread, waited for here unless ``prepare`` compiled it already)."""
    target = model_of(models, request.model)
    n = len(request.prompt_token_ids)
    if n == 0:
        raise InvalidParameter("The prompt is empty: it must hold at least one token.", "prompt")
    if n + request.params.max_tokens > target.max_context:
        raise PromptTooLong(n, request.params.max_tokens, target.max_context)
    # [shaping] a bad logit_bias token or a grammar that does not compile: a 400 naming it
    bad = [t for t, _ in request.logit_bias if not 0 <= t < target.vocab_size]
    if bad:
        raise InvalidParameter(f"logit_bias names token ids outside the vocabulary: {bad[:5]}", "logit_bias")
    if request.grammar is not None and request.compiled is None:
        future = compile_grammar(grammars, target, request.grammar)
        request = replace(request, compiled=grammars.wait(request.grammar, future))
    return request


def compile_grammar(
    grammars: GrammarCompiler, target: LoadedModel, spec: GrammarSpec
) -> concurrent.futures.Future[CompiledGrammar]:
    """[shaping] ``spec`` compiled for ``target``'s tokenizer on ``grammars``' thread."""
    tokenizer, vocab, eos = target.tokenizer, target.vocab_size, target.eos_token_ids
    return grammars.compile(
        target.name, spec, lambda s: matcher(s, ll_tokenizer(tokenizer, vocab, eos), tokenizer)
    )


def shaping(target: LoadedModel, request: GenerationRequest) -> Shaping | None:
    """[shaping] The request's bias, grammar state and min_tokens, or None when it has none."""
    params = request.params
    if not request.logit_bias and request.grammar is None and not params.min_tokens:
        return None
    bias = logit_bias_tensor(request.logit_bias, target.vocab_size, target.device)
    constraint = None
    if request.grammar is not None:
        compiled = request.compiled if isinstance(request.compiled, CompiledGrammar) else None
        constraint = Constraint(
            request.grammar, target.tokenizer, target.vocab_size, target.eos_token_ids, compiled
        )
    # the ids that would end it (Sequence.stops): none of them before min_tokens tokens
    stops = sorted(ending_ids(params, target.eos_token_ids, request.grammar is not None))
    early = (as_ids(stops, target.device), params.min_tokens) if params.min_tokens and stops else None
    return Shaping(bias, constraint, early)


def drafter_for(
    models: dict[str, LoadedModel], target: LoadedModel, request: GenerationRequest, ngram_max: int
) -> Drafter | None:
    """The request's drafter: none, the client's prediction, prompt lookup, or the target's draft."""
    mode = request.spec.mode
    if mode == SpecMode.OFF:
        return None
    if request.prediction is not None:  # Predicted Outputs: the client's text drafts
        return PredictionDrafter(target.device, request.prediction, len(request.prompt_token_ids))
    if mode == SpecMode.AUTO:
        mode = SpecMode.DRAFT if target.draft else SpecMode.NGRAM
    if mode == SpecMode.NGRAM or target.draft is None:
        return PromptLookupDrafter(target.device, max_ngram=ngram_max)
    draft = model_of(models, target.draft)
    factory = draft.draft_runner_factory or draft.runner_factory
    confidence = request.spec.draft_confidence
    if confidence is None:  # a fixed k (adaptive off) stays fixed unless the request says otherwise
        confidence = DRAFT_CONFIDENCE.get(draft.device.type, 0.0) if request.spec.adaptive else 0.0
    fit = vocab_fit(target, draft)
    return DraftModelDrafter(
        factory(draft.model), draft.device, confidence, max_len=draft.max_context, fit=fit
    )


def draft_cost_prior(models: dict[str, LoadedModel], target: LoadedModel, drafter: Drafter | None) -> float:
    """Memory-bound decoding reads every weight once a step, so a draft step costs about its
    share of the target's parameters (a floor: small models also pay per-kernel overheads)."""
    if not isinstance(drafter, DraftModelDrafter) or target.draft is None:
        return 0.0
    return model_of(models, target.draft).n_params / target.n_params


def new_sequence(
    models: dict[str, LoadedModel],
    target: LoadedModel,
    request: GenerationRequest,
    runner: SequenceRunner,
    drafter: Drafter | None,
) -> Sequence:
    """A checked request's sequence on its ``runner`` (its slot), drafting with ``drafter``."""
    device = target.device
    generator = torch.Generator(device=device)
    if request.params.seed is not None:
        generator.manual_seed(request.params.seed)
    else:
        generator.seed()
    # A seeded sampled request must repeat: adaptive k and the goodput check follow measured
    # timings, and a different k consumes the generator differently. Such requests draft a
    # fixed k (greedy output does not depend on k at all, so it keeps adapting).
    seeded_sampling = request.params.seed is not None and not request.params.greedy
    # exact mode caps a step at the runner's padded width (see docs/architecture.md, Exact mode)
    step_limit = runner.max_step_tokens
    controller = SpecController(
        k_max=min(request.spec.max_k, step_limit - 1) if step_limit else request.spec.max_k,
        adaptive=request.spec.adaptive and not seeded_sampling,
        speculate=drafter is not None,
        draft_cost_prior=draft_cost_prior(models, target, drafter),
        drafter_stops=isinstance(drafter, DraftModelDrafter) and drafter.min_confidence > 0,
    )
    seq = Sequence(
        request=request,
        target=target,
        runner=runner,
        drafter=drafter,
        controller=controller,
        generator=generator,
        counts=torch.zeros(target.vocab_size, dtype=torch.long, device=device),
        tokens=list(request.prompt_token_ids),
    )
    if request.params.repetition_penalty != 1:
        seen = torch.zeros(target.vocab_size, dtype=torch.bool)
        seen[torch.tensor(request.prompt_token_ids, dtype=torch.long)] = True
        seq.prompt_seen = seen.to(device)
    seq.stats.prompt_tokens = len(request.prompt_token_ids)
    seq.stats.drafter = drafter.name if drafter else "none"
    seq.shaping = shaping(target, request)  # [shaping]
    if request.params.prompt_logprobs is not None:
        seq.prompt_logprobs = [None]  # the first prompt token: nothing predicts it
    if seq.shaping is not None and isinstance(drafter, DraftModelDrafter):
        drafter.shape = seq.shaping.draft  # [shaping] the draft's logits get the bias and mask too
    return seq
