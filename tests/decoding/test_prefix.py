"""Prefix caching across requests on the llama.cpp backend (decoding/prefix.py): which slot a prompt
takes, and, on tiny GGUFs, that a request reusing a cached prefix gives exactly what the same request
gives cold (tokens and logprobs to the bit), speculation on and off, greedy and seeded sampling, and
under random joins and aborts while slots are reused."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from decoding.engine import Engine
from decoding.errors import NoFreeSlot
from decoding.params import GenerationRequest, SamplingParams, SpecMode, SpecParams
from decoding.prefix import SlotCache
from decoding.sequence import LoadedModel

# ---- the slot choice, alone --------------------------------------------------------------------


def _filled(cache: SlotCache, tokens: list[int], unit: int = 4) -> int:
    """A cold request for ``tokens`` as it leaves its slot: its prompt prefilled alone in
    pieces of ``unit`` (the last one partial), the slot given back; which slot it was."""
    take = cache.take([], unit)  # keeping nothing: the least recently used slot, as a cold request's
    for at in range(0, len(tokens), unit):
        cache.wrote(take.slot, at, tokens[at : at + unit], alone=True)
    cache.give_back(take.slot)
    return take.slot


def test_a_prompt_takes_the_free_slot_sharing_its_longest_whole_pieces():
    cache = SlotCache(3, min_copy=1000)
    s10 = _filled(cache, list(range(10)))
    s7 = _filled(cache, [*list(range(7)), 99, 98])
    assert s7 != s10 and cache.held[s7].exact == cache.held[s10].exact == 8  # the partial piece is not
    take = cache.take(list(range(12)), 4)
    assert take == (s10, 8, None)  # s7 shares 7 tokens, 4 of them in whole pieces; s10 shares 8
    assert cache.held[s10].tokens == list(range(8))


def test_the_prompts_last_token_is_left_to_its_first_step():
    for strict, tokens, reuse in ((True, 8, 4), (False, 8, 7), (False, 9, 8)):
        cache = SlotCache(1)
        _filled(cache, list(range(8)))
        # at most all but the last prompt token; strict: in whole pieces (of 4)
        assert cache.take(list(range(tokens)), 4, strict=strict).reuse == reuse


def test_loose_reuse_takes_every_shared_token_and_other_grids_none():
    cache = SlotCache(1)
    _filled(cache, list(range(10)))
    assert cache.take([*list(range(7)), 50, 51], 4, strict=False).reuse == 7
    cache.give_back(0)
    assert cache.take(list(range(12)), 8).reuse == 0  # its pieces were of 4, not 8


def test_a_slot_taken_without_a_prompt_keeps_its_record_until_the_prompt_chooses():
    cache = SlotCache(2)
    a = _filled(cache, list(range(12)))
    _filled(cache, [50] * 12)
    assert cache.take().slot == a  # the least recently used, reserved as it is
    assert cache.take(list(range(14)), 4, mine=a) == (a, 12, None)  # its own conversation's, still held


def test_without_a_useful_prefix_the_least_recently_used_slot_goes():
    cache = SlotCache(3)
    first = _filled(cache, [10] * 8)
    for t in (11, 12):
        _filled(cache, [t] * 8)
    assert cache.take([7] * 9, 4) == (first, 0, None)
    assert cache.held[first].tokens == []


def test_a_running_requests_prefix_is_copied_never_its_slot_taken():
    cache = SlotCache(2, min_copy=4)
    running = cache.take(list(range(20)), 4)
    for at in range(0, 16, 4):
        cache.wrote(running.slot, at, list(range(at, at + 4)), alone=True)
    take = cache.take([*list(range(13)), 77], 4)
    assert take.slot != running.slot and take.source == running.slot and take.reuse == 12
    assert cache.held[take.slot].tokens == list(range(12)) and cache.held[take.slot].exact == 12
    with pytest.raises(NoFreeSlot):  # both owned: nothing is handed out
        cache.take(list(range(20)), 4)


def test_a_slot_holding_more_of_another_conversation_is_copied_from_not_cut():
    cache = SlotCache(2, min_copy=4)
    a = _filled(cache, list(range(24)))  # conversation A: a shared 8-token system prompt, then its own
    take = cache.take(list(range(8)) + [90] * 10, 4)  # conversation B
    assert take == (1 - a, 8, a)
    assert cache.held[a].tokens == list(range(24))  # A keeps its conversation


def test_a_salt_reuses_only_what_was_cached_under_it():
    for salt, reuse in ((None, 0), ("tenant-b", 0), ("tenant-a", 8)):
        cache = SlotCache(1)
        take = cache.take(list(range(9)), 4, salt="tenant-a")
        for at in range(0, 8, 4):
            cache.wrote(take.slot, at, list(range(at, at + 4)), alone=True)
        cache.give_back(take.slot)
        assert cache.take(list(range(9)), 4, salt=salt).reuse == reuse


def test_pieces_batched_with_another_sequence_or_off_the_grid_are_not_exact():
    cache = SlotCache(1)
    take = cache.take(list(range(20)), 4)
    cache.wrote(take.slot, 0, [0, 1, 2, 3], alone=True)
    cache.wrote(take.slot, 4, [4, 5, 6, 7], alone=False)  # beside another sequence's row
    cache.wrote(take.slot, 8, [8, 9, 10, 11], alone=True)  # after a gap in the exact prefix
    assert cache.held[0].exact == 4
    cache.cut(0, 2)
    assert cache.held[0].exact == 2 and cache.held[0].tokens == [0, 1]


# ---- tiny GGUFs: warm output is cold output, to the bit -------------------------------------------

try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMACPP = True
except ImportError:
    HAVE_LLAMACPP = False

needs_llamacpp = pytest.mark.skipif(
    not HAVE_LLAMACPP,
    reason="llama-cpp-python is not installed (the llamacpp extra: pip install 'specgate[llamacpp]')",
)
# the engine's prompt chunks (AsyncEngine sets its prefill budget; 64 on a CPU), the draft's pieces
# too: on the tiny model a position's KV rounds by its chunk's width from about this wide
GRID = 64


@pytest.fixture(scope="module")
def ggufs(tiny_models, tmp_path_factory):
    if not HAVE_LLAMACPP:
        pytest.skip("llama-cpp-python is not installed")
    from tests.decoding.tiny_gguf import write_gguf

    where = tmp_path_factory.mktemp("gguf")
    return {n: write_gguf(tiny_models[n], where / f"{n}.gguf") for n in ("tiny", "tiny-draft")}


def _engine(tiny_models, ggufs, prefix_cache: bool, slots: int = 3) -> Engine:
    """The tiny target and its tiny draft on llama.cpp, exact mode, flash attention on (with it a
    position's KV rounds by the chunk it was computed in, on the tiny model too): weights as they
    ship and an f32 cache, as tests/decoding/test_prompt_logprobs.py says why. The draft decodes
    its catch-ups in pieces of GRID tokens (``n_batch``), so seeded sampling reuses its KV too."""
    from decoding.llamacpp import GGUFInfo, LlamaCppModel

    models = {}
    for name, draft, n_batch in (("tiny", "tiny-draft", 512), ("tiny-draft", None, GRID)):
        llama = LlamaCppModel(
            ggufs[name], 512, slots, repack=False, kv_type="f32", n_batch=n_batch, prefix_cache=prefix_cache
        )
        t = tiny_models[name]
        info = GGUFInfo(llama, t.model.config)
        m = LoadedModel(name, info, t.tokenizer, draft, max_context=512, eos_token_ids=t.eos_token_ids)  # type: ignore[arg-type]
        m.runner_factory, m.draft_runner_factory = llama.runner, llama.draft_runner  # type: ignore[assignment]
        models[name] = m
    engine = Engine(models)
    engine.chunk_tokens = GRID  # as AsyncEngine sets it
    return engine


def _request(rid: str, ids: list[int], mode: str, seed: int | None = None, n: int = 10) -> GenerationRequest:
    temperature = 0.0 if seed is None else 0.9
    params = SamplingParams(max_tokens=n, temperature=temperature, seed=seed, logprobs=2, ignore_eos=True)
    # a fixed k: the controller would rightly keep speculation off on a random model
    return GenerationRequest(rid, "tiny", ids, params, SpecParams(SpecMode(mode), max_k=3, adaptive=False))


Result = list[tuple[int, float]]


def _run(engine: Engine, reqs: list[GenerationRequest]) -> tuple[dict[str, Result], dict[str, int]]:
    """Each request's (token, logprob)s and cached prompt tokens, run together in GRID-token steps."""
    seqs = [engine.start(r) for r in reqs]
    got: dict[str, Result] = {r.request_id: [] for r in reqs}
    try:
        while any(s.finished is None for s in seqs):
            live = [s for s in seqs if s.finished is None]
            for out in engine.step_batch(live, GRID):
                if out is not None:
                    got[out.request_id] += [(x.token_id, x.logprob) for x in out.logprobs or []]
    finally:
        for s in seqs:
            s.release()
    return got, {s.request.request_id: s.stats.cached_tokens for s in seqs}


def _one(engine: Engine, req: GenerationRequest) -> tuple[Result, int]:
    got, cached = _run(engine, [req])
    return got[req.request_id], cached[req.request_id]


@needs_llamacpp
@pytest.mark.parametrize(
    ("mode", "seed"), [("off", None), ("draft", None), ("ngram", None), ("off", 7), ("draft", 7)]
)
def test_a_prompt_reusing_a_cached_prefix_gives_what_it_gives_cold(tiny_models, ggufs, mode, seed):
    """Random conversations: a prompt, then one that shares a random prefix of it or of it and its
    output (the next turn), on an engine that keeps slots' KV and on one that does not."""
    warm, cold = _engine(tiny_models, ggufs, True), _engine(tiny_models, ggufs, False)
    rng = random.Random(f"{mode}-{seed}")
    reused = 0
    for trial in range(12):
        first = [rng.randrange(3, 250) for _ in range(rng.randrange(20, 260))]
        out, _ = _one(warm, _request(f"a{trial}", first, mode, seed))
        held = first + [t for t, _ in out]
        at = rng.randrange(0, len(held) + 1)
        second = held[:at] + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 100))]
        req = _request(f"b{trial}", second, mode, seed)
        got, cached = _one(warm, req)
        assert got == _one(cold, req)[0], f"trial {trial}: {cached} cached of {len(second)}"
        assert cached % GRID == 0 and cached <= min(at, len(first) - 1)
        reused += cached
    assert reused > 0


