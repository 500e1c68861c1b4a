"""The batched engine on tiny random models in float32 (the static backend, one forward pass over
every running request): a request's output does not depend on what else is in the batch, on when
others join or leave, on k, or on how its prompt was chunked; aborts free a slot within one step."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from decoding.params import FinishReason, GenerationRequest, SamplingParams, SpecMode, SpecParams, StepOutput
from decoding.runner import Row, forward_many
from decoding.static import StaticModel
from decoding.warmup import freeze_heap, warm_up

PROMPTS = [
    "hello wörld, write a poem",
    "def f(x):\n    return x * 2\n\ndef f(x):",
    "€€€ ünïcödé 日本語",
    "a",
    "the quick brown fox jumps over the lazy dog, the quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13",
]
_ids = itertools.count()


def request(models, prompt, mode="off", k=4, adaptive=False, **params) -> GenerationRequest:
    params.setdefault("max_tokens", 24)
    params.setdefault("ignore_eos", True)
    params.setdefault("temperature", 0)
    ids = models["tiny"].tokenizer(prompt)["input_ids"]
    spec = SpecParams(SpecMode(mode), max_k=k, adaptive=adaptive)
    return GenerationRequest(f"r{next(_ids)}", "tiny", ids, SamplingParams(**params), spec)


def run_batch_outputs(engine, requests, join_at=None, budget=None) -> dict[str, list[StepOutput]]:
    """Drive Engine.step_batch by hand: request i joins at step join_at[i]; each leaves when done.
    Each request's outputs, in order."""
    join_at = join_at or [0] * len(requests)
    waiting = sorted(zip(join_at, range(len(requests)), requests, strict=True))
    running, out = {}, {r.request_id: [] for r in requests}
    step = 0
    while waiting or running:
        while waiting and waiting[0][0] <= step:
            r = waiting.pop(0)[2]
            running[r.request_id] = engine.start(r)
        seqs = list(running.values())
        if seqs:
            for o in engine.step_batch(seqs, budget):
                if o is None:
                    continue
                out[o.request_id].append(o)
                if o.finish_reason is not None:
                    running.pop(o.request_id).release()
        step += 1
    return out


def run_batch(engine, requests, join_at=None, budget=None) -> dict[str, list[int]]:
    """run_batch_outputs' tokens per request."""
    outs = run_batch_outputs(engine, requests, join_at, budget)
    return {rid: [t for o in got for t in o.token_ids] for rid, got in outs.items()}


def alone(engine, r) -> list[int]:
    return engine.generate(r)[0]


def test_tiny_models_batch_on_the_static_backend(tiny_models):
    seq = Engine(tiny_models).start(request(tiny_models, "x"))
    assert hasattr(seq.runner, "batch_model"), "the CPU default must batch requests (backend static)"
    seq.release()


def test_batched_rows_equal_rows_run_alone(tiny_models):
    """One pass over rows of different lengths, widths and slots gives each row's logits alone."""
    m = tiny_models["tiny"].model
    static = StaticModel(m, max_len=256, slots=6, graphs=False)
    prompts = [list(range(10, 10 + n)) for n in (5, 40, 17, 90)]
    solo = []
    for p in prompts:
        r = static.runner()
        r.forward(p, logits=False)
        solo.append((r.forward([3, 4, 5]), r.forward([7])))
        r.release()
    runners = [static.runner() for _ in prompts]
    forward_many(runners, [torch.tensor(p) for p in prompts], ["none"] * 4)
    a = forward_many(runners, [torch.tensor([3, 4, 5])] * 4, ["all"] * 4)
    b = forward_many(runners, [torch.tensor([7])] * 4, ["all"] * 4)
    for (sa, sb), x, y in zip(solo, a, b, strict=True):
        torch.testing.assert_close(x, sa, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(y, sb, rtol=1e-4, atol=1e-4)
    # a prefill chunk and decoding rows in one pass
    r2 = static.runner()
    mixed = forward_many([runners[0], r2], [torch.tensor([9]), torch.tensor(prompts[1])], ["all", "last"])
    ref = static.runner()
    torch.testing.assert_close(mixed[1], ref.forward(prompts[1])[-1:], rtol=1e-4, atol=1e-4)
    assert isinstance(Row(0, torch.tensor([1]), 0), Row)


@pytest.mark.parametrize(
    "mode,k,adaptive", [("off", 1, False), ("draft", 2, False), ("ngram", 4, False), ("draft", 8, True)]
)
def test_greedy_output_is_the_same_alone_and_in_a_batch(tiny_models, mode, k, adaptive):
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, p, mode, k, adaptive, max_tokens=12 + 5 * i) for i, p in enumerate(PROMPTS)]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    plain = {
        r.request_id: alone(engine, request(tiny_models, p, max_tokens=r.params.max_tokens))
        for r, p in zip(reqs, PROMPTS, strict=True)
    }
    assert list(expected.values()) == list(plain.values())  # speculation itself is lossless
    assert run_batch(engine, reqs) == expected
    # joining and leaving mid-stream, prompts prefilled in small chunks beside decoding rows
    assert run_batch(engine, reqs, join_at=[0, 3, 3, 7, 1, 12], budget=5) == expected


