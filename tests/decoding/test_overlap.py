"""Steps queued ahead (Engine.overlap: on by default on CUDA, forced here on the CPU, where it only
costs): the step after a plain one is launched before the host reads that one back, from the tokens
it chose on the device; any other step (speculative, a grammar, penalties, logprobs) is launched as
soon as the one before is committed, before the call returns. Nothing a request sees may change: its
output alone and in a batch, as rows join, finish (by length or a stop token) and abort while a step
of theirs is queued, and a seeded request's draws."""

from __future__ import annotations

import time

import pytest

from decoding.ahead import Ahead
from decoding.async_engine import AsyncEngine
from decoding.batch import DecodeBatch, QueuedStep, Verifying
from decoding.controller import SpecController
from decoding.engine import Engine
from tests.decoding.test_batch import (
    PROMPTS,
    alone,
    request,
    run_batch,
    run_batch_outputs,
    run_with_one_leaving,
)


def overlapping(models) -> Engine:
    engine = Engine(models)
    engine.overlap = True
    return engine


@pytest.mark.parametrize("sampled", [False, True])
def test_output_is_the_same_with_steps_queued_ahead(tiny_models, sampled):
    kw = dict(temperature=0.9, top_p=0.95, top_k=50) if sampled else {}
    reqs = [
        request(tiny_models, p, "off", max_tokens=6 + 5 * i, seed=7 + i, **kw) for i, p in enumerate(PROMPTS)
    ]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    engine = overlapping(tiny_models)
    assert {r.request_id: alone(engine, r) for r in reqs} == expected
    assert run_batch(engine, reqs) == expected
    taken = engine.ahead_steps
    assert taken > 0, "no step was queued ahead"
    # rows joining (their prefill waits a step), leaving at their max_tokens, prompts in chunks
    assert run_batch(engine, reqs, join_at=[0, 3, 3, 7, 1, 12], budget=5) == expected
    assert engine.ahead_steps > taken


def test_a_stop_token_ends_a_row_whose_next_step_is_queued(tiny_models):
    """A row that meets its stop token had its next step queued already: that step is dropped, the
    row ends where it would alone, and the others go on unchanged."""
    ref = Engine(tiny_models)
    free = alone(ref, request(tiny_models, PROMPTS[1], max_tokens=20))
    stop = free[6]
    reqs = [request(tiny_models, PROMPTS[1], max_tokens=20, stop_token_ids=[stop])] + [
        request(tiny_models, p, max_tokens=20) for p in (PROMPTS[0], PROMPTS[4])
    ]
    expected = {r.request_id: alone(ref, r) for r in reqs}
    assert expected[reqs[0].request_id] == free[: free.index(stop)]
    engine = overlapping(tiny_models)
    assert run_batch(engine, reqs) == expected


def test_mixed_plain_and_speculative_rows_with_overlap(tiny_models):
    """Speculating rows, and rows whose input the host must see first (logprobs, penalties), are
    queued once their step is committed; a batch that mixes them with plain rows, and adaptive rows
    that turn speculation off, still match alone, with steps of every kind taken ahead."""
    reqs = [
        request(tiny_models, PROMPTS[0], "off"),
        request(tiny_models, PROMPTS[4], "ngram", 4),
        request(tiny_models, PROMPTS[5], "draft", 6, adaptive=True),
        request(tiny_models, PROMPTS[2], "off", logprobs=2),
        request(tiny_models, PROMPTS[3], "off", presence_penalty=0.5),
    ]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    engine = overlapping(tiny_models)
    assert run_batch(engine, reqs, join_at=[0, 0, 2, 4, 5], budget=7) == expected
    assert engine.ahead_steps > 0


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("mode", ["draft", "ngram"])
def test_speculative_steps_queued_ahead_change_nothing(tiny_models, mode, sampled, monkeypatch):
    """A speculative step is launched as soon as the one before is committed (before the host
    streams its tokens): greedy and seeded sampled outputs are what each request gives alone without
    it, alone and in a batch whose rows join (their prefill waits a step) and leave, and the steps
    taken were speculative ones."""
    kw = dict(temperature=0.9, top_p=0.95, top_k=50) if sampled else {}
    reqs = [
        request(tiny_models, p, mode, 3, max_tokens=8 + 5 * i, seed=11 + i, **kw)
        for i, p in enumerate(PROMPTS[:5])
    ]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    engine = overlapping(tiny_models)
    widths: list[int] = []
    take = Ahead.take

    def spy(self, seqs, joining=False):  # type: ignore[no-untyped-def]
        queued = self.queued.get(seqs[0].target.name)
        if queued is not None:
            widths.append(queued.batch.width)
        return take(self, seqs, joining)

    monkeypatch.setattr(Ahead, "take", spy)
    assert {r.request_id: alone(engine, r) for r in reqs} == expected
    assert run_batch(engine, reqs) == expected
    assert run_batch(engine, reqs, join_at=[0, 2, 2, 5, 1], budget=6) == expected
    assert max(widths) == 4, "no speculative step was queued ahead"


