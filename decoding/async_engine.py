"""The engine as the gateway sees it: ``generate(request)`` yields one ``StepOutput`` per
verification step, ``abort(request_id)`` stops a request within one step.

Model work runs on one worker thread (torch releases the GIL inside kernels, so the event loop stays
responsive). The worker takes one step of each active request in turn, so a long generation does not
hold back another request's first token. Batching those steps into one forward pass would replace
``_run_round`` alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from decoding.engine import Engine, Sequence
from decoding.errors import EngineOverloaded, EngineStopped
from decoding.params import FinishReason, GenerationRequest, StepOutput

log = logging.getLogger("specgate.engine")


@dataclass
class _Pending:
    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput]
    submitted: float


class AsyncEngine:
    def __init__(self, engine: Engine, max_active: int = 4, max_queued: int = 32):
        self.engine = engine
        self.max_active = max_active
        self.max_queued = max_queued
        self._inbox: collections.deque[_Pending] = collections.deque()
        self._active: dict[str, tuple[_Pending, Sequence]] = {}
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stopping = False
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

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StepOutput]:
        """Validate (raising before any work), queue, then yield steps until one has a finish_reason.

        Leaving the iterator early (client gone, stop string matched) aborts the request.
        """
        self.engine.check(request)
        pending = _Pending(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
        with self._lock:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if len(self._inbox) >= self.max_queued:
                raise EngineOverloaded(len(self._inbox))
            self._inbox.append(pending)
            self._wake.notify()
        finished = False
        try:
            while True:
                out = await pending.queue.get()
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
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
            for pending in admitted:
                self._admit(pending)
            self._run_round()
        for pending, seq in list(self._active.values()):
            self._finish(pending, seq, FinishReason.ABORT)
        with self._lock:
            for pending in self._inbox:
                self._emit(
                    pending, StepOutput(pending.request.request_id, [], finish_reason=FinishReason.ABORT)
                )
            self._inbox.clear()

    def _admit(self, pending: _Pending) -> None:
        rid = pending.request.request_id
        try:
            seq = self.engine.start(pending.request)
        except Exception as exc:  # validated already; a failure here is a real fault
            log.exception("could not start request %s", rid)
            self._emit(pending, StepOutput(rid, [], finish_reason=FinishReason.ERROR, error=str(exc)))
            return
        seq.stats.queue_s = time.perf_counter() - pending.submitted
        self._active[rid] = (pending, seq)

    def _run_round(self) -> None:
        for rid in list(self._active):
            pending, seq = self._active[rid]
            with self._lock:
                aborted = rid in self._aborted
                self._aborted.discard(rid)
            if aborted:
                self._finish(pending, seq, FinishReason.ABORT)
                continue
            try:
                out = self.engine.step(seq)
            except Exception as exc:
                log.exception("request %s failed in a step", rid)
                self._finish(pending, seq, FinishReason.ERROR, error=str(exc))
                continue
            self._emit(pending, out)
            if out.finish_reason is not None:
                self._drop(rid, seq)
        with self._lock:  # aborts for requests that are neither queued nor active
            live = set(self._active) | {p.request.request_id for p in self._inbox}
            self._aborted &= live

    def _finish(
        self, pending: _Pending, seq: Sequence, reason: FinishReason, error: str | None = None
    ) -> None:
        rid = pending.request.request_id
        self._emit(pending, StepOutput(rid, [], finish_reason=reason, stats=seq.stats, error=error))
        self._drop(rid, seq)

    def _drop(self, rid: str, seq: Sequence) -> None:
        self._active.pop(rid, None)
        seq.release()
