"""The CUDA fast path on a GPU: graph replays compute what the eager static forward computes, and
speculation over graphs stays lossless. Skipped where there is no CUDA device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from decoding import invariant
from decoding.engine import Engine
from decoding.loader import ModelSpec, load_all
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.runner import Row
from decoding.static import StaticModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _greedy(rid: str, model: str, ids: range, max_tokens: int, spec: SpecParams) -> GenerationRequest:
    """A greedy request of ``max_tokens`` that ignores EOS (outputs of one length to compare)."""
    return GenerationRequest(
        rid, model, list(ids), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), spec
    )


@pytest.fixture(scope="module")
def gpu_models():
    return load_all(
        [
            ModelSpec(
                "tiny",
                "tiny-random",
                draft="tiny-draft",
                dtype="float32",
                device="cuda",
                backend="cuda_graphs",
                max_context=512,
                slots=16,
            ),
            ModelSpec(
                "tiny-draft",
                "tiny-random-draft",
                dtype="float32",
                device="cuda",
                backend="cuda_graphs",
                max_context=512,
                slots=16,
            ),
            ModelSpec(
                "tiny-eager", "tiny-random", dtype="float32", device="cuda", backend="eager", max_context=512
            ),
        ]
    )


@pytest.mark.parametrize("compile_step", [False, True])
def test_graph_replay_matches_eager_static(gpu_models, compile_step):
    m = gpu_models["tiny"].model
    graphs = StaticModel(m, 256, slots=1, graphs=True, compile_step=compile_step).runner()
    plain = StaticModel(m, 256, slots=1, graphs=False).runner()
    ids = list(range(10, 40))
    for r in (graphs, plain):
        r.forward(ids, logits=False)
    for toks in ([1], [2, 3, 4], [5, 6, 7, 8, 9]):
        torch.testing.assert_close(graphs.forward(toks), plain.forward(toks), rtol=1e-4, atol=1e-4)
        graphs.crop(graphs.length - 1)
        plain.crop(plain.length - 1)


def test_prompt_chunks_beside_decode_rows_run_as_graphs(gpu_models):
    """A step with prompt chunks replays a graph (the fused chunk kernel) and computes what the eager
    static forward with SDPA computes."""
    from decoding.runner import Row

    m = gpu_models["tiny"].model
    graphs = StaticModel(m, 256, slots=4, graphs=True)
    plain = StaticModel(m, 256, slots=4, graphs=False)
    plain.fused_attention = False  # the SDPA path: gathered caches and additive masks
    ids = torch.arange(10, 250, device="cuda")
    got = {}
    for name, sm in (("graphs", graphs), ("plain", plain)):
        sm.forward_rows([Row(0, ids[:30], 0, "none"), Row(1, ids[40:52], 0, "none")])
        step = sm.forward_rows(
            [
                Row(0, ids[30:31], 30),
                Row(1, ids[52:55], 12),
                Row(2, ids[60:100], 0, "none"),
                Row(3, ids[:20], 0, "none"),
            ]
        )
        assert step[2] is None and step[3] is None
        after = sm.forward_rows([Row(2, ids[100:101], 40), Row(3, ids[20:22], 20)])
        got[name] = [*step[:2], *after]
    assert any(key[4] for key in graphs.graphs), "no chunk graph was captured"
    for a, b in zip(got["graphs"], got["plain"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode,k", [("draft", 2), ("draft", 5), ("ngram", 4)])
def test_speculation_over_graphs_is_lossless(gpu_models, mode, k):
    engine = Engine(gpu_models)
    ids = list(range(30, 60))
    p = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected, _, _ = engine.generate(GenerationRequest("a", "tiny-eager", ids, p, SpecParams(SpecMode.OFF)))
    got, _, _ = engine.generate(
        GenerationRequest("b", "tiny", ids, p, SpecParams(SpecMode(mode), max_k=k, adaptive=False))
    )
    assert got == expected


def _bf16_model(hidden: int, layers: int, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=1024,
    )
    with torch.device("cuda"):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


def _pair(target: StaticModel, draft: StaticModel) -> Engine:
    """An engine serving ``target`` as "t" with ``draft`` ("d") drafting for it."""
    from decoding.engine import LoadedModel

    t = LoadedModel("t", target.model, None, draft="d", max_context=512, runner_factory=target.runner)
    d = LoadedModel(
        "d",
        draft.model,
        None,
        max_context=512,
        runner_factory=draft.runner,
        draft_runner_factory=draft.draft_runner,
    )
    return Engine({"t": t, "d": d})


@pytest.mark.parametrize("shown", [False, True])
@pytest.mark.parametrize("compile_step", [False, True])
def test_exact_mode_rows_equal_one_token_steps_in_bf16(compile_step, shown):
    """On a GPU, 1-row and 9-row steps may run different GEMM and attention kernels; exact mode runs
    both at one width, or (``shown``: graphs captured ahead, as a server's load does) at the widths
    ExactWidths.prove showed to round alike, so each verification row equals the 1-token step to the
    bit."""
    static = StaticModel(
        _bf16_model(512, 4, 0), 256, slots=1, graphs=True, compile_step=compile_step, exact=True
    )
    if shown:
        static.capture(range(1, static.max_graph_tokens + 1), (1,))
        assert static.max_graph_tokens in static.widths.proven[1]
        if compile_step:
            assert 1 not in static.widths.proven[1]  # N = 1's own compile: never shown
    r = static.runner()
    r.forward(list(range(100, 160)), logits=False)
    base = r.length
    block = [5, 6, 7, 8, 9, 10]
    rows = r.forward(block)
    r.crop(base)
    singles = []
    for tok in block:
        singles.append(r.forward([tok])[0])
    assert all(torch.equal(a, b) for a, b in zip(singles, rows, strict=True))


def test_a_width_the_device_does_not_show_keeps_padding(monkeypatch):
    """ExactWidths.prove keeps only the widths whose probe matched the exact width's to the bit, and
    never one that runs compiled code of its own: such a width is not run, its steps pad to the next
    width shown; where no probe matches, every step pads as exact mode did before."""
    from decoding import exact

    static = StaticModel(_bf16_model(512, 4, 0), 256, slots=2, graphs=True, exact=True)
    X = static.max_graph_tokens
    monkeypatch.setattr(static.widths, "own_compile", lambda rows, width: width == 3)
    static.capture(range(1, 2), (2,))
    shown = static.widths.proven[2]
    assert 3 not in shown and X in shown
    assert static.step_shape(2, 3, 0, exact=True).width == min(w for w in shown if w > 3)
    assert static.exact_padding == X  # a verification of k = 2 pads: priced as exact mode was
    assert static.widths.proven.get(1) is None  # bucket by bucket
    monkeypatch.setattr(exact, "agrees", lambda ref, out: False)
    static.capture(range(1, 2), (4,))
    assert static.widths.proven[4] == (X,)
    assert static.step_shape(3, 1, 0, exact=True).width == X
    assert static.free_slots == 2  # the probe's slots were given back


@pytest.mark.parametrize("shown", [False, True])
def test_exact_speculation_in_bf16_is_token_identical(shown):

    target = StaticModel(_bf16_model(512, 4, 0), 512, slots=2, graphs=True, exact=True)
    if shown:
        target.capture(range(1, 2), (1,))
    # the target's own weights as its draft: acceptance is high, and rejections fall on bf16 ties
    draft = StaticModel(_bf16_model(512, 4, 0), 512, slots=2, graphs=True)
    engine = _pair(target, draft)
    ids = list(range(200, 264))
    p = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    expected, _, _ = engine.generate(GenerationRequest("a", "t", ids, p, SpecParams(SpecMode.OFF)))
    for k in (2, 5, 8):
        got, _, _ = engine.generate(
            GenerationRequest("b", "t", ids, p, SpecParams(SpecMode.DRAFT, max_k=k, adaptive=False))
        )
        assert got == expected


@pytest.mark.parametrize("mode,k", [("off", 1), ("draft", 3), ("ngram", 5)])
def test_batched_graphs_give_each_request_its_output_alone(gpu_models, mode, k):
    """Batches of 1..8 rows through graphs of every batch bucket (float32): each request's greedy
    output equals its output alone, whoever joins or leaves."""
    from tests.decoding.test_batch import run_batch

    engine = Engine(gpu_models)
    reqs = [
        _greedy(
            f"g{i}",
            "tiny",
            range(30 + i, 60 + 7 * i),
            20 + 3 * i,
            SpecParams(SpecMode(mode), max_k=k, adaptive=False),
        )
        for i in range(8)
    ]
    expected = {r.request_id: engine.generate(r)[0] for r in reqs}
    assert run_batch(engine, reqs) == expected
    assert run_batch(engine, reqs, join_at=[0, 0, 1, 2, 2, 5, 9, 9], budget=16) == expected


def _fast_pair_requests(gpu_models, params: SamplingParams, n: int):  # type: ignore[no-untyped-def]
    """A fast-mode target and draft under graphs, their engine, and ``n`` requests of growing prompts
    drafting a fixed k = 3 with ``params`` (a seed: 100 + i where ``params`` has one)."""
    target = StaticModel(gpu_models["tiny"].model, 512, slots=8, graphs=True)
    draft = StaticModel(gpu_models["tiny-draft"].model, 512, slots=8, graphs=True)
    reqs = [
        GenerationRequest(
            f"p{i}",
            "t",
            list(range(30 + i, 70 + 9 * i)),
            params if params.seed is None else dataclasses.replace(params, seed=params.seed + i),
            SpecParams(SpecMode.DRAFT, max_k=3, adaptive=False),
        )
        for i in range(n)
    ]
    return target, _pair(target, draft), reqs


def test_fast_mode_rows_beside_prompt_chunks_decode_plainly(gpu_models):
    """Fast mode under graphs: a step that takes prompt chunks decodes its other rows plainly, so no
    graph of a verification width beside chunks is captured mid-stream (Engine._plain_beside_prompts);
    speculation resumes once the prompts are in, and outputs equal each request's alone."""
    from tests.decoding.test_batch import run_batch

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    target, engine, reqs = _fast_pair_requests(gpu_models, params, 6)
    expected = {r.request_id: engine.generate(r)[0] for r in reqs}
    assert run_batch(engine, reqs, join_at=[0, 2, 3, 5, 8, 9], budget=16) == expected
    keys = set(target.graphs)  # (batch, width, attended length, slot, chunk tokens)
    assert [key for key in keys if key[4] and key[0]], "no step had prompt chunks beside decode rows"
    assert [key for key in keys if key[1] > 1 and not key[4]], "no step speculated"
    assert not [key for key in keys if key[1] > 1 and key[4]], sorted(keys)


def test_fast_mode_seeded_rows_with_a_fixed_k_sample_the_same_alone_and_batched(gpu_models):
    """Rows that sample with a fixed k keep it beside prompt chunks (Engine.keeps_k): their draws
    follow their k, so a seeded request joined by others mid-stream samples as it does alone."""
    from tests.decoding.test_batch import run_batch

    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=100, ignore_eos=True)
    target, engine, reqs = _fast_pair_requests(gpu_models, params, 5)
    expected = {r.request_id: engine.generate(r)[0] for r in reqs}
    assert run_batch(engine, reqs, join_at=[0, 2, 3, 5, 8], budget=16) == expected
    assert [key for key in target.graphs if key[1] > 1 and key[4]], "no row drafted beside a chunk"