def test_mixed_modes_and_k_in_one_batch(tiny_models):
    engine = Engine(tiny_models)
    reqs = [
        request(tiny_models, PROMPTS[0], "off"),
        request(tiny_models, PROMPTS[1], "draft", 3),
        request(tiny_models, PROMPTS[4], "ngram", 6),
        request(tiny_models, PROMPTS[5], "draft", 8, adaptive=True),
        request(tiny_models, PROMPTS[2], "draft", 2, presence_penalty=0.5, frequency_penalty=0.3),
    ]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    assert run_batch(engine, reqs, join_at=[0, 0, 2, 4, 5], budget=7) == expected


@pytest.mark.parametrize("mode", ["off", "draft", "ngram"])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_models, mode):
    engine = Engine(tiny_models)
    kw = dict(temperature=0.9, top_p=0.95, top_k=50)
    reqs = [request(tiny_models, p, mode, 3, seed=100 + i, **kw) for i, p in enumerate(PROMPTS[:5])]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    assert run_batch(engine, reqs, join_at=[0, 1, 1, 4, 6], budget=9) == expected


def test_sampled_speculation_in_a_batch_matches_the_target_distribution(tiny_models):
    """First tokens of 240 seeded requests sampled in batches of 16, with draft speculation, against
    plain sampling alone: the same distribution (chi-square)."""
    from scipy.stats import chi2_contingency

    engine = Engine(tiny_models)
    counts: dict[str, dict[int, int]] = {"off": {}, "draft": {}}
    for mode in counts:
        reqs = [
            request(tiny_models, "ab", mode, 2, max_tokens=2, temperature=1.0, top_k=3, seed=s)
            for s in range(240)
        ]
        if mode == "off":
            outs = [alone(engine, r) for r in reqs]
        else:
            outs = []
            for i in range(0, len(reqs), 16):
                got = run_batch(engine, reqs[i : i + 16])
                outs.extend(got[r.request_id] for r in reqs[i : i + 16])
        for o in outs:
            counts[mode][o[0]] = counts[mode].get(o[0], 0) + 1
    keys = sorted(set(counts["off"]) | set(counts["draft"]))
    assert len(keys) >= 2
    table = [[counts[m].get(k, 0) + 1 for k in keys] for m in counts]
    assert chi2_contingency(table).pvalue > 1e-3


async def _collect(engine: AsyncEngine, r: GenerationRequest, stop_after: int | None = None):
    tokens, finish = [], None
    async for out in engine.generate(r):
        tokens.extend(out.token_ids)
        finish = out.finish_reason
        if stop_after is not None and len(tokens) >= stop_after:
            break  # leaving the iterator aborts the request
    return tokens, finish


async def test_abort_mid_batch_and_mid_prefill_leaves_the_others_unchanged(tiny_models):
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, p, "draft", 3, max_tokens=40) for p in PROMPTS[:4]]
    long_prompt = request(tiny_models, "long " * 300, max_tokens=8)
    expected = {r.request_id: alone(engine, r) for r in reqs}
    steps_before = engine.total_steps
    ae = AsyncEngine(engine, max_active=8, prefill_budget=16)
    try:
        pool = tiny_models["tiny"].runner_factory.__self__  # the target's pool
        await run_with_one_leaving(ae, pool, reqs, expected, 2, _abort_during_prefill(ae, long_prompt))
    finally:
        ae.shutdown()
    assert engine.total_steps > steps_before


async def run_with_one_leaving(ae: AsyncEngine, pool, reqs, expected, stop_after: int, *others) -> None:
    """Every request of ``reqs`` but the last runs to its end and the last leaves (an abort) after
    ``stop_after`` tokens, beside ``others``: each output is its output alone (the leaver's, up to where
    it left), then every request ends and every slot of the target's ``pool`` is back."""
    *full, leaver = reqs
    results = await asyncio.wait_for(
        asyncio.gather(
            *(_collect(ae, r) for r in full), _collect(ae, leaver, stop_after=stop_after), *others
        ),
        120,
    )
    for r, (tokens, finish) in zip(full, results, strict=False):
        assert tokens == expected[r.request_id] and finish == FinishReason.LENGTH
    left = results[len(full)][0]
    assert left == expected[leaver.request_id][: len(left)]
    for _ in range(100):
        if ae.active == 0:
            break
        await asyncio.sleep(0.02)
    assert ae.active == 0 and pool.free_slots == pool.slots


async def _abort_during_prefill(ae: AsyncEngine, r: GenerationRequest):
    it = ae.generate(r).__aiter__()
    task = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0.05)  # 300+ prompt tokens at 16 per step: still prefilling
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await it.aclose()
    return [], None


async def test_more_requests_than_kv_slots_wait_and_all_finish(tiny_models):
    """Twice as many requests as the target has KV slots: the rest queue until slots free up, and
    every one finishes with the output it has alone (nothing refused, truncated or deadlocked)."""
    engine = Engine(tiny_models)
    static = tiny_models["tiny"].runner_factory.__self__
    n = static.slots * 2
    reqs = [request(tiny_models, PROMPTS[i % len(PROMPTS)], "off", max_tokens=6 + i) for i in range(n)]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    ae = AsyncEngine(engine, max_active=n, max_queued=n)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_collect(ae, r) for r in reqs)), 120)
    finally:
        ae.shutdown()
    for r, (tokens, finish) in zip(reqs, results, strict=True):
        assert finish == FinishReason.LENGTH and tokens == expected[r.request_id]


