"""The llama.cpp runner on the pinned GGUFs as they ship (slow: the real pair): multi-token steps,
cut-backs and batching compute exactly what one-token steps of one sequence do, so greedy
speculation is token-identical to target-only decoding on the same runner."""

from __future__ import annotations

import logging

import pytest
import torch

from decoding import loader, store
from decoding.engine import Engine
from decoding.errors import ModelLoadError
from decoding.loader import ModelSpec
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams

PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
NO_LLAMACPP = "llama-cpp-python is not installed (the llamacpp extra: pip install 'specgate[llamacpp]')"

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMACPP = True
except ImportError:
    HAVE_LLAMACPP = False

needs_llamacpp = pytest.mark.skipif(not HAVE_LLAMACPP, reason=NO_LLAMACPP)
real = [pytest.mark.slow, needs_llamacpp]


def _need_pair() -> None:
    for alias in PAIR:
        if not store.is_cached(alias) or not store.gguf_available(alias):
            pytest.skip(f"{alias} not pulled with its GGUF (run `specgate models pull`)")


@pytest.fixture(scope="module")
def pair():
    _need_pair()
    return loader.load_all(
        [
            ModelSpec("target", PAIR[0], draft="draft", backend="llamacpp", slots=4, max_context=2048),
            ModelSpec("draft", PAIR[1], backend="llamacpp", slots=4, max_context=2048),
        ],
        pull=False,
    )


def _chat(tok, turns: list[str]) -> list[int]:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


PROMPTS = {
    "code": ["Write a Python function that merges two sorted lists into one sorted list."],
    "edit": [
        "Rename the variable total to acc everywhere and return the code only:\n"
        "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
    ],
    "prose": ["Explain in three sentences why the sky is blue."],
    "cjk": ["用两句话解释什么是哈希表。"],
    "multi-turn": [
        "What is a Python list comprehension?",
        "A compact way to build a list: [x * x for x in range(5)].",
        "Now show the same with a condition that keeps only even numbers.",
    ],
}


def _request(ids: list[int], mode: str, k: int = 4) -> GenerationRequest:
    # a fixed k: the controller may rightly turn speculation off, which would test nothing
    return GenerationRequest(
        f"r-{mode}",
        "target",
        ids,
        SamplingParams(max_tokens=40, temperature=0),
        SpecParams(SpecMode(mode), max_k=k, adaptive=False),
    )


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.slow
@needs_llamacpp
def test_greedy_speculation_is_token_identical_to_target_only(pair, kind):
    engine = Engine(pair)
    ids = _chat(pair["target"].tokenizer, PROMPTS[kind])
    plain, _, _ = engine.generate(_request(ids, "off"))
    draft, stats, _ = engine.generate(_request(ids, "draft"))
    ngram, _, _ = engine.generate(_request(ids, "ngram"))
    assert len(plain) > 5
    assert draft == plain
    assert ngram == plain
    assert stats.spec_steps > 0 and stats.accepted > 0  # verification of several tokens did happen


@pytest.mark.parametrize("repack", [True, False], ids=["repacked", "not-repacked"])
@pytest.mark.parametrize("context", ["short", "past 512 positions"])
@pytest.mark.slow
@needs_llamacpp
def test_verification_rows_equal_one_token_steps_bit_for_bit(pair, context, repack):
    """The property speculation's losslessness rests on (docs/architecture.md, "The llama.cpp
    backend"): every row of an exact step (up to ``max_step_tokens``) has exactly the logits of
    one-token steps, also where a one-token step over an f16 cache would take another path."""
    from decoding.llamacpp import LlamaCppModel

    m = pair["target"]
    llama = m.model.llama if repack else LlamaCppModel(store.gguf_file(PAIR[0]), 2048, 2, repack=False)
    code = "".join(
        f"def f{i}(x):\n    return x * {i} + 1\n\n" for i in range(30 if context != "short" else 3)
    )
    ids = _chat(m.tokenizer, ["Summarise this code:\n" + code])  # ~540 tokens past 512
    assert (len(ids) > 512) == (context != "short")
    # one prompt prefill: the one-token steps, then the same cache cut back for each wider step (the
    # cut itself is what speculation relies on after a rejection)
    runner = llama.runner()
    try:
        runner.forward(ids[:-1], logits=False)
        steps = [ids[-1], *(785 + 7 * j for j in range(15))][: runner.max_step_tokens]  # logits, not text
        singles = torch.cat([runner.forward([t]) for t in steps])  # [max_step_tokens, V]
        for width in range(2, len(steps) + 1):
            runner.crop(len(ids) - 1)
            rows = runner.forward(steps[:width])  # [width, V]
            assert torch.equal(rows, singles[:width]), (
                f"width {width}: max diff {(rows - singles[:width]).abs().max()}"
            )
    finally:
        runner.release()
        if not repack:
            llama.close()


