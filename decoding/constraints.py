"""Logit shaping that speculation must keep exact: a grammar (structured outputs, tool calls) and
``logit_bias``. One ``Constraint`` per request, applied per row, so a batched engine calls it once
per running request per step.

The rule that keeps speculation lossless (docs/architecture.md, "Structured outputs"): the output is
the *masked, biased target's*, so

- the target's logits at every verified position get the bias and the mask of the grammar state
  reached along the draft path, before penalties' consumers (temperature, top-p/top-k, greedy
  argmax, rejection sampling) read them;
- a draft model's logits get the same bias and mask while it drafts (its p is then the masked
  draft's, which rejection sampling needs to be the distribution the token was really drawn from);
- drafts are cut at the first token the grammar rejects (their masks do not exist);
- the matcher advances only by tokens verification accepted; drafting and mask computation roll
  back whatever they consumed (vLLM #15554, SGLang #24283: grammar state advanced by drafts).

Tokens the grammar forces (``propose_forced``) are proposed as drafts; verification still checks
them, since another tokenisation of the same bytes may be what the masked target prefers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.torch as llt
import numpy as np
import torch

from decoding.drafters import Proposal
from decoding.errors import InvalidParameter
from decoding.grammar import CompiledGrammar, ll_tokenizer, matcher, short_error
from decoding.params import GrammarSpec
from decoding.runner import as_ids

_executor: llguidance.LLExecutor | None = None


def _exec() -> llguidance.LLExecutor:
    global _executor  # one thread pool for all requests, built on first use
    if _executor is None:
        _executor = llguidance.LLExecutor()
    return _executor


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed bitmask [W, ceil(V/32)] int32 -> allowed [W, V] bool (CPU)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].astype(bool))


class Constraint:
    """A request's grammar state. ``tokens`` committed so far live in the matcher; every other
    method leaves the matcher where it found it."""

    def __init__(
        self,
        spec: GrammarSpec,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        compiled: CompiledGrammar | None = None,
    ):
        self.vocab_size = vocab_size
        self.eos = set(eos_token_ids)
        self.param = spec.param
        if compiled is not None:  # compiled off the engine's thread (decoding.grammar.GrammarCompiler)
            self.matcher = compiled.matcher()
        else:
            self.matcher = matcher(spec, ll_tokenizer(tokenizer, vocab_size, eos_token_ids), tokenizer)

    def propose_forced(self) -> list[int]:
        """Tokens the grammar forces from here (canonical tokenisation of the forced bytes)."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())

    def check_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar accepts; an end-of-turn token counts where the
        grammar may end, and ends the drafts. (End tokens never reach the matcher: llguidance errs,
        for good, on one fed to a finished grammar.)"""
        drafts = list(drafts)
        end = next((i for i, t in enumerate(drafts) if t in self.eos), len(drafts))
        n = int(self.matcher.validate_tokens(drafts[:end]))
        if n < end or end == len(drafts):
            return n
        return n + int(self._may_end_after(drafts[:end]))

    def _may_end_after(self, prefix: list[int]) -> bool:
        if prefix and not self.matcher.consume_tokens(prefix):
            raise AssertionError("drafts that passed validation were rejected")
        try:
            return bool(self.matcher.is_accepting())
        finally:
            if prefix:
                self.matcher.rollback(len(prefix))

    def masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Allowed tokens [len(drafts)+1, V] at each verified position: row i is the state after
        drafts[:i]. The drafts must have passed ``check_drafts``. One llguidance call. The row after
        an end-of-turn draft allows nothing (it is never output; ``apply_logit_mask`` leaves it)."""
        drafts = list(drafts)
        ended = bool(drafts) and drafts[-1] in self.eos
        path = drafts[:-1] if ended else drafts
        bitmask = llt.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        if path:
            llt.fill_next_token_bitmask_par_with_draft_tokens(_exec(), [(self.matcher, 0, path)], bitmask)
        else:  # llguidance's draft call refuses an empty draft
            llt.fill_next_token_bitmask(self.matcher, bitmask, 0)
        if ended:
            bitmask[-1] = 0
        return unpack(bitmask, self.vocab_size)

    def draft_mask(self, drafted: Sequence[int]) -> torch.Tensor:
        """Allowed tokens [V] after the committed tokens plus ``drafted`` (while a draft model
        drafts). After an end-of-turn draft, everything: ``check_drafts`` cuts there anyway."""
        drafted = list(drafted)
        if any(t in self.eos for t in drafted):
            return torch.ones(self.vocab_size, dtype=torch.bool)
        if drafted and not self.matcher.consume_tokens(drafted):
            raise AssertionError("a masked draft produced a token its grammar rejects")
        try:
            bitmask = llt.allocate_token_bitmask(1, self.vocab_size)
            llt.fill_next_token_bitmask(self.matcher, bitmask, 0)
        finally:
            if drafted:
                self.matcher.rollback(len(drafted))
        return unpack(bitmask, self.vocab_size)[0]

    def commit(self, accepted: Sequence[int]) -> None:
        """Advance by the tokens verification accepted (end-of-turn tokens are not output)."""
        tokens = [t for t in accepted if t not in self.eos]
        if tokens and not self.matcher.consume_tokens(tokens):
            if self.matcher.is_error():  # a limit of llguidance's (parser items, lexer states) hit
                raise InvalidParameter(
                    f"The grammar failed during generation: {short_error(self.matcher.get_error())}",
                    self.param,
                )
            raise AssertionError(f"verified tokens broke the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def may_end(self) -> bool:
        """Whether the output may end here. At a dead end (a state no token continues from)
        llguidance allows an end token too, and calls itself stopped once it has computed a mask
        there: ending would return output the grammar refuses."""
        return bool(self.matcher.is_accepting())


def apply_logit_mask(
    logits: torch.Tensor,  # [W, V]
    allowed: torch.Tensor,  # [W, V] bool
) -> torch.Tensor:
    """Disallowed tokens get -inf. A row with nothing allowed (past an end-of-turn draft, never
    output) is left as it is, so that no row becomes NaN under softmax."""
    allowed = allowed.to(logits.device)
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # [W, V]
    return logits.masked_fill(~allowed, float("-inf"))


def logit_bias_tensor(
    pairs: Sequence[tuple[int, float]], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """OpenAI's ``logit_bias`` as a dense [V] float32 row (None when empty)."""
    if not pairs:
        return None
    bias = torch.zeros(vocab_size, dtype=torch.float32)
    for token, value in pairs:
        bias[token] = value
    return bias.to(device)


def apply_logit_bias(
    logits: torch.Tensor,  # [W, V]
    bias: torch.Tensor | None,  # [V]
) -> torch.Tensor:
    if bias is None:
        return logits
    return (logits.float() + bias).to(logits.dtype)


class Shaping:
    """One request's bias, grammar and min_tokens, as the engine's three call sites use them
    (target rows, draft rows, commit). ``forced`` is the prefix of the current proposal the grammar
    forced. ``early``: the ids that would end the request and vLLM's ``min_tokens``, none of which may
    come before that many tokens (as a mask of the target's and the draft's rows alike, so
    speculation stays exact; a grammar that allows nothing else wins: its output must end)."""

    def __init__(
        self,
        bias: torch.Tensor | None,
        constraint: Constraint | None,
        early: tuple[torch.Tensor, int] | None = None,
    ):
        self.bias = bias
        self.constraint = constraint
        self.early = early
        self.produced = 0  # tokens committed (output so far)
        self.forced: list[int] = []

    def _allowed(self, allowed: torch.Tensor | None, first: int, T: int, V: int) -> torch.Tensor | None:
        """The grammar's [T, V] allowed tokens (None: every token), less the stop ids at rows whose
        output position (``first`` + row) is below min_tokens."""
        if self.early is None or first >= self.early[1]:
            return allowed
        ids, n = self.early
        banned = torch.zeros(T, V, dtype=torch.bool, device=ids.device)
        banned[: n - first, ids] = True
        if allowed is None:
            return ~banned
        kept = allowed.to(banned.device) & ~banned
        empty = ~kept.any(-1, keepdim=True)  # the grammar allows nothing but an end there
        return torch.where(empty, allowed.to(banned.device), kept)

    def commit(self, accepted: Sequence[int], end: int | None = None) -> None:
        """Advance by ``accepted``; ``end``: the stop token that followed them. An end-of-turn token
        where the grammar may not end (its dead end, as in an empty language ``dead_end`` could not prove) is
        the request's fault, raised as ``InvalidParameter``, not output that breaks its grammar."""
        if self.constraint is not None:
            self.constraint.commit(accepted)
            ending = end in self.constraint.eos or self.constraint.done
            if ending and not self.constraint.may_end:
                raise InvalidParameter(
                    "The grammar reached a state no output can continue from: it admits no complete output "
                    "along the one generated.",
                    self.constraint.param,
                )
        self.produced += len(accepted)

    @property
    def ended(self) -> bool:
        """The grammar has ended: it allows no token after what was committed."""
        return self.constraint is not None and self.constraint.done

    def forced_drafts(self, limit: int) -> list[int]:
        """The tokens the grammar forces next, at most ``limit`` of them, kept as ``forced``: proposed
        as drafts (verification still checks them: another tokenisation of the same bytes may be
        what the masked target prefers)."""
        if self.constraint is None:
            return []
        self.forced = self.constraint.propose_forced()[: max(0, limit)]
        return self.forced

    def cut(self, forced: list[int], proposal: Proposal | None, device: torch.device) -> Proposal | None:
        """One row's drafts under the grammar: ``forced``, then the drafter's ``proposal``, cut at the
        first token the grammar rejects (None: nothing left). Forced drafts are deterministic
        (p = one-hot)."""
        if self.constraint is None:
            return proposal
        drafted = proposal.tokens.tolist() if proposal is not None else []
        tokens = forced + drafted
        n = self.constraint.check_drafts(tokens)
        if n == 0:
            return None
        probs = None
        if proposal is not None and proposal.probs is not None:
            V = proposal.probs.shape[-1]
            one_hot = torch.nn.functional.one_hot(as_ids(forced, device), V)
            probs = torch.cat([one_hot.to(proposal.probs.dtype), proposal.probs])[:n]
        return Proposal(as_ids(tokens[:n], device), probs)

    def target(
        self,
        logits: torch.Tensor,  # [k+1, V]
        drafts: torch.Tensor,  # [k]
    ) -> torch.Tensor:
        logits = apply_logit_bias(logits, self.bias)
        grammar = self.constraint.masks(drafts.tolist()) if self.constraint is not None else None
        allowed = self._allowed(grammar, self.produced, *logits.shape)
        return logits if allowed is None else apply_logit_mask(logits, allowed)

    def draft(
        self,
        row: torch.Tensor,  # [1, V]
        drafted: Sequence[int],  # tokens this proposal drafted before this row (after ``forced``)
    ) -> torch.Tensor:
        row = apply_logit_bias(row, self.bias)
        at = [*self.forced, *drafted]
        grammar = self.constraint.draft_mask(at)[None] if self.constraint is not None else None
        allowed = self._allowed(grammar, self.produced + len(at), *row.shape)
        return row if allowed is None else apply_logit_mask(row, allowed)