def _invariant_model(max_len: int, slots: int, compile_step: bool) -> StaticModel:
    """A bf16 model in batch-invariant exact mode, under graphs."""
    return StaticModel(
        _bf16_model(512, 4, 0),
        max_len,
        slots=slots,
        graphs=True,
        compile_step=compile_step,
        exact=True,
        batch_invariant=True,
    )


@pytest.mark.parametrize("compile_step", [False, True])
def test_exact_mode_logits_of_a_row_do_not_depend_on_the_batch(compile_step):
    """Exact mode's matmuls, RMSNorms and attention are batch-invariant: a row's logits have the same
    bits alone as in batches of 2, 5 and 16 (graph buckets 2, 8, 16: M = 18..144), in another order,
    and beside a prefill chunk that shares its matmuls."""
    static = _invariant_model(256, 17, compile_step)
    assert static.ops is invariant.OPS
    runners = [static.runner() for _ in range(16)]
    for i, r in enumerate(runners):
        r.forward(list(range(100 + 7 * i, 120 + 11 * i)), logits=False)
    slots, starts = [r.slot for r in runners], [r.length for r in runners]
    prefill = Row(static.acquire(), torch.arange(40, 80).cuda(), 0, "none")
    gen = torch.Generator().manual_seed(0)
    for T in (1, 4):  # forward_batch writes the rows' K/V without committing them: each call rewrites
        ids = torch.randint(0, 4096, (16, T), generator=gen).cuda()
        alone = [
            static.forward_batch([slots[b]], [starts[b]], ids[b : b + 1], exact=True)[0].clone()
            for b in range(16)
        ]
        for B in (2, 5, 16):
            got = static.forward_batch(slots[:B], starts[:B], ids[:B], exact=True)
            assert all(torch.equal(got[b], alone[b]) for b in range(B)), f"batch of {B}, {T} tokens a row"
        order = [9, 2, 14, 0, 5]
        got = static.forward_batch(
            [slots[b] for b in order], [starts[b] for b in order], ids[order], exact=True
        )
        assert all(torch.equal(got[i], alone[b]) for i, b in enumerate(order)), "rows in another order"
        short = [Row(slots[b], ids[b], starts[b]) for b in range(5)]
        mixed = static.forward_rows([*short, prefill], exact=True)
        assert all(torch.equal(mixed[b], alone[b]) for b in range(5)), "beside a prefill chunk"