def test_a_row_leaving_undoes_its_queued_speculative_step(tiny_models):
    """A row that leaves (its stop token, or the driver dropping it) while its next speculative step
    is queued: its caches are cut back to what it committed, so its slot and draft hold nothing of
    the undone step, and the rows that stay go on unchanged."""
    engine = overlapping(tiny_models)
    reqs = [request(tiny_models, p, "draft", 3, max_tokens=20) for p in PROMPTS[:3]]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    seqs = [engine.start(r) for r in reqs]
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for _ in range(4):
        for s, o in zip(seqs, engine.step_batch(seqs), strict=True):
            if o is not None:
                out[s.request.request_id] += o.token_ids
    leaver = seqs.pop(1)
    queued = engine.ahead.queued[leaver.target.name]
    assert leaver in queued.seqs and leaver.runner.length > len(leaver.tokens) - 1
    while seqs:
        outs = engine.step_batch(seqs)
        assert leaver.runner.length == len(leaver.tokens) - 1
        assert leaver.drafter.runner.length <= len(leaver.tokens) - 1
        for s, o in zip(list(seqs), outs, strict=True):
            if o is not None:
                out[s.request.request_id] += o.token_ids
                if o.finish_reason is not None:
                    seqs.remove(s)
                    s.release()
    leaver.release()
    for r in (reqs[0], reqs[2]):
        assert out[r.request_id] == expected[r.request_id]
    assert out[reqs[1].request_id] == expected[reqs[1].request_id][: len(out[reqs[1].request_id])]


@pytest.mark.parametrize("mode", ["off", "draft"])
async def test_abort_while_a_step_is_queued_frees_the_slot(tiny_models, mode):
    """An abort while the leaver's next step (plain, or speculative) is queued: every KV slot comes
    back and the others' outputs are theirs alone."""
    engine = overlapping(tiny_models)
    reqs = [request(tiny_models, p, mode, 3, max_tokens=30) for p in PROMPTS[:4]]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    ae = AsyncEngine(engine, max_active=8)
    try:
        await run_with_one_leaving(ae, tiny_models["tiny"].runner_factory.__self__, reqs, expected, 3)
    finally:
        ae.shutdown()
    assert engine.ahead_steps > 0


def test_grammar_rows_queued_ahead_match_alone(tiny_models):
    """Rows under a grammar are queued once their step is committed (the matcher has taken the
    accepted tokens by then): forced tokens, drafts cut at the first the grammar rejects, masked
    verification and the grammar's own end are what each request gives alone without it."""
    import dataclasses
    import json

    from decoding.params import GrammarSpec
    from tests.decoding.test_constraints import SCHEMAS
    from tests.decoding.test_constraints import request as shaped

    grammar = GrammarSpec("json_schema", json.dumps(SCHEMAS[1]))
    reqs = [
        dataclasses.replace(shaped(tiny_models, prompt, mode, grammar, max_tokens=60), request_id=f"g{i}")
        for i, (prompt, mode) in enumerate((("hello", "draft"), ("{ json please ü", "ngram"), ("x", "off")))
    ]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    engine = overlapping(tiny_models)
    assert run_batch(engine, reqs) == expected
    assert engine.ahead_steps > 0


