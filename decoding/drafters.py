"""Proposers of draft tokens. The engine verifies whatever a drafter proposes, so a drafter can only
cost speed, never correctness.

Both drafters see the whole committed sequence (prompt + generated) on every call and keep their
own state in step with it: the draft model's KV cache catches up on tokens it has not seen (the
bonus token, tokens from plain steps) and is cut back to what verification kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from decoding.params import SamplingParams
from decoding.runner import SequenceRunner, as_ids, forward_many
from decoding.sampling import apply_penalties, probs_from_logits, sample
from decoding.vocab import VocabFit


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k'] with k' <= k; may be empty
    probs: torch.Tensor | None  # [k', V] draft distribution p at the target's width; None: deterministic


# Shapes a draft model's logits row [1, V] given the tokens drafted so far in this proposal:
# logit_bias and the grammar's mask (decoding.constraints.Shaping.draft), so that p is the
# distribution the draft was really drawn from. Deterministic drafters need none: their proposals
# are cut by the grammar afterwards.
DraftShape = Callable[[torch.Tensor, list[int]], torch.Tensor]


class Drafter(Protocol):
    name: str

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,  # [V] completion-token counts, for penalties
        generator: torch.Generator | None,
    ) -> Proposal: ...

    def catch_up(self, tokens: list[int]) -> None:
        """Absorb a backlog of unseen tokens (the prompt, tokens from plain steps) ahead of a proposal,
        so that the proposal's own cost is what it costs in steady state."""
        ...

    def rollback(self, valid: int) -> None:
        """Only the first ``valid`` tokens of the sequence seen so far are still right."""
        ...

    def release(self) -> None: ...


