"""A step's host sync and its device timing: on CUDA the work is asynchronous, so results come back
through one pinned copy and durations through in-stream events."""

from __future__ import annotations

import time

import torch


class PendingRead:
    """A step's results on their way to the host. On CUDA the copy goes to pinned memory and the wait
    is an event's, which releases the GIL (``tolist`` on a device tensor would hold it while the GPU
    finishes), so the server's event loop streams the last step's tokens while this one computes; and
    work queued after the copy (the next step, launched ahead) does not delay it."""

    def __init__(self, t: torch.Tensor):
        self.done: torch.cuda.Event | None = None
        if t.device.type == "cuda":
            t = t.to("cpu", non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        self.host = t

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class StepTimer:
    """Draft and verification time of one step. On CUDA the work is asynchronous, so host clocks
    would time kernel launches: events are recorded in-stream and read after the step's one sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.lead_in: torch.cuda.Event | None = None
        self.lead_host = 0.0
        self.drafted_ahead: tuple[torch.cuda.Event | None, torch.cuda.Event | None] = (None, None)
        if self.cuda:
            self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            self.events[0].record()
        else:
            self.times = [time.perf_counter()]

    def begin(self) -> None:
        """The work queued so far was a lead-in (a draft's catch-up), not the step's draft, whose
        segment starts here. On CUDA that work may still run when the step's host clock starts, so
        ``lead`` is its device time; on a CPU it is done by then, and ``lead`` is 0."""
        if self.cuda:
            self.lead_in = self.events[0]
            self.events[0] = torch.cuda.Event(enable_timing=True)
            self.events[0].record()
        else:
            now = time.perf_counter()
            self.lead_host = now - self.times[0]
            self.times = [now]

    def ahead(self, began: torch.cuda.Event | None, ended: torch.cuda.Event | None) -> None:
        """A draft pass of this step that ran before it began (``decoding.drafters.FirstDrafts``),
        counted with its drafts."""
        self.drafted_ahead = (began, ended)

    def mark(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.times.append(time.perf_counter())

    def stop(self) -> None:
        """The step's work is all queued: its end, before anything queued after it (a step ahead)."""
        if self.cuda:
            self.events[2].record()
        else:
            self.times.append(time.perf_counter())

    def done(self) -> tuple[float, float]:
        """(draft seconds, verification seconds); call after ``stop`` and the step's host sync."""
        if self.cuda:
            self.events[2].synchronize()  # already complete: the step's read-back waited for it
            e = self.events
            began, ended = self.drafted_ahead
            ahead = began.elapsed_time(ended) / 1e3 if began is not None and ended is not None else 0.0
            return e[0].elapsed_time(e[1]) / 1e3 + ahead, e[1].elapsed_time(e[2]) / 1e3
        t = self.times
        return t[1] - t[0], t[2] - t[1]

    def lead(self) -> float:
        """Device seconds of the lead-in (``begin``) that a host clock started after it waited for;
        call after ``done``."""
        return 0.0 if self.lead_in is None else self.lead_in.elapsed_time(self.events[0]) / 1e3

    def lead_seconds(self) -> float:
        """What the lead-in took: its device seconds on CUDA (``lead``), its host seconds on a CPU,
        which ran it before ``begin``; call after ``done``."""
        return self.lead() if self.cuda else self.lead_host