def test_no_step_is_queued_while_requests_wait_to_join(tiny_models):
    """A step told that requests wait to join (AsyncEngine: some queued, a place free) queues nothing
    ahead, so a joiner's prompt goes in at the next step rather than the one after; the rows already
    running give what they give alone."""
    engine = overlapping(tiny_models)
    reqs = [request(tiny_models, p, "draft", 3, max_tokens=12) for p in PROMPTS[:2]]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    seqs = [engine.start(r) for r in reqs]
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}

    def step(rows, joining=False):  # type: ignore[no-untyped-def]
        for s, o in zip(list(rows), engine.step_batch(rows, joining=joining), strict=True):
            if o is not None:
                out.setdefault(s.request.request_id, []).extend(o.token_ids)
                if o.finish_reason is not None:
                    rows.remove(s)
                    s.release()

    step(seqs)  # the prompts
    step(seqs)
    assert seqs[0].target.name in engine.ahead.queued
    step(seqs, joining=True)  # takes the queued step and queues none
    assert not engine.ahead.queued
    late = engine.start(request(tiny_models, PROMPTS[2], max_tokens=4))
    seqs.append(late)
    step(seqs)
    assert late.prefilled, "the joiner's prompt waited behind a queued step"
    while seqs:
        step(seqs)
    for r in reqs:
        assert out[r.request_id] == expected[r.request_id]


def test_a_row_ending_at_its_max_tokens_does_not_hold_the_others_back(tiny_models, monkeypatch):
    """Rows of one batch that end at different max_tokens: the step after each end is still queued
    before the host reads the step before back (``Ahead.launch``, the ending row left out of it),
    not only once that step is committed (``Ahead.speculate``, the GPU idle while the host reads
    and streams), as when the rows end together; the outputs are still what each gives alone."""
    late = []
    speculate = Ahead.speculate

    def counted(self, rows, read_at, *after):  # type: ignore[no-untyped-def]
        before = dict(self.queued)
        speculate(self, rows, read_at, *after)
        late.extend(name for name in self.queued if self.queued[name] is not before.get(name))

    monkeypatch.setattr(Ahead, "speculate", counted)
    staggered = [
        request(tiny_models, p, max_tokens=n) for p, n in zip(PROMPTS[:4], (3, 6, 9, 12), strict=True)
    ]
    together = [request(tiny_models, p, max_tokens=12) for p in PROMPTS[:4]]
    queued_late = {}
    for name, reqs in (("staggered", staggered), ("together", together)):
        expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
        engine = overlapping(tiny_models)
        late.clear()
        assert run_batch(engine, reqs) == expected
        queued_late[name] = len(late)
    assert queued_late["staggered"] == queued_late["together"]


def test_a_step_queued_after_a_commit_costs_from_the_read_before_it(tiny_models, monkeypatch):
    """A speculative step launched once the step before is committed is costed from when that step
    was read back, not from its own launch: the device waits through the commit and the launch,
    and a controller that missed that time chose k = 1 steps that cost more than plain ones."""
    reads: list[float] = []
    starts: list[float] = []
    results = Verifying.results
    speculate = Ahead.speculate

    def read(self):  # type: ignore[no-untyped-def]
        out = results(self)
        reads.append(time.perf_counter())
        return out

    def queued(self, rows, read_at, *after):  # type: ignore[no-untyped-def]
        launched = time.perf_counter()
        speculate(self, rows, read_at, *after)
        ahead = self.queued.get(rows[0].target.name)
        if ahead is not None and ahead.batch.width > 1:
            starts.append(ahead.start)
            assert reads[-1] <= ahead.start < launched

    monkeypatch.setattr(Verifying, "results", read)
    monkeypatch.setattr(Ahead, "speculate", queued)
    reqs = [request(tiny_models, p, "draft", 4) for p in PROMPTS[:3]]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    assert run_batch(overlapping(tiny_models), reqs) == expected
    assert starts, "no speculative step was queued after a commit"


