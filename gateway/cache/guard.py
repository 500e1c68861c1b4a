"""The near-miss guard: a semantic match is refused when the two texts differ in a word that flips
or pins down the answer, however close their embeddings are.

Sentence embeddings place "what is X" and "what is not X", "sort 5 items" and "sort 50 items",
"capital of Austria" and "capital of Australia" within a few hundredths of each other, so
similarity alone cannot tell a paraphrase from a different question (OPENAI-CONTRACT.md lists
this bug). Paraphrases reword the ordinary words; near misses change one of these:

- negations (not, no, never, without, n't, non-, ...), compared as a count, and words negated by a
  prefix ("unsafe", "unsigned", "async", "immutable", "invalid", "deserialize") where the other
  text has the bare word ("safe", "signed", "sync", ...) and not the prefixed one;
- numbers, digits or spelled out ("five" == "5"), compared as a multiset, digits inside words
  included ("ww2", "python3", "sha256", "ipv6", "int64");
- polarity words (largest/smallest, ascending/descending, key/value, time/space, ...), also as
  the head of a compound ("uppercase", "overflow", "minimize") and in the plural, compared as a set;
- named things: capitalised words outside the sentence-initial position (or sentence-initial words
  that are not common English), ALLCAPS, code identifiers (snake_case, camelCase, dotted.names),
  single letters (variables, options: "option a" and "option b" embed at 0.87), quoted or
  back-ticked strings, operator symbols and every other symbol (math, currency, emoji: MiniLM
  reads most of them as one unknown token), and every word in a script other than Latin (the
  English embedder cannot tell two such questions apart);
- layout: where a line is indented (code), every line's indent, compared exactly;
- argument order: "Is Python faster than Java?" and "Is Java faster than Python?" share every word
  (similarity 0.99) and have opposite answers. The arguments of a text (its names, its numbers and
  the words either side of a relation word: than, to, into, from, vs, ...) are kept in order of
  appearance, and the arguments two texts share must come in the same order. A paraphrase that adds
  or drops an argument still matches; one that swaps two is refused (symmetric relations, "Python
  and Java", are refused too: a miss costs a generation, a wrong hit a wrong answer).

The key terms are small, so entries store them instead of the prompt text, and only as keyed
digests (``KeyTerms.hashed``): every comparison is one of equality or order, which digests keep, and a
cache entry in Redis then holds no name, number or quoted string of anyone's prompt.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

GUARD_VERSION = "g3"  # in the semantic scope: bump when key terms change form or meaning


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


_NEGATIONS = _words(
    "not no never none nothing nobody nowhere neither nor without cannot cant isnt arent wasnt werent "
    "dont doesnt didnt wont wouldnt shouldnt couldnt hasnt havent hadnt mustnt neednt aint "
    "except excluding exclude avoid lack lacks lacking non"
)
# Prefixes that negate the word they open (un+safe, a+sync, in+valid, de+serialize). A prefixed word
# refuses a match only where the other text has its stem bare and not the prefixed word, so the
# false readings ("under", "index", "about") cost nothing: no paraphrase holds "der", "dex", "bout".
_NEGATING_PREFIXES = ("non", "anti", "dis", "un", "in", "im", "il", "ir", "de", "a")
_MIN_STEM = 3
# Both sides of common antonym pairs; any difference in this set refuses the match.
_POLARITY = _words(
    "largest smallest biggest least most more less fewer greater lower higher lowest highest maximum minimum "
    "max min increase decrease increasing decreasing ascending descending before after first last best worst "
    "above below over under inside outside add remove insert delete encrypt decrypt encode decode true false "
    "enable disable open close start stop upper lower left right north south east west old new older newer "
    "oldest newest early late earlier later fast slow faster slower hot cold warm cool positive negative "
    "odd even prefix suffix import export input output push pop buy sell win lose "
    # pairs whose two sides a question names alone: "sort by key" and "sort by value" embed at 0.93
    "key value read write horizontal horizontally vertical vertically row column time space "
    "synonym antonym sum product union intersection brief briefly detail detailed concise verbose "
    "upload download client server frontend backend width height public private "
    "static dynamic local global stack heap shallow deep absolute relative explicit implicit "
    "singular plural head tail inner outer prepend append plus minus multiply divide addition "
    "subtraction multiplication division up down short shorter long longer soft hard light dark strong weak "
    "lazy eager inclusive exclusive yesterday tomorrow good bad better worse big small large tall heavy thick "
    "thin wide narrow high low full empty same different similar cheap expensive easy difficult simple complex "
    "happy sad rich poor pros cons success failure love hate correct wrong safe dangerous"
)
# Words that relate the argument before them to the one after: their order is the question.
_RELATIONS = _words("than to into onto from vs versus over against toward towards via instead rather")
# Skipped when looking for a relation's arguments (articles, auxiliaries, pronouns, question words;
# not _COMMON, whose verbs "list", "sort" and "set" are also the nouns code questions compare).
_FILLER = _words(
    "a an the is are was were be been being do does did can could should would will shall may might must "
    "i you we they it its this that these those there here of in on at for by with about as if and or but "
    "so much far also just very really any some what which who how when where why whats my your our"
)
_NUMBER_WORDS = {
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6", "seven": "7",
    "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13",
    "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17", "eighteen": "18",
    "nineteen": "19", "twenty": "20", "thirty": "30", "forty": "40", "fifty": "50", "hundred": "100",
    "thousand": "1000", "million": "1000000", "billion": "1000000000", "dozen": "12", "half": "0.5",
    "once": "1", "twice": "2", "single": "1", "double": "2", "triple": "3", "pair": "2",
}  # fmt: skip
_ORDINALS = {"first": "1", "second": "2", "third": "3", "fourth": "4", "fifth": "5", "tenth": "10"}
# Words that start sentences in questions and instructions; capitalised there, they name nothing.
_COMMON = _words(
    "a an the what which who whom whose why how when where is are was were be do does did can could "
    "should would will shall may might must please tell give show list explain describe define write "
    "create make generate find compute calculate convert translate summarize summarise compare name "
    "i im ive id you your we our they it its this that these those there here in on at for of to from "
    "by with about as if and or but so then also just hey hi hello ok okay quick briefly simply now "
    "help implement return print sort reverse check count get set use using let lets say provide "
    "whats whos hows wheres whens whys difference meaning definition my me recommend suggest "
    "fix debug refactor optimize optimise rewrite improve review outline draft plan run try"
)

_WORD = re.compile(
    r"`[^`]*`|\"[^\"]*\"|[A-Za-z_][\w.']*[\w]|[A-Za-z]|\d+(?:[.,]\d+)*|[<>=!+\-*/%&|^~]{1,3}|[^\W\d_]+|[^\w\s]"
)
_SENTENCE_END = re.compile(r"[.!?:;\n]\s*$")
_OPERATORS = re.compile(r"^[<>=!+\-*/%&|^~]{1,3}$")
_IDENT = re.compile(r"_|[a-z][A-Z]|\w\.\w")


@dataclass(frozen=True)
class KeyTerms:
    negations: int
    numbers: tuple[str, ...]  # sorted multiset
    polarity: tuple[str, ...]  # sorted set
    names: tuple[str, ...]  # sorted set, lowercased
    # arguments in order of first appearance; None: an entry stored before order was kept
    order: tuple[str, ...] | None = ()
    words: tuple[str, ...] = ()  # sorted set of the words (stems of prefixed ones are looked up here)
    prefixed: tuple[tuple[str, str], ...] = ()  # (word, stem) of words opening with a negating prefix
    layout: tuple[int, ...] = ()  # each non-empty line's indent, where any line is indented (code)

    def to_json(self) -> list[object]:
        out: list[object] = [self.negations, list(self.numbers), list(self.polarity), list(self.names)]
        if self.order is None:
            return out
        return [*out, list(self.order), list(self.words), [list(p) for p in self.prefixed], list(self.layout)]

    @classmethod
    def from_json(cls, raw: list[object]) -> KeyTerms:
        neg, nums, pol, names = raw[:4]
        order: tuple[str, ...] | None = tuple(raw[4]) if len(raw) > 4 else None  # type: ignore[arg-type]
        words = tuple(raw[5]) if len(raw) > 5 else ()  # type: ignore[arg-type]
        prefixed = tuple((str(w), str(s)) for w, s in raw[6]) if len(raw) > 6 else ()  # type: ignore[attr-defined]
        layout = tuple(int(n) for n in raw[7]) if len(raw) > 7 else ()  # type: ignore[attr-defined]
        return cls(int(neg), tuple(nums), tuple(pol), tuple(names), order, words, prefixed, layout)  # type: ignore[arg-type, call-overload]

    def hashed(self, salt: str) -> KeyTerms:
        """Every term as a keyed digest (salt: the tenant): ``compatible`` compares digests as it
        compares words, and what is stored names nothing of the prompt (a card number, a quoted
        password and a person's name were stored as typed)."""
        key = hashlib.blake2b(salt.encode("utf-8"), digest_size=32).digest()

        def h(term: str) -> str:
            return hashlib.blake2b(term.encode("utf-8"), digest_size=8, key=key).hexdigest()

        return KeyTerms(
            self.negations,
            tuple(sorted(h(t) for t in self.numbers)),
            tuple(sorted(h(t) for t in self.polarity)),
            tuple(sorted(h(t) for t in self.names)),
            None if self.order is None else tuple(h(t) for t in self.order),
            tuple(sorted(h(t) for t in self.words)),
            tuple(sorted((h(w), h(s)) for w, s in self.prefixed)),
            self.layout,  # indent widths: nothing of the text
        )


def key_terms(text: str) -> KeyTerms:
    negations = 0
    numbers: list[str] = []
    polarity: set[str] = set()
    names: set[str] = set()
    sentence_start = True
    order: list[str] = []  # arguments, in order
    seen: set[str] = set()  # letter runs of every word
    prefixed: set[tuple[str, str]] = set()
    words: list[str] = []  # words, numbers and quoted strings, lowercased: the relations' neighbours
    relations: list[int] = []  # indexes into words
    text = unicodedata.normalize("NFKC", text)  # "x²" is "x2", full-width "ｘ" is "x"
    for m in _WORD.finditer(text):
        tok = m.group()
        preceding = text[max(0, m.start() - 3) : m.start()]
        if m.start() > 0 and _SENTENCE_END.search(preceding):
            sentence_start = True
        if tok[0] in '`"' or not _latin(tok):
            names.add(tok.lower())
            order.append(tok.lower())
            words.append(tok.lower())
        elif tok[0].isdigit():
            numbers.append(tok.replace(",", ""))
            order.append(numbers[-1])
            words.append(numbers[-1])
        elif _OPERATORS.match(tok):
            if tok not in ("-",):  # a hyphen between words is not an operator
                names.add(tok)
        elif not tok[0].isalpha():  # one character: a symbol names something, punctuation nothing
            if (
                unicodedata.category(tok)[0] == "S" or tok in "#@()[]{}"
            ):  # "≤"/"≥", "€"/"$", emoji: 1.000 apart
                names.add(tok)
                order.append(tok)
        else:
            word = tok.lower().rstrip("'").removesuffix("'s")
            bare = word.replace("'", "")
            if bare in _NEGATIONS or word.endswith("n't"):
                negations += 1
            elif bare in _NUMBER_WORDS:
                numbers.append(_NUMBER_WORDS[bare])
                order.append(numbers[-1])
            elif bare in _ORDINALS and bare not in _POLARITY:
                numbers.append(_ORDINALS[bare])
            for digits in _DIGITS.findall(bare):  # "ww2", "python3", "sha256": a number all the same
                numbers.append(digits.replace(",", ""))
                order.append(numbers[-1])
            polar = _polar(bare)
            if polar is not None:
                polarity.add(polar)
            for part in _PARTS.findall(bare):  # "case-insensitive" splits at the hyphen already
                if len(part) >= _MIN_STEM:  # shorter words are never looked up
                    seen.add(part)
                prefixed.update((part, stem) for stem in _negated_stems(part))
            if _is_name(tok, sentence_start, bare) or _is_letter(bare, text[m.end() :]):
                names.add(bare)
                order.append(bare)
            if bare in _RELATIONS:
                relations.append(len(words))
            words.append(bare)
        sentence_start = False
    for i in relations:  # the nearest argument-like word either side of each relation word
        for side in (range(i - 1, -1, -1), range(i + 1, len(words))):
            arg = next((words[j] for j in side if _argument(words[j])), None)
            if arg is not None:
                order.append(arg)
    return KeyTerms(
        negations,
        tuple(sorted(numbers)),
        tuple(sorted(polarity)),
        tuple(sorted(names)),
        _in_order(order, text),
        tuple(sorted(seen)),
        tuple(sorted(prefixed)),
        _layout(text),
    )


_DIGITS = re.compile(r"\d+(?:[.,]\d+)*")  # as the number tokens read them: "python3.12" has "3.12"
_PARTS = re.compile(r"[a-z]+")


def _layout(text: str) -> tuple[int, ...]:
    """The indent of every non-empty line, where any line is indented: code whose lines are nested
    otherwise is other code ("if x:\nprint(x)" fails where "if x:\n    print(x)" runs; they embed at
    1.000). Text with no indented line has none, so prose paraphrases keep matching."""
    lines = [line for line in text.split("\n") if line.strip()]
    indents = tuple(len(line) - len(line.lstrip(" \t")) for line in lines)
    return indents if any(indents) else ()


def _polar(word: str) -> str | None:
    """The polarity word ``word`` is, in the plural ("keys", "values") or as a compound's head
    ("uppercase", "overflow", "minimize": a polarity word and at least four more letters)."""
    if word in _POLARITY:
        return word
    if word.endswith("s") and word[:-1] in _POLARITY:
        return word[:-1]
    for n in range(len(word) - 4, 1, -1):
        if word[:n] in _POLARITY:
            return word[:n]
    return None


def _negated_stems(word: str) -> list[str]:
    """What ``word`` negates, read with each prefix it opens with ("insecure": "secure", "nsecure")."""
    return [
        word[len(p) :] for p in _NEGATING_PREFIXES if word.startswith(p) and len(word) - len(p) >= _MIN_STEM
    ]


def _argument(word: str) -> bool:
    return not (word in _FILLER or word in _RELATIONS or word in _POLARITY or word in _NEGATIONS) and not (
        len(word) > 3 and word.endswith("er")
    )  # comparatives: quicker, cheaper, safer


def _in_order(args: list[str], text: str) -> tuple[str, ...]:
    """The arguments by where each first appears in the text (relation neighbours were found after
    the names), each once."""
    low = text.lower()
    firsts = {a: _first(low, a) for a in dict.fromkeys(args)}
    return tuple(sorted(firsts, key=lambda a: firsts[a]))


def _first(low: str, arg: str) -> int:
    m = re.search(r"(?<![\w.])" + re.escape(arg) + r"(?![\w])", low)
    return m.start() if m else low.find(arg)


def _latin(tok: str) -> bool:
    """Every letter Latin. MiniLM is an English model: it reads the CJK characters it has no token for
    as one unknown token ("什么是递归" and "什么是闭包", what is recursion / a closure, embed at 1.000)
    and Hangul or Arabic hardly better (0.96, 0.93 for two different questions), so a word in another
    script is compared as a name is, exactly."""
    return all(unicodedata.name(c, "").startswith("LATIN") for c in tok if c.isalpha())


def _is_letter(bare: str, after: str) -> bool:
    """A letter standing for something: a variable or an option ("use x", "option b", "go with a"),
    any letter but the words "a" and "i", which name something only where no word follows them."""
    if len(bare) != 1 or not bare.isalpha():
        return False
    return bare not in "ai" or not after.lstrip()[:1].isalpha()


def _is_name(tok: str, sentence_start: bool, bare: str) -> bool:
    if _IDENT.search(tok):
        return True
    if tok.isupper() and len(tok) > 1:
        return True  # acronyms: SQL, HTTP
    if tok[0].isupper() and tok.lower() != "i":
        return not (sentence_start and bare in _COMMON)
    return False


def compatible(a: KeyTerms, b: KeyTerms) -> bool:
    """True when nothing answer-changing differs between the two texts."""
    if (a.negations, a.numbers, a.polarity, a.names) != (b.negations, b.numbers, b.polarity, b.names):
        return False
    if a.layout != b.layout or _negates(a, b) or _negates(b, a):
        return False
    if a.order is None or b.order is None:  # an old entry: no order to compare, so no match on one
        return len(a.order or b.order or ()) < 2
    shared = set(a.order) & set(b.order)
    return [x for x in a.order if x in shared] == [x for x in b.order if x in shared]


def _negates(a: KeyTerms, b: KeyTerms) -> bool:
    """``a`` says "unsafe" (or "async", "invalid", ...) where ``b`` says "safe" and never "unsafe"."""
    words = set(b.words)
    return any(stem in words and word not in words for word, stem in a.prefixed)
