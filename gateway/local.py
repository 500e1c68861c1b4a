"""The local backend: chat template -> token ids -> ``EngineClient`` -> safe text.

Every choice is submitted in ``start`` (an engine request of its own; seeded ``seed + j`` so n seeded
choices differ yet repeat), so a refusal is raised there, before serving sends anything. The engine
knows a choice by an id generated here, never by the client's ``x-request-id``: that one is only a
label, and two requests may carry the same one (by accident, or one tenant reusing another's) without
colliding in the engine or aborting each other. Each choice's steps run in a pump task, and the pumps
feed one queue that ``Generation`` iterates. Closing the generation cancels the pumps and closes every
choice's stream, which aborts its engine request within one step (the disconnect path, streaming or
not).
"""

from __future__ import annotations

import asyncio
import copy
import difflib
import re
import threading
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import jinja2

from decoding.client import EngineClient, StepStream, Tokenizer
from decoding.errors import EngineStopped, InvalidParameter, PromptTooLong
from decoding.params import (
    FinishReason,
    GenerationRequest,
    RequestStats,
    SamplingParams,
    StepOutput,
    TokenLogprob,
)
from gateway.backends import Delta, Generation, Job, LogprobEntry, PromptLogprobs
from gateway.detokenize import IncrementalDetokenizer, StopMatcher, token_texts
from gateway.errors import bad_request
from gateway.grammars import grammar_for, guided_grammar, loose_calls, template_messages
from gateway.tools import ToolCallParser

_DONE = object()  # a pump finished its choice


