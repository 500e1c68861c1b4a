"""The local engine behind ``decoding.client.EngineClient``: ``submit(request)`` refuses at once or
returns the request's steps, one ``StepOutput`` per verification step; closing them stops the
request within one step.

Model work runs on one worker thread (torch releases the GIL inside kernels, so the event loop stays
responsive). Continuous batching: requests join and leave between steps, and each step is one forward
pass of a target model over all of its running requests (``Engine.step_batch``), prompts prefilled in
chunks of at most ``prefill_budget`` tokens per step beside the decoding rows, so a long prompt never
holds the running streams, or an abort, for more than one chunk. A step in which no row decodes (a
burst of requests reaching an idle engine) holds no stream back, and takes up to ``burst_budget``.

Requests are keyed by their submission, never by ``request_id``: that is the client's label, and two
requests that share one (by accident, or one tenant reusing another's) must not collide.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from decoding import admission
from decoding.engine import Engine, Sequence
from decoding.errors import EngineOverloaded, EngineStopped, NoFreeSlot
from decoding.params import BatchStep, FinishReason, GenerationRequest, StepOutput

log = logging.getLogger("specgate.engine")


@dataclass(eq=False)  # hashed by identity: the engine's key for a request
class _Pending:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput]
    submitted: float


class Steps:
    """One submitted request's steps (a ``decoding.client.StepStream``). Leaving before the last
    step, by ``aclose`` or by a cancelled wait, aborts the request."""

    def __init__(self, engine: AsyncEngine, pending: _Pending):
        self._engine = engine
        self._pending = pending
        self._done = False

    def __aiter__(self) -> Steps:
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._pending.queue.get()
        except BaseException:
            await self.aclose()
            raise
        if out.finish_reason is not None:
            self._done = True
        return out

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._engine._abort(self._pending)

    def __del__(self) -> None:
        # Dropped unclosed: abort on the request's own loop. Never take the engine's lock here: a
        # collection can run on the worker thread while it holds that lock.
        if not self._done:
            with contextlib.suppress(RuntimeError):  # that loop has closed
                self._pending.loop.call_soon_threadsafe(self._engine._abort, self._pending)


class AsyncEngine:
    def __init__(
        self,
        engine: Engine,
        max_active: int = 4,
        max_queued: int = 32,
        prefill_budget: int | None = None,
        burst_budget: int | None = None,
    ):
        self.engine = engine
        self.max_active = max_active
        self.max_queued = max_queued
        # prompt tokens prefilled per step beside the decoding rows (None: a device default)
        self.prefill_budget = prefill_budget or default_prefill_budget(engine)
        # ... and in a step with no decoding row (None: a device default, never below the above)
        self.burst_budget = max(
            self.prefill_budget, burst_budget or default_burst_budget(engine, self.prefill_budget)
        )
        # chunks on the prefill budget's grid: a prompt is cut the same alone and under load
        engine.chunk_tokens = self.prefill_budget
        self._inbox: collections.deque[_Pending] = collections.deque()
        self._active: dict[_Pending, Sequence] = {}
        self._aborted: set[_Pending] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        self._step_observers: list[Callable[[BatchStep], None]] = []
        self._thread = threading.Thread(target=self._loop, name="specgate-engine", daemon=True)
        self._thread.start()

    # ---- facing the gateway -------------------------------------------------------------------

    @property
    def model_names(self) -> list[str]:
        return sorted(self.engine.models)

    @property
    def queue_depth(self) -> int:
        return len(self._inbox)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def total_steps(self) -> int:
        return self.engine.total_steps

    def add_step_observer(self, observe: Callable[[BatchStep], None]) -> None:
        """Call ``observe`` with every batched step (on the engine's thread, so it must be quick and
        thread-safe; prometheus_client's metrics are). Register before requests arrive."""
        self._step_observers.append(observe)

    def tokenizer(self, model: str) -> Any:
        return self.engine.model(model).tokenizer

    def max_context(self, model: str) -> int:
        return self.engine.model(model).max_context

    def submit(self, request: GenerationRequest) -> Steps:
        """Validate and queue the request, or raise before any work (``decoding.client``); then its
        steps, until one has a finish_reason. Closing them early aborts the request."""
        request = self.engine.check(request)
        pending = _Pending(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        with self._lock:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            # the inbox holds requests the loop admits at its next turn (up to the free slots) and those
            # that will wait: max_queued bounds the waiting. Counting all of them refused a burst that
            # reached a step in progress while slots were free (3 admitted, 5 refused at max_active 4,
            # max_queued 2, on the real gateway)
            free = max(0, self.max_active - len(self._active))
            if len(self._inbox) >= self.max_queued + free:
                raise EngineOverloaded(len(self._inbox))
            self._inbox.append(pending)
            self._wake.notify()
        return Steps(self, pending)

    async def prepare(self, request: GenerationRequest) -> GenerationRequest:
        """``request`` with its grammar compiled, awaited off the event loop (a large grammar takes
        seconds, and ``submit`` would compile it on the loop): submit what this returns."""
        if request.grammar is None or request.compiled is not None:
            return request
        grammars = self.engine.grammars
        future = admission.compile_grammar(grammars, self.engine.model(request.model), request.grammar)
        try:  # shielded: the compile may be shared with other requests, and a timeout must not cancel it
            compiled = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), grammars.limits.timeout_s
            )
        except TimeoutError:
            raise grammars.timed_out(request.grammar) from None
        return replace(request, compiled=compiled)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """``submit`` as one async generator (tests, benchmarks): a refusal is raised by the first
        ``__anext__``, and leaving the generator early aborts the request."""
        steps = self.submit(request)
        try:
            async for out in steps:
                yield out
        finally:
            await steps.aclose()

    def _abort(self, pending: _Pending) -> None:
        with self._lock:
            if pending in self._inbox:  # never started: nothing to free
                self._inbox.remove(pending)
                return
            self._aborted.add(pending)
            self._wake.notify()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout)

    # ---- the worker thread --------------------------------------------------------------------

    def _emit(self, pending: _Pending, out: StepOutput) -> None:
        with contextlib.suppress(RuntimeError):  # the request's loop has closed: nobody is listening
            pending.loop.call_soon_threadsafe(pending.queue.put_nowait, out)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self._inbox and not self._active:
                    self._wake.wait()
                if self._stopping:
                    break
                admitted: list[_Pending] = []
                while self._inbox and len(self._active) + len(admitted) < self.max_active:
                    admitted.append(self._inbox.popleft())
                aborted, self._aborted = self._aborted, set()
            for pending in aborted:
                seq = self._active.get(pending)
                if seq is not None:
                    self._finish(pending, seq, FinishReason.ABORT)
            for i, pending in enumerate(admitted):
                if not self._admit(pending):  # every KV slot taken: these wait for one to free
                    with self._lock:
                        self._inbox.extendleft(reversed(admitted[i:]))
                    break
            self._run_step()
        for pending, seq in list(self._active.items()):
            self._finish(pending, seq, FinishReason.ABORT)
        with self._lock:
            for pending in self._inbox:
                self._emit(
                    pending, StepOutput(pending.request.request_id, [], finish_reason=FinishReason.ABORT)
                )
            self._inbox.clear()

    def _admit(self, pending: _Pending) -> bool:
        """Start a request; False when no KV slot is free (it stays queued)."""
        rid = pending.request.request_id
        try:
            seq = self.engine.start(pending.request)
        except NoFreeSlot:
            if not self._active:  # nothing will free a slot: a configuration fault, not a wait
                self._emit(
                    pending, StepOutput(rid, [], finish_reason=FinishReason.ERROR, error="no KV-cache slot")
                )
                return True
            return False
        except Exception as exc:  # validated already; a failure here is a real fault
            log.exception("could not start request %s", rid)
            self._emit(pending, StepOutput(rid, [], finish_reason=FinishReason.ERROR, error=str(exc)))
            return True
        seq.stats.queue_s = time.perf_counter() - pending.submitted
        self._active[pending] = seq
        return True

    def _run_step(self) -> None:
        """One batched step per target model over its running requests."""
        by_model: dict[str, list[_Pending]] = {}
        for pending, seq in self._active.items():
            by_model.setdefault(seq.target.name, []).append(pending)
        # requests that will be admitted before the next step: no step is queued ahead of it
        joining = bool(self._inbox) and len(self._active) < self.max_active
        for group in by_model.values():
            seqs = [self._active[p] for p in group]
            decoding = any(s.prefilled for s in seqs)
            budget = self.prefill_budget if decoding else self.burst_budget
            try:
                outs = self.engine.step_batch(seqs, budget, joining)
            except Exception as exc:
                log.exception("a step of %d requests failed", len(seqs))
                for p, seq in zip(group, seqs, strict=True):
                    self._finish(p, seq, FinishReason.ERROR, error=str(exc))
                continue
            for p, seq, out in zip(group, seqs, outs, strict=True):
                if out is None:
                    continue  # a prefill chunk: nothing to say yet
                self._emit(p, out)
                if out.finish_reason is not None:
                    self._drop(p, seq)
            if self._step_observers:
                self._observe(seqs[0].target.name, outs)

    def _observe(self, model: str, outs: list[StepOutput | None]) -> None:
        given = [o for o in outs if o is not None]
        step = BatchStep(
            model,
            rows=len(given),
            prefilling=len(outs) - len(given),
            tokens=sum(len(o.token_ids) for o in given),
            drafted=max((o.drafted for o in given), default=0),
        )
        for observe in self._step_observers:
            try:
                observe(step)
            except Exception:  # an observer's fault must not stop the engine
                log.exception("a step observer failed")

    def _finish(
        self, pending: _Pending, seq: Sequence, reason: FinishReason, error: str | None = None
    ) -> None:
        rid = pending.request.request_id
        self._emit(pending, StepOutput(rid, [], finish_reason=reason, stats=seq.stats, error=error))
        self._drop(pending, seq)

    def _drop(self, pending: _Pending, seq: Sequence) -> None:
        self._active.pop(pending, None)
        seq.release()