class DraftModelDrafter:
    """A small causal LM sharing the target's vocabulary, sampled autoregressively k times."""

    name = "draft"

    # Unseen tokens a proposal feeds itself in its first draft pass (after a full acceptance: d_k and
    # the bonus); a longer backlog is caught up first, outside the draft's timed cost. On a GPU a
    # pass of up to a graph's width costs about what one token does, and a backlog of a few tokens
    # (a row's plain steps) fed that way replays a graph instead of running the uncaptured path.
    INLINE = 2
    INLINE_GPU = 8

    def __init__(
        self,
        runner: SequenceRunner,
        device: torch.device,
        min_confidence: float = 0.0,
        max_len: int | None = None,
        fit: VocabFit | None = None,
    ):
        self.runner = runner
        # None: the draft's logits are as wide as its target's and every id is a token of both
        self.fit = fit
        self.device = device
        # the draft's own context (its cache's capacity), which may be shorter than the target's
        self.max_len = max_len
        # Stop drafting after a token the draft itself gave less than this probability (as
        # transformers' assisted generation does): past such a token the next ones are rarely
        # accepted, and their draft steps are wasted. Reading the probability is a host sync per
        # drafted token, which a CPU does anyway and a GPU pays as a launch gap (see Engine).
        self.min_confidence = min_confidence
        self.shape: DraftShape | None = None  # the request's logit_bias / grammar, set by the engine
        self.inline = self.INLINE_GPU if device.type == "cuda" else self.INLINE

    def room(self, tokens: list[int]) -> int | None:
        """The most tokens it may draft after ``tokens`` within its context (None: no bound). Past it
        the row decodes plainly: a draft served at a shorter context than its target's (a 2k-token
        draft for a 4k target; each model's max_context) overflowed its cache, and the request failed
        mid-stream as a server error."""
        return None if self.max_len is None else max(0, self.max_len - len(tokens))

    def backlog(self, tokens: list[int]) -> int:
        """Tokens of ``tokens`` a proposal would first catch up on (``catch_up``; 0: none, or few
        enough to feed in its first draft pass)."""
        n = len(tokens) - 1 - self.runner.length
        return n if n + 1 > self.inline else 0

    def catch_up(self, tokens: list[int]) -> None:
        if self.backlog(tokens):
            self.runner.forward(self.feedable(tokens[self.runner.length : -1]), logits=False)

    def feedable(self, tokens: list[int]) -> list[int]:
        return tokens if self.fit is None else self.fit.feedable(tokens)

    def narrow(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [..., V_draft] over the ids it may propose (VocabFit.narrow), for an argmax."""
        return logits if self.fit is None else self.fit.narrow(logits)

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Proposal:
        proposal = propose_many([(self, tokens, k, params, counts, generator)])[0]
        assert proposal is not None
        return proposal

    def _pick(self, row: torch.Tensor, state: _Drafting, last: bool) -> bool:
        """Choose the next draft token from ``row`` [1, V]; False when drafting should stop after it."""
        params = state.params
        if self.fit is not None:
            row = self.fit.widen(row)  # [1, V_target]
        row = apply_penalties(row, state.counts, row.new_zeros(0, dtype=torch.long), params)
        if self.shape is not None:  # a host read of the drafted ids: the grammar runs on the CPU
            row = self.shape(row, [int(t) for t in state.drafted])
        check = not last and self.min_confidence > 0  # is there a next draft step to skip?
        if params.greedy:
            tok = row.argmax(-1)  # [1]
            confidence = row.float().softmax(-1).max() if check else None
        else:
            p = probs_from_logits(row, params)  # [1, V]
            tok = sample(p, state.generator)
            state.probs.append(p[0])
            confidence = p[0, tok] if check else None
        state.drafted.append(type(self).picked([state], len(state.drafted), tok))
        if params.penalised:
            state.counts[state.drafted[-1]] += 1
        # the unsure token is still proposed: verifying it costs a row, not a step
        return confidence is None or float(confidence) >= self.min_confidence

    @staticmethod
    def picked(states: list[_Drafting], step: int, tokens: torch.Tensor) -> torch.Tensor:
        """A hook on the tokens [B] that draft pass ``step`` (from 0) chose for ``states``' rows, which
        it returns, as they are here (benchmarks replace them)."""
        return tokens

    def rollback(self, valid: int) -> None:
        self.runner.crop(min(self.runner.length, valid))

    def release(self) -> None:
        self.runner.release()


class StatelessDrafter:
    """A drafter that reads the sequence afresh at each proposal: nothing to catch up on, roll back
    or free."""

    def catch_up(self, tokens: list[int]) -> None:
        pass

    def rollback(self, valid: int) -> None:
        pass

    def release(self) -> None:
        pass


class PromptLookupDrafter(StatelessDrafter):
    """Prompt lookup decoding (Saxena 2023): find the latest earlier occurrence of the sequence's last
    n tokens (n from ``max_ngram`` down to ``min_ngram``) and propose the tokens that followed it.
    Deterministic, so verification treats its proposal as p = one-hot."""

    name = "ngram"

    def __init__(self, device: torch.device, max_ngram: int = 3, min_ngram: int = 1):
        self.device = device
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Proposal:
        found = lookup_ngram(np.asarray(tokens, dtype=np.int64), k, self.max_ngram, self.min_ngram)
        return Proposal(as_ids(found, self.device), None)


def lookup_ngram(seq: np.ndarray, k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Tokens that followed the most recent earlier match of the longest matching suffix n-gram."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = seq[L - n :]
        # windows starting at 0..L-n-1: every n-gram that is followed by at least one token
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # [L-n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + k].tolist()
    return []


@dataclass
class _Drafting:
    """One row's proposal in progress (propose_many)."""

    drafter: DraftModelDrafter
    tokens: list[int]  # the sequence so far (committed tokens)
    k: int
    params: SamplingParams
    counts: torch.Tensor
    generator: torch.Generator | None
    drafted: list[torch.Tensor] = field(default_factory=list)  # [1] each
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] each

    def proposal(self) -> Proposal:
        toks = (
            torch.cat(self.drafted)
            if self.drafted
            else torch.zeros(0, dtype=torch.long, device=self.drafter.device)
        )
        return Proposal(toks, torch.stack(self.probs) if self.probs else None)


ProposeItem = tuple[Drafter | None, list[int], int, SamplingParams, torch.Tensor, torch.Generator | None]


