"""Each step's time, without adding a synchronisation.

On a GPU the host runs ahead of the device, so the wall clock between two step ends says when the host
finished enqueuing, not how long the device took. There the clock records a CUDA event on the current
stream as a step begins and as it ends, and reads their elapsed time once the end event has completed;
nothing waits for it. The live search therefore judges the step ``lag`` steps back (``DEVICE_LAG``),
which has completed by then on every rank in a job whose host does not run further ahead than that; a
step not complete yet is skipped, never waited for. On the host the wall clock is the step's time and
the step just ended is judged (lag 0).
"""

from __future__ import annotations

import time
from typing import Any

import torch

DEVICE_LAG = 2  # steps between a step's end and its judgement on a GPU
KEEP = 16  # steps whose times are kept, at least ``lag`` + 1


def device_now(cuda: bool) -> Any:
    """A mark of now: a CUDA event recorded on the current stream (it completes when the work enqueued before it
    has), else ``time.perf_counter`` seconds. The step clock and the collective recorder both time with it."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepClock:
    """``begin(step)``/``end(step)`` around each step; ``seconds(step)`` once known (None before)."""

    def __init__(self, cuda: bool, lag: int | None = None) -> None:
        self.cuda = cuda
        self.lag = (DEVICE_LAG if cuda else 0) if lag is None else lag
        self._marks: dict[int, list[Any]] = {}  # step -> [start, end]: events on a GPU, perf_counter seconds else

    def begin(self, step: int) -> None:
        self._marks[step] = [device_now(self.cuda), None]
        for old in [s for s in self._marks if s <= step - max(KEEP, self.lag + 1)]:
            del self._marks[old]

    def end(self, step: int) -> None:
        marks = self._marks.get(step)
        if marks is not None:
            marks[1] = device_now(self.cuda)

    def seconds(self, step: int) -> float | None:
        """The step's time if it has ended and (on a GPU) its end event has completed; never blocks."""
        marks = self._marks.get(step)
        if marks is None or marks[1] is None:
            return None
        start, end = marks
        if not self.cuda:
            return end - start
        if not end.query():
            return None
        return start.elapsed_time(end) / 1e3