@pytest.mark.parametrize("compile_step", [False, True])
@pytest.mark.parametrize("mode,k", [("off", 1), ("draft", 3), ("ngram", 5)])
def test_exact_mode_gives_each_request_its_output_alone_in_any_batch(compile_step, mode, k):
    """bf16, where a batch's other rows would change a row's rounding through cuBLAS: in exact mode
    each greedy request's tokens are the same alone as in batches of 2, 5 and 16, whoever joins.
    Compiled, the graphs are captured ahead as a server's load does, so its steps run at the widths
    ExactWidths.prove showed (the invariant kernels' rows do not depend on M: every width)."""
    from tests.decoding.test_batch import run_batch

    target = _invariant_model(512, 16, compile_step)
    if compile_step:
        target.capture_serving(16)
        X = target.max_graph_tokens  # every width, but N = 1's own compile (ExactWidths.own_compile)
        assert all(ws == tuple(range(1 + (B == 1), X + 1)) for B, ws in target.widths.proven.items())
    # the target's own weights as its draft (acceptance is high; rejections fall where bf16 rounds)
    draft = StaticModel(_bf16_model(512, 4, 0), 512, slots=16, graphs=True, compile_step=compile_step)
    engine = _pair(target, draft)
    reqs = [
        GenerationRequest(
            f"x{i}",
            "t",
            list(range(200 + 13 * i, 230 + 17 * i)),
            SamplingParams(max_tokens=16 + 2 * i, temperature=0, ignore_eos=True),
            SpecParams(SpecMode(mode), max_k=k, adaptive=False),
        )
        for i in range(16)
    ]
    expected = {r.request_id: engine.generate(r)[0] for r in reqs}
    for n in (2, 5, 16):
        assert run_batch(engine, reqs[:n]) == {r.request_id: expected[r.request_id] for r in reqs[:n]}, n
    # joining while others decode: their prompts prefill in the same steps (whole prompts: a chunk's
    # attention is SDPA's, batch-invariant only at one chunking)
    assert run_batch(engine, reqs, join_at=[0, 0, 1, 2, 2, 3, 5, 5, 6, 8, 9, 9, 10, 12, 13, 15]) == expected


