"""The synchronous core: one speculative step of one sequence.

A sequence's target KV cache always holds every committed token but the last ("pending") one. A step
feeds [pending, d_1..d_k] to the target in one forward pass, verifies, and cuts the cache back to the
committed length, so a rejected draft costs nothing later and the prompt is never recomputed. A plain
step is the same with k = 0.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.controller import SpecController
from decoding.drafters import Drafter, DraftModelDrafter, PromptLookupDrafter
from decoding.errors import PromptTooLong, UnknownModel
from decoding.params import (
    FinishReason,
    GenerationRequest,
    RequestStats,
    SpecMode,
    StepOutput,
    TokenLogprob,
)
from decoding.runner import EagerRunner, SequenceRunner
from decoding.sampling import apply_penalties, logprobs_of, probs_from_logits
from decoding.verify import verify_greedy, verify_sampling

RunnerFactory = Callable[[PreTrainedModel], SequenceRunner]

# SpecParams.draft_confidence when a request leaves it unset, by the draft's device type. On a CPU
# the probability is read for free (every op is synchronous) and measured on the real pair it pays
# (docs/benchmarks.md). On a GPU reading it is a host sync per drafted token, a launch gap in the
# draft's queue; that trade was not measured here, so GPUs keep drafting the chosen k.
DRAFT_CONFIDENCE = {"cpu": 0.6}


@dataclass
class LoadedModel:
    """A resident model. ``draft`` names another resident model used as its draft (may be None)."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft: str | None = None
    max_context: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    runner_factory: RunnerFactory = EagerRunner
    # the runner when this model drafts for another (static backends: unpadded; see ModelSpec.exact)
    draft_runner_factory: RunnerFactory | None = None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @functools.cached_property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


@dataclass
class Sequence:
    request: GenerationRequest
    target: LoadedModel
    runner: SequenceRunner
    drafter: Drafter | None
    controller: SpecController
    generator: torch.Generator
    counts: torch.Tensor  # [V] completion-token counts (penalties)
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    prefilled: bool = False
    finished: FinishReason | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens) - self.stats.prompt_tokens

    def release(self) -> None:
        self.runner.release()
        if self.drafter is not None:
            self.drafter.release()


class StepTimer:
    """Draft and verification time of one step. On CUDA the work is asynchronous, so host clocks
    would time kernel launches: events are recorded in-stream and read after the step's one sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self.events[0].record()
        else:
            self.times = [time.perf_counter()]

    def mark(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.times.append(time.perf_counter())

    def done(self) -> tuple[float, float]:
        """(draft seconds, verification seconds); call after the step's host sync."""
        if self.cuda:
            self.events[2].record()
            self.events[2].synchronize()  # already complete: the step's read-back waited for it
            e = self.events
            return e[0].elapsed_time(e[1]) / 1e3, e[1].elapsed_time(e[2]) / 1e3
        self.times.append(time.perf_counter())
        t = self.times
        return t[1] - t[0], t[2] - t[1]