def test_the_next_step_is_queued_before_the_rows_report(tiny_models, monkeypatch):
    """A step's rows take their tokens, then the next step is queued, and only then do their
    controllers, stats and outputs follow: the device does not wait for every row's bookkeeping."""
    calls: list[str] = []

    def spy(owner: type, name: str):  # type: ignore[no-untyped-def]
        original = getattr(owner, name)

        def called(self, *args):  # type: ignore[no-untyped-def]
            calls.append(name)
            return original(self, *args)

        monkeypatch.setattr(owner, name, called)

    spy(QueuedStep, "apply")
    spy(Ahead, "speculate")
    spy(Engine, "commit_step")
    reqs = [request(tiny_models, p, "draft", 4) for p in PROMPTS[:3]]
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    calls.clear()
    assert run_batch(overlapping(tiny_models), reqs) == expected
    queued = [i for i, c in enumerate(calls) if c == "speculate"]
    assert queued, "no step was queued after a commit"
    assert all(calls[i - 1] == "apply" and calls[i + 1] == "commit_step" for i in queued)


@pytest.mark.parametrize("model", ["tiny", "tiny-self"])
def test_the_next_first_draft_pass_is_queued_before_the_read(tiny_models, monkeypatch, model):
    """Greedy rows drafting with a model queue their next step's first draft pass behind each
    speculative step's verification, before the host reads it (``FirstDrafts``), fed at the places
    the device's accepted counts give. Its proposals are then what they are without it: every step
    proposes the same tokens, and accepts as many, as when each first pass runs after the read, as
    rows finish at different max_tokens (the pass's rows a superset of the next step's), with every
    draft rejected (``tiny``: each row fed its pending token and the bonus) and every one accepted
    (``tiny-self``, which drafts for itself: fed d_k and the bonus)."""
    import dataclasses

    from decoding.drafters import FirstDrafts

    taken: list[tuple[int, int]] = []  # (rows taking it, rows in the pass)
    take = FirstDrafts.take

    def counted(self, live):  # type: ignore[no-untyped-def]
        got = take(self, live)
        if got is not None:
            taken.append((len(live), len(self.rows)))
        return got

    proposed: list[list[list[int] | None]] = []  # each step's proposals, row by row
    build = DecodeBatch.build

    def built(pending, proposals, device):  # type: ignore[no-untyped-def]
        proposed.append([None if p is None else p.tolist() for p in proposals])
        return build(pending, proposals, device)

    monkeypatch.setattr(FirstDrafts, "take", counted)
    monkeypatch.setattr(DecodeBatch, "build", built)
    reqs = [
        dataclasses.replace(request(tiny_models, p, "draft", 3, max_tokens=n), model=model)
        for p, n in zip(PROMPTS[:4], (9, 17, 24, 24), strict=True)
    ]
    ahead = run_batch_outputs(overlapping(tiny_models), reqs)
    proposed_ahead = list(proposed)
    proposed.clear()
    monkeypatch.setattr(Ahead, "first_drafts", lambda *_: None)
    after = run_batch_outputs(overlapping(tiny_models), reqs)
    assert len(taken) >= 4 and any(n < of for n, of in taken)  # a step after a row ended took a subset
    assert proposed_ahead == proposed
    for r in reqs:
        steps = [(o.token_ids, o.drafted, o.accepted) for o in ahead[r.request_id]]
        assert steps == [(o.token_ids, o.drafted, o.accepted) for o in after[r.request_id]]
        assert any(d for _, d, _ in steps), "no speculative step"
        if model == "tiny-self":
            assert all(a == d for _, d, a in steps)