async def test_a_burst_reaching_an_idle_engine_is_prefilled_in_one_step(tiny_models):
    """Requests queued at an idle engine: the first step takes every prompt (up to ``burst_budget``,
    not the ``prefill_budget`` chunks that keep decoding rows' latency), so every first token comes
    from the second; a prompt that joins while rows decode is still chunked; outputs are each request's alone."""
    from decoding.params import BatchStep

    engine = Engine(tiny_models)
    burst = [request(tiny_models, PROMPTS[i], "off", max_tokens=48) for i in (0, 1, 2, 4)]
    late = request(tiny_models, PROMPTS[5] * 2, "off", max_tokens=4)
    expected = {r.request_id: alone(engine, r) for r in [*burst, late]}
    ae = AsyncEngine(engine, max_active=0, max_queued=8, prefill_budget=4, burst_budget=256)
    seen: list[BatchStep] = []
    ae.add_step_observer(seen.append)

    async def join_late():
        while not seen:
            await asyncio.sleep(0.001)
        return await _collect(ae, late)

    try:
        tasks = [asyncio.ensure_future(_collect(ae, r)) for r in burst]
        while ae.queue_depth < len(burst):
            await asyncio.sleep(0.001)
        with ae._wake:  # every request queued before the engine admits any
            ae.max_active = len(burst) + 1
            ae._wake.notify()
        results = await asyncio.wait_for(asyncio.gather(*tasks, join_late()), 120)
    finally:
        ae.shutdown()
    assert all(len(r.prompt_token_ids) > 4 for r in burst)
    # the first step prefills every prompt but its last token, which the next feeds: every first token
    assert seen[1].rows == len(burst) and seen[1].prefilling == 0
    for r, (tokens, finish) in zip([*burst, late], results, strict=True):
        assert finish == FinishReason.LENGTH and tokens == expected[r.request_id]
    # the late prompt joined decoding rows: it came in chunks of 4 beside them
    assert sum(s.prefilling for s in seen[1:]) >= (len(late.prompt_token_ids) - 1) // 4


async def test_step_observers_see_each_batched_step(tiny_models):
    """The engine reports every step over a target's batch (the metrics' batch size, tokens a step,
    k by batch size): rows given tokens, prompt chunks beside them, the tokens, the drafts."""
    from decoding.params import BatchStep

    reqs = [
        request(tiny_models, PROMPTS[1] * 3, "draft", k=3, max_tokens=10),
        # long enough to be decoding still when the long prompt, prefilled after it, joins it
        request(tiny_models, PROMPTS[4], "off", max_tokens=40),
    ]
    ae = AsyncEngine(Engine(tiny_models), max_active=2, prefill_budget=16)
    seen: list[BatchStep] = []
    ae.add_step_observer(seen.append)
    ae.add_step_observer(lambda step: 1 / 0)  # a faulty observer: logged, the engine goes on
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_collect(ae, r) for r in reqs)), 120)
    finally:
        ae.shutdown()
    assert [finish for _, finish in results] == [FinishReason.LENGTH] * 2
    assert all(s.model == "tiny" for s in seen)
    assert sum(s.tokens for s in seen) == 50  # every token of both requests, counted once
    assert max(s.rows for s in seen) == 2 and max(s.drafted for s in seen) > 0
    assert any(s.prefilling and s.rows for s in seen)  # a prompt chunk beside a decoding row
    # the long prompt's 16-token chunks before its last, which gives its first token
    assert sum(s.prefilling for s in seen) >= (len(reqs[0].prompt_token_ids) - 1) // 16


def test_duplicate_request_ids_do_not_collide(tiny_models):
    """The engine keys requests by submission: the client's request_id is only a label."""
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, p, max_tokens=10) for p in PROMPTS[:3]]
    same = [GenerationRequest("same", r.model, r.prompt_token_ids, r.params, r.spec) for r in reqs]
    expected = [alone(engine, r) for r in reqs]

    async def main():
        ae = AsyncEngine(engine, max_active=4)
        try:
            return await asyncio.wait_for(asyncio.gather(*(_collect(ae, r) for r in same)), 60)
        finally:
            ae.shutdown()

    results = asyncio.run(main())
    assert [t for t, _ in results] == expected


def test_batch_costs_choose_no_speculation_where_the_batch_is_compute_bound():
    from decoding.batch_controller import BatchCosts

    costs = BatchCosts()
    # memory-bound up to 16 rows, then each row costs as much as the whole step did
    for rows in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        costs.observe(rows, rows, 0, 0.0, 0.01 * max(1.0, rows / 16))
    costs.observe(2, 2, 1, 0.002, 0.01)
    small = costs.best_k([(0.8, True, 6)] * 2, 0.1, probe=False)
    large = costs.best_k([(0.8, True, 6)] * 64, 0.1, probe=False)
    assert small >= 3
    assert large == 0  # 64 rows x (k+1) is past the knee: speculation would slow the batch
    assert costs.best_k([(0.8, True, 6)] * 64, 0.1, probe=True) == 2  # a probe turn still measures


def test_batch_costs_weigh_every_rows_acceptance():
    from decoding.batch_controller import BatchCosts

    costs = BatchCosts()
    for rows in (4, 8, 16, 32):
        costs.observe(rows, rows, 0, 0.0, 0.01)
    costs.observe(4, 4, 1, 0.003, 0.01)
    assert costs.best_k([(0.05, True, 8)] * 4, 0.1, probe=False) == 0  # drafts nobody keeps
    assert costs.best_k([(0.9, True, 8)] * 4, 0.1, probe=False) >= 3
    assert costs.best_k([(0.9, False, 8)] * 4, 0.1, probe=False) == 8  # prompt lookup drafts for free