def _draft_pass(
    runners: list[SequenceRunner],
    feed: torch.Tensor | list[torch.Tensor] | list[list[int]],
    device: torch.device,
    fit: VocabFit | None = None,
) -> torch.Tensor:
    """Each row's next-token logits after feeding it its tokens (a [B, W] tensor on the device, each
    row's own tensor, or host lists, which go over in one copy): [B, V]. One decode-only step where
    the runners share a batched model (rows padded to one width: the padding lands past each row's
    length, where nothing reads it), else forward_many. ``fit``: the draft's VocabFit, whose
    ``feedable`` the fed ids pass through (a target's token, or a benchmark's replayed one, may be an
    id the draft has no row for)."""
    if fit is not None and fit.target > fit.draft:
        if isinstance(feed, torch.Tensor):
            feed = fit.feedable_ids(feed)
        elif isinstance(feed[0], list):
            feed = [fit.feedable(f) for f in feed]
        else:
            feed = [fit.feedable_ids(f) for f in feed]
    model = getattr(runners[0], "batch_model", None)
    if isinstance(feed, torch.Tensor):
        widths = [int(feed.shape[1])] * len(runners)
    else:
        widths = [len(f) if isinstance(f, list) else int(f.shape[0]) for f in feed]
    same = all(getattr(r, "batch_model", None) is model and not getattr(r, "exact", False) for r in runners)
    if model is not None and same and max(widths) <= model.max_graph_tokens:
        starts = [r.advance(w) for r, w in zip(runners, widths, strict=True)]  # type: ignore[attr-defined]
        W = max(widths)
        if isinstance(feed, torch.Tensor):
            ids = feed
        elif isinstance(feed[0], list):
            host = [f + [0] * (W - len(f)) for f in feed]
            ids = torch.tensor(host, dtype=torch.long)  # [B, W] on the host: the graph's one copy
        elif min(widths) == W:  # one stack (a kernel or two; padding copies row by row)
            ids = torch.stack(feed)
        else:
            ids = pad_sequence(feed, batch_first=True)
        logits = model.forward_batch([r.slot for r in runners], starts, ids)  # type: ignore[attr-defined]
        if min(widths) == W:  # one width (a step's first pass usually): a column, no index to copy
            return logits[:, W - 1]
        last = as_ids(widths, device) - 1
        return logits[torch.arange(len(runners), device=device), last]
    rows = list(feed)
    out = forward_many(runners, [as_ids(f, device) for f in rows], ["last"] * len(runners))
    return torch.cat([o for o in out if o is not None])


# A catch-up pass holds at most this many rows and each runner's prefill_chunk tokens in all: the
# static backend's prompt-chunk graphs (decoding/graphs.py, CHUNK_ROWS and the largest chunk bucket).
# Past them a pass runs eagerly, which on the H200 stalled a 16-row batch's first draft (16 prompts
# of 131 tokens, one pass) for 0.6 s (bench.probe_auto_fast).
CATCH_UP_ROWS = 8


def catch_up_many(items: list[ProposeItem]) -> int:
    """Draft models absorb their backlogs (a prompt, tokens from plain steps) before the rows that
    will draft do so: in passes of up to CATCH_UP_ROWS rows and a prefill chunk of tokens. Returns
    how many tokens they took in."""
    todo = []
    for drafter, tokens, k, *_ in items:
        if isinstance(drafter, DraftModelDrafter) and k > 0 and drafter.backlog(tokens):
            todo.append(
                (drafter.runner, drafter.feedable(tokens[drafter.runner.length : -1]), drafter.device)
            )
    fed = sum(len(t) for _, t, _ in todo)
    while todo:
        budget = getattr(todo[0][0], "prefill_chunk", None) or sum(len(t) for _, t, _ in todo)
        batch: list[tuple[SequenceRunner, torch.Tensor]] = []
        rest = []
        for runner, toks, device in todo:
            n = min(len(toks), budget) if len(batch) < CATCH_UP_ROWS else 0
            if n:
                batch.append((runner, as_ids(toks[:n], device)))
                budget -= n
            if n < len(toks):
                rest.append((runner, toks[n:], device))
        forward_many([r for r, _ in batch], [t for _, t in batch], ["none"] * len(batch))
        todo = rest
    return fed


def drafts_argmax(drafter: DraftModelDrafter, params: SamplingParams) -> bool:
    """Whether a row's drafts are its draft model's argmax, pass after pass, nothing read on the host
    between passes: greedy, no penalty, no confidence stop, no shaping."""
    return params.greedy and not params.penalised and drafter.min_confidence == 0 and drafter.shape is None