class LocalBackend:
    name = "local"

    def __init__(self, engine: EngineClient, default_max_tokens: int = 4096):
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self._as_text: dict[str, Any] = {}  # per model: its tokenizer reading added tokens as text
        self._as_text_lock = threading.Lock()

    def as_text(self, model: str, tok: Tokenizer) -> Any:
        """``model``'s ``spelling_tokenizer``, made at its first use (~0.6 s for Qwen's, on the
        2-core EPYC) and shared by every prompt after it."""
        with self._as_text_lock:
            if model not in self._as_text:
                self._as_text[model] = spelling_tokenizer(tok)
            return self._as_text[model]

    def model_ids(self) -> list[str]:
        return self.engine.model_names

    def _prompts(self, job: Job, tok: Tokenizer) -> list[tuple[list[int], str]]:
        """(token ids, text) per prompt; text is what ``echo`` sends back."""
        if job.kind == "chat":
            try:
                ids = chat_prompt_ids(
                    tok,
                    template_messages(job.messages or []),
                    as_text=lambda: self.as_text(job.model, tok),
                    tools=job.tools if job.calls_tools else None,
                    add_generation_prompt=job.add_generation_prompt,
                    continue_final_message=job.continue_final_message,
                    **(job.chat_template_kwargs or {}),
                )
            except jinja2.TemplateError as exc:  # the template's raise_exception: roles out of order...
                raise bad_request(f"The chat template refused the messages: {exc}", param="messages") from exc
            except Exception as exc:
                if not job.chat_template_kwargs:
                    raise
                # rendering a client's variables failed (1 / 0, a string where a list goes): theirs
                raise bad_request(
                    f"The chat template failed with these chat_template_kwargs: {type(exc).__name__}: {exc}",
                    param="chat_template_kwargs",
                ) from exc
            return [(ids, "")]
        out = []
        vocab = len(tok)
        for p in job.prompts or []:
            if isinstance(p, str):
                out.append((list(tok(p)["input_ids"]), p))
            else:
                bad = next((t for t in p if not 0 <= t < vocab), None)
                if bad is not None:  # the model would index past its embeddings, after the 200
                    raise bad_request(
                        f"Token id {bad} in prompt is outside the vocabulary of model '{job.model}' "
                        f"(ids 0 to {vocab - 1}).",
                        param="prompt",
                    )
                out.append((list(p), tok.decode(p, skip_special_tokens=True)))
        return out

    def _build(self, job: Job, tok: Tokenizer) -> tuple[list[tuple[list[int], str]], list[GenerationRequest]]:
        prompts = self._prompts(job, tok)
        return prompts, self._requests(job, prompts)

    def _requests(self, job: Job, prompts: list[tuple[list[int], str]]) -> list[GenerationRequest]:
        context = self.engine.max_context(job.model)
        bias = tuple((int(t), b) for t, b in (job.logit_bias or {}).items())
        # (a body's nesting is bounded where it is parsed, far below what building these recurses to)
        grammar = (
            guided_grammar(job.guided)
            if job.guided is not None
            else grammar_for(
                job.response_format, job.tools, job.tool_choice, job.parallel_tool_calls is not False
            )
        )
        prediction = None
        if job.prediction is not None:
            tok = self.engine.tokenizer(job.model)
            prediction = tuple(encode_in_pieces(tok, job.prediction))
        # echo with logprobs: the prompt's tokens are scored too (legacy completions, as OpenAI's and vLLM's)
        prompt_logprobs = job.logprobs if job.kind == "completion" and job.echo else None
        reqs = []
        for ids, _ in prompts:
            # no limit given: as many as fit, up to the server default; the engine ends it at the
            # context's end with finish_reason "length". A prompt that leaves no room is refused
            # in OpenAI's words for it, naming no completion tokens the client never asked for
            if job.max_tokens is None and len(ids) >= context:
                raise PromptTooLong(len(ids), None, context)
            # max_tokens 0 (echo alone): one token is asked for and dropped (_pump), so that the prompt
            # goes through the engine's one path to its logprobs
            max_tokens = (
                max(1, job.max_tokens)
                if job.max_tokens is not None
                else max(1, min(self.default_max_tokens, context - len(ids)))
            )
            for j in range(job.n):
                params = SamplingParams(
                    max_tokens=max_tokens,
                    temperature=job.temperature,
                    top_p=job.top_p,
                    top_k=job.top_k,
                    seed=None if job.seed is None else job.seed + j,
                    presence_penalty=job.presence_penalty,
                    min_tokens=job.min_tokens,
                    ignore_eos=job.ignore_eos,
                    min_p=job.min_p,
                    repetition_penalty=job.repetition_penalty,
                    frequency_penalty=job.frequency_penalty,
                    logprobs=job.logprobs,
                    prompt_logprobs=prompt_logprobs,
                )
                reqs.append(
                    GenerationRequest(
                        uuid.uuid4().hex,
                        job.model,
                        ids,
                        params,
                        job.spec,
                        logit_bias=bias,
                        grammar=grammar,
                        prediction=prediction,
                        cache_salt=job.cache_salt,
                    )
                )
        return reqs

    async def prompt_tokens(self, job: Job) -> int:
        """The prompt tokens ``start`` would count for ``job`` (all its prompts), without starting it:
        a semantic cache hit answers a prompt other than the stored one, and reports this."""
        tok = self.engine.tokenizer(job.model)  # raises UnknownModel
        prompts = await asyncio.to_thread(self._prompts, job, tok)
        return sum(len(ids) for ids, _ in prompts)

    async def start(self, job: Job) -> Generation:
        tok = self.engine.tokenizer(job.model)  # raises UnknownModel
        # The chat template (jinja, in Python) and tokenizing a long prompt or prediction take
        # milliseconds to seconds, and compiling a grammar up to limits.grammar_timeout_s: all off
        # the event loop, so other requests' streams keep flowing meanwhile. n choices share one
        # compiled grammar (the engine's compiler keeps it).
        prompts, reqs = await asyncio.to_thread(self._build, job, tok)
        reqs = [await self.engine.prepare(r) for r in reqs]
        streams: list[StepStream] = []
        try:
            for r in reqs:  # a refusal (unknown model, prompt too long, overload, shutdown) raises here
                streams.append(self.engine.submit(r))
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        stats: list[RequestStats] = []
        gen = Generation(prompt_tokens=sum(len(ids) for ids, _ in prompts), deltas=_empty())
        gen.prompt_texts = [text for _, text in prompts]
        gen.echo_logprobs = any(r.params.prompt_logprobs is not None for r in reqs)
        gen.deltas = _Closing(self._merge(job, tok, reqs, streams, stats, gen), streams)
        return gen

    async def _merge(
        self,
        job: Job,
        tok: Tokenizer,
        reqs: list[GenerationRequest],
        streams: list[StepStream],
        stats: list[RequestStats],
        gen: Generation,
    ) -> AsyncGenerator[Delta, None]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        pumps = [
            asyncio.ensure_future(self._pump(i, job, tok, r, steps, queue, stats, gen))
            for i, (r, steps) in enumerate(zip(reqs, streams, strict=True))
        ]
        try:
            remaining = len(pumps)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    assert isinstance(item, Delta)
                    yield item
            merged = merge_stats(stats)
            gen.speculative = merged.as_dict()
            gen.cached_tokens = merged.cached_tokens
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(
        self,
        index: int,
        job: Job,
        tok: Tokenizer,
        req: GenerationRequest,
        steps: StepStream,
        queue: asyncio.Queue[object],
        stats: list[RequestStats],
        gen: Generation,
    ) -> None:
        detok = IncrementalDetokenizer(tok, req.prompt_token_ids)
        matcher = StopMatcher(list(job.stops), after=job.min_tokens)
        names = [t["function"]["name"] for t in job.tools or []]  # tool-call text -> tool_calls deltas
        parallel = job.parallel_tool_calls is not False
        calls = (
            ToolCallParser(names, parallel, loose_calls(job.tools, job.response_format))
            if job.calls_tools
            else None
        )
        seen = RequestStats(prompt_tokens=len(req.prompt_token_ids))
        returned: list[int] = []  # the completion's token ids as the client gets them (to a stop)
        try:
            step = await steps.__anext__()
            while True:
                _observe(seen, step)
                if step.prompt_logprobs is not None:  # the first step's: a delta of its own, first
                    scored = await asyncio.to_thread(
                        _prompt_logprobs, tok, req.prompt_token_ids, step.prompt_logprobs
                    )
                    queue.put_nowait(Delta(index, "", prompt_logprobs=scored))
                if job.max_tokens == 0:  # echo alone: the prompt and its logprobs, no completion
                    queue.put_nowait(Delta(index, "", None, "length", 0))
                    stats.append(seen)
                    break
                finish: str | None = None
                texts: list[str] = []
                used = 0  # tokens of this step before (and including) the one completing a stop
                for tid in step.token_ids:
                    texts.append(matcher.feed(detok.add(tid)))
                    used += 1
                    if matcher.stopped:
                        finish = "stop"
                        break
                if finish is None and step.finish_reason is not None:
                    if step.finish_reason == FinishReason.ABORT:  # the engine is shutting down
                        raise EngineStopped("generation was aborted by the engine")
                    if step.finish_reason == FinishReason.ERROR:
                        if step.error_param is not None:  # the request's fault (its grammar): a 400
                            raise InvalidParameter(step.error or "", step.error_param)
                        raise RuntimeError(f"generation failed: {step.error}")
                    tail = matcher.feed(detok.flush())
                    tail += matcher.flush()
                    if texts:
                        texts[-1] += tail
                    else:
                        texts.append(tail)
                    finish = (
                        "stop" if matcher.stopped or step.finish_reason == FinishReason.STOP else "length"
                    )
                seen.completion_tokens += used
                if req.prediction is not None:
                    returned += step.token_ids[:used]
                lps = _logprobs(tok, step, used)
                for delta in _split(index, texts, lps, used, job.granularity):
                    if calls is not None:
                        delta.text, pieces = calls.feed(delta.text)
                        delta.tool_calls = pieces or None
                    queue.put_nowait(delta)
                if finish is not None:
                    if calls is not None:
                        text, pieces = calls.flush()
                        if text or pieces:
                            queue.put_nowait(Delta(index, text, None, None, 0, pieces or None))
                        if calls.calls and finish == "stop":
                            finish = "tool_calls"
                    queue.put_nowait(Delta(index, "", None, finish, 0))
                    final = step.stats if step.finish_reason is not None and step.stats else seen
                    final.completion_tokens = seen.completion_tokens
                    if req.prediction is not None:  # summed over the choices, as usage is
                        found = await asyncio.to_thread(prediction_found, req.prediction, returned)
                        accepted, rejected = gen.prediction_tokens or (0, 0)
                        gen.prediction_tokens = (accepted + found, rejected + len(req.prediction) - found)
                    stats.append(final)
                    break
                step = await steps.__anext__()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            await steps.aclose()
            queue.put_nowait(_DONE)