def test_batch_costs_keep_plain_steps_apart_from_verification_and_stalls():
    """A stalled verification step of 2 rows at k = 1 (4 target rows, as a plain step of 4 has) and
    one stalled plain step leave the plain cost where the plain steps put it, near enough that
    drafts nobody keeps are not drafted."""
    from decoding.batch_controller import BatchCosts

    costs = BatchCosts()
    for _ in range(4):
        costs.observe(4, 4, 0, 0.0, 0.005)
    costs.observe(2, 4, 1, 0.003, 0.09)  # a graph captured mid-step
    costs.observe(4, 12, 2, 0.003, 0.006)
    assert costs.t_plain(4) == pytest.approx(0.005)
    costs.observe(4, 4, 0, 0.0, 0.5)  # a collector pause
    assert costs.t_plain(4) <= 0.005 * 1.31
    assert costs.best_k([(0.02, True, 8)] * 4, 0.1, probe=False) == 0


def spy_prefill_chunks(monkeypatch) -> list[bool]:  # type: ignore[no-untyped-def]
    """Engine.prefill_chunks spied on: per step, whether it took any prompt chunk."""
    had_chunks: list[bool] = []
    chunks_of = Engine.prefill_chunks

    def spy(prefilling, budget, grid=None):  # type: ignore[no-untyped-def]
        out = chunks_of(prefilling, budget, grid)
        had_chunks.append(any(n for _, n in out))
        return out

    monkeypatch.setattr(Engine, "prefill_chunks", staticmethod(spy))
    return had_chunks


def test_steps_that_prefill_are_no_cost_samples(tiny_models, monkeypatch):
    """A request joining a decoding batch prefills in the same step as the others decode: that step's
    time is not what a decode step costs, so neither the batch's costs nor a row's controller take
    it as a sample (acceptance still counts)."""
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, f"{i} a prompt of some words", "draft", 3, max_tokens=12) for i in range(3)]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    join_at = [0, 3, 6]
    timings: list[str] = []
    commit = Engine.commit_step

    def spy_commit(self, step, rows, applied, end, timing="wall"):  # type: ignore[no-untyped-def]
        timings.append(timing)
        return commit(self, step, rows, applied, end, timing)

    had_chunks = spy_prefill_chunks(monkeypatch)
    monkeypatch.setattr(Engine, "commit_step", spy_commit)
    assert run_batch(engine, reqs, join_at, budget=4) == expected
    assert len(had_chunks) == len(timings) and any(had_chunks) and not all(had_chunks)
    assert all(t == "none" for t, c in zip(timings, had_chunks, strict=True) if c)
    assert all(t != "none" for t, c in zip(timings, had_chunks, strict=True) if not c)


def test_a_rows_first_token_never_waits_for_its_draft(tiny_models, monkeypatch):
    """In a batch that speculates, a row joining it drafts nothing in the step that gives its first
    token where its draft's catch-up on the prompt is dearer than a plain step (the draft takes in
    the prompt when the row first drafts), as a request alone does; the rows already decoding keep
    drafting in that step, and every output is still its own alone."""
    from decoding.batch_controller import BatchCosts
    from decoding.controller import SpecController

    monkeypatch.setattr(BatchCosts, "best_k", lambda self, rows, prior, probe, **_: 3)
    monkeypatch.setattr(BatchCosts, "catch_up_cheap", lambda self, backlog, batch: False)
    # alone, the first row speculates too: its own controller judges by measured step times, and on
    # a loaded machine it decoded plainly, so its draft had a backlog when the second row joined and
    # (rightly) caught nothing up in the step giving that row its first token (3 of 6 runs failed)
    monkeypatch.setattr(SpecController, "choose_k", lambda self, left=None, catch_up=0.0: 3)
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, f"{i} some prompt words", "draft", 4, adaptive=True) for i in range(2)]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    seqs = [engine.start(reqs[0])]
    steps: list[dict[str, int]] = []  # per step: request -> tokens it drafted
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while seqs:
        if len(steps) == 3:
            seqs.append(engine.start(reqs[1]))
        steps.append({})
        for o in engine.step_batch(seqs):
            if o is not None:
                steps[-1][o.request_id] = o.drafted
                out[o.request_id].extend(o.token_ids)
        for s in [s for s in seqs if s.finished is not None]:
            seqs.remove(s)
            s.release()
    assert out == expected
    a, b = (r.request_id for r in reqs)
    first_a = next(st for st in steps if a in st)
    first_b = next(i for i, st in enumerate(steps) if b in st)
    assert first_a[a] == 0 and steps[first_b][b] == 0  # the first token of each
    assert steps[first_b][a] > 0  # the other row kept drafting in that step
    assert any(st.get(b, 0) > 0 for st in steps[first_b + 1 :])


def test_draft_catch_up_runs_in_chunk_graph_sized_passes(tiny_models, monkeypatch):
    """Ten rows whose draft must first absorb a 300-token prompt each: the catch-up runs in passes of
    at most CATCH_UP_ROWS rows and a prefill chunk of tokens (each a prompt-chunk graph on a GPU,
    not one eager pass), and every row's output is still its output alone."""
    from decoding import drafters

    engine = Engine(tiny_models)
    reqs = [request(tiny_models, f"{i} " + "long prompt " * 100, "draft", 3, max_tokens=6) for i in range(10)]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    passes: list[tuple[int, int]] = []
    inner = drafters.forward_many

    def spy(runners, rows, wants):
        if all(w == "none" for w in wants):
            passes.append((len(rows), sum(int(r.shape[0]) for r in rows)))
        return inner(runners, rows, wants)

    monkeypatch.setattr(drafters, "forward_many", spy)
    assert run_batch(engine, reqs) == expected
    probe = tiny_models["tiny-draft"].runner_factory.__self__.runner()
    limit = probe.prefill_chunk
    probe.release()
    assert len(passes) > 1 and sum(t for _, t in passes) >= 10 * 300
    assert all(n <= drafters.CATCH_UP_ROWS and t <= limit for n, t in passes)