def test_prompt_chunks_beside_plain_rows_are_queued_ahead(tiny_models, monkeypatch):
    """A long prompt prefilled in chunks beside plain rows: each step with its next chunk is queued
    before the host reads the step before back, as plain steps are, not run as a synchronous step;
    every output is what it is alone, and the prompt's first token comes at the same call as
    without steps queued ahead (its last chunk is not chained past: it decodes from the next step)."""
    chunked: list[int] = []
    take = Ahead.take

    def taken(self, seqs, joining=False):  # type: ignore[no-untyped-def]
        step = self.queued.get(seqs[0].target.name)
        if step is not None and step.chunks:
            chunked.append(len(step.chunks))
        return take(self, seqs, joining)

    monkeypatch.setattr(Ahead, "take", taken)
    prefilled: list[int] = []  # id of each controller told its prompt's prefill, once it is complete
    observe_prefill = SpecController.observe_prefill

    def told(self, tokens, seconds):  # type: ignore[no-untyped-def]
        prefilled.append(id(self))
        return observe_prefill(self, tokens, seconds)

    monkeypatch.setattr(SpecController, "observe_prefill", told)
    reqs = [request(tiny_models, p, "off", max_tokens=30) for p in PROMPTS[:3]]
    reqs.append(request(tiny_models, "long " * 60, max_tokens=6))
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    first_at = {}
    for name, engine in (("queued", overlapping(tiny_models)), ("in step", Engine(tiny_models))):
        calls = 0
        step_batch = engine.step_batch

        def counted(seqs, budget=None, joining=False, step_batch=step_batch, name=name):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            outs = step_batch(seqs, budget, joining)
            if any(o is not None and o.request_id == reqs[-1].request_id for o in outs):
                first_at.setdefault(name, calls)
            return outs

        engine.step_batch = counted  # type: ignore[method-assign]
        prefilled.clear()
        assert run_batch(engine, reqs, join_at=[0, 0, 0, 2], budget=8) == expected
        # a prompt whose last chunk is queued behind the step taken is not complete by that step
        assert len(prefilled) == len(set(prefilled)) == len(reqs)
    assert len(chunked) >= 4, "no step with a prompt chunk was queued ahead"
    assert first_at["queued"] == first_at["in step"]


async def test_abort_mid_prefill_while_its_chunk_is_queued_frees_the_slot(tiny_models):
    """A prompt aborted while a step holding its next chunk is queued: every KV slot comes back and
    the other requests' outputs are theirs alone."""
    from tests.decoding.test_batch import _abort_during_prefill

    engine = overlapping(tiny_models)
    reqs = [request(tiny_models, p, "off", max_tokens=40) for p in PROMPTS[:4]]
    long_prompt = request(tiny_models, "long " * 300, max_tokens=8)
    expected = {r.request_id: alone(Engine(tiny_models), r) for r in reqs}
    ae = AsyncEngine(engine, max_active=8, prefill_budget=16)
    try:
        pool = tiny_models["tiny"].runner_factory.__self__
        await run_with_one_leaving(ae, pool, reqs, expected, 2, _abort_during_prefill(ae, long_prompt))
    finally:
        ae.shutdown()
    assert engine.ahead_steps > 0


def test_a_queued_chunk_step_whose_rows_all_stop_gives_its_chunks_back(tiny_models, monkeypatch):
    """The only decoding row meets its stop token while a step holding a prompt's next chunk is
    queued behind it: that step is not taken, its chunk is given back (fed again by the next step),
    and the prompt's output is what it is alone."""
    dropped: list[int] = []  # prompt tokens of queued chunk steps that were not taken
    take = Ahead.take

    def taken(self, seqs, joining=False):  # type: ignore[no-untyped-def]
        step = self.queued.get(seqs[0].target.name)
        got = take(self, seqs, joining)
        if got is None and step is not None:
            dropped.extend(n for _, n in step.chunks)
        return got

    monkeypatch.setattr(Ahead, "take", taken)
    ref = Engine(tiny_models)
    free = alone(ref, request(tiny_models, PROMPTS[1], max_tokens=20))
    stop = free[5]
    reqs = [
        request(tiny_models, PROMPTS[1], max_tokens=20, stop_token_ids=[stop]),
        request(tiny_models, "long " * 60, max_tokens=6),
    ]
    expected = {r.request_id: alone(ref, r) for r in reqs}
    assert expected[reqs[0].request_id] == free[: free.index(stop)]
    assert run_batch(overlapping(tiny_models), reqs, join_at=[0, 2], budget=4) == expected
    assert dropped, "no queued step with a prompt chunk was left untaken"