async def _empty() -> AsyncIterator[Delta]:
    return
    yield


class _Closing:
    """The merged deltas; closing them also closes every choice's stream, even when the merge never
    started (an async generator that never ran skips its ``finally``)."""

    def __init__(self, deltas: AsyncGenerator[Delta, None], streams: list[StepStream]):
        self._deltas = deltas
        self._streams = streams

    def __aiter__(self) -> _Closing:
        return self

    def __anext__(self) -> Awaitable[Delta]:
        return self._deltas.__anext__()

    async def aclose(self) -> None:
        try:
            await self._deltas.aclose()
        finally:
            for s in self._streams:
                await s.aclose()


def _observe(stats: RequestStats, step: StepOutput) -> None:
    """Speculation stats from the steps seen, for a request left early (stop string) that never
    receives the engine's final stats (the engine's own bookkeeping, without the step's seconds)."""
    stats.record_step(step.drafted, step.accepted, 0.0)
    stats.cached_tokens = step.cached_tokens


def prediction_found(prediction: Sequence[int], output: Sequence[int]) -> int:
    """Tokens of ``prediction`` that appear in ``output`` in order (difflib's matching blocks, the
    standard library's diff): OpenAI's accepted prediction tokens, the rest being rejected ones.
    Counted on the returned output rather than on what speculation happened to verify, so the figure
    is the same streamed or not, whatever k the controller chose, and for any drafter. Without
    autojunk, which would drop a short vocabulary's common tokens from the match: ~0.2 s for 4,000
    tokens each of varied text and ~1 s over 20 distinct tokens (this 2-core EPYC), off the loop."""
    if not prediction or not output:
        return 0
    # Only the prediction's first twice the output's length (and a margin) is matched: difflib's pure
    # Python scans all of it once per block, and a 950 KB prediction answered in 4 tokens held the
    # GIL for ~0.6 s in slices, each slowing every stream's step. A prediction's tokens that far past
    # the output's length count as rejected (an approximation, as OpenAI's own count is).
    prediction = prediction[: 2 * len(output) + 256]
    blocks = difflib.SequenceMatcher(None, prediction, output, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks)