def test_batch_costs_remeasure_the_plain_step_while_speculating():
    """A batch that speculates from its first steps on still runs a plain step now and then, so the
    cost speculation must beat is measured again, not judged by one early (cold) sample."""
    from decoding.batch_controller import BatchCosts

    costs = BatchCosts()
    costs.observe(4, 4, 0, 0.0, 0.05)  # a cold first plain step: 5x its real cost
    costs.observe(4, 8, 1, 0.004, 0.011)
    ks = [costs.best_k([(0.1, True, 4)] * 4, 0.1, probe=costs.probe_turn()) for _ in range(64)]
    # one cold sample is not trusted to show speculation clearly ahead: no slack in the period
    assert ks.count(0) >= 2 and max(ks) > 0
    for _ in range(10):
        costs.observe(4, 4, 0, 0.0, 0.01)  # what plain steps measure once warm
    costs.probe_turn()  # a step that is no re-measurement turn
    assert costs.best_k([(0.1, True, 4)] * 4, 0.1, probe=False) == 0  # at a = 0.1, speculation loses


def test_batch_costs_remeasure_less_often_where_speculation_clearly_pays():
    """With the plain cost sampled twice and speculation far ahead (a = 0.8, verification about a
    plain step), a plain re-measurement costs a step's gain and could not change the choice: one in
    remeasure_every x remeasure_slack steps, not one in remeasure_every."""
    from decoding.batch_controller import BatchCosts

    def plain_steps(costs: BatchCosts, n: int) -> int:
        ks = [costs.best_k([(0.8, True, 4)] * 4, 0.1, probe=costs.probe_turn()) for _ in range(n)]
        assert max(ks) > 0
        return ks.count(0)

    close, clear = BatchCosts(), BatchCosts()
    for costs in (close, clear):
        costs.observe(4, 16, 3, 0.0042, 0.0052)  # k = 3: three 1.4 ms draft passes, 5.2 ms verification
    close.observe(4, 4, 0, 0.0, 0.0052)  # one plain sample: not yet trusted
    for _ in range(2):
        clear.observe(4, 4, 0, 0.0, 0.0052)
    assert plain_steps(close, 128) == 4
    assert plain_steps(clear, 128) == 1


def test_rows_beside_prompt_chunks_decode_plainly(tiny_models, monkeypatch):
    """A step that takes a prompt chunk gives its decoding rows one token each, on every device (the
    prompt's row would wait for their drafts and the drafts' catch-up); they draft again once the
    prompt is in, and every output is its own alone."""
    engine = Engine(tiny_models)
    reqs = [
        request(tiny_models, "a prompt of some words", "draft", 3, max_tokens=20),
        request(tiny_models, "a much longer prompt " * 12, "draft", 3, max_tokens=6),
    ]
    expected = {r.request_id: alone(engine, r) for r in reqs}
    drafted: list[int] = []
    launch = Engine.launch_step

    def spy_launch(self, device, decoding, ks, chunks, plain=False, undoable=False):  # type: ignore[no-untyped-def]
        step = launch(self, device, decoding, ks, chunks, plain, undoable)
        drafted.append(max(step.batch.n_drafts, default=0))
        return step

    had_chunks = spy_prefill_chunks(monkeypatch)
    monkeypatch.setattr(Engine, "launch_step", spy_launch)
    assert run_batch(engine, reqs, join_at=[0, 4], budget=8) == expected
    assert len(had_chunks) == len(drafted)
    beside = [d for c, d in zip(had_chunks, drafted, strict=True) if c]
    assert len(beside) >= 4 and not any(beside)  # the long prompt's chunks: plain beside them
    assert any(d for c, d in zip(had_chunks, drafted, strict=True) if not c)  # drafting before and after


def test_a_new_request_starts_from_the_acceptance_of_the_ones_before(tiny_models):
    engine = Engine(tiny_models)
    first = request(tiny_models, "def add(a, b):", mode="draft", k=4, adaptive=False, max_tokens=16)
    alone(engine, first)
    (key, pop), *_ = engine.population.items()
    assert key == ("tiny", "draft")
    n = pop.accepted_w + pop.rejected_w
    assert n >= pop.weight  # fixed k = 4 verified every step
    seq = engine.start(request(tiny_models, "x", mode="draft", adaptive=True))
    try:
        assert seq.controller.acceptance == pytest.approx(pop.accepted_w / n)
        assert seq.controller.accepted_w + seq.controller.rejected_w == pytest.approx(pop.weight)
    finally:
        seq.release()
    plain = engine.start(request(tiny_models, "x"))  # no drafter: no prior to take
    plain.release()
    assert len(engine.population) == 1


def _four_row_tables():
    """BatchCosts that measured 4 rows: plain 5 ms, k = 1 in 7 ms (a 1.5 ms draft pass and 5.5 ms of
    verification), k = 3 in 10 ms."""
    from decoding.batch_controller import BatchCosts

    costs = BatchCosts()
    for _ in range(3):
        costs.observe(4, 4, 0, 0.0, 0.005)
    costs.observe(4, 8, 1, 0.0015, 0.0055)
    costs.observe(4, 16, 3, 0.0045, 0.0055)
    return costs


