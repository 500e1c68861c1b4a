"""Grammars a client can make arbitrarily costly: compiled once per request, off the event loop, on a
deep stack, within limits; grammars no output satisfies are refused (issue 48)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from decoding import admission
from decoding.async_engine import AsyncEngine
from decoding.engine import Engine
from decoding.errors import InvalidParameter
from decoding.grammar import GrammarCompiler, GrammarLimits, json_depth, ll_tokenizer, matcher
from decoding.params import FinishReason, GenerationRequest, GrammarSpec, SamplingParams, SpecMode, SpecParams
from decoding.tiny import byte_tokenizer


def defs_chain(n: int) -> str:
    """The issue's schema: ``$defs`` each referring to the next, n deep."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)
    }
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "b"\n'


def compile_on(compiler: GrammarCompiler, spec: GrammarSpec) -> Any:
    tok = byte_tokenizer()
    build = lambda s: matcher(s, ll_tokenizer(tok, 259, (tok.eos_token_id,)), tok)  # noqa: E731
    return compiler.wait(spec, compiler.compile("tiny", spec, build))


@pytest.mark.parametrize(
    "spec",
    [GrammarSpec("json_schema", defs_chain(1000)), GrammarSpec("lark", lark_chain(4000), "guided_grammar")],
    ids=["defs-1000", "lark-4000"],
)
def test_grammars_that_overflowed_the_stack_compile_on_the_compile_thread(spec: GrammarSpec) -> None:
    """Both killed the process with a segfault when compiled on an 8 MB stack (the event loop's).
    Run in a child process, so that a regression fails this test rather than the test run."""
    code = (
        "import sys, json\n"
        "from decoding.grammar import GrammarCompiler\n"
        "from decoding.params import GrammarSpec\n"
        "from tests.decoding.test_grammar_limits import compile_on\n"
        "spec = GrammarSpec(**json.loads(sys.stdin.read()))\n"
        "compiled = compile_on(GrammarCompiler(), spec)\n"
        "print('compiled', compiled.matcher().is_error())\n"
    )
    payload = json.dumps({"kind": spec.kind, "text": spec.text, "param": spec.param})
    done = subprocess.run(
        [sys.executable, "-c", code], input=payload, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "compiled False"


def test_the_compile_runs_on_a_thread_of_its_own_and_survives_faults() -> None:
    compiler = GrammarCompiler()
    seen: list[str] = []

    def build(spec: GrammarSpec) -> Any:
        seen.append(threading.current_thread().name)
        if spec.text == "boom":
            raise RuntimeError("a fault in the native library's wrapper")
        return object()

    with pytest.raises(RuntimeError):
        compiler.wait(GrammarSpec("lark", "boom"), compiler.compile("m", GrammarSpec("lark", "boom"), build))
    ok = GrammarSpec("lark", 'start: "a"')
    assert compiler.wait(ok, compiler.compile("m", ok, build)) is not None  # the thread lives on
    assert len(seen) == 2 and all(name.startswith("specgate-grammar-") for name in seen)


def test_identical_grammars_compile_once_and_requests_get_their_own_matcher() -> None:
    compiler = GrammarCompiler()
    calls = []
    tok = byte_tokenizer()

    def build(spec: GrammarSpec) -> Any:
        calls.append(spec)
        time.sleep(0.2)  # concurrent requests find this compile in flight
        return matcher(spec, ll_tokenizer(tok, 259, (tok.eos_token_id,)), tok)

    spec = GrammarSpec("lark", 'start: "yes" | "no"')
    futures = [compiler.compile("m", spec, build) for _ in range(8)]
    compiled = {id(compiler.wait(spec, f)) for f in futures}
    compiler.wait(spec, compiler.compile("m", spec, build))  # and later ones find the result
    assert len(calls) == 1 and len(compiled) == 1
    a, b = compiler.wait(spec, futures[0]).matcher(), compiler.wait(spec, futures[1]).matcher()
    yes, no = (tok(w, add_special_tokens=False)["input_ids"] for w in ("yes", "no"))
    assert a.consume_tokens(yes)
    assert b.validate_tokens(no) == 2  # the other copy is still at the start


def test_a_compile_past_the_timeout_is_a_400_naming_the_parameter() -> None:
    compiler = GrammarCompiler(GrammarLimits(timeout_s=0.2))
    release = threading.Event()
    spec = GrammarSpec("json_schema", "{}", "response_format")
    future = compiler.compile("m", spec, lambda s: release.wait(30) and object())
    with pytest.raises(InvalidParameter) as err:
        compiler.wait(spec, future)
    assert err.value.param == "response_format" and "grammar_timeout_s" in str(err.value)
    release.set()
    assert future.result(30) is not None  # it finished on its own, and is kept for the next request


@pytest.mark.parametrize(
    ("spec", "limits", "words"),
    [
        (
            GrammarSpec("lark", "start: " + '"a" ' * 600, "guided_grammar"),
            GrammarLimits(max_bytes=2048),
            "2048",
        ),
        (GrammarSpec("json_schema", '{"items": ' * 70 + "{}" + "}" * 70), GrammarLimits(), "nests 71"),
    ],
    ids=["size", "depth"],
)
def test_limits_refuse_before_any_work(spec: GrammarSpec, limits: GrammarLimits, words: str) -> None:
    compiler = GrammarCompiler(limits)
    with pytest.raises(InvalidParameter) as err:
        compiler.wait(spec, compiler.compile("m", spec, lambda s: pytest.fail("compiled past a limit")))
    assert err.value.param == spec.param and words in str(err.value)


def test_json_depth_reads_strings_as_text() -> None:
    assert json_depth('{"a": [1, {"b": "[[[{{{\\"]]]"}]}') == 3
    assert json_depth("[]") == 1 and json_depth('"{"') == 0


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("regex", r"[^\s\S]"),
        ("regex", r"a[^\s\S]"),
        ("regex", r"[a-z]{3}[^\s\S]"),
        ("lark", 'start: "a" /[^\\s\\S]/'),
        ("lark", 'start: "yes" x\nx: x "b"'),
    ],
)
def test_grammars_no_output_satisfies_are_refused(kind: str, text: str) -> None:
    tok = byte_tokenizer()
    with pytest.raises(InvalidParameter) as err:
        matcher(GrammarSpec(kind, text, f"guided_{kind}"), ll_tokenizer(tok, 259, (tok.eos_token_id,)), tok)
    assert err.value.param == f"guided_{kind}"