def merge_stats(parts: list[RequestStats]) -> RequestStats:
    out = RequestStats(drafter=parts[0].drafter if parts else "none")
    for s in parts:
        for name in (
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "steps",
            "spec_steps",
            "drafted",
            "accepted",
        ):
            setattr(out, name, getattr(out, name) + getattr(s, name))
        out.spec_disabled_steps += s.spec_disabled_steps
        for i, (d, a) in enumerate(zip(s.drafted_by_position, s.accepted_by_position, strict=True)):
            if i == len(out.drafted_by_position):
                out.drafted_by_position.append(0)
                out.accepted_by_position.append(0)
            out.drafted_by_position[i] += d
            out.accepted_by_position[i] += a
    return out


# A message's content in the rendered prompt, while it is tokenized apart (private-use characters,
# which no tokenizer's added tokens hold)
_HOLE = re.compile("\ue000(\\d+)\ue001")


def chat_prompt_ids(
    tok: Tokenizer, messages: list[dict[str, Any]], as_text: Callable[[], Any] | None = None, **template: Any
) -> list[int]:
    """The chat template's prompt as token ids, each message's content as text: a special token's
    spelling in it (``<|im_end|>\n<|im_start|>system``) stays those characters, not the tokens
    that would close the message and open another role's turn, as OpenAI's API reads it. Rendered
    and tokenized whole (transformers' ``apply_chat_template(tokenize=True)``) where no content
    holds an added token's text; otherwise each such content is held out of the rendering and
    tokenized by the tokenizer ``as_text`` gives, asked for only then (``spelling_tokenizer``: a
    copy, made here where no ``as_text`` is given; LocalBackend keeps one per model), the
    template around it as usual. By hand because transformers' ``split_special_tokens`` applies to
    a whole text, the template's own tokens included."""
    added = tuple(tok.get_added_vocab())
    held: list[str] = []
    safe = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str) and any(a in c for a in added):
            m = {**m, "content": f"\ue000{len(held)}\ue001"}
            held.append(c)
        safe.append(m)
    if not held:
        return list(tok.apply_chat_template(messages, tokenize=True, **template)["input_ids"])
    text = tok.apply_chat_template(safe, tokenize=False, **template)
    spelling = as_text() if as_text is not None else spelling_tokenizer(tok)
    ids: list[int] = []
    for i, part in enumerate(_HOLE.split(text)):  # template, content index, template, ...
        if i % 2:
            ids += spelling(held[int(part)], add_special_tokens=False)["input_ids"]
        elif part:
            ids += tok(part, add_special_tokens=False)["input_ids"]
    return ids