class Engine:
    def __init__(self, models: dict[str, LoadedModel], ngram_max: int = 3):
        self.models = models
        self.ngram_max = ngram_max
        self.total_steps = 0  # target forward passes, all requests (observability, tests)

    def model(self, name: str) -> LoadedModel:
        if name not in self.models:
            raise UnknownModel(name, sorted(self.models))
        return self.models[name]

    def check(self, request: GenerationRequest) -> LoadedModel:
        """Everything that can refuse a request before any model work."""
        target = self.model(request.model)
        n = len(request.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + request.params.max_tokens > target.max_context:
            raise PromptTooLong(n, request.params.max_tokens, target.max_context)
        return target

    def start(self, request: GenerationRequest) -> Sequence:
        target = self.check(request)
        device = target.device
        generator = torch.Generator(device=device)
        if request.params.seed is not None:
            generator.manual_seed(request.params.seed)
        else:
            generator.seed()
        drafter = self._drafter(target, request)
        # A seeded sampled request must repeat: adaptive k and the goodput check follow measured
        # timings, and a different k consumes the generator differently. Such requests draft a
        # fixed k (greedy output does not depend on k at all, so it keeps adapting).
        seeded_sampling = request.params.seed is not None and not request.params.greedy
        runner = target.runner_factory(target.model)
        # an exact static runner keeps a step bit-identical to 1-token steps up to its padded width
        step_limit = runner.max_step_tokens
        controller = SpecController(
            k_max=min(request.spec.max_k, step_limit - 1) if step_limit else request.spec.max_k,
            adaptive=request.spec.adaptive and not seeded_sampling,
            speculate=drafter is not None,
            draft_cost_prior=self._draft_cost_prior(target, drafter),
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
        seq.stats.prompt_tokens = len(request.prompt_token_ids)
        seq.stats.drafter = drafter.name if drafter else "none"
        return seq

    def _draft_cost_prior(self, target: LoadedModel, drafter: Drafter | None) -> float:
        """Memory-bound decoding reads every weight once a step, so a draft step costs about its
        share of the target's parameters (a floor: small models also pay per-kernel overheads)."""
        if not isinstance(drafter, DraftModelDrafter) or target.draft is None:
            return 0.0
        return self.model(target.draft).n_params / target.n_params

    def _drafter(self, target: LoadedModel, request: GenerationRequest) -> Drafter | None:
        mode = request.spec.mode
        if mode == SpecMode.OFF:
            return None
        if mode == SpecMode.AUTO:
            mode = SpecMode.DRAFT if target.draft else SpecMode.NGRAM
        if mode == SpecMode.NGRAM:
            return PromptLookupDrafter(target.device, max_ngram=self.ngram_max)
        if target.draft is None:
            return PromptLookupDrafter(target.device, max_ngram=self.ngram_max)
        draft = self.model(target.draft)
        factory = draft.draft_runner_factory or draft.runner_factory
        confidence = request.spec.draft_confidence
        if confidence is None:  # a fixed k (adaptive off) stays fixed unless the request says otherwise
            confidence = DRAFT_CONFIDENCE.get(draft.device.type, 0.0) if request.spec.adaptive else 0.0
        return DraftModelDrafter(factory(draft.model), draft.device, confidence)

    @torch.inference_mode()
    def step(self, seq: Sequence) -> StepOutput:
        """One verification (or plain) step; the returned tokens are this step's SSE chunk."""
        req, params = seq.request, seq.request.params
        if not seq.prefilled:
            t0 = time.perf_counter()
            if len(seq.tokens) > 1:
                seq.runner.forward(seq.tokens[:-1], logits=False)
            seq.stats.prefill_s = time.perf_counter() - t0
            seq.controller.observe_prefill(len(seq.tokens) - 1, seq.stats.prefill_s)
            seq.prefilled = True  # the draft prefills lazily, at its first proposal (if any)

        k = seq.controller.choose_k()
        remaining = params.max_tokens - seq.completion_tokens
        k = min(k, remaining - 1)  # never draft past max_tokens
        if k > 0 and seq.drafter is not None:
            # a backlog (after plain steps) is a one-off cost: keep it out of the per-token draft cost
            t0 = time.perf_counter()
            seq.drafter.catch_up(seq.tokens)
            seq.stats.decode_s += time.perf_counter() - t0
        timer = StepTimer(seq.target.device)
        if k > 0 and seq.drafter is not None:
            proposal = seq.drafter.propose(seq.tokens, k, params, seq.counts, seq.generator)
            draft_tokens, draft_probs = proposal.tokens, proposal.probs
        else:
            draft_tokens = torch.zeros(0, dtype=torch.long, device=seq.target.device)
            draft_probs = None
        timer.mark()
        kk = int(draft_tokens.shape[0])

        n_before = len(seq.tokens)
        pending = torch.tensor([seq.tokens[-1]], dtype=torch.long, device=seq.target.device)
        logits = seq.runner.forward(torch.cat([pending, draft_tokens]))  # [kk+1, V]
        assert logits is not None
        processed = apply_penalties(logits, seq.counts, draft_tokens, params)
        if params.greedy:
            n_t, cand = verify_greedy(draft_tokens, processed)
        else:
            n_t, cand = verify_sampling(
                draft_tokens, draft_probs, probs_from_logits(processed, params), seq.generator
            )
        n, *cand_list = torch.cat([n_t[None], cand]).tolist()  # the one host sync of the step
        new_list = cand_list[: n + 1]
        new = cand[: n + 1]
        seq.runner.crop(n_before + n)
        if seq.drafter is not None:
            seq.drafter.rollback(n_before + n)
        t_draft, t_target = timer.done()

        seq.controller.observe(kk, n, t_draft, t_target)
        self.total_steps += 1
        self._record(seq.stats, kk, n, t_draft + t_target)
        if kk == 0 and seq.controller.switched_off:
            seq.stats.spec_disabled_steps += 1

        new_list, finish = self._truncate(seq, new_list)
        logprobs = None
        if params.logprobs is not None and new_list:
            rows = logprobs_of(logits[: len(new_list)], new[: len(new_list)], params.logprobs)
            logprobs = [TokenLogprob(t, lp, tuple(top)) for t, (lp, top) in zip(new_list, rows, strict=True)]
        seq.tokens.extend(new_list)
        if new_list and params.penalised:  # counts exist for the penalties alone
            # index_add_, not `counts[idx] += 1`: a token accepted twice in one step counts twice
            idx = torch.tensor(new_list, device=seq.counts.device)
            seq.counts.index_add_(0, idx, torch.ones_like(idx))
        seq.stats.completion_tokens = seq.completion_tokens
        seq.finished = finish
        return StepOutput(
            request_id=req.request_id,
            token_ids=new_list,
            drafted=kk,
            accepted=n,
            logprobs=logprobs,
            finish_reason=finish,
            stats=seq.stats if finish else None,
        )

    def _truncate(self, seq: Sequence, new: list[int]) -> tuple[list[int], FinishReason | None]:
        params = seq.request.params
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(seq.target.eos_token_ids)
        for i, t in enumerate(new):
            if t in stops:
                return new[:i], FinishReason.STOP  # the stop token itself is not output
        remaining = params.max_tokens - seq.completion_tokens
        if len(new) >= remaining:
            return new[:remaining], FinishReason.LENGTH
        return new, None

    @staticmethod
    def _record(stats: RequestStats, k: int, n: int, seconds: float) -> None:
        stats.steps += 1
        stats.decode_s += seconds
        if k == 0:
            return
        stats.spec_steps += 1
        stats.drafted += k
        stats.accepted += n
        while len(stats.drafted_by_position) < k:
            stats.drafted_by_position.append(0)
            stats.accepted_by_position.append(0)
        for i in range(k):
            stats.drafted_by_position[i] += 1
            if i < n:
                stats.accepted_by_position[i] += 1

    def generate(self, request: GenerationRequest) -> tuple[list[int], RequestStats, FinishReason]:
        """Run one request to the end (CLI, benchmarks, tests)."""
        seq = self.start(request)
        try:
            out: list[int] = []
            while True:
                step = self.step(seq)
                out.extend(step.token_ids)
                if step.finish_reason is not None:
                    return out, seq.stats, step.finish_reason
        finally:
            seq.release()
