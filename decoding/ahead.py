"""Steps queued ahead of the call that takes them, so the device computes the next step while the host
streams and schedules: a plain step's next is chained before its rows are read back, from the tokens
it chose on the device (``Ahead.launch``); any other is launched once its step is committed
(``Ahead.speculate``); a queued step is undone for rows that are gone when it is taken (``Ahead.take``,
``QueuedStep.undo``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from decoding.batch import DecodeBatch, QueuedStep, Verifying
from decoding.drafters import DraftModelDrafter, FirstDrafts, draft_first, drafts_argmax
from decoding.runner import as_ids
from decoding.timing import StepTimer

if TYPE_CHECKING:
    from decoding.engine import Engine
    from decoding.params import StepOutput
    from decoding.sequence import Sequence


class Ahead:
    """An engine's steps queued ahead, per target model (where ``Engine.overlap`` says). They are the
    engine's own steps: chosen, launched, passed and committed by its ``ks_for``, ``launch_step``,
    ``target_pass`` and ``commit_step``."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.queued: dict[str, QueuedStep] = {}  # per target: the step queued by the last call
        self.planned: dict[str, tuple[list[int] | None, list[int]]] = {}  # per target: next step's k
        self.taken = 0  # steps queued ahead whose results were used (observability, tests)
        self.budget: int | None = None  # prompt tokens a step may take (the last call's prefill budget)

    def overlaps(self, seq: Sequence) -> bool:
        """Whether steps are queued ahead: on by default where the device runs asynchronously
        (CUDA); ``Engine.overlap`` forces it either way (tests run it on the CPU, where it only costs)."""
        overlap = self.engine.overlap
        return overlap if overlap is not None else seq.target.device.type == "cuda"

    @staticmethod
    def _ends(seq: Sequence, in_flight: int) -> bool:
        """Whether max_tokens ends a row by the ``in_flight`` steps not yet read back."""
        return seq.request.params.max_tokens - seq.completion_tokens <= in_flight

    @staticmethod
    def _chains(seq: Sequence) -> bool:
        """Whether a row's next step can be queued before the host sees the steps not yet read back:
        it is plain, its input is the token those steps chose (nothing the host must first see: a
        grammar, penalty counts, logprobs read from a step's logits)."""
        params = seq.request.params
        return seq.shaping is None and not params.penalised and params.logprobs is None

    def planned_ks(self, decoding: list[Sequence], plain: bool = False) -> list[int]:
        """This step's k per row: 0 where it is ``plain`` (the plan is dropped), else chosen when the
        last step was queued (``launch``), if for these rows, else now."""
        planned = self.planned.pop(decoding[0].target.name, None) if decoding else None
        if plain:
            return [0] * len(decoding)
        if planned is not None and planned[0] == [id(s) for s in decoding]:
            return planned[1]
        return self.engine.ks_for(decoding)

    def launch(
        self,
        rows: list[Sequence],
        verifying: Verifying,
        pick: list[int] | None,
        in_flight: int,
        prefilling: list[Sequence] | None = None,
    ) -> None:
        """Queue the next plain step of ``rows`` (``verifying``'s rows, or those at ``pick``) behind
        the ``in_flight`` steps not yet read back. A row those steps end by max_tokens is left out of
        it (it has no next step; holding the others back for it made every step where a row of a
        batch finished a synchronous one). The rows' k for it are chosen now; when any is not 0
        they are kept for that step, and nothing is queued (``speculate`` queues it once this step
        is committed). ``prefilling``: prompts still being prefilled, whose next chunks (within
        ``budget``) go beside the rows, which decode plainly beside them (``Engine._plain_beside_prompts``):
        a long prompt's chunks were each a synchronous step, ~1.5 ms over their kernels' 6.3 ms at
        N = 16 on the H200 (bench.gpu_batch, 2026-12-03). Not where a prompt's last chunk is in
        flight (it decodes in the next step, once its prefill is committed), a prompt scores its
        tokens, or a row samples with a fixed k (it keeps drafting beside chunks)."""
        if not rows or not self.overlaps(rows[0]):
            return
        if any(self._ends(s, in_flight) for s in rows):
            at = range(len(rows)) if pick is None else pick
            going = [(i, s) for i, s in zip(at, rows, strict=True) if not self._ends(s, in_flight)]
            pick, rows = [i for i, _ in going], [s for _, s in going]
        if not rows or not all(self._chains(s) for s in rows):
            return
        chunks: list[tuple[Sequence, int]] = []
        if prefilling:
            if any(
                s.runner.length >= len(s.tokens) - 1 or s.prompt_logprobs is not None for s in prefilling
            ) or any(self.engine.keeps_k(s) for s in rows):
                return
            chunks = self.engine.prefill_chunks(prefilling, self.budget, self.engine.chunk_tokens)
        name = rows[0].target.name
        ks = [] if chunks else self.engine.ks_for(rows, pending=in_flight)
        if any(ks):
            self.planned[name] = ([id(s) for s in rows], ks)
            return
        ids = verifying.chosen()  # [B]
        if pick is not None:
            ids = ids[as_ids(pick, ids.device)]
        B = len(rows)
        batch = DecodeBatch(ids[:, None], ids.new_zeros(B, 0), [0] * B)
        generators = {id(s): s.generator.get_state() for s in rows if not s.request.params.greedy}
        timer = StepTimer(rows[0].target.device)
        timer.mark()
        start = time.perf_counter()
        logits, _ = self.engine.target_pass(rows, batch, chunks)
        verifying = Verifying.queue(rows, [None] * B, batch, logits)
        self.queued[name] = QueuedStep(
            list(rows), batch, verifying, timer, start, generators=generators, chunks=chunks
        )
        timer.stop()

    def first_drafts(
        self, rows: list[Sequence], batch: DecodeBatch, verifying: Verifying
    ) -> FirstDrafts | None:
        """The next step's first draft pass, queued behind this speculative step's verification and
        ahead of its read-back (``decoding.drafters.FirstDrafts``), where steps are queued ahead and
        every row drafted greedily with a draft model, unshaped, and verified on the device at once:
        each row is fed its last kept token (the pending one or d_n) and the bonus token at the
        places n puts them. The device drafts it while the host reads this step back, applies it and
        launches the next (``speculate``), where it would otherwise wait: ~1 ms a step at N = 4 on the
        H200, a tenth of a k = 4 step (bench.probe_spec_host). Used only by the step ``speculate``
        launches right after this one is applied; a row that ends, or a next step that is plain,
        leaves it unread (what it wrote lies past the caches' lengths)."""
        if not rows or batch.width == 1 or not self.overlaps(rows[0]):
            return None
        outcome = verifying.outcome()
        # the rows that drafted this step (a row at its last token drafts none; it ends here)
        drafting = [b for b, k in enumerate(batch.n_drafts) if k]
        drafters = [rows[b].drafter for b in drafting]
        if (
            outcome is None
            or not drafters
            or not all(
                isinstance(d, DraftModelDrafter)
                and drafts_argmax(d, rows[b].request.params)
                and d.runner.length >= len(rows[b].tokens)  # it drafted this step from the pending token on
                and ((room := d.room(rows[b].tokens)) is None or room >= batch.n_drafts[b] + 2)  # fits
                for b, d in zip(drafting, drafters, strict=True)
            )
        ):
            return None
        n, argmax, ids = outcome[0], outcome[1], batch.ids  # [B], [B, W], [B, W]
        if len(drafting) < len(rows):
            idx = as_ids(drafting, n.device)
            n, argmax, ids = n[idx], argmax[idx], ids[idx]
        at = n[:, None]
        fed = torch.cat([ids.gather(1, at), argmax.gather(1, at)], dim=1)  # [B', 2]
        pending = [len(rows[b].tokens) - 1 for b in drafting]  # where each row's step began
        starts = as_ids(pending, n.device) + n  # [B']
        last = max(p + batch.n_drafts[b] for p, b in zip(pending, drafting, strict=True))
        return draft_first(drafters, fed, starts, last)  # type: ignore[arg-type]

    def speculate(self, rows: list[Sequence], read_at: float, after: QueuedStep | None = None) -> None:
        """Queue the next step of ``rows`` (a committed step's, with no prompt waiting) now, rather
        than at the next call, where nothing is queued yet: a step whose input the host had to
        read first (speculative, or a row with a grammar, penalties or logprobs). Its proposals,
        pass and verification then run while the host streams this step's tokens and schedules
        the next; what it needs of the host (accepted tokens, counts, the grammar's state) is
        committed by now. Undone where not taken (QueuedStep.undo). Its cost is counted from
        ``read_at``, when the step before was read back: the device waits from then until this
        one's first kernel, through the commit before it and its own launch (~1.5 ms at N = 16 on
        the H200, which the controller otherwise missed: k = 1 steps costed at 6.5 ms took 7.9).
        ``after``: the step just applied, whose ``first_drafts`` it may use."""
        live = [s for s in rows if s.finished is None]
        if not live or not self.overlaps(live[0]) or live[0].target.name in self.queued:
            return
        first = after.first if after is not None else None
        step = self.engine.launch_step(
            live[0].target.device, live, self.planned_ks(live), [], undoable=True, first=first
        )
        step.start = read_at
        self.queued[live[0].target.name] = step

    def take(self, seqs: list[Sequence], joining: bool = False) -> list[StepOutput | None] | None:
        """This call's step, queued by the last for ``seqs``' target (None: none is): its rows that are
        still here emit, the ones that left are undone, and rows new since (their prefill comes next
        step) emit None. None, and all undone, when no row of it is here."""
        step = self.queued.pop(seqs[0].target.name, None)
        if step is None:
            return None
        here = {id(s) for s in seqs if s.finished is None}
        kept = [s for s in step.seqs if id(s) in here]
        step.undo([s for s in step.seqs if id(s) not in here])
        if not kept:
            for s, n in step.chunks:  # their chunks are fed again by the step that takes them next
                s.runner.crop(s.runner.length - n)
            return None
        queued = {id(s) for s in step.seqs}
        # no new rows, none about to join: the next step can be queued too (prompts being prefilled
        # beside plain rows: with their next chunks)
        whole = all(id(s) in queued for s in seqs) and not joining
        chains = all(id(s) in queued or not s.prefilled for s in seqs) and not joining
        began = time.perf_counter()
        if chains and step.batch.width == 1:  # plain: queue the next before this one's read
            pos = {id(s): i for i, s in enumerate(step.seqs)}
            pick = None if len(kept) == len(step.seqs) else [pos[id(s)] for s in kept]
            prefilling = [s for s in seqs if not s.prefilled and s.finished is None]
            self.launch(kept, step.verifying, pick, in_flight=1, prefilling=prefilling)
        chained = kept[0].target.name in self.queued  # a plain step queued behind this plain one
        launched = time.perf_counter()
        results = step.verifying.results()
        read_at = time.perf_counter()
        self.taken += 1
        by_row = dict(zip((id(s) for s in step.seqs), results, strict=True))
        applied = step.apply(kept, [by_row[id(s)] for s in kept])
        if whole:
            self.speculate(kept, read_at, step)
        # a step that also prefilled is no sample of a decode step's cost
        outs = self.engine.commit_step(step, kept, applied, read_at, "none" if step.chunks else "wall")
        # a plain step's host work, which a speculative step's wall time would show
        if chained and not step.chunks:
            self.engine.costs_of(kept[0]).observe_host(
                len(kept), launched - began + time.perf_counter() - read_at
            )
        self.engine.took_chunks([(s, n) for s, n in step.chunks if s.finished is None], read_at - step.start)
        return [outs.get(id(s)) for s in seqs]
