"""The synchronous core: one batched speculative step over every running sequence of a model.

A sequence's target KV cache always holds every committed token but the last ("pending") one. A step
feeds each decoding row [pending, d_1..d_k] and each prefilling row its next prompt chunk to the
target in one forward pass, verifies every decoding row, and cuts each cache back to its committed
length, so a rejected draft costs nothing later and the prompt is never recomputed. A plain step is
the same with k = 0; a request alone is the batch of one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Literal

import torch
from torch.nn.utils.rnn import pad_sequence

from decoding import admission
from decoding.ahead import Ahead
from decoding.batch import Applied, DecodeBatch, QueuedStep, Verifying
from decoding.batch_controller import BatchCosts, KRow, choose_ks
from decoding.controller import Population, expected_tokens
from decoding.drafters import (
    Drafter,
    DraftModelDrafter,
    FirstDrafts,
    ProposeItem,
    catch_up_many,
    propose_many,
)
from decoding.grammar import GrammarCompiler, GrammarLimits
from decoding.params import (
    FinishReason,
    GenerationRequest,
    RequestStats,
    StepOutput,
    TokenLogprob,
)
from decoding.runner import Want, as_ids, forward_many
from decoding.sampling import Scored, score
from decoding.sequence import LoadedModel, Sequence
from decoding.timing import StepTimer

Timing = Literal["wall", "none"]  # what a step's cost sample is (Engine.commit_step)


# The most prompt tokens a step feeds a sequence whose prompt is scored (SamplingParams.prompt_logprobs):
# its chunk's logits are [T, V], ~150 MB at V = 152k in float32 (and as much again for their
# log-softmax), scored and dropped within the step
SCORED_CHUNK = 256


class Engine:
    def __init__(
        self, models: dict[str, LoadedModel], ngram_max: int = 3, grammar_limits: GrammarLimits | None = None
    ):
        self.models = models
        self.ngram_max = ngram_max
        self.grammars = GrammarCompiler(grammar_limits)  # compiles off the caller's thread
        self.total_steps = 0  # target forward passes, all requests (observability, tests)
        self.costs: dict[str, BatchCosts] = {}  # per target: measured step costs by batch shape
        self.population: dict[tuple[str, str], Population] = {}  # per (target, drafter): acceptance
        self.overlap: bool | None = None  # queue steps ahead (None: where the device is CUDA)
        self.ahead = Ahead(self)  # the steps queued ahead of the calls that take them
        # prompt chunks end on multiples of this (or at the prompt's end), whatever shares the step
        # (``prefill_chunks``); None: wherever the budget runs out. AsyncEngine sets its prefill budget
        self.chunk_tokens: int | None = None

    @property
    def ahead_steps(self) -> int:
        """Steps queued ahead whose results were used (observability, tests)."""
        return self.ahead.taken

    def model(self, name: str) -> LoadedModel:
        return admission.model_of(self.models, name)

    def check(self, request: GenerationRequest) -> GenerationRequest:
        """Everything that can refuse a request before any model work (decoding.admission); the
        request to ``start``, its grammar compiled."""
        return admission.check(self.models, request, self.grammars)

    def start(self, request: GenerationRequest) -> Sequence:
        """A checked request's sequence (``check`` runs where a request enters: ``AsyncEngine.submit``,
        ``generate``)."""
        target = self.model(request.model)
        runner = target.runner_factory(target.model)  # NoFreeSlot: the caller queues the request
        try:
            drafter = self._drafter(target, request)
        except BaseException:
            runner.release()
            raise
        seq = admission.new_sequence(self.models, target, request, runner, drafter)
        self._reuse_prefix(seq)
        if drafter is not None:
            self._population(seq).seed(seq.controller)
            seq.controller.seed(*_step_tables(seq))
        return seq

    def _reuse_prefix(self, seq: Sequence) -> None:
        """The prompt's prefix that the target's KV (and the draft's) kept from a request before
        (decoding/prefix.py): only what recomputes to the same bits for the target; for the draft
        all it shares, but where seeded sampling draws from its probabilities. A scored prompt
        (prompt_logprobs) computes every position: it keeps nothing, and its slot is still
        labelled with its salt."""
        request = seq.request
        scored = request.params.prompt_logprobs is not None
        prompt, salt = [] if scored else request.prompt_token_ids, request.cache_salt
        seq.stats.cached_tokens = seq.runner.reuse(prompt, True, salt, self.chunk_tokens)
        if isinstance(seq.drafter, DraftModelDrafter):
            seeded = request.params.seed is not None and not request.params.greedy
            seq.drafter.runner.reuse(prompt, seeded, salt)

    def _drafter(self, target: LoadedModel, request: GenerationRequest) -> Drafter | None:
        """The request's drafter (a method, so that benchmarks can wrap it)."""
        return admission.drafter_for(self.models, target, request, self.ngram_max)

    def step(self, seq: Sequence) -> StepOutput:
        """One step of one sequence (its whole prompt first, if not yet prefilled)."""
        while True:
            out = self.step_batch([seq], prefill_budget=None)[0]
            if out is not None:
                return out

    @torch.inference_mode()
    def step_batch(
        self, seqs: list[Sequence], prefill_budget: int | None = None, joining: bool = False
    ) -> list[StepOutput | None]:
        """One forward pass of the target over ``seqs`` (all of one target model): decoding rows
        draft, verify and emit; prefilling rows take their next prompt chunk (within
        ``prefill_budget`` tokens in all, None: whole prompts) and emit None until done.

        Where the device runs asynchronously the next step is queued before this call returns, and
        the next call takes it (``Ahead.take``): a plain step's before its rows are read back (its
        rows' next tokens stay on the device, ``Ahead.launch``), any other once this one is
        committed (``Ahead.speculate``); either way the device computes while the host streams and
        schedules. ``joining``: requests wait to join the batch at the next call, so nothing is
        queued (a queued step would hold their prefill back a step)."""
        if not seqs:
            return []
        self.ahead.budget = prefill_budget  # the next chunks of a step queued ahead keep within it
        taken = self.ahead.take(seqs, joining)
        if taken is not None:
            return taken
        decoding = [s for s in seqs if s.prefilled]
        chunks = self.prefill_chunks([s for s in seqs if not s.prefilled], prefill_budget, self.chunk_tokens)
        plain = self._plain_beside_prompts(decoding, chunks)
        ks = self.ahead.planned_ks(decoding, plain)
        if plain and any(keep := [self.keeps_k(s) for s in decoding]):
            # their own controllers' k (a fixed k is no batch choice: the others' controllers are not asked)
            kept = iter(self.ks_for([s for s, k in zip(decoding, keep, strict=True) if k]))
            ks = [next(kept) if k else 0 for k in keep]
        t0 = time.perf_counter()
        step = self.launch_step(seqs[0].target.device, decoding, ks, chunks, plain)
        whole = len(decoding) == len(seqs) and not joining  # no prompt in this step or the next
        if not joining and max(step.batch.n_drafts, default=1) == 0:
            prefilling = [s for s in seqs if not s.prefilled]
            self.ahead.launch(decoding, step.verifying, None, in_flight=1, prefilling=prefilling)
        results = step.verifying.results()  # the step's one host sync
        read_at = time.perf_counter()
        # a step that also prefilled is no sample of a decode step's cost
        timing: Timing = "none" if any(n for _, n in chunks) else "wall"
        applied = step.apply(decoding, results)
        if whole:
            self.ahead.speculate(decoding, read_at, step)
        outs = self.commit_step(step, decoding, applied, read_at, timing)
        for s, targets, scored in step.prompt_scores:  # read back with the step's results
            assert s.prompt_logprobs is not None
            s.prompt_logprobs += [
                TokenLogprob(t, lp, tuple(top)) for t, (lp, top) in zip(targets, scored.read(), strict=True)
            ]
        self.took_chunks(chunks, time.perf_counter() - t0)
        return [outs.get(id(s)) for s in seqs]

    def took_chunks(self, chunks: list[tuple[Sequence, int]], elapsed: float) -> None:
        """A step's prompt chunks are in their caches: their prefill's cost, and the prompts they
        complete are prefilled (they decode from the next step on). A prompt with a chunk in a step
        queued after this one (``Ahead.launch``) is not complete by this one, whatever its length
        says."""
        queued = self.ahead.queued.get(chunks[0][0].target.name) if chunks else None
        later = {id(s) for s, _ in queued.chunks} if queued is not None else set()
        step_tokens = sum(n for _, n in chunks)
        for s, n in chunks:
            s.stats.prefill_s += elapsed
            # the controller's per-token slope: this sequence's share of a step that others share
            s.prefill_cost += elapsed * n / step_tokens if step_tokens else 0.0
            if s.runner.length == len(s.tokens) - 1 and id(s) not in later:
                s.controller.observe_prefill(len(s.tokens) - 1 - s.stats.cached_tokens, s.prefill_cost)
                s.prefilled = True  # the draft prefills lazily, at its first proposal (if any)

    def launch_step(
        self,
        device: torch.device,
        decoding: list[Sequence],
        ks: list[int],
        chunks: list[tuple[Sequence, int]],
        plain: bool = False,
        undoable: bool = False,
        first: FirstDrafts | None = None,
    ) -> QueuedStep:
        """A step's front half, all queued on the device: each decoding row's proposal (up to its k,
        grammar-forced tokens free unless ``plain`` and its k is 0), the target's pass with ``chunks`` beside them,
        and verification. ``undoable``: the sampled rows' generator states are kept, for a step
        launched ahead that is not taken. ``first``: the proposals' first draft pass, queued behind
        the step before, which the host has read and applied (``Ahead.first_drafts``); behind this
        one's verification the next step's is queued where it may be used."""
        generators = {
            id(s): s.generator.get_state() for s in decoding if undoable and not s.request.params.greedy
        }
        # [shaping] grammar-forced tokens: free drafts, up to the step width and max_tokens
        forced = [
            s.shaping.forced_drafts(
                min(
                    0 if plain and not k else s.controller.k_max,
                    s.request.params.max_tokens - s.completion_tokens - 1,
                )
            )
            if s.shaping is not None and s.drafter is not None
            else []
            for s, k in zip(decoding, ks, strict=True)
        ]
        items: list[ProposeItem] = [
            (
                s.drafter,
                s.tokens + f,
                _within(s.drafter, s.tokens + f, k - len(f)),
                s.request.params,
                s.counts,
                s.generator,
            )
            for s, k, f in zip(decoding, ks, forced, strict=True)
        ]
        timer = StepTimer(device)
        caught_up = catch_up_many(items)  # a one-off cost: kept out of the step's (StepTimer.lead)
        timer.begin()
        start = time.perf_counter()
        proposals = propose_many(items, first)
        if first is not None and first.taken:
            timer.ahead(first.began, first.ended)
        proposals = [
            s.shaping.cut(f, p, device) if s.shaping is not None else p
            for s, f, p in zip(decoding, forced, proposals, strict=True)
        ]  # [shaping] forced + drafted, cut at the first token the grammar rejects
        timer.mark()
        batch = DecodeBatch.build(
            [s.tokens[-1] for s in decoding], [p.tokens if p is not None else None for p in proposals], device
        )
        logits, prompt_logits = self.target_pass(decoding, batch, chunks)  # [B, W, V]; [T, V] per chunk
        verifying = Verifying.queue(decoding, proposals, batch, logits)
        timer.stop()
        prompt_scores = self._score_prompts(chunks, prompt_logits)  # their [T, V] logits go here
        # the logits [B, W, V] outlive the call only where a row reads logprobs from them (at N = 64
        # and W = 9 they are 175 MB in bf16, and the next step's are allocated before these are freed)
        kept = logits if any(s.request.params.logprobs is not None for s in decoding) else None
        step = QueuedStep(
            list(decoding), batch, verifying, timer, start, kept, generators, prompt_scores, caught_up
        )
        if not chunks:
            step.first = self.ahead.first_drafts(decoding, batch, verifying)
        return step

    @staticmethod
    def _score_prompts(
        chunks: list[tuple[Sequence, int]], logits: dict[int, torch.Tensor]
    ) -> list[tuple[Sequence, list[int], Scored]]:
        """The scores of the prompt tokens each scored chunk predicts, still on the device: a chunk
        fed at positions [p, p + n) scores the tokens at [p + 1, p + n] (row j's logits are the
        distribution of the token after it), so the prompt's last token is scored by its last chunk
        and the first by none."""
        out = []
        for s, n in chunks:
            if id(s) not in logits:
                continue
            top_n = s.request.params.prompt_logprobs
            assert top_n is not None
            p = s.runner.length - n  # the chunk is in the cache already
            targets = s.tokens[p + 1 : p + n + 1]
            out.append((s, targets, score(logits[id(s)], as_ids(targets, logits[id(s)].device), top_n)))
        return out

    def commit_step(
        self,
        step: QueuedStep,
        rows: list[Sequence],
        applied: list[Applied],
        end: float,
        timing: Timing = "wall",
    ) -> dict[int, StepOutput | None]:
        """The outcome of each of ``rows`` (``QueuedStep.apply``'s), and the step's costs for the
        controllers. The costs are the step's wall time from when its host work began
        (``QueuedStep.start``: for a step queued after a commit, the read-back before it) to its
        read-back (``end``), host work included (it is what throughput pays; a speculative step's
        ~2 ms of it at N = 4 on the H200 decides whether a k pays), less the device time of a
        draft's catch-up it waited for (``timer.lead``), split between draft and target as the
        device's events split them; ``timing`` "none": not a sample (acceptance still counts)."""
        if not rows:
            return {}
        timer = step.timer
        d_draft, d_target = timer.done()
        costs = self.costs_of(rows[0])
        if step.caught_up:
            costs.observe_catch_up(step.caught_up, timer.lead_seconds())
        wall = max(end - step.start - timer.lead(), d_draft + d_target)
        W = step.batch.width
        if W == 1 and self.ahead.overlaps(rows[0]):
            # plain steps queue back to back (Ahead.launch): the host's share is hidden, so what one
            # costs is its device time, also for a plain step between speculative ones
            wall = d_draft + d_target
        t_draft = wall * d_draft / (d_draft + d_target) if d_draft + d_target > 0 else 0.0
        t_target = wall - t_draft
        B = len(step.seqs)  # the rows the device ran, those that left since included
        model = W > 1 and any(isinstance(s.drafter, DraftModelDrafter) for s in rows)
        # a shape's first use (kernels loaded, memory grown) is no sample of its cost (BatchCosts.first_use)
        timed = timing != "none" and not (W > 1 and costs.first_use(B, W - 1, model, wall))
        if timed:
            if W > 1 and len(rows) == B:  # what it gave against what the model expected of it
                expected = sum(
                    expected_tokens(s.controller.acceptance, a.drafted)
                    for s, a in zip(rows, applied, strict=True)
                )
                costs.observe_goodput(B, W - 1, model, expected, sum(a.accepted + 1 for a in applied), wall)
            costs.observe(B, B * W, W - 1, t_draft, t_target)
        self.total_steps += 1
        passes = W - 1  # draft passes this step ran: rows draft in lockstep up to the longest
        outs: dict[int, StepOutput | None] = {}
        for s, a in zip(rows, applied, strict=True):
            # a row's draft time is its k passes' share: the others' longer proposals are not its cost
            share = t_draft * a.drafted / passes if passes else 0.0
            outs[id(s)] = self._commit(s, a, share, t_target, timed)
        return outs

    @staticmethod
    def keeps_k(seq: Sequence) -> bool:
        """Whether a row keeps its k beside prompt chunks (``_plain_beside_prompts``): one that
        samples with a k the client fixed. Its draws follow its k, and a seeded request samples the
        same alone and in a batch only if its k is the same in both (an adaptive row's k is the
        batch's choice anyway; a greedy row's output does not depend on k)."""
        return seq.drafter is not None and not seq.controller.adaptive and not seq.request.params.greedy

    @staticmethod
    def _plain_beside_prompts(decoding: list[Sequence], chunks: list[tuple[Sequence, int]]) -> bool:
        """Whether the decoding rows of a step that also takes prompt chunks decode plainly: always.
        A prompt's row waits for the whole step, so drafting beside its chunk (and the drafts'
        catch-up on the decoding rows' own prompts) delays its first token for the others' gain: on
        a 2-core AVX512-BF16 EPYC (the real pair, 4 requests, prompts of 45-254 tokens in 64-token
        chunks) three speculative steps beside the longest prompt's chunks took 3.0, 1.5 and 1.4 s
        against ~0.9 s plain, and its first token came ~3 s later, while the decoding rows would
        draft with it, batched, a few steps on. Under CUDA graphs in fast mode, verification widths
        beside each chunk size would besides be graphs captured mid-stream (100-140 ms each for the
        7B shape on the H200). A long prompt's chunks keep the others plain for as many steps.
        Rows that sample with a fixed k keep it (``keeps_k``)."""
        return bool(decoding) and any(n for _, n in chunks)

    @staticmethod
    def prefill_chunks(
        prefilling: list[Sequence], budget: int | None, grid: int | None = None
    ) -> list[tuple[Sequence, int]]:
        """The prompt tokens each prefilling sequence feeds this step: the fewest left first (first
        come first served among equals). First come first served alone, a short prompt that arrived
        while a long one was being prefilled waited for all of its chunks: on the 2-core EPYC a
        34-token chat request's first token came 42.8 s after it was sent, behind a 3,000-token
        prompt's 64-token chunks. Fewest-left-first gives it the next step, and the long prompt the
        rest of that step's budget; the long one waits at most a step for each prompt admitted
        beside it (``limits.max_active`` of them at once), each of which then decodes.

        ``grid``: a chunk that does not finish its prompt ends on a multiple of it, so a prompt is
        cut into the same chunks alone and under any load (the rest of a step's budget short of the
        next multiple waits for the next step). A backend whose prefill rows round by the chunk's
        width (llama.cpp's) otherwise fills the same prompt's cache with other bits under load:
        greedy output differed from the same request's alone in 1-2 of 4 chat requests arriving
        together (the real pair on the 2-core EPYC, 64-token chunks)."""
        chunks: list[tuple[Sequence, int]] = []
        order = sorted(prefilling, key=lambda s: len(s.tokens) - 1 - s.runner.length)  # stable
        for s in order:
            todo = len(s.tokens) - 1 - s.runner.length
            n = todo if budget is None else min(todo, max(budget, 0))
            if grid and n < todo:
                aligned = n - (s.runner.length + n) % grid
                n = aligned if aligned > 0 or chunks else n  # a budget under the grid still progresses
            if s.prompt_logprobs is not None:
                n = min(n, SCORED_CHUNK)
            if n <= 0 < todo:
                continue  # over budget this step: its turn comes
            if budget is not None:
                budget -= n
            chunks.append((s, n))
        return chunks

    def target_pass(
        self, decoding: list[Sequence], batch: DecodeBatch, chunks: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The target's one pass: decoding rows and prefill chunks; logits of the decoding rows
        [B, W, V] (padding rows past a row's k hold garbage, never read), and of each chunk of a
        prompt that is scored (SamplingParams.prompt_logprobs), [T, V] by id of its sequence."""
        runners = [s.runner for s in decoding]
        model = getattr(runners[0], "batch_model", None) if runners else None
        exact = {bool(getattr(r, "exact", False)) for r in runners}
        batched = (
            model is not None
            and len(exact) == 1
            and all(getattr(r, "batch_model", None) is model for r in runners)
        )
        todo = [(s, n) for s, n in chunks if n]
        if batched and not todo:
            assert model is not None
            starts = [r.advance(1 + k) for r, k in zip(runners, batch.n_drafts, strict=True)]  # type: ignore[attr-defined]
            logits = model.forward_batch([r.slot for r in runners], starts, batch.ids, exact.pop())  # type: ignore[attr-defined]
            return logits, {}
        rows = [batch.ids[b, : 1 + k] for b, k in enumerate(batch.n_drafts)]
        wants: list[Want] = ["all"] * len(rows)
        for s, n in todo:
            runners.append(s.runner)
            rows.append(as_ids(s.tokens[s.runner.length : s.runner.length + n], s.target.device))
            wants.append("none" if s.prompt_logprobs is None else "prompt")
        out = forward_many(runners, rows, wants) if runners else []
        scored = {id(s): t for (s, _), t in zip(todo, out[len(decoding) :], strict=True) if t is not None}
        if not decoding:
            return batch.ids.new_zeros(0, 1, 1, dtype=torch.float), scored
        return pad_sequence([t for t in out[: len(decoding)] if t is not None], batch_first=True), scored

    def costs_of(self, seq: Sequence) -> BatchCosts:
        """The batch cost model of ``seq``'s target, seeded from the start-up tables."""
        costs = self.costs.get(seq.target.name)
        if costs is None:
            costs = self.costs[seq.target.name] = BatchCosts(padded_width=_padded_width(seq))
        costs.seed(*_step_tables(seq))  # once per table
        return costs

    def _population(self, seq: Sequence) -> Population:
        key = (seq.target.name, seq.stats.drafter)
        pop = self.population.get(key)  # per row and step: no Population built to be thrown away
        if pop is None:
            pop = self.population[key] = Population()
        return pop

    def ks_for(self, decoding: list[Sequence], pending: int = 0) -> list[int]:
        """Each row's k for the next step (``pending``: tokens of steps not yet read back), by
        ``batch_controller.choose_ks``."""
        if not decoding:
            return []
        costs = self.costs_of(decoding[0])
        # (the rows' ids are listed only where a batch was judged off: not on a speculative step)
        if costs.off_rows is not None and costs.stays_off([id(s.controller) for s in decoding]):
            return [0] * len(decoding)  # judged off lately, and nothing it read has moved since
        rows = [
            KRow(
                s.controller,
                s.drafter is not None,
                isinstance(s.drafter, DraftModelDrafter),
                s.completion_tokens + pending,
                s.request.params.max_tokens - s.completion_tokens - pending,
                s.drafter.backlog(s.tokens) if isinstance(s.drafter, DraftModelDrafter) else 0,
            )
            for s in decoding
        ]
        return choose_ks(rows, costs)

    def _commit(self, seq: Sequence, a: Applied, t_draft: float, t_target: float, timed: bool) -> StepOutput:
        """A row's controller, stats and output for a step it has taken (``QueuedStep.apply``)."""
        kk, n = a.drafted, a.accepted
        seq.controller.observe(kk, n, t_draft if kk else 0.0, t_target, timed)
        if kk and seq.drafter is not None:  # a verification: what the population counts
            self._population(seq).observe(kk, n)
        seq.stats.record_step(kk, n, t_draft + t_target)
        if kk == 0 and seq.controller.switched_off:
            seq.stats.spec_disabled_steps += 1
        seq.stats.completion_tokens = seq.completion_tokens
        prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # the first output carries them
        return StepOutput(
            request_id=seq.request.request_id,
            token_ids=a.tokens,
            drafted=kk,
            accepted=n,
            logprobs=a.logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=a.finish,
            stats=seq.stats if a.finish else None,
            error=str(a.error) if a.error is not None else None,
            error_param=a.error.param if a.error is not None else None,
            cached_tokens=seq.stats.cached_tokens,
        )

    def generate(self, request: GenerationRequest) -> tuple[list[int], RequestStats, FinishReason]:
        """Run one request to the end (CLI, benchmarks, tests)."""
        seq = self.start(self.check(request))
        out: list[int] = []
        for ((_, step),) in self.steps_to_end([seq]):
            if step is not None:
                out.extend(step.token_ids)
                if step.finish_reason is not None:
                    return out, seq.stats, step.finish_reason
        raise AssertionError("a sequence stepped to its end without a finish reason")

    def steps_to_end(self, seqs: list[Sequence]) -> Iterator[list[tuple[Sequence, StepOutput | None]]]:
        """Step ``seqs`` together (whole prompts first) until every one has finished: each step's
        (sequence, output) pairs. A sequence is released once it finishes, and every one left when
        the iteration stops early (warm-up, benchmarks, tests)."""
        running = list(seqs)
        try:
            while running:
                pairs = list(zip(running, self.step_batch(running), strict=True))
                running = [s for s, o in pairs if o is None or o.finish_reason is None]
                for s, o in pairs:
                    if o is not None and o.finish_reason is not None:
                        s.release()
                yield pairs
        finally:
            for s in running:
                s.release()


_NO_TABLE: dict[tuple[int, int], float] = {}


def _within(drafter: Drafter | None, tokens: list[int], k: int) -> int:
    """``k``, or fewer where a draft model's context ends sooner (``DraftModelDrafter.room``)."""
    room = drafter.room(tokens) if isinstance(drafter, DraftModelDrafter) else None
    return k if room is None else min(k, room)


def _padded_width(seq: Sequence) -> int:
    """The width every row of ``seq``'s target steps runs at (a static model's exact mode where
    its device did not show narrower steps to round alike, ``StaticModel.exact_padding``), 0 where a
    step's width is its widest row's."""
    runner = seq.runner
    model = getattr(runner, "batch_model", None)
    if getattr(runner, "exact", False) and getattr(model, "exact", False):
        return int(model.exact_padding)  # type: ignore[union-attr]
    return 0


def _step_tables(seq: Sequence) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float] | None]:
    """The start-up step tables (``StaticModel.step_costs``) of a sequence's target and, where it
    drafts with a model, its draft; empty where its runners have none (eager, a CPU)."""

    def table(runner: object) -> dict[tuple[int, int], float]:
        return getattr(getattr(runner, "batch_model", None), "step_costs", None) or _NO_TABLE

    draft = table(seq.drafter.runner) if isinstance(seq.drafter, DraftModelDrafter) else None
    return table(seq.runner), draft
