"""Times every collective of a step, without adding a synchronisation.

Where NCCL loaded Lagom's profiler plugin, a group's collectives come from NCCL's own records, read once per
step (``nccl``: ``lagom.runtime.apply.nccl_calls``), and the calls the tap and adapters report for them are
left at once. Every other call they report is timed here: wall clock and the work's completion callback on
CPU, CUDA events on the current stream on GPU, resolved when the step ends.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lagom.runtime.apply.nccl_calls import COLLECTIVES, ORDER, P2P, NcclCalls, NcclRows, Seconds
from lagom.runtime.apply.step_clock import device_now
from lagom.step.calls import CallRecord, TuningKey

log = logging.getLogger("lagom.runtime")

CALLBACK_GRACE_S = 0.01  # a completed future runs its callbacks right after waking its waiters
STALE_STEPS = 100  # a call still open this many steps after its own was never completed: dropped
FIELDS = len(CallRecord._fields)  # a record's fields, as the kept list holds them
_record = tuple.__new__  # (CallRecord, a row's fields) -> the record: a named tuple made in C from the row


class _Open:
    """A call whose end is not known yet. ``t0``/``start``/``end``: floats on CPU, CUDA events on GPU."""

    __slots__ = ("group", "collective", "nbytes", "seq", "step", "t0", "start", "end", "future", "exact", "tensors")

    def __init__(self, group: str, collective: str, nbytes: int, seq: int, step: int, t0: Any, start: Any,
                 tensors: int = 1) -> None:
        self.group, self.collective, self.nbytes, self.seq, self.step = group, collective, nbytes, seq, step
        self.t0, self.start, self.tensors = t0, start, tensors
        self.end: Any = None
        self.future: Any = None
        self.exact = True

    # Each drops the future once it has run: the future holds the call's outputs, which must not outlive
    # the caller's use of them until the step ends (a gathered parameter the framework frees, say).
    def finish_cpu(self, _future: Any = None) -> None:
        self.end = time.perf_counter()
        self.future = None

    def finish_cuda(self, _future: Any = None) -> None:
        # Run by the future with current streams that wait for the work's kernels: this event
        # completes when the collective does, and nothing on the host waits for it.
        self.end = device_now(True)
        self.future = None


class _TimedWork:
    """A work without a completion future: its end is taken when the caller waits for it."""

    __slots__ = ("_work", "_op", "_now")

    def __init__(self, work: Any, op: _Open, now: Callable[[], Any]) -> None:
        self._work, self._op, self._now = work, op, now

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._op.end is None:
            self._op.end = self._now()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Recorder:
    """Times the collectives of each step; never waits for one.

    ``track`` is called by the adapters right after issuing a call. Records come out of
    ``end_step``; a call whose completion is not visible yet (CUDA events not reached, future not
    done) stays open and comes out of a later ``end_step`` with its own step number.
    ``records`` keeps at least the last ``max_records`` records (at most a quarter more: trimming the list's
    front moves every record left, so it is done once per quarter, not every step); ``summary`` covers every step.
    They are kept as their fields, ``FIELDS`` a record one after another in one list: kept as objects, every step's
    records added to what each full collection of the process walks, and a long job paid more per call for those
    collections than for recording it; kept as a tuple each (which a collection stops tracking), every step's rows
    stayed young objects until one, which set off the garbage collector's young collection every few dozen steps.
    ``in_step`` is True between ``begin_step`` and ``end_step``: the torch.distributed tap records
    only then, so Lagom's own calls between steps are not taken for the job's.
    """

    def __init__(self, *, cuda: bool | None = None, max_records: int = 100_000) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.max_records = max_records
        self.step = 0
        self.in_step = False
        self._kept: list[Any] = []  # the kept records' fields (what CallRecord takes), FIELDS a record, oldest first
        self._seq = 0
        self._t0: Any = None
        self._open: list[_Open] = []
        self._totals: dict[tuple[str, str, int], list[float]] = {}  # (group, collective, bytes) -> [count, seconds]
        self.nccl: NcclCalls | None = None  # NCCL's own records, where its profiler plugin is Lagom's

    def _now(self) -> Any:
        return device_now(self.cuda)

    @property
    def records(self) -> list[CallRecord]:
        """The kept records, oldest first: made anew at each read (read it once, not per step)."""
        return list(map(_record, itertools.repeat(CallRecord), zip(*[iter(self._kept)] * FIELDS)))

    @property
    def pending(self) -> int:
        """Calls tracked but not resolved yet."""
        return len(self._open)

    def begin_step(self, step: int) -> None:
        self.step, self._seq, self._t0 = step, 0, self._now()
        self.in_step = True
        if self.nccl is not None:
            self.nccl.begin(step)

    def from_nccl(self, group: str, collective: str) -> bool:
        """Whether NCCL's own records carry this call (the caller then records nothing)."""
        return self.nccl is not None and self.nccl.takes(group, collective)

    def track(self, group: str, collective: str, nbytes: int, work: Any = None, tensors: int = 1,
              by_lagom: bool = False) -> Any:
        """Start timing a call now; it ends when ``work`` completes (now if there is no work). ``tensors``:
        how many coalesced tensors NCCL runs as this call of ``nbytes`` in all (``calls.nccl_aggregates``).
        ``by_lagom``: Lagom runs the call itself (Flash-Overlap's p2p steps), so NCCL records no collective for it.

        Returns what the caller should hand on instead of ``work``: the work itself, or, for a
        work without a completion future, a proxy that takes the end time when it is waited on.
        """
        nccl = self.nccl  # ``from_nccl`` inline: on every collective's calling thread
        if nccl is not None and not by_lagom:  # ``takes``' collectives' and transfers' cases inline
            if collective in COLLECTIVES:
                if group in nccl.owned:
                    return work
            elif collective in P2P:
                if group in nccl.owned_p2p and group not in nccl.p2p_to_tap:
                    return work
            elif nccl.takes(group, collective):
                return work
        if self._t0 is None:
            self._t0 = self._now()
        op = _Open(group, collective, int(nbytes), self._seq, self.step, self._t0, self._now(), tensors)
        self._seq += 1
        self._open.append(op)
        if work is None:
            op.end = op.start
            return None
        try:
            op.future = work.get_future()
        except (AttributeError, RuntimeError):  # gloo send/recv and reduce_scatter: no future
            op.exact = False
            return _TimedWork(work, op, self._now)
        op.future.add_done_callback(op.finish_cuda if self.cuda else op.finish_cpu)
        return work

    def ended(self, group: str, collective: str, nbytes: int, start: float, end: float, tensors: int = 1) -> None:
        """A call timed by its caller on the host clock (``time.perf_counter``): it ran from ``start`` to ``end``.
        Host recorders only (a CUDA recorder's times are events)."""
        if self.from_nccl(group, collective):
            return
        if self._t0 is None:
            self._t0 = self._now()
        op = _Open(group, collective, int(nbytes), self._seq, self.step, self._t0, start, tensors)
        op.end = end
        self._seq += 1
        self._open.append(op)

    def end_step(self) -> list[CallRecord]:
        """Resolve what has completed; return those records (this step's and late earlier ones)."""
        self.in_step = False
        done: list[tuple[Any, ...]] = []  # the rows' fields: kept field by field, records made once for the caller
        still: list[_Open] = []
        step_end = None
        stale = [op for op in self._open if op.step < self.step - STALE_STEPS] if self._open else None
        if stale:
            log.warning("dropping %d calls that never completed (e.g. %s issued in step %d): their works' futures "
                        "were never marked done", len(stale), f"{stale[0].group}/{stale[0].collective}", stale[0].step)
            self._open = [op for op in self._open if op.step >= self.step - STALE_STEPS]
        for op in self._open:
            future = op.future  # read before the end: a completion sets the end, then drops the future
            if op.end is None and future is None:  # no future, not waited through the proxy: the step end bounds it
                step_end = step_end or self._now()
                op.end = step_end
            elif op.end is None and not self.cuda and future.done():
                deadline = time.perf_counter() + CALLBACK_GRACE_S
                while op.end is None and time.perf_counter() < deadline:
                    time.sleep(0)
            record = self._resolve(op)
            if record is None:
                still.append(op)
            else:
                done.append(record)
        self._open = still
        nccl = self._from_nccl(done)
        done.sort(key=ORDER)
        if nccl.fields and done and ORDER(done[-1]) > ORDER(nccl.fields[0]):  # late calls of both interleave
            done += nccl.fields
            done.sort(key=ORDER)
            self._add_up(done)
        else:  # NCCL's rows come after the tracked ones, each key's added up in one array operation
            self._add_up(done)
            if nccl.durations is None:
                self._add_up(nccl.fields)
            else:
                self._add_up_durations(nccl.durations)
            done += nccl.fields
        kept = self._kept
        extend = kept.extend
        for row in done:  # its fields, not the row: the rows die with the step (a tuple copied in C each)
            extend(row)
        if len(kept) > (self.max_records + self.max_records // 4) * FIELDS:
            del kept[: len(kept) - self.max_records * FIELDS]
        return list(map(_record, itertools.repeat(CallRecord), done))  # each a C copy of its row, no Python call

    def _add_up(self, rows: list[tuple[Any, ...]]) -> None:
        totals = self._totals  # keyed by tuple: a key's text is made once, in ``summary``, not per call
        for group, collective, nbytes, _, _, start_s, end_s, _, _ in rows:
            total = totals.get((group, collective, nbytes))
            if total is None:
                total = totals[(group, collective, nbytes)] = [0, 0.0]
            total[0] += 1
            total[1] += end_s - start_s

    def _add_up_durations(self, durations: list[tuple[tuple[str, str, int], Seconds]]) -> None:
        """As ``_add_up`` rows of these durations, to the same float: a running sum is added in order, as one by one
        (an array's in one operation; a list's, a small drain's few, one by one)."""
        totals = self._totals
        for key, seconds in durations:
            total = totals.get(key)
            if total is None:
                total = totals[key] = [0, 0.0]
            total[0] += len(seconds)
            if isinstance(seconds, list):
                added = total[1]
                for s in seconds:
                    added += s
                total[1] = added
            else:
                total[1] = float(np.add.accumulate(np.concatenate(((total[1],), seconds)))[-1])

    def _from_nccl(self, tracked: list[tuple[Any, ...]]) -> NcclRows:
        """NCCL's records drained at this step's end; on a failure, said once, the tap and adapters record every
        call from the next step (a job must never fail because Lagom reads NCCL's records)."""
        if self.nccl is None:
            return NcclRows()
        try:
            return self.nccl.end(self._seq, tracked)
        except Exception as err:  # noqa: BLE001 - recording must never fail the job's step
            self.nccl = None
            log.warning("NCCL profiler: reading its records failed (%s: %s); collectives are recorded through "
                        "torch's hooks from the next step", type(err).__name__, err)
            return NcclRows()

    def _resolve(self, op: _Open) -> tuple[Any, ...] | None:
        """The call's row, as the fields CallRecord takes; None while it has not completed."""
        if op.end is None:
            return None
        if self.cuda:
            if not (op.t0.query() and op.start.query() and op.end.query()):
                return None
            start, end = op.t0.elapsed_time(op.start) / 1e3, op.t0.elapsed_time(op.end) / 1e3
        else:
            start, end = op.start - op.t0, op.end - op.t0
        return op.group, op.collective, op.nbytes, op.seq, op.step, start, max(start, end), op.exact, op.tensors

    def summary(self) -> dict[str, dict[str, float]]:
        """Per key over every resolved call: how many, and their total seconds."""
        return {str(TuningKey(*k)): {"count": int(c), "total_s": t} for k, (c, t) in self._totals.items()}