@pytest.mark.slow
@needs_llamacpp
def test_crop_forgets_the_cut_positions(pair):
    m = pair["draft"]
    ids = _chat(m.tokenizer, PROMPTS["prose"])
    fresh, cut = m.runner_factory(m.model), m.runner_factory(m.model)
    try:
        fresh.forward(ids[:-1], logits=False)
        cut.forward(ids[:-1], logits=False)
        rejected = cut.forward([ids[-1], 11, 12, 13])  # a draft verification, then a rejection
        cut.crop(len(ids))  # keeps ids[-1]: position len(ids) - 1
        assert cut.length == len(ids)
        expected = fresh.forward([ids[-1], 99, 100])
        again = cut.forward([99, 100])
        assert torch.equal(again, expected[1:])  # the stale 11, 12, 13 are not attended
        assert torch.equal(rejected[0], expected[0])
        cut.crop(0)
        cut.forward(ids[:-1], logits=False)  # a cache cut to nothing refills like a fresh one
        assert torch.equal(cut.forward([ids[-1]]), expected[:1])
    finally:
        fresh.release()
        cut.release()


@pytest.mark.slow
@needs_llamacpp
def test_two_sequences_batched_compute_what_each_computes_alone(pair):
    m = pair["target"]
    llama = m.model.llama  # type: ignore[attr-defined]
    a_ids = _chat(m.tokenizer, PROMPTS["code"])
    b_ids = _chat(m.tokenizer, PROMPTS["cjk"])
    alone = []
    for ids, tail in ((a_ids, [1, 2, 3]), (b_ids, [5])):
        r = m.runner_factory(m.model)
        r.forward(ids, logits=False)
        alone.append(r.forward(tail))
        r.release()
    ra, rb = m.runner_factory(m.model), m.runner_factory(m.model)
    try:
        # prefill rows of different lengths in one pass, then a verification row beside a decode row
        llama.forward_rows([ra.row(a_ids, "none"), rb.row(b_ids, "none")], exact=True)
        ids = torch.zeros(2, 3, dtype=torch.long)
        ids[0], ids[1, 0] = torch.tensor([1, 2, 3]), 5
        starts = [ra.advance(3), rb.advance(1)]
        out = llama.forward_batch([ra.slot, rb.slot], starts, ids, exact=True)  # [2, 3, V]
        assert torch.equal(out[0], alone[0])
        assert torch.equal(out[1, :1], alone[1])
    finally:
        ra.release()
        rb.release()


@pytest.mark.slow
@needs_llamacpp
def test_batched_engine_steps_match_each_request_alone(pair):
    engine = Engine(pair)
    tok = pair["target"].tokenizer
    reqs = [_request(_chat(tok, PROMPTS["edit"]), "draft"), _request(_chat(tok, PROMPTS["prose"]), "ngram")]
    alone = [engine.generate(r)[0] for r in reqs]
    seqs = [engine.start(r) for r in reqs]
    got: list[list[int]] = [[], []]
    try:
        while any(s.finished is None for s in seqs):
            live = [s for s in seqs if s.finished is None]
            for s, out in zip(live, engine.step_batch(live), strict=True):
                if out is not None:
                    got[seqs.index(s)].extend(out.token_ids)
    finally:
        for s in seqs:
            s.release()
    assert got == alone


@pytest.mark.slow
@needs_llamacpp
def test_a_prompt_prefilled_beside_another_fills_the_cache_it_fills_alone(pair):
    """A prompt is cut into the same chunks alone and under load (``Engine.chunk_tokens``): llama.cpp's
    prefill rows round by the chunk's width, and a long prompt that took what a short one left of a
    step's budget filled its cache with other bits, so greedy output differed from the same request
    alone (a burst of chat requests on the real gateway). Logprobs show any bit of difference."""
    engine = Engine(pair)
    engine.chunk_tokens = 64  # as AsyncEngine sets it: its prefill budget
    tok = pair["target"].tokenizer
    long_ids = _chat(tok, [PROMPTS["edit"][0] + PROMPTS["code"][0]])
    short_ids = _chat(tok, PROMPTS["prose"])
    assert len(long_ids) > 64 > len(short_ids)  # the short one takes part of the long one's chunk

    def request(rid: str, ids: list[int]) -> GenerationRequest:
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
        return GenerationRequest(rid, "target", ids, params, SpecParams(SpecMode.OFF))

    def run(reqs: list[GenerationRequest]) -> dict[str, list[object]]:
        seqs = [engine.start(r) for r in reqs]
        got: dict[str, list[object]] = {r.request_id: [] for r in reqs}
        try:
            while any(s.finished is None for s in seqs):
                live = [s for s in seqs if s.finished is None]
                for out in engine.step_batch(live, 64):
                    if out is not None:
                        got[out.request_id] += out.logprobs or []
        finally:
            for s in seqs:
                s.release()
        return got

    alone = run([request("long", long_ids)])["long"]
    beside = run([request("long", long_ids), request("short", short_ids)])["long"]
    assert len(alone) == 6
    assert beside == alone