@needs_llamacpp
def test_a_shared_prefix_is_copied_to_a_second_conversation_and_gives_what_it_gives_cold(tiny_models, ggufs):
    warm, cold = _engine(tiny_models, ggufs, True), _engine(tiny_models, ggufs, False)
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(150)]
    a = system + [rng.randrange(3, 250) for _ in range(100)]
    b = system + [rng.randrange(3, 250) for _ in range(30)]
    _one(warm, _request("a", a, "draft"))
    got, cached = _one(warm, _request("b", b, "draft"))
    assert cached == 128 and got == _one(cold, _request("b", b, "draft"))[0]
    # conversation a's slot was copied from, not cut: its next turn reuses all of its whole pieces
    assert _one(warm, _request("a2", [*a, 5, 6], "draft"))[1] == 192


@needs_llamacpp
def test_reusing_a_prefix_off_the_grid_would_change_the_bits(tiny_models, ggufs):
    """Why reuse stops at whole pieces: the whole common prefix kept, where a prompt's last chunk
    was partial and a cold prefill of the next prompt computes those positions in a whole one, the
    logprobs change (so the test above could fail)."""
    rng = random.Random(5)
    loose, cold = _engine(tiny_models, ggufs, True), _engine(tiny_models, ggufs, False)

    def keep_all(seq):  # the target keeps all it shares, as a greedy request's draft does
        seq.stats.cached_tokens = seq.runner.reuse(seq.request.prompt_token_ids, False, None, GRID)

    loose._reuse_prefix = keep_all  # type: ignore[method-assign]
    differed = 0
    for trial in range(6):
        first = [rng.randrange(3, 250) for _ in range(rng.randrange(70, 250))]
        if len(first) % GRID == 1:
            continue  # prefilled in whole pieces only
        second = first + [rng.randrange(3, 250) for _ in range(GRID)]
        _one(loose, _request(f"a{trial}", first, "off"))
        got, cached = _one(loose, _request(f"b{trial}", second, "off"))
        assert cached == len(first)  # the first's prompt and its first output token's position
        differed += got != _one(cold, _request(f"b{trial}", second, "off"))[0]
    assert differed


