"""The decoding rows of one batched step, described once (after vLLM's ``SpecDecodeMetadata``):
built by the engine, read by the model runner and the verifier; the step's verification, queued on
the device, and what comes back of it (``Verifying``); and a step's queued work (``QueuedStep``),
taken by a later call when launched ahead, and what it gives each row once read (``QueuedStep.apply``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from decoding.drafters import FirstDrafts, Proposal
from decoding.errors import InvalidParameter
from decoding.params import FinishReason, TokenLogprob
from decoding.runner import as_ids
from decoding.sampling import Scored, apply_penalties, logprobs_of, probs_from_logits
from decoding.sequence import Sequence
from decoding.timing import PendingRead, StepTimer
from decoding.verify import verify_greedy, verify_greedy_batch, verify_sampling

PAD_DRAFT = -1  # a drafted-token slot past a row's k: equal to no token, so never accepted


@dataclass
class DecodeBatch:
    """B rows, each [pending, d_1..d_k_b] padded to W = 1 + max k_b tokens."""

    ids: torch.Tensor  # [B, W] token ids fed to the target (padding: 0)
    drafts: torch.Tensor  # [B, W-1] drafted tokens (padding: PAD_DRAFT)
    n_drafts: list[int]  # [B] k_b, drafted tokens per row (host)

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @classmethod
    def build(
        cls,
        pending: list[int],  # [B] each row's last committed token, not yet in its cache
        proposals: list[torch.Tensor | None],  # [k_b] drafted tokens per row (None: none)
        device: torch.device,
    ) -> DecodeBatch:
        B = len(pending)
        pend = torch.tensor(pending, dtype=torch.long).to(device, non_blocking=True)  # [B]
        n_drafts = [0 if p is None else int(p.shape[0]) for p in proposals]
        if max(n_drafts, default=0) == 0:
            return cls(pend[:, None], pend.new_zeros(B, 0), n_drafts)
        if min(n_drafts) == max(n_drafts):  # one stack; padding copies row by row (propose_many's _lockstep)
            drafts = torch.stack(proposals)  # type: ignore[arg-type]  # [B, K]
        else:
            empty = pend.new_zeros(0)
            rows = [empty if p is None else p for p in proposals]
            drafts = pad_sequence(rows, batch_first=True, padding_value=PAD_DRAFT)  # [B, K]
        ids = torch.cat([pend[:, None], drafts.clamp_min(0)], dim=1)  # [B, K+1]
        return cls(ids, drafts, n_drafts)


@dataclass
class Verifying:
    """A step's verification, queued on the device; its results come back in one read: per row
    (accepted n, candidates [k+1]). Greedy rows without penalties are verified all at once (``plain``,
    their n first, then their argmax rows of W), the others row by row (n, then k+1 candidates)."""

    flat: torch.Tensor  # [len(plain) * (1 + W) + sum over others of (2 + k)]
    read: PendingRead
    plain: list[int]
    others: list[int]
    n_drafts: list[int]  # [B]

    @classmethod
    def queue(
        cls,
        decoding: list[Sequence],
        proposals: list[Proposal | None],
        batch: DecodeBatch,
        logits: torch.Tensor,  # [B, W, V]
    ) -> Verifying:
        """Verify every decoding row with the pure verifiers: greedy rows without penalties all at
        once, the others (their own sampling parameters, generator, penalties) row by row. Queued on
        the device; the step's one host sync (``Verifying.results``) reads every row's result."""
        plain = [
            b
            for b, s in enumerate(decoding)
            if s.request.params.greedy and not s.request.params.penalised and s.shaping is None
        ]
        parts: list[torch.Tensor] = []
        if plain:
            if len(plain) == len(decoding):
                n_t, am = verify_greedy_batch(batch.drafts, logits)
            else:
                idx = as_ids(plain, logits.device)
                n_t, am = verify_greedy_batch(batch.drafts[idx], logits[idx])
            parts += [n_t, am.flatten()]
        batched = set(plain)
        others = [b for b in range(len(decoding)) if b not in batched]
        for b in others:
            s, prop, k = decoding[b], proposals[b], batch.n_drafts[b]
            params = s.request.params
            draft_tokens = batch.drafts[b, :k]
            processed = apply_penalties(logits[b, : k + 1], s.counts, draft_tokens, params, s.prompt_seen)
            if s.shaping is not None:  # [shaping] bias + the grammar's masks along the draft path
                processed = s.shaping.target(processed, draft_tokens)
            if params.greedy:
                n1, cand = verify_greedy(draft_tokens, processed)
            else:
                probs = probs_from_logits(processed, params)
                n1, cand = verify_sampling(draft_tokens, prop.probs if prop else None, probs, s.generator)
            parts += [n1[None], cand]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=logits.device)
        return cls(flat, PendingRead(flat), plain, others, list(batch.n_drafts))

    @functools.cached_property
    def offsets(self) -> list[int]:
        """Where each row's candidates start in ``flat``."""
        W = 1 + max(self.n_drafts, default=0)
        at = {b: len(self.plain) + i * W for i, b in enumerate(self.plain)}
        o = len(self.plain) * (1 + W)
        for b in self.others:
            at[b] = o + 1
            o += 2 + self.n_drafts[b]
        return [at[b] for b in range(len(self.n_drafts))]

    def results(self) -> list[tuple[int, list[int]]]:
        flat = self.read.wait()  # the step's one host sync
        ns = {b: int(flat[i]) for i, b in enumerate(self.plain)}
        out = []
        for b, at in enumerate(self.offsets):
            n = ns[b] if b in ns else int(flat[at - 1])
            out.append((n, flat[at : at + self.n_drafts[b] + 1]))
        return out

    def outcome(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where every row was verified at once (greedy, no penalties or grammar): the accepted
        counts n [B] and the target's argmax [B, W] on the device, the bonus token of row b at
        column n[b]; else None."""
        B = len(self.n_drafts)
        if len(self.plain) != B or not B:
            return None
        return self.flat[:B], self.flat[B:].view(B, -1)

    def chosen(self) -> torch.Tensor:
        """[B] each row's first candidate, on the device: the token a plain step emits."""
        return self.flat[as_ids(self.offsets, self.flat.device)]


class Applied(NamedTuple):
    """What a step gave a row, once taken (``QueuedStep.apply``)."""

    drafted: int  # k, the row's drafted tokens in the step
    accepted: int  # n of them
    tokens: list[int]  # its new tokens, cut at a stop or max_tokens
    finish: FinishReason | None
    logprobs: list[TokenLogprob] | None
    error: InvalidParameter | None = None  # with finish ERROR: the row's grammar failed (its alone)


@dataclass
class QueuedStep:
    """A step's work queued on the device, and what its back half (the host's read, the commit) needs.
    Launched ahead of the call that takes it (decoding.ahead.Ahead.launch, speculate), the device never
    waits for the host's bookkeeping; its rows' caches then already hold its tokens, and it is undone
    for rows that are gone when it is taken."""

    seqs: list[Sequence]  # its decoding rows, in batch order
    batch: DecodeBatch
    verifying: Verifying
    timer: StepTimer
    # perf_counter when its host work began, or (queued once the step before was committed) when
    # that step was read back: what the step costs is counted from here
    start: float
    logits: torch.Tensor | None = None  # [B, W, V] kept for rows that read logprobs
    generators: dict[int, torch.Tensor] = field(default_factory=dict)  # id(seq) -> state before it
    # the prompt chunks beside it that are scored (SamplingParams.prompt_logprobs): (sequence, the
    # tokens scored, their scores); read with the step's results
    prompt_scores: list[tuple[Sequence, list[int], Scored]] = field(default_factory=list)
    caught_up: int = 0  # tokens the rows' drafts caught up on before it (its timer's lead-in)
    first: FirstDrafts | None = None  # the next step's first draft pass, queued behind it
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)  # prompt chunks beside it (queued ahead)

    def apply(self, rows: list[Sequence], results: list[tuple[int, list[int]]]) -> list[Applied]:
        """Each of ``rows`` (its rows still running; ``results`` theirs) takes its accepted tokens:
        its caches are cut back to them, it finishes where they end it, and logprobs are read from
        logits that the next step's pass may overwrite (a graph's buffer). What the next step's launch
        needs, and no more: the rows' controllers, stats and outputs can wait until it is queued
        (Engine.commit_step; with them the device waited ~12 us a row on a 2-core EPYC, 0.75 ms a
        step at N = 64). ``undo`` is the inverse, for a step launched ahead that is not taken."""
        at = {id(s): b for b, s in enumerate(self.seqs)}
        out = []
        for s, (n, cand) in zip(rows, results, strict=True):
            b = at[id(s)]
            kk = self.batch.n_drafts[b]
            params = s.request.params
            n_before = len(s.tokens)
            if kk:  # a plain step leaves nothing to cut, and steps queued after it must keep their token
                s.runner.crop(n_before + n)
                if s.drafter is not None:  # nor its draft (which took nothing past the row's tokens)
                    s.drafter.rollback(n_before + n)
            new, finish = _truncate(s, cand[: n + 1])
            error = None
            if s.shaping is not None:
                try:
                    # [shaping] the matcher advances by accepted tokens only
                    s.shaping.commit(new, end=cand[len(new)] if finish is FinishReason.STOP else None)
                except InvalidParameter as exc:  # a grammar past llguidance's limits ends its row
                    new, finish, error = [], FinishReason.ERROR, exc  # alone, not the batch's step
                if finish is None and s.shaping.ended:  # its output is complete: only an EOS may follow
                    finish = FinishReason.STOP
            logprobs = None
            if params.logprobs is not None and new:
                assert self.logits is not None, "a step keeps its logits where a row wants logprobs"
                ids = as_ids(new, self.logits.device)
                top = logprobs_of(self.logits[b, : len(new)], ids, params.logprobs)
                logprobs = [TokenLogprob(t, lp, tuple(alt)) for t, (lp, alt) in zip(new, top, strict=True)]
            s.tokens.extend(new)
            if new and params.penalised:  # counts exist for the penalties alone
                # index_add_, not `counts[idx] += 1`: a token accepted twice in one step counts twice
                idx = as_ids(new, s.counts.device)
                s.counts.index_add_(0, idx, torch.ones_like(idx))
            s.finished = finish
            out.append(Applied(kk, n, new, finish, logprobs, error))
        return out

    def undo(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if s.runner.length > len(s.tokens) - 1:
                s.runner.crop(len(s.tokens) - 1)
            if s.drafter is not None:
                s.drafter.rollback(len(s.tokens) - 1)
            if id(s) in self.generators:
                s.generator.set_state(self.generators[id(s)])


def _truncate(seq: Sequence, new: list[int]) -> tuple[list[int], FinishReason | None]:
    """A row's new tokens up to its first stop (not output) or its max_tokens, and why it ends there."""
    for i, t in enumerate(new):
        if t in seq.stops:
            return new[:i], FinishReason.STOP
    remaining = seq.request.params.max_tokens - seq.completion_tokens
    if len(new) >= remaining:
        return new[:remaining], FinishReason.LENGTH
    return new, None