@pytest.mark.parametrize("compile_step", [False, True])
def test_exact_mode_output_does_not_depend_on_prompt_chunking(compile_step):
    """Prompt chunks attend with the fused chunk kernel (keys in fixed blocks from position 0) and
    share the invariant matmuls: a prompt cut into 16-token chunks beside other rows gives each greedy
    request the tokens it gets with its prompt whole and alone."""
    from decoding.engine import LoadedModel
    from tests.decoding.test_batch import run_batch

    target = _invariant_model(512, 8, compile_step)
    engine = Engine(
        {"t": LoadedModel("t", target.model, None, max_context=512, runner_factory=target.runner)}
    )
    reqs = [
        GenerationRequest(
            f"c{i}",
            "t",
            list(range(300 + 13 * i, 340 + 29 * i)),
            SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
            SpecParams(SpecMode.OFF),
        )
        for i in range(8)
    ]
    expected = {r.request_id: engine.generate(r)[0] for r in reqs}
    assert run_batch(engine, reqs, join_at=[0, 0, 1, 2, 3, 5, 5, 8], budget=16) == expected


def test_max_active_on_a_gpu_is_sized_from_its_free_memory():
    from decoding.sizing import MAX_ACTIVE_GPU, default_max_active, footprint, max_active_for

    tiny = ModelSpec("t", "tiny-random", dtype="float32", device="cuda")
    assert default_max_active([tiny]) == MAX_ACTIVE_GPU  # a tiny model's slots fit many times over
    # a context whose slots fill the device: what fits in the memory free now
    huge = ModelSpec("t", "tiny-random", dtype="float32", device="cuda", max_context=4_000_000)
    n = default_max_active([huge])
    free, total = torch.cuda.mem_get_info()
    assert n == max_active_for(free, total, [footprint(huge, torch.device("cuda"))])
    assert 1 <= n < MAX_ACTIVE_GPU