def test_batch_costs_discount_speculation_by_what_it_realised():
    """Speculative steps that give fewer tokens per second than the model promised (estimates that
    lag a text the draft stopped following, costs the tables miss) discount the next choice: a k that
    pays on paper by 11% is not taken once steps realise 81% of their promise, one that pays 1.48x
    still is; plain steps fade the evidence, and steps that deliver more than promised change nothing."""

    marginal, paying = [(0.55, True, 1)] * 4, [(0.8, True, 4)] * 4
    fresh = _four_row_tables()
    assert fresh.realised is None
    assert fresh.best_k(marginal, 0.1, probe=False) == 1

    let_down = _four_row_tables()
    for _ in range(4):  # each step: 1.55 x 4 tokens expected, 5 given, in the 7 ms the tables say
        let_down.observe_goodput(4, 1, True, 4 * 1.55, 5, 0.007)
    assert let_down.realised == pytest.approx(5 / 6.2)
    assert let_down.best_k(marginal, 0.1, probe=False) == 0
    assert let_down.best_k(paying, 0.1, probe=False) >= 3
    for _ in range(40):
        let_down.observe(4, 4, 0, 0.0, 0.005)
    assert let_down.realised is None  # faded below the weight of evidence it needs

    kept = _four_row_tables()
    for _ in range(4):
        kept.observe_goodput(4, 1, True, 4 * 1.55, 7, 0.007)
    assert kept.realised is not None and kept.realised > 1
    assert kept.best_k(marginal, 0.1, probe=False) == 1


def test_batch_costs_switch_speculation_on_again_only_on_a_probe_or_a_clear_gain():
    """Once no k pays, the rows' acceptance estimates stop being measured: a k that pays on paper by
    a few percent waits for a probe turn (as a batch that is on keeps it), one that pays clearly is
    taken at once; a probe from off drafts, not a plain re-measurement, and probes that find
    nothing space out."""

    dead, marginal, paying = [(0.05, True, 4)] * 4, [(0.5, True, 1)] * 4, [(0.8, True, 4)] * 4
    on = _four_row_tables()
    assert on.best_k(marginal, 0.1, probe=False) == 1  # 6 tokens in 7 ms against 4 in 5 ms: 1.07x

    costs = _four_row_tables()
    assert costs.best_k(dead, 0.1, probe=False) == 0
    assert costs.best_k(marginal, 0.1, probe=False) == 0  # off: 1.07x is not enough to switch on
    costs.steps = costs.remeasure_every  # a re-measurement turn, were speculation on
    assert costs.best_k(marginal, 0.1, probe=True) == 1  # the probe drafts at the best k
    assert costs.best_k(dead, 0.1, probe=False) == 0  # ... finds nothing
    assert costs.backoff == 2
    assert costs.best_k(dead, 0.1, probe=True) == 2
    assert costs.best_k(dead, 0.1, probe=False) == 0
    assert costs.backoff == 4
    assert costs.best_k(paying, 0.1, probe=False) >= 3  # a clear gain switches on at once
    assert costs.best_k(paying, 0.1, probe=False) >= 3
    assert costs.backoff == 1  # ... and stays on: the probes' wait starts again


def test_the_engine_reports_what_speculative_steps_realised(tiny_models):
    """A batch that speculates feeds its steps' realised goodput to the target's BatchCosts: with
    the tiny target drafting for itself every draft is accepted, so steps give at least the tokens
    the rows' acceptance estimates promised."""
    import dataclasses

    engine = Engine(tiny_models)
    reqs = [
        dataclasses.replace(request(tiny_models, p, "draft", 3, max_tokens=24), model="tiny-self")
        for p in PROMPTS[:4]
    ]
    run_batch(engine, reqs)
    got, n_got, _, _ = engine.costs["tiny-self"].realised_sums
    assert n_got > 0 and got / n_got >= 1.0


def test_rows_drafting_one_k_greedily_propose_as_one_tensor(tiny_models, monkeypatch):
    """Greedy rows drafting the same k propose as a batch: each pass feeds the last pass's tokens as
    one column and the proposals are rows of one tensor, padded nowhere (a copy kernel a row on a
    GPU), and each row proposes what it would alone; the verification batch stacks them likewise."""
    from decoding import batch, drafters
    from decoding.drafters import DraftModelDrafter, propose_many
    from decoding.params import SamplingParams as SP

    pool = tiny_models["tiny-draft"].runner_factory.__self__
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
    greedy = SP(max_tokens=8, temperature=0)

    def items(k):  # fresh draft runners that have seen all of each prompt but its last token
        out = []
        for p in prompts:
            r = pool.draft_runner()
            if len(p) > 1:
                r.forward(p[:-1], logits=False)
            out.append((DraftModelDrafter(r, torch.device("cpu")), p, k, greedy, torch.zeros(0), None))
        return out

    alone = []  # each row's greedy continuation, token by token
    for it in items(3):
        runner, fed, toks = it[0].runner, [it[1][-1]], []
        for _ in range(3):
            toks.append(int(runner.forward(fed)[-1].argmax()))
            fed = toks[-1:]
        alone.append(torch.tensor(toks))
        it[0].release()

    def no_padding(*a, **kw):
        raise AssertionError("padded row by row")

    monkeypatch.setattr(drafters, "pad_sequence", no_padding)
    monkeypatch.setattr(batch, "pad_sequence", no_padding)
    its = items(3)
    got = propose_many(its)
    for it in its:
        it[0].release()
    assert all(p is not None and p.tokens.shape == (3,) for p in got)
    for p, a in zip(got, alone, strict=True):
        assert p.tokens.tolist() == a.tolist()
    b = batch.DecodeBatch.build([p[-1] for p in prompts], [p.tokens for p in got], torch.device("cpu"))
    assert b.drafts.tolist() == [a.tolist() for a in alone]
    assert b.ids[:, 0].tolist() == [p[-1] for p in prompts]