def default_prefill_budget(engine: Engine) -> int:
    """Prompt tokens per step. On the H200's 7B shape 16 decode rows cost 4.4 ms of kernel time a
    step, 6.3 ms beside a 128-token chunk at 3,000 tokens of context (bench.probe_prefill kernels);
    beside a 256-token chunk a step took 2.5x one alone (measured before the chunk kernel's grid was
    cut, not since): 128 keeps the streams' inter-token latency within 2x while a long prompt
    prefills (bench.gpu_batch). A CPU pays for every row, so its chunks are smaller
    (docs/benchmarks.md)."""
    on_gpu = any(m.device.type == "cuda" for m in engine.models.values())
    return 128 if on_gpu else 64


def default_burst_budget(engine: Engine, prefill_budget: int) -> int:
    """Prompt tokens in a step with no decoding row. A GPU computes many prompt tokens in one step for
    about what they cost in chunks, less each chunk's weight read and launches: on the H200's 7B shape
    16 prompts of 128 tokens in 8 steps of 256 gave their first tokens 46 / 74 ms (p50 / max) after
    they were sent, and 3163 tok/s over the run; in one step 52 / 52 ms and 3385 tok/s
    (bench.gpu_batch, 2026-12-03 18:44 and 21:31 UTC). A CPU's step costs per token, and an abort
    waits for the step: its burst is chunked like any prompt."""
    on_gpu = any(m.device.type == "cuda" for m in engine.models.values())
    return 2048 if on_gpu else prefill_budget