@needs_llamacpp
@pytest.mark.parametrize("exact", [None, False])
@pytest.mark.slow
@needs_llamacpp
def test_exact_mode_is_the_default_and_off_takes_llamacpps_own_cache(exact):
    """Unset, a llama.cpp target runs exact (q8_0 cache, steps capped); ``exact: false`` takes
    llama.cpp's f16 cache (faster long prefill) and uncapped, freely batched target rows."""
    _need_pair()
    m = loader.load_llamacpp(
        ModelSpec("t", PAIR[0], backend="llamacpp", slots=1, max_context=256, exact=exact), pull=False
    )
    runner = m.runner_factory(m.model)
    try:
        on = exact is None
        assert runner.exact is on and runner.m.kv_type == ("q8_0" if on else "f16")
        assert (runner.max_step_tokens is not None) is on
        ids = _chat(m.tokenizer, ["Say hi."])
        assert runner.forward(torch.tensor(ids)) is not None  # a prompt decodes on either cache
    finally:
        runner.release()
        runner.m.close()


def test_llamacpp_backend_needs_a_gguf_and_a_cpu():
    with pytest.raises(ModelLoadError, match="GGUF"):
        loader.load(ModelSpec("x", "tiny-random", backend="llamacpp"))
    with pytest.raises(ModelLoadError, match="CPU"):
        loader.load(ModelSpec("x", PAIR[0], backend="llamacpp", device="cuda"))


def test_auto_picks_llamacpp_for_a_gguf_at_the_default_dtype(monkeypatch):
    monkeypatch.setattr(loader, "_llamacpp_installed", lambda: True)
    cpu = torch.device("cpu")
    assert loader.use_llamacpp(ModelSpec("x", PAIR[0]), cpu)
    assert loader.use_llamacpp(ModelSpec("x", "/models/any.gguf"), cpu)
    assert not loader.use_llamacpp(ModelSpec("x", PAIR[0], dtype="float32"), cpu)  # torch numerics asked for
    assert not loader.use_llamacpp(ModelSpec("x", PAIR[0], backend="static"), cpu)
    assert not loader.use_llamacpp(ModelSpec("x", "tiny-random"), cpu)
    assert not loader.use_llamacpp(ModelSpec("x", PAIR[0]), torch.device("cuda"))


def test_a_missing_extra_is_named_once_and_auto_falls_back(monkeypatch, caplog):
    from decoding import llamacpp

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    loader._llamacpp_installed.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="specgate.loader"):
            for _ in range(3):
                assert not loader.use_llamacpp(ModelSpec("x", PAIR[0]), torch.device("cpu"))
        lines = [r.getMessage() for r in caplog.records if "specgate[llamacpp]" in r.getMessage()]
        assert len(lines) == 1
    finally:
        loader._llamacpp_installed.cache_clear()


@pytest.mark.slow
@needs_llamacpp
def test_torch_keeps_one_thread_where_llamacpp_runs_every_cpu_model(pair):
    import torch

    assert torch.get_num_threads() == 1  # its OpenMP threads would spin on llama.cpp's cores


@pytest.mark.slow
@needs_llamacpp
def test_an_amx_build_whose_kernels_crash_loads_without_them(monkeypatch):
    """Where the child process finds llama.cpp's AMX kernels crash (GCC 12 without -fno-dse), the model
    loads without the extra buffers and exact mode keeps the unrepacked step cap; a build whose kernels
    run keeps them, with the AMX cap (every row of up to 16 equals its one-token step)."""
    from decoding import llamacpp

    _need_pair()
    monkeypatch.setattr(llamacpp, "amx_build", lambda lib: True)
    monkeypatch.setattr(llamacpp, "amx_works", lambda lib, path: False)
    llama = llamacpp.LlamaCppModel(store.gguf_file(PAIR[1]), 256, 1)
    try:
        assert llama.exact_step == llamacpp.EXACT_STEP["plain"]
    finally:
        llama.close()


