"""Opt-in record of what a rank did, in order, so tests and tools can check the overlap schedule.

Recording is process-wide rather than context-local because autograd may run backward on another
thread; it costs one list append per step while active and nothing otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

StepKind = Literal["compute", "send", "recv", "wait", "reduce"]


@dataclass(frozen=True)
class Step:
    """One step of a decomposed collective on this rank.

    op: which operator ran it (e.g. "all_gather_matmul.forward").
    kind: "compute" (work on one piece), "send"/"recv" (transfer posted), "wait" (compute waits for
        a posted transfer to land), "reduce" (a received partial added into the result).
    peer: group rank whose shard the step is about: the source for gathered pieces, the destination
        for scattered partials, the sender for waits and reductions.
    chunk: chunk index within that shard; None when the step covers the whole shard.
    numel: elements moved (transfers only, 0 otherwise).
    """

    op: str
    kind: StepKind
    peer: int
    chunk: int | None
    numel: int = 0


_recorders: list[list[Step]] = []


@contextmanager
def record_schedule() -> Iterator[list[Step]]:
    """Collect every step this process runs inside the block into the yielded list."""
    steps: list[Step] = []
    _recorders.append(steps)
    try:
        yield steps
    finally:
        _recorders.remove(steps)


def note(op: str, kind: StepKind, peer: int, chunk: int | None, numel: int = 0) -> None:
    """Append one step to every active recorder."""
    if _recorders:
        step = Step(op, kind, peer, chunk, numel)
        for steps in _recorders:
            steps.append(step)