@pytest.mark.parametrize("exact", [False, True])
def test_a_server_load_captures_every_graph_its_batches_use(exact):
    """ModelSpec.max_batch: the graphs of every step shape up to that many rows are captured at
    load, so a batch of requests joining, prefilling in chunks, speculating and leaving captures
    none mid-stream."""
    from tests.decoding.test_batch import run_batch

    common = dict(dtype="float32", device="cuda", backend="cuda_graphs", max_context=512, slots=8)
    models = load_all(
        [
            ModelSpec("t", "tiny-random", draft="d", exact=exact, max_batch=4, **common),
            ModelSpec("d", "tiny-random-draft", exact=False, max_batch=4, **common),
        ]
    )
    statics = [models[n].runner_factory.__self__ for n in ("t", "d")]  # type: ignore[attr-defined]
    captured = [set(s.graphs) for s in statics]
    assert all(captured)
    engine = Engine(models)
    reqs = [
        _greedy(
            f"c{i}",
            "t",
            range(30 + i, 70 + 41 * i),
            24,
            SpecParams(SpecMode.DRAFT if i % 2 else SpecMode.OFF, max_k=2 + i, adaptive=i == 3),
        )
        for i in range(4)
    ]
    run_batch(engine, reqs, join_at=[0, 1, 3, 6], budget=64)
    for s, before in zip(statics, captured, strict=True):
        assert set(s.graphs) == before, sorted(set(s.graphs) - before)


@pytest.mark.parametrize("exact", [False, True])
def test_timing_the_captured_steps_leaves_every_live_slot_as_it_was(gpu_models, exact):
    """StaticModel.time_steps (the engine's start-up cost table) replays every captured graph of short
    rows and of prompt chunks alone, on the scratch slot: a graph whose buffers still hold a served row's slot and start does
    not write to it, so a running sequence's next logits are unchanged. Every (batch, width) a step
    can take gets a positive time; in exact mode every width costs what the width it runs at does."""
    sm = StaticModel(gpu_models["tiny"].model, 256, slots=2, graphs=True, exact=exact)
    sm.capture(range(1, 4), (1, 2), chunk_tokens=(32,))
    r = sm.runner()
    r.forward(list(range(10, 40)), logits=False)
    base = r.length
    r.forward([7, 8])  # a graph of width 2 now holds this row's slot and start, and tokens 7, 8
    r.crop(base)
    r.forward([3])
    r.forward([4])  # the cache at base, base + 1 now holds 3, 4 (7, 8 replayed there would change it)
    before = r.forward([5])
    r.crop(base + 2)
    table = sm.time_steps()
    widths = range(1, sm.max_graph_tokens + 1) if exact else range(1, 4)
    chunks = {(0, 32)} if sm.fused_attention else set()  # prompt chunks alone run as graphs with it
    assert set(table) == {(B, W) for B in (1, 2) for W in widths} | chunks
    assert all(t > 0 for t in table.values())
    if exact:
        assert all(table[B, W] == table[B, sm.widths.width(B, W)] for B in (1, 2) for W in widths)
    assert torch.equal(r.forward([5]), before)