@dataclass
class FirstDrafts:
    """A step's first draft pass, queued behind the verification of the step before it and ahead of
    that step's read-back (``draft_first``), so the device drafts while the host reads, commits and
    plans. Each row was fed [its last kept token, the bonus token] at the places the device's accepted
    counts gave them; ``take`` hands the pass's tokens to the rows' proposals once the host has read
    that step and cut the drafts' caches back to it."""

    rows: dict[int, int]  # id(drafter) -> its row in the pass
    tokens: torch.Tensor  # [B] each row's argmax, the first drafted token of its next proposal
    began: torch.cuda.Event | None = None  # the pass's device time, counted with the next step's drafts
    ended: torch.cuda.Event | None = None
    taken: bool = False

    def take(self, live: list[_Drafting]) -> torch.Tensor | None:
        """``live``'s first drafted tokens [len(live)], their draft caches moved on past the two
        tokens the pass fed them; None (and nothing moved) unless every row was in the pass and its
        cache ends where the pass began: one token short of the sequence (a rejection) or two (all
        accepted, d_k never fed)."""
        at = [self.rows.get(id(d.drafter)) for d in live]
        if (
            self.taken
            or None in at
            or any(not 1 <= len(d.tokens) - d.drafter.runner.length <= 2 for d in live)
        ):
            return None
        for d in live:
            d.drafter.runner.advance(len(d.tokens) - d.drafter.runner.length)  # type: ignore[attr-defined]
        self.taken = True
        if at == list(range(len(self.rows))):
            return self.tokens
        return self.tokens[as_ids([b for b in at if b is not None], self.tokens.device)]


def draft_first(
    drafters: list[DraftModelDrafter],
    fed: torch.Tensor,  # [B, 2] each row's last kept token and bonus token, on the device
    starts: torch.Tensor,  # [B] the cache position of each row's first fed token, on the device
    last_start: int,  # a bound on the largest start, from the host
) -> FirstDrafts | None:
    """The next step's first draft pass over ``drafters``' rows, queued now (``FirstDrafts``); None
    where their runners do not share a model that places rows from the device."""
    runners = [d.runner for d in drafters]
    model = getattr(runners[0], "batch_model", None)
    if (
        not getattr(model, "device_starts", False)
        or any(getattr(r, "batch_model", None) is not model or getattr(r, "exact", False) for r in runners)
        or last_start + fed.shape[1] > model.cache_len  # type: ignore[union-attr]  # a row at its context's end
    ):
        return None
    cuda = fed.device.type == "cuda"
    began, ended = (
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    )
    if began is not None:
        began.record()
    slots = [r.slot for r in runners]  # type: ignore[attr-defined]
    fit = drafters[0].fit  # one draft model: the runners share it
    if fit is not None:
        fed = fit.feedable_ids(fed)
    logits = model.forward_batch(slots, starts, fed, last_start=last_start)  # type: ignore[union-attr]
    tokens = drafters[0].narrow(logits[:, -1]).argmax(-1)  # [B]
    if ended is not None:
        ended.record()
    return FirstDrafts({id(d): b for b, d in enumerate(drafters)}, tokens, began, ended)


def propose_many(items: list[ProposeItem], first: FirstDrafts | None = None) -> list[Proposal | None]:
    """Every row's proposal for one step: draft models draft in lockstep, one batched forward pass
    per drafted position over the rows still drafting (a row leaves at its k or its confidence
    stop); prompt lookup proposes per row. None where a row drafts nothing (no drafter, k = 0).
    ``first``: the first pass, queued already (greedy rows only: its tokens are argmaxes)."""
    out: list[Proposal | None] = [None] * len(items)
    live: list[tuple[int, _Drafting]] = []
    for i, (drafter, tokens, k, params, counts, generator) in enumerate(items):
        if drafter is None or k <= 0:
            continue
        if not isinstance(drafter, DraftModelDrafter):
            out[i] = drafter.propose(tokens, k, params, counts, generator)
            continue
        assert drafter.runner.length < len(tokens), "draft cache ran ahead of the sequence"
        counts = counts.clone() if params.penalised else counts  # counts exist for penalties alone
        live.append((i, _Drafting(drafter, tokens, k, params, counts, generator)))
    if not live:
        return out
    # the unseen tokens of each row (the bonus token, after a full acceptance d_k as well; a backlog
    # was absorbed by catch_up), their last position's logits drafting the first token
    feed: list[torch.Tensor] | list[list[int]] = [items[i][1][d.drafter.runner.length :] for i, d in live]
    device = live[0][1].drafter.device
    # greedy rows with no penalty, confidence stop or shaping: one argmax a pass for the batch
    plain = all(drafts_argmax(d.drafter, d.params) for _, d in live)
    pre = first.take([d for _, d in live]) if first is not None and plain else None  # [B]
    if plain and len({d.k for _, d in live}) == 1 and len({type(d.drafter) for _, d in live}) == 1:
        return _lockstep(live, feed, device, out, pre)
    step = 0
    while live:
        toks: torch.Tensor | None
        if pre is not None and step == 0:
            rows, toks = pre[:, None], pre  # the pass ran ahead; rows are never read when plain
        else:
            rows = _draft_pass(
                [d.drafter.runner for _, d in live], feed, device, live[0][1].drafter.fit
            )  # [B, V]
            toks = live[0][1].drafter.narrow(rows).argmax(-1) if plain else None  # [B]
        still: list[tuple[int, _Drafting]] = []
        nxt: list[torch.Tensor] = []
        for b, (i, d) in enumerate(live):
            last = step == d.k - 1
            if toks is not None:
                d.drafted.append(type(d.drafter).picked([d], step, toks[b : b + 1]))
                go = True
            else:
                go = d.drafter._pick(rows[b : b + 1], d, last)
            if go and not last:
                still.append((i, d))
                nxt.append(d.drafted[-1])  # stays on the device (no sync unless min_confidence)
            else:
                out[i] = d.proposal()
        live, feed = still, nxt
        step += 1
    return out