@needs_llamacpp
def test_the_amx_verdict_is_taken_once_per_build_of_the_library(monkeypatch, tmp_path):
    """The child runs once per build (its shared objects' names, sizes and times); its exit status is
    the verdict, kept under the store's home, and a crash (a signal) reads as 'does not work'."""
    import subprocess

    from decoding import llamacpp

    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    runs: list[list[str]] = []

    def child(args, **_):  # type: ignore[no-untyped-def]
        runs.append(args)
        return subprocess.CompletedProcess(args, -11)

    monkeypatch.setattr(llamacpp.subprocess, "run", child)
    lib = llamacpp._lib()
    assert llamacpp.amx_works(lib, tmp_path / "m.gguf") is False
    assert llamacpp.amx_works(lib, tmp_path / "m.gguf") is False
    assert len(runs) == 1 and runs[0][-2:] == ["--amx-check", str(tmp_path / "m.gguf")]
    assert list((tmp_path / "llamacpp").glob("amx-*.json"))


@needs_llamacpp
def test_an_amx_check_that_fails_without_a_crash_keeps_no_verdict(monkeypatch, tmp_path):
    """A child that exits with an error (its model did not load) or hangs says nothing of the
    kernels: no verdict (None), none kept, and the next load checks again."""
    import subprocess

    from decoding import llamacpp

    monkeypatch.setenv("SPECGATE_HOME", str(tmp_path))
    outcomes = [subprocess.TimeoutExpired(["x"], 600), 1, 0]
    runs: list[list[str]] = []

    def child(args, **_):  # type: ignore[no-untyped-def]
        runs.append(args)
        out = outcomes[len(runs) - 1]
        if isinstance(out, BaseException):
            raise out
        return subprocess.CompletedProcess(args, out, stdout=b"", stderr=b"ValueError: no model")

    monkeypatch.setattr(llamacpp.subprocess, "run", child)
    lib = llamacpp._lib()
    assert llamacpp.amx_works(lib, tmp_path / "m.gguf") is None
    assert llamacpp.amx_works(lib, tmp_path / "m.gguf") is None
    assert not list((tmp_path / "llamacpp").glob("amx-*.json"))
    assert llamacpp.amx_works(lib, tmp_path / "m.gguf") is True
    assert llamacpp.amx_works(lib, tmp_path / "m.gguf") is True
    assert len(runs) == 3


@pytest.mark.slow
@needs_llamacpp
def test_a_conversations_next_turn_reuses_its_prefix_and_gives_what_it_gives_cold(pair):
    """Prefix caching on the real pair (decoding/prefix.py): the next turn of a conversation, and a
    second conversation sharing its system prompt, reuse whole 64-token chunks of what the slots
    kept and give, to the bit (logprobs), what they give with every slot's KV dropped first."""
    engine = Engine(pair)
    engine.chunk_tokens = 64  # as AsyncEngine sets it: its prefill budget
    tok = pair["target"].tokenizer
    system = "You are a careful reviewer. " + PROMPTS["edit"][0] * 3
    turn1 = _chat(tok, [system + PROMPTS["code"][0]])
    other = _chat(tok, [system + PROMPTS["prose"][0]])

    def run(ids: list[int], mode: str, cold: bool) -> tuple[list[object], int]:
        if cold:
            for m in pair.values():
                for slot in range(m.model.llama.slots):
                    m.model.llama.cut(slot, 0)
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
        seq = engine.start(
            GenerationRequest(f"r-{mode}", "target", ids, params, SpecParams(SpecMode(mode), 3, False))
        )
        got: list[object] = []
        try:
            while seq.finished is None:
                for out in engine.step_batch([seq], 64):
                    got += (out.logprobs or []) if out is not None else []
        finally:
            seq.release()
        return got, seq.stats.cached_tokens

    for mode in ("off", "draft"):
        first, _ = run(turn1, mode, cold=True)
        answer = tok.decode([x.token_id for x in first])  # type: ignore[attr-defined]
        turn2 = _chat(tok, [system + PROMPTS["code"][0], answer, "Now add type hints."])
        warm, cached = run(turn2, mode, cold=False)
        assert cached >= 64 and cached % 64 == 0
        assert warm == run(turn2, mode, cold=True)[0]
        shared, cached = run(other, mode, cold=False)
        assert cached >= 64
        assert shared == run(other, mode, cold=True)[0]