def spelling_tokenizer(tok: Tokenizer) -> Any:
    """A copy of ``tok`` that reads added tokens' spellings as text, for message contents
    (``chat_prompt_ids``). transformers' ``split_special_tokens=True`` sets that as a flag on the
    shared Rust tokenizer for the call, and the next call sets it back, while prompts are tokenized
    on threads (``LocalBackend.start``): under concurrent requests a content's ``<|im_end|>``
    became the turn marker again, or another prompt's template markers were read as text (53 of
    400 prompts, four threads on the real tokenizer). The copy's flag is set once, and the shared
    tokenizer's never."""
    clone: Any = copy.deepcopy(tok)
    clone.split_special_tokens = True
    clone.backend_tokenizer.encode_special_tokens = True
    return clone


def _logprobs(tok: Tokenizer, step: StepOutput, used: int) -> list[LogprobEntry] | None:
    if step.logprobs is None:
        return None

    used_lps = step.logprobs[:used]
    # special tokens as "": the text they are logprobs of leaves them out (IncrementalDetokenizer)
    ids = [t for lp in used_lps for t in (lp.token_id, *(t for t, _ in lp.top))]
    text = token_texts(tok, ids, skip_special=True)
    return [LogprobEntry(text[lp.token_id], lp.logprob, [(text[t], v) for t, v in lp.top]) for lp in used_lps]


def _prompt_logprobs(tok: Tokenizer, ids: list[int], scored: list[TokenLogprob | None]) -> PromptLogprobs:
    """The engine's prompt scores as text: every token decoded on its own, as completion tokens are
    (``_logprobs``), in one call for the prompt's and the alternatives' distinct ids (a long prompt
    has thousands)."""
    text = token_texts(tok, [*ids, *(t for s in scored if s is not None for t, _ in s.top)])
    rest = []
    for s in scored[1:]:
        assert s is not None, "only the first prompt token goes unscored"
        rest.append(LogprobEntry(text[s.token_id], s.logprob, [(text[t], v) for t, v in s.top]))
    return PromptLogprobs(str(text[ids[0]]), rest)


def _split(
    index: int, texts: list[str], lps: list[LogprobEntry] | None, used: int, granularity: str
) -> list[Delta]:
    """One delta for the step, or one per token (``stream_granularity: token``)."""
    if used == 0 and not any(texts):
        return []
    if granularity == "token":
        return [
            Delta(index, t, None if lps is None else lps[i : i + 1], None, 1 if i < used else 0)
            for i, t in enumerate(texts)
        ]
    return [Delta(index, "".join(texts), lps, None, used)]


PIECE_CHARS = 16_384


def encode_in_pieces(tok: Tokenizer, text: str) -> list[int]:
    """``text``'s token ids, encoded a piece of up to ``PIECE_CHARS`` at a time, cut after a newline
    where one is near. The tokenizer drops the GIL while it splits text but holds it while it builds
    the id lists, so one 950 KB prediction held every stream's event loop for ~70 ms at a time; in
    pieces each hold is short. For drafts only (Predicted Outputs): a piece's edge may tokenize
    otherwise than the whole text would, which speculation makes lossless anyway."""
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + PIECE_CHARS)
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        ids += tok.encode(text[start:end], add_special_tokens=False)
        start = end
    return ids