def _lockstep(
    live: list[tuple[int, _Drafting]],
    feed: list[torch.Tensor] | list[list[int]],
    device: torch.device,
    out: list[Proposal | None],
    first: torch.Tensor | None = None,
) -> list[Proposal | None]:
    """``propose_many`` where every row drafts greedily, unshaped, the same k: each pass feeds the
    last one's argmax column [B, 1] as it is, and the proposals are the rows of one [B, k] tensor.
    Row by row, a pass's feed and the proposals cost a copy kernel a row each: at N = 64 on the H200,
    a k = 1 step took 10.6 ms against its graphs' 5.9 (bench.probe_spec_host, 2026-12-03 13:56 UTC).
    ``first``: the first pass's tokens [B], run ahead (``FirstDrafts``)."""
    runners = [d.drafter.runner for _, d in live]
    states = [d for _, d in live]
    picked = type(states[0].drafter).picked
    narrow, fit = states[0].drafter.narrow, states[0].drafter.fit  # one draft model for the batch
    cols: list[torch.Tensor] = []
    fed: torch.Tensor | list[torch.Tensor] | list[list[int]] = feed
    for step in range(states[0].k):
        chose = (
            first
            if step == 0 and first is not None
            else narrow(_draft_pass(runners, fed, device, fit)).argmax(-1)
        )
        toks = picked(states, step, chose)  # [B]
        cols.append(toks)
        fed = toks[:, None]
    drafts = torch.stack(cols, dim=1)  # [B, k]
    for b, (i, _) in enumerate(live):
        out[i] = Proposal(drafts[b], None)
    return out


class PredictionDrafter(StatelessDrafter):
    """Predicted Outputs (OpenAI's ``prediction``): propose what follows, in the client's predicted
    text, the place the output so far has reached. Deterministic, like prompt lookup.

    The place is found again at every proposal, so a divergence (an edit) costs only the steps until
    the output rejoins the prediction: the longest suffix of the output (up to ``SYNC`` tokens) that
    occurs in the prediction, at the occurrence nearest where the last proposal expected to be.
    """

    name = "prediction"
    SYNC = 8

    def __init__(self, device: torch.device, prediction: tuple[int, ...], prompt_tokens: int):
        self.device = device
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.prompt_tokens = prompt_tokens
        self.expected = 0  # where, in the prediction, the next output token was expected last time
        self.output_len = 0

    def propose(
        self,
        tokens: list[int],
        k: int,
        params: SamplingParams,
        counts: torch.Tensor,
        generator: torch.Generator | None,
    ) -> Proposal:
        out = tokens[self.prompt_tokens :]
        hint = self.expected + len(out) - self.output_len
        at = align(self.prediction, np.asarray(out, dtype=np.int64), hint, self.SYNC)
        found = [] if at is None else self.prediction[at : at + k].tolist()
        if at is not None:
            self.expected, self.output_len = at, len(out)
        return Proposal(as_ids(found, self.device), None)


def align(prediction: np.ndarray, output: np.ndarray, hint: int, sync: int) -> int | None:
    """Index in ``prediction`` of the token after the output's end: 0 before any output; else just
    past the longest output suffix (<= ``sync`` tokens) found in the prediction, the occurrence
    nearest ``hint``; None when not even the last token occurs."""
    if len(output) == 0:
        return 0
    P = len(prediction)
    for n in range(min(sync, len(output), P), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(prediction, n)  # [P-n+1, n]
        hits = np.flatnonzero((windows == output[-n:]).all(axis=1)) + n  # ends of matches
        if hits.size:
            return int(hits[np.argmin(np.abs(hits - hint))])
    return None