def test_a_drafts_catch_up_is_measured_into_the_batch_costs(tiny_models):
    """A step whose drafts first catch up on their prompts records what that took, a token: the
    cost model prices later catch-ups by it, not by the start-up table alone."""
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, "long prompt " * 20 + p, "draft", 3, max_tokens=6) for p in PROMPTS[:3]]
    seq = engine.start(reqs[0])
    costs = engine.costs_of(seq)
    seq.release()
    costs.catch_up_token = None
    run_batch(engine, reqs)
    assert costs.catch_up_token is not None and 0 < costs.catch_up_token < 1.0


def test_a_shapes_stalled_first_use_is_no_cost_sample(tiny_models, monkeypatch):
    """A speculative step of a shape never measured that stalls (kernels loaded on first use: 53 ms
    against ~6 predicted on the H200) is held back: neither the verification cost nor the realised
    goodput takes it, so the batch does not go plain for it; the shape's next step measures it, and
    the outputs are each request's alone."""
    engine = Engine(tiny_models)
    reqs = [request(tiny_models, p, "draft", 3, max_tokens=10) for p in PROMPTS[:3]]
    expected = {r.request_id: alone(engine, r) for r in reqs}  # measures one row's shapes
    seq = engine.start(reqs[0])
    costs = engine.costs_of(seq)
    seq.release()
    # per 2-row speculative step: its width, its rows bucket measured, the goodput sums unchanged
    seen: list[tuple[int, bool, bool]] = []
    commit = Engine.commit_step

    def stall_first(self, step, rows, applied, end, timing="wall"):  # type: ignore[no-untyped-def]
        two = step.batch.width > 1 and len(step.seqs) == 2
        before = list(costs.realised_sums)
        out = commit(self, step, rows, applied, end + (1000.0 if two and not seen else 0.0), timing)
        if two:
            seen.append((step.batch.width, (2, 8) in costs.target, costs.realised_sums == before))
        return out

    monkeypatch.setattr(Engine, "commit_step", stall_first)
    # other shapes may be held too: a real step of this process stalled (the rule at work; on a
    # loaded 2-core EPYC a one-row shape, and in another run the two-row plain (2, 4), did), which
    # is no concern of the stalled shape here
    held_before = set(costs.held)
    assert (2, 8) not in costs.target and (2, 8) not in held_before
    assert run_batch(engine, reqs[1:]) == {r.request_id: expected[r.request_id] for r in reqs[1:]}
    assert len(seen) >= 2 and seen[0][0] == 4  # k = 3: 8 target rows
    assert seen[0][1:] == (False, True)  # the stalled step: no cost sample, no goodput sample
    assert seen[1][1] and not seen[1][2] and costs.target[2, 8] < 1.0  # the next one is the sample
    assert (2, 8) in costs.held - held_before


def test_freeze_heap_takes_what_exists_out_of_collection_and_collects_garbage_first() -> None:
    """What is alive when ``freeze_heap`` runs leaves the collector's generations (a full collection
    no longer walks it); a cycle that was already garbage is collected first, not frozen."""
    import gc
    import weakref

    class Node:
        pass

    kept = [Node()]
    garbage = Node()
    garbage.self = garbage  # type: ignore[attr-defined]
    gone = weakref.ref(garbage)
    del garbage
    try:
        assert freeze_heap() == gc.get_freeze_count() > 0
        assert gone() is None
        assert not any(o is kept for o in gc.get_objects())
        later: list[Node] = []
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


@pytest.mark.parametrize("name", ["tiny", "tiny-draft"])  # with its draft model; by prompt lookup
def test_warm_up_runs_speculative_steps_then_forgets_them(tiny_models, monkeypatch, name):
    """``decoding.warmup.warm_up`` verifies drafts greedily and by rejection sampling, frees every slot, and
    leaves no measured cost or acceptance behind: an adaptive request after it starts as on an
    engine that never warmed up."""
    import decoding.batch as batch_mod

    used: list[str] = []
    for fn in ("verify_greedy_batch", "verify_sampling"):
        real = getattr(batch_mod, fn)
        monkeypatch.setattr(batch_mod, fn, lambda *a, _f=real, _n=fn, **k: used.append(_n) or _f(*a, **k))
    warmed, fresh = Engine(tiny_models), Engine(tiny_models)
    assert warm_up(warmed, name) > 0
    assert {"verify_greedy_batch", "verify_sampling"} <= set(used)
    pools = {id(m.runner_factory.__self__): m.runner_factory.__self__ for m in tiny_models.values()}
    assert all(p.free_slots == p.slots for p in pools.values())
    assert not warmed.costs and not warmed.population
    # a new request's acceptance estimate starts where a fresh engine's does (its k choices also
    # follow measured step times, so its steps are not compared)
    r = request(tiny_models, PROMPTS[4], "auto", adaptive=True, max_tokens=32)
    r = GenerationRequest(r.request_id, name, r.prompt_token_ids, r.params, r.spec)
    a, b = warmed.start(r), fresh.start(r)
    try:
        assert (a.controller.accepted_w, a.controller.rejected_w) == (
            b.controller.accepted_w,
            b.controller.rejected_w,
        )
    finally:
        a.release()
        b.release()