@pytest.mark.parametrize(
    ("kind", "text"),
    [("regex", r"a|[^\s\S]"), ("regex", ""), ("lark", 'start: "a" | "b" /[^\\s\\S]/'), ("regex", "(ab)*")],
)
def test_grammars_with_some_output_are_not(kind: str, text: str) -> None:
    tok = byte_tokenizer()
    assert matcher(GrammarSpec(kind, text), ll_tokenizer(tok, 259, (tok.eos_token_id,)), tok) is not None


def test_a_dead_end_met_while_generating_ends_the_request_with_the_grammars_error(tiny_models: Any) -> None:
    """An empty language the search cannot prove (many first tokens, then nothing): the end token
    llguidance allows at the dead end is no licence to stop with output the grammar refuses."""
    engine = Engine(tiny_models)
    tok = tiny_models["tiny"].tokenizer
    for mode in (SpecMode.OFF, SpecMode.DRAFT):
        request = GenerationRequest(
            "r",
            "tiny",
            tok("hi")["input_ids"],
            SamplingParams(max_tokens=6),
            SpecParams(mode),
            grammar=GrammarSpec("lark", "start: /[a-z]/ /[^\\s\\S]/", "guided_grammar"),
        )
        out, _, finish = engine.generate(request)
        assert finish == FinishReason.ERROR and len(out) <= 1  # the letter, then no end it may take


def test_prepare_compiles_off_the_event_loop_once_for_n_choices(
    tiny_models: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one request's grammar compiles, the loop runs on (other streams keep their pace), and
    its n choices share the compile."""
    threads: list[str] = []
    real = admission.matcher

    def slow(spec: GrammarSpec, *args: Any) -> Any:
        threads.append(threading.current_thread().name)
        time.sleep(1.0)
        return real(spec, *args)

    monkeypatch.setattr(admission, "matcher", slow)
    engine = AsyncEngine(Engine(tiny_models), max_active=4)
    spec = GrammarSpec(
        "json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}})
    )
    requests = [
        GenerationRequest(f"r{j}", "tiny", [1, 2, 3], SamplingParams(max_tokens=4), grammar=spec)
        for j in range(4)
    ]

    async def run() -> tuple[int, list[GenerationRequest]]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        task = asyncio.create_task(ticker())
        prepared = await asyncio.gather(*(engine.prepare(r) for r in requests))
        task.cancel()
        return ticks, list(prepared)

    try:
        ticks, prepared = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(threads) == 1 and threads[0].startswith("specgate-grammar-")  # once, not on the loop
    assert ticks >= 10  # a loop held by the compile would not have ticked at all in that second
    assert len({id(r.compiled) for r in prepared}) == 1 and prepared[0].compiled is not None