@needs_llamacpp
def test_random_joins_and_aborts_while_slots_are_reused_keep_every_output_cold(tiny_models, ggufs):
    """Requests from a few conversations join a running batch at random steps and some are aborted
    at random (mid-prefill or mid-decode), so slots are taken, copied from while running and reused;
    every request that finishes gives the tokens it gives alone on an engine that caches nothing,
    and without speculation the same logprobs too (a speculative row's logprobs under load come
    from verification rows of other widths, which on the tiny model round otherwise, cache or not)."""
    warm, cold = _engine(tiny_models, ggufs, True, slots=4), _engine(tiny_models, ggufs, False, slots=4)
    rng = random.Random(11)
    system = [rng.randrange(3, 250) for _ in range(100)]
    convs = [system + [rng.randrange(3, 250) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    modes = ["off", "draft", "ngram"]
    finished: dict[str, tuple[GenerationRequest, Result]] = {}
    running: list = []
    got: dict[str, Result] = {}
    n_started = aborted = cached = 0
    for _ in range(160):
        if len(running) < 3 and rng.random() < 0.3:
            c = rng.randrange(len(convs))
            req = _request(f"r{n_started}", list(convs[c]), rng.choice(modes), n=rng.randrange(3, 12))
            seq = warm.start(req)
            cached += seq.stats.cached_tokens
            running.append((seq, c))
            got[req.request_id] = []
            n_started += 1
        if running and rng.random() < 0.05:
            seq, _ = running.pop(rng.randrange(len(running)))
            seq.release()
            aborted += 1
        if not running:
            continue
        outs = warm.step_batch([s for s, _ in running], GRID)
        still = []
        for (seq, c), out in zip(running, outs, strict=True):
            if out is not None:
                got[out.request_id] += [(x.token_id, x.logprob) for x in out.logprobs or []]
            if seq.finished is None:
                still.append((seq, c))
                continue
            seq.release()
            finished[seq.request.request_id] = (seq.request, got[seq.request.request_id])
            convs[c] = convs[c] + [t for t, _ in got[seq.request.request_id]] + [rng.randrange(3, 250)]
            if len(convs[c]) > 400:  # a new conversation, within the 512-token context
                convs[c] = [*system, rng.randrange(3, 250)]
        running = still
    for seq, _ in running:
        seq.release()
    assert len(finished) >= 8 and aborted >= 1 and cached > 0
    for req, result in finished.values():
        alone = _one(cold, req)[0]
        if req.spec.mode != SpecMode.OFF:
            result, alone = [t for t, _ in result], [t for t, _ in alone]
        assert result == alone, req.request_id


@needs_llamacpp
def test_salted_and_scored_prompts_reuse_only_what_their_salt_left(tiny_models, ggufs):
    """A salted request's slot is labelled with its salt, a scored one's (prompt_logprobs) too, though
    it keeps nothing: an unsalted request, or one of another salt, reuses none of it."""
    engine = _engine(tiny_models, ggufs, True, slots=1)
    ids = list(range(3, 203))

    def cached(salt: str | None, scored: bool = False) -> int:
        req = _request("r", ids, "off", n=2)
        params = replace(req.params, prompt_logprobs=1 if scored else None)
        return _one(engine, replace(req, params=params, cache_salt=salt))[1]

    assert cached("a") == 0
    assert cached("a") == 192
    assert (cached(None), cached("b")) == (0, 0)
    assert cached("b") == 192
    assert cached("a", scored=True) == 0  # scored: computes every position, and the slot is now a's
    assert (cached("b"), cached("b")) == (0, 192)
