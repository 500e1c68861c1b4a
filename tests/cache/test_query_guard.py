"""Key normalisation and the near-miss guard, without any store."""

from __future__ import annotations

import pytest

from gateway.cache.guard import KeyTerms, compatible, key_terms
from gateway.cache.query import build_query, parse_controls


def key(body: dict[str, object], tenant: str = "t") -> str:
    return build_query(body, tenant=tenant, endpoint="chat").exact_key


BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def test_equivalent_bodies_share_a_key() -> None:
    same = [
        {**BASE, "temperature": 0.0},
        {**BASE, "n": 1, "presence_penalty": 0, "stop": [], "speculative": {"mode": "ngram"}},
        {**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {**BASE, "stream": True, "stream_options": {"include_usage": True}, "cache": {"ttl": 5}, "user": "x"},
        {**BASE, "messages": [{"role": "user", "content": "hi", "name": None}]},
    ]
    assert {key(b) for b in same} == {key(BASE)}


def _schema(properties: object) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": {"properties": properties}}}


def _tool(prop: object) -> dict[str, object]:
    return {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": prop}}}}


def test_output_changing_fields_split_the_key() -> None:
    variants = [
        {**BASE, "temperature": 0.1},
        {k: v for k, v in BASE.items() if k != "temperature"},  # absent: the gateway's default applies
        {**BASE, "max_tokens": 5},
        {**BASE, "stop": "x"},
        {**BASE, "seed": 3},
        {**BASE, "seed": 2**62},  # the seeds beyond float64's integers (its step is 1024 here) differ,
        {**BASE, "seed": 2**62 + 1},  # and so do their samples: one's replayed for the other's was wrong
        {**BASE, "n": 2},
        {**BASE, "top_k": 5},
        {**BASE, "frequency_penalty": 0.2},
        {**BASE, "tools": [{"type": "function", "function": {"name": "f"}}]},
        {**BASE, "some_future_param": 1},
        {**BASE, "model": "m2"},
        {**BASE, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
        {**BASE, "messages": [{"role": "user", "content": "hi "}]},
        # a null inside a value is no absent field: {"const": null} pins the value where {} admits any,
        # and a tool's schema goes into the prompt nulls and all (both were one key with the plain one)
        {**BASE, "response_format": _schema({"a": {"const": None}})},
        {**BASE, "response_format": _schema({"a": {}})},
        {**BASE, "tools": [_tool({"type": "string"})]},
        {**BASE, "tools": [_tool({"type": "string", "default": None})]},
    ]
    keys = [key(b) for b in variants] + [key(BASE), key(BASE, tenant="u")]
    assert len(set(keys)) == len(keys)
    assert key({**BASE, "stop": "x"}) == key({**BASE, "stop": ["x"]})
    assert key({**BASE, "max_completion_tokens": 5}) == key({**BASE, "max_tokens": 5})


def test_semantic_eligibility() -> None:
    assert build_query(BASE, tenant="t", endpoint="chat").semantic_text == "hi"
    multi = {**BASE, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    assert build_query(multi, tenant="t", endpoint="chat").semantic_text is None, (
        "last turn is not the user's"
    )
    long = {**BASE, "messages": [{"role": "user", "content": "x" * 2000}]}
    assert build_query(long, tenant="t", endpoint="chat").semantic_text is None
    hot = build_query({**BASE, "temperature": 0.3}, tenant="t", endpoint="chat", semantic_max_temperature=0.5)
    assert hot.semantic_text == "hi"


def test_continuations_are_exact_only() -> None:
    """A completion continues its prompt's text: another text, however close ("...the lazy" and
    "...the lazy dog", "x = [10, 20" and "x = [10, 20,", a trailing newline or indent), has another
    continuation, so neither legacy completions nor a chat turn continued in place hit by similarity."""
    completion = {"model": "m", "prompt": "The quick brown fox jumps over the lazy", "temperature": 0}
    assert build_query(completion, tenant="t", endpoint="completions").semantic_text is None
    for continued in ({"add_generation_prompt": False}, {"continue_final_message": True}):
        q = build_query({**BASE, **continued}, tenant="t", endpoint="chat")
        assert q.semantic_text is None, continued


def test_semantic_scope_keeps_earlier_turns() -> None:
    def conv(first: str, last: str) -> str:
        msgs = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": last},
        ]
        return build_query({**BASE, "messages": msgs}, tenant="t", endpoint="chat").scope_key

    assert conv("a", "x") == conv("a", "y")
    assert conv("a", "x") != conv("b", "x")


def test_controls() -> None:
    c = parse_controls({"Cache-Control": "no-store, no-cache"}, {}, 100)
    assert c.no_cache and c.no_store and c.ttl_s is None
    c = parse_controls({}, {"cache": {"ttl": 60, "no_store": True}}, 100)
    assert not c.no_cache and c.no_store and c.ttl_s == 60


def test_unknown_control_fields_are_named_bounded() -> None:
    """The refusal named every unknown field whole: 500 KB of them came back in the 400."""
    fields = {f"k{i}" * 10: 1 for i in range(10_000)}
    with pytest.raises(ValueError) as refused:
        parse_controls({}, {"cache": fields}, 100)
    assert "k0k0" in str(refused.value) and "9995 more" in str(refused.value)
    assert len(str(refused.value)) < 400


def test_guard_key_terms() -> None:
    f = key_terms("Isn't the `parse_args` result in Python 3.12 the largest, not five?")
    assert f.negations == 2 and f.numbers == ("3.12", "5") and f.polarity == ("largest",)
    assert "`parse_args`" in f.names and "python" in f.names
    assert compatible(key_terms("List the top five tips."), key_terms("Give me the top 5 tips."))
    assert compatible(
        key_terms("What is the capital of France?"), key_terms("Which city is France's capital?")
    )
    assert not compatible(key_terms("What is X?"), key_terms("What is not X?"))
    assert not compatible(key_terms("x < y"), key_terms("x <= y"))
    assert not compatible(key_terms("Call getUser."), key_terms("Call getUsers."))


NEGATED_OR_OPPOSITE = [
    ("what year did ww2 end", "what year did ww1 end"),
    ("how do i print in python2", "how do i print in python3"),
    ("how to compute sha256 of a file", "how to compute sha1 of a file"),
    ("how to declare a signed int in c", "how to declare an unsigned int in c"),
    ("Is it safe to eat raw eggs?", "Is it unsafe to eat raw eggs?"),
    ("how to serialize json in go", "how to deserialize json in go"),
    ("what is a blocking socket", "what is a non-blocking socket"),
    ("how do i write a sync function", "how do i write an async function"),
    ("is a string mutable in python", "is a string immutable in python"),
    ("how to install docker", "how to uninstall docker"),
    ("How to uppercase a string in Python", "How to lowercase a string in Python"),
    ("how to sort a dict by key in python", "how to sort a dict by value in python"),
    ("what is the time complexity of binary search", "what is the space complexity of binary search"),
    ("Explain recursion briefly", "Explain recursion in detail"),
    ("Give me a synonym for happy", "Give me an antonym for happy"),
    ("git reset --soft HEAD~1", "git reset --hard HEAD~1"),  # similarity 0.96
    ("write a poem about the sea", "write a short poem about the sea"),  # 0.97
    ("is coffee good for you", "is coffee bad for you"),  # 0.93
    ("option a", "option b"),  # 0.87: a conversation's choice between options
    ("go with a", "go with b"),
    ("use x", "use y"),
]
OTHER_SCRIPTS = [
    ("什么是递归？", "什么是闭包？"),  # what is recursion / a closure: similarity 1.000 (unknown tokens)
    ("今天天气怎么样？", "明天天气怎么样？"),  # today's / tomorrow's weather: 0.91
    (
        "파이썬에서 리스트를 뒤집는 방법은?",
        "파이썬에서 파일을 삭제하는 방법은?",
    ),  # reverse a list / delete a file: 0.96
    ("كيف أعكس قائمة في بايثون؟", "كيف أحذف ملفا في بايثون؟"),  # the same two: 0.93
    ("Что такое рекурсия?", "Что такое замыкание?"),
]


SYMBOLS = [
    ("is 5 ≤ 3", "is 5 ≥ 3"),  # 0.90
    ("what does 😂 mean", "what does 😭 mean"),  # 1.000: one unknown token each
    ("what is ∑", "what is ∏"),  # 1.000
    ("convert 5 € to $", "convert 5 $ to €"),  # 0.99
    ("is ∅ a subset of A", "is A a subset of ∅"),  # 0.96
    ("what is x²", "what is x³"),
    ("how do I read a file in c", "how do I read a file in c#"),
    ("explain: x = [] if y else {}", "explain: x = {} if y else []"),  # 0.97: brackets, in order
]


@pytest.mark.parametrize(("a", "b"), SYMBOLS)
def test_guard_compares_symbols_exactly(a: str, b: str) -> None:
    assert not compatible(key_terms(a), key_terms(b))
    assert compatible(key_terms(a), key_terms(a + "?"))


CODE_LAYOUT = [
    ("Why does this fail?\nif x:\nprint(x)", "Why does this fail?\nif x:\n    print(x)"),  # 1.000
    (  # 0.97: the print left the loop
        "What does this print?\nfor i in range(3):\n    pass\nprint(i)",
        "What does this print?\nfor i in range(3):\n    print(i)",
    ),
    ("What's wrong here?\ndef f():\nreturn total", "What's wrong here?\ndef f():\n\treturn total"),
]


@pytest.mark.parametrize(("a", "b"), CODE_LAYOUT)
def test_guard_compares_the_layout_of_code(a: str, b: str) -> None:
    assert not compatible(key_terms(a), key_terms(b))
    assert not compatible(key_terms(a).hashed("t"), key_terms(b).hashed("t"))
    assert compatible(key_terms(b), key_terms(b + "\n\n")), "blank lines are no layout"
    assert KeyTerms.from_json(key_terms(b).to_json()) == key_terms(b)


@pytest.mark.parametrize(("a", "b"), OTHER_SCRIPTS)
def test_guard_compares_words_of_other_scripts_exactly(a: str, b: str) -> None:
    assert not compatible(key_terms(a), key_terms(b))
    assert compatible(key_terms(a), key_terms(a.replace("？", "?")))


KEPT = [
    ("Is it unsafe to eat raw eggs?", "Is eating raw eggs unsafe?"),
    ("What is an unsigned integer?", "What's an unsigned integer?"),
    ("how do I use python3 venv", "how do I use venv in python3"),
    ("How do I sort a dict by its keys in Python?", "How to sort a Python dictionary by key?"),
    ("how to uppercase a string in python", "how do i convert a string to uppercase in python"),
    ("What is an IP address?", "What's an IP address?"),
    ("How do I install numpy?", "How can I install numpy?"),
    ("What is a tuple in Python?", "What's a tuple in Python?"),  # "a" the article, not an option
]


@pytest.mark.parametrize(("a", "b"), NEGATED_OR_OPPOSITE)
def test_guard_refuses_numbers_in_words_negating_prefixes_and_opposites(a: str, b: str) -> None:
    assert not compatible(key_terms(a), key_terms(b))
    assert not compatible(key_terms(a).hashed("t"), key_terms(b).hashed("t")), "digests compare alike"


@pytest.mark.parametrize(("a", "b"), KEPT)
def test_guard_keeps_paraphrases_around_those_words(a: str, b: str) -> None:
    assert compatible(key_terms(a), key_terms(b))
    assert compatible(key_terms(a).hashed("t"), key_terms(b).hashed("t"))


def test_hashed_key_terms_name_nothing_of_the_text() -> None:
    text = 'Why was card 4111 1111 of Alice Smith declined with "hunter2 secret"?'
    stored = str(key_terms(text).hashed("tenant-a").to_json()).lower()
    for word in ("4111", "1111", "alice", "smith", "hunter2", "declined", "card"):
        assert word not in stored
    assert key_terms(text).hashed("tenant-a") != key_terms(text).hashed("tenant-b"), "keyed by tenant"


SWAPPED = [
    ("Is Python faster than Java?", "Is Java faster than Python?"),
    ("is a list faster than a tuple?", "is a tuple faster than a list?"),
    ("Is a mutex slower than a spinlock?", "Is a spinlock slower than a mutex?"),
    ("Is 5 greater than 3?", "Is 3 greater than 5?"),
    ("Subtract 3 from 10.", "Subtract 10 from 3."),
    ("convert celsius to fahrenheit", "convert fahrenheit to celsius"),
    ("Translate this from English into French.", "Translate this from French into English."),
    ("Should I migrate from MySQL to Postgres?", "Should I migrate from Postgres to MySQL?"),
    ("Does Rust beat Go in performance?", "Does Go beat Rust in performance?"),
    ("How do I convert a list to a set in Python?", "How do I convert a set to a list in Python?"),
]
REWORDED = [
    ("Is Python faster than Java?", "Is Python much faster than Java?"),
    ("Is Java faster than Python?", "Would Java be faster than Python?"),
    ("How do I convert celsius to fahrenheit?", "What is the way to convert celsius into fahrenheit?"),
    ("How do I convert a list to a set in Python?", "How can I turn a list into a set in Python?"),
]


@pytest.mark.parametrize(("a", "b"), SWAPPED)
def test_guard_refuses_swapped_arguments(a: str, b: str) -> None:
    assert not compatible(key_terms(a), key_terms(b))
    assert compatible(key_terms(a), key_terms(a))


@pytest.mark.parametrize(("a", "b"), REWORDED)
def test_guard_keeps_paraphrases_that_keep_the_order(a: str, b: str) -> None:
    assert compatible(key_terms(a), key_terms(b))


def test_guard_key_terms_round_trip_and_old_entries() -> None:
    f = key_terms("Is Python faster than Java?")
    assert f.order == ("python", "java")
    assert KeyTerms.from_json(f.to_json()) == f
    old = KeyTerms.from_json(f.to_json()[:4])  # stored before argument order was kept
    assert old.order is None
    assert not compatible(old, f)  # two arguments it cannot check: no match
    one = key_terms("What is Python?")
    assert compatible(KeyTerms.from_json(one.to_json()[:4]), one)
