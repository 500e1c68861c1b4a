"""What the engine holds: a resident model (``LoadedModel``) and a running request on it
(``Sequence``: its runner, drafter, controller, generator and tokens so far)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoding.constraints import Shaping
from decoding.controller import SpecController
from decoding.drafters import Drafter
from decoding.params import FinishReason, GenerationRequest, RequestStats, SamplingParams, TokenLogprob
from decoding.runner import EagerRunner, SequenceRunner

RunnerFactory = Callable[[PreTrainedModel], SequenceRunner]


def ending_ids(params: SamplingParams, eos_token_ids: Iterable[int], grammar: bool = False) -> frozenset[int]:
    """The token ids that end a request (not output): its stop ids, and the model's EOS unless
    ignored (``Sequence.stops``; min_tokens holds them all back, ``admission.shaping``). Under a
    grammar EOS ends it even with ignore_eos: the grammar allows EOS only where its output may end,
    and an EOS output there and gone on from (``ignore_eos``, as benchmark clients send it) put the
    EOS's text inside the structured output and more after it (a regex's digits, then EOS, then
    digits), or, once the grammar had ended, unconstrained tokens."""
    ended = () if params.ignore_eos and not grammar else eos_token_ids
    return frozenset(params.stop_token_ids) | frozenset(ended)


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
        """Its logits' width, which may exceed its tokenizer's ids (rows padding no token maps to)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @functools.cached_property
    def token_ids(self) -> int:
        """One past its tokenizer's largest id (its logits' width where it has no tokenizer)."""
        if self.tokenizer is None:  # benchmarks serve token ids alone
            return self.vocab_size
        return max(self.tokenizer.get_vocab().values()) + 1


@dataclass
class Sequence:
    request: GenerationRequest
    target: LoadedModel
    runner: SequenceRunner
    drafter: Drafter | None
    controller: SpecController
    generator: torch.Generator
    counts: torch.Tensor  # [V] completion-token counts (penalties)
    prompt_seen: torch.Tensor | None = None  # [V] bool: the prompt's tokens (repetition_penalty only)
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    prefilled: bool = False
    prefill_cost: float = 0.0  # seconds of prefill steps, in proportion to this sequence's tokens in each
    finished: FinishReason | None = None
    shaping: Shaping | None = None  # logit_bias and grammar (decoding/constraints.py); None: neither
    # the prompt's tokens scored so far (SamplingParams.prompt_logprobs; None: not asked for), until
    # the first output carries them
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens) - self.stats.prompt_tokens

    @functools.cached_property
    def stops(self) -> frozenset[int]:
        """The token ids that end it (not output): its stop ids, and the model's EOS unless ignored
        (built once, not per row and step)."""
        return ending_ids(self.request.params, self.target.eos_token_ids, self.request.grammar is not None)

    def release(self) -> None:
        self.runner.release()
        if self.drafter is not None:
            self.drafter.release()