def test_steps_to_end_releases_each_row_as_it_ends_and_the_rest_when_left(tiny_models):
    engine = Engine(tiny_models)
    pool = tiny_models["tiny"].runner_factory.__self__
    reqs = [request(tiny_models, PROMPTS[i], "draft", k=2, max_tokens=3 + 5 * i) for i in range(3)]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for pairs in engine.steps_to_end([engine.start(r) for r in reqs]):
        for _, o in pairs:
            if o is not None:
                got[o.request_id] += o.token_ids
    assert got == {r.request_id: alone(engine, r) for r in reqs}
    assert pool.free_slots == pool.slots
    steps = engine.steps_to_end([engine.start(r) for r in reqs])
    next(steps)
    assert pool.free_slots == pool.slots - len(reqs)
    steps.close()  # left early: every row still running is released
    assert pool.free_slots == pool.slots


def test_a_short_prompt_is_not_held_behind_a_long_ones_chunks():
    """Prompt chunks go to the prompts with the fewest tokens left first (first come first served
    among equals): a short prompt admitted while a long one is being prefilled takes the next step,
    the long one the rest of its budget."""

    class Seq:
        def __init__(self, prompt: int, done: int) -> None:
            self.tokens = [0] * (prompt + 1)  # the prompt and the token its prefill predicts
            self.runner = type("R", (), {"length": done})()
            self.prompt_logprobs = None

    long, short, other = Seq(3000, 640), Seq(34, 0), Seq(34, 0)
    assert [(s, n) for s, n in Engine.prefill_chunks([long, short], 64)] == [(short, 34), (long, 30)]
    assert Engine.prefill_chunks([long, other, short], 64) == [(other, 34), (short, 30)]  # ties: in order
    assert Engine.prefill_chunks([long], 64) == [(long, 64)]
    assert Engine.prefill_chunks([long, short], None) == [(short, 34), (long, 2360)]


def test_prompt_chunks_end_on_the_grid_whatever_shares_the_step(tiny_models):
    """With a grid (``Engine.chunk_tokens``, AsyncEngine's prefill budget) a prompt is cut into the
    same chunks alone and beside others: what a short prompt leaves of the budget short of the
    long one's next multiple waits for the next step (llama.cpp's rows round by the chunk's width:
    tests/decoding/test_llamacpp.py), and a burst step takes whole multiples."""

    class Seq:
        def __init__(self, prompt: int, done: int) -> None:
            self.tokens = [0] * (prompt + 1)
            self.runner = type("R", (), {"length": done})()
            self.prompt_logprobs = None

    long, short = Seq(3000, 640), Seq(34, 0)
    assert Engine.prefill_chunks([long, short], 64, 64) == [(short, 34)]
    assert [n for _, n in Engine.prefill_chunks([long, Seq(10, 0)], 128, 64)] == [10, 64]
    assert Engine.prefill_chunks([long], 64, 64) == [(long, 64)]
    assert Engine.prefill_chunks([long], 2000, 64) == [(long, 1984)]  # a burst: whole multiples
    assert Engine.prefill_chunks([long], 32, 64) == [(long, 32)]  # a budget under the grid: no stall
    tail = Seq(700, 640)  # the rest of a prompt ends where it ends
    assert Engine.prefill_chunks([tail, short], 128, 64) == [(short, 34), (tail, 60)]
    ae = AsyncEngine(Engine(tiny_models), prefill_budget=48)
    try:
        assert ae.engine.chunk_tokens == 48
    finally:
        ae.shutdown()


async def test_a_burst_during_a_step_fills_the_free_slots_before_the_queue(tiny_models):
    """max_queued bounds the requests that wait, not those the loop admits at its next turn: a burst
    that arrives while a step runs gets the free slots and max_queued more, then 503s. It had counted
    every request not yet admitted, so free slots went unused and clients were refused."""
    import threading

    from decoding.errors import EngineOverloaded

    engine = Engine(tiny_models)
    ae = AsyncEngine(engine, max_active=4, max_queued=2)
    stepping, release = threading.Event(), threading.Event()

    def hold(_step: object) -> None:  # the engine thread waits here, after a step, until released
        stepping.set()
        release.wait(60)

    ae.add_step_observer(hold)
    first = request(tiny_models, PROMPTS[0], "off", max_tokens=4)
    burst = [request(tiny_models, PROMPTS[i % len(PROMPTS)], "off", max_tokens=3) for i in range(1, 6)]
    try:
        tasks = [asyncio.ensure_future(_collect(ae, first))]
        while not stepping.is_set():  # one running request, the loop inside its step
            await asyncio.sleep(0.001)
        steps = [ae.submit(r) for r in burst]  # 3 free slots + 2 to wait: all accepted
        with pytest.raises(EngineOverloaded):
            ae.submit(request(tiny_models, PROMPTS[0], "off", max_tokens=3))
        release.set()  # (later steps pass through hold at once)

        async def drain(s):  # type: ignore[no-untyped-def]
            return [out async for out in s]

        outs = await asyncio.wait_for(asyncio.gather(*tasks, *(drain(s) for s in steps)), 120)
    finally:
        release.set()
        ae.shutdown()
    assert all(o[-1].finish_reason == FinishReason.LENGTH for o in outs[1:])
