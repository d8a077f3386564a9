"""The recorder's collectives as NCCL itself saw them: Lagom's profiler plugin, drained once per step.

Where NCCL loaded Lagom's profiler (``lagom.nccl_profiler``), every collective NCCL runs lands in a ring in C
with no Python on NCCL's path. ``NcclCalls`` reads that ring once per step, on the thread that ends the step
(one C call), and turns the step's records into the recorder's ``CallRecord`` rows. Records are put in the
step whose window (``begin_step`` to ``end_step``, on CLOCK_MONOTONIC) holds the collective's launch, so a
record published after its step ended (its kernel channels report late) keeps its step; a launch outside every
window (between steps: Lagom's own agreement, the framework's housekeeping) is left out, as the torch tap
leaves it out.

Which layer records a call (never two). The profiler takes over a group's collectives (``COLLECTIVES``) from the
step after its communicator is matched to the group, and its sends and receives (``P2P``: NCCL's P2p events,
one row per transfer, under the tap's names send_recv and recv) from the step after NCCL first reports one on a
communicator matched to the group by hash, commName or call order (a rank count alone could be torch's two-rank
communicator of another group's pair). Until then, and for everything else (all-to-all, gloo, a group no
communicator could be matched to), the torch tap and the adapters' layers record as before. A call Lagom runs
itself (Flash-Overlap's p2p steps for a collective key) stays the adapters' to record. A step's records of a
group not yet taken over are dropped here, since the tap has them.

Collectives torch runs as NCCL sends and receives (all-to-all: ``BUILT_ON_P2P``) give P2p events NCCL's records
cannot tell from the job's own transfers. So the first one the tap sees on a group hands that group's sends and
receives back to the tap at that moment: the group's P2p records launched from then on are dropped (said once).
torch's gather and scatter, which the tap does not record, are built the same way and would show as transfers.

Matching communicators to groups (``drain.group_names``): a commName that is one of the group's torch names,
else the only group of that rank count, else call order: a communicator whose step's sequence of (collective,
bytes) equals that of exactly one group of its size, as the tap recorded it in the same step (checked on steps
``ORDER_LAG`` behind, whose calls have all completed). Each method used is said once in the log.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import struct
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import gt, itemgetter, le, lt
from pathlib import Path
from typing import Any, cast

import numpy as np

from lagom.nccl_profiler.drain import (
    FUNCTIONS,
    P2P_FUNCTIONS,
    PER_RANK_COUNT,
    RECORD_DTYPE,
    CollectiveRecord,
    Drained,
    GroupMatch,
    ProfilerDrain,
    group_names,
    joined,
)
from lagom.step.calls import CallRecord

log = logging.getLogger("lagom.runtime")

COLLECTIVES = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"})
P2P = frozenset({"send_recv", "recv"})  # the tap's names for a send and a receive (a send is a send_recv key's)
BUILT_ON_P2P = frozenset({"all_to_all"})  # run by torch as NCCL sends and receives (see the module docstring)
P2P_TRUSTED = frozenset({"hash", "comm_name", "call_order"})  # matches that a communicator's transfers may follow
WINDOWS = 100  # steps whose windows are kept for late records (the recorder's STALE_STEPS)
ORDER_LAG = 2  # steps between a step's end and its use for call-order matching
KEPT_RECORDS = 1 << 16  # records kept for the report's what-ran table (the most recent)
NEVER = int(np.iinfo(np.int64).max)
Seconds = np.ndarray | list[float]  # a key's row durations
_NAMES = list(CallRecord._fields)  # a row's fields, in the order CallRecord takes them
ORDER = itemgetter(_NAMES.index("step"), _NAMES.index("seq"))  # a row's fields -> the recorder's order of rows


def row_name(function: str | None) -> str:
    """A record's collective as the recorder, the tap and the plan name it: NCCL's send is a send_recv key's."""
    return "send_recv" if function == "send" else function or "?"


def _shares_a_launch(start: np.ndarray, stop: np.ndarray, comm: np.ndarray | None) -> bool:
    """Whether two of these collectives are of one launch (a coalesced operation), as ``drain.launches`` numbers
    them: on the same communicator, one starts before the one before it stopped. ``comm`` None: all on one
    communicator (then usually in start order already, and not sorted)."""
    if comm is None:
        if not (start[1:] >= start[:-1]).all():
            order = np.argsort(start, kind="stable")
            start, stop = start[order], stop[order]
        return bool((start[1:] <= stop[:-1]).any())
    order = np.lexsort((start, comm))
    start, stop, comm = start[order], stop[order], comm[order]
    return bool(((comm[1:] == comm[:-1]) & (start[1:] <= stop[:-1])).any())


def _launches_overlap(comm: list[int] | None, start: Sequence[int], stop: Sequence[int], calls: Sequence[int]) -> bool:
    """``_shares_a_launch`` of the records ``calls`` of columns as lists (``comm``: each record's communicator; None:
    all on one): put in (communicator, start) order (stable), whether one starts before the one before it, on its
    communicator, stopped."""
    if comm is None:
        starts = [start[i] for i in calls]
        if all(map(le, starts, starts[1:])):  # in start order already, usually
            return any(map(le, starts[1:], [stop[i] for i in calls]))
    ordered = sorted(calls, key=(lambda i: start[i]) if comm is None else (lambda i: (comm[i], start[i])))
    return any((comm is None or comm[a] == comm[b]) and start[b] <= stop[a] for a, b in zip(ordered, ordered[1:]))


class _Pick:
    """A column's values at ``rows``, in that order, as a list."""

    __slots__ = ("rows",)

    def __init__(self, rows: Sequence[int]) -> None:
        self.rows = rows

    def __call__[T](self, column: Sequence[T]) -> list[T]:
        return [column[i] for i in self.rows]


def _same[T](column: Sequence[T]) -> Sequence[T]:
    return column


_FLAT: dict[int, struct.Struct] = {}  # per record count: ``LISTED`` that many times, one struct


def _listed(records: np.ndarray) -> list[tuple[int, ...]]:
    """The columns ``LISTED`` reads, each a tuple of every record's value."""
    flat = _FLAT.get(len(records))
    if flat is None:
        flat = _FLAT[len(records)] = struct.Struct("<" + LISTED.format.lstrip("<") * len(records))
    values = flat.unpack(records)
    width = len(LISTED_FIELDS)
    return [values[i::width] for i in range(width)]


def _durations(names: list[str], functions: list[str], sizes: list[int], kinds: np.ndarray, nbytes: np.ndarray,
               seconds: np.ndarray) -> list[tuple[tuple[str, str, int], Seconds]]:
    """Each key's row durations (``seconds``), in row order; ``kinds`` and ``nbytes`` say which rows share a key
    (their communicator and function, and their bytes), ``names``, ``functions`` and ``sizes`` what the key is."""
    if (kinds == kinds[0]).all() and (nbytes == nbytes[0]).all():  # the usual drain: one key
        return [((names[0], functions[0], sizes[0]), seconds)]
    order = np.lexsort((nbytes, kinds))  # stable: each run of one (communicator, function, bytes) in row order
    kinds, nbytes = kinds[order], nbytes[order]
    runs = np.split(order, np.flatnonzero((kinds[1:] != kinds[:-1]) | (nbytes[1:] != nbytes[:-1])) + 1)
    return [(key, seconds[rows[0] if len(rows) == 1 else np.sort(np.concatenate(rows))])
            for key, rows in _keyed(runs, names, functions, sizes).items()]


def _keyed[Run: (np.ndarray, list[int])](runs: Iterable[Run], names: list[str], functions: list[str],
                                         sizes: Sequence[int]) -> dict[tuple[str, str, int], list[Run]]:
    """Runs of rows (each of one communicator, function and bytes, in (communicator, function, bytes) order) by the
    key they are: two communicators of one group, or a send and a send_recv, are one key."""
    by_key: dict[tuple[str, str, int], list[Run]] = {}
    for run in runs:
        i = int(run[0])
        by_key.setdefault((names[i], functions[i], sizes[i]), []).append(run)
    return by_key


def _numbered(launched: np.ndarray, at: np.ndarray | None, windows: list[_Window]
              ) -> tuple[np.ndarray, range | list[int], list[int], np.ndarray | None]:
    """Rows launched at ``launched`` (in launch order) in windows ``at`` (None: all in the one): their start in
    seconds from their window's begin, their seq (each window numbers its rows after its tracked calls, in launch
    order) and step, in (step, seq) order as the recorder keeps rows; and the order that puts them so (None: they
    are already)."""
    n = len(launched)
    if at is None or (at[0] == at[-1] and (at == at[0]).all()):  # one window: this step's, the usual case
        window = windows[0 if at is None else int(at[0])]
        window.next_seq += n
        return (launched - window.begin_ns) / 1e9, range(window.next_seq - n, window.next_seq), [window.step] * n, None
    start_s = (launched - np.array([w.begin_ns for w in windows], np.int64)[at]) / 1e9
    seq = np.empty(n, dtype=np.int64)
    for i in np.unique(at).tolist():
        mine = at == i
        seq[mine] = windows[i].next_seq + np.arange(int(mine.sum()))
        windows[i].next_seq += int(mine.sum())
    steps = np.array([w.step for w in windows], np.int64)[at]
    order = np.lexsort((seq, steps))  # stable; a job's step ids may repeat or go back
    if (order[1:] > order[:-1]).all():
        return start_s, seq.tolist(), steps.tolist(), None
    return start_s[order], seq[order].tolist(), steps[order].tolist(), order


def _each(values: list[int], of: np.ndarray | None) -> int | np.ndarray:
    """Per record, a value of a few (one per window, or per communicator): ``values[0]`` itself where every record
    has the one (``of`` None), else each record's ``values[of]``."""
    return values[0] if of is None else np.array(values, dtype=np.int64)[of]


def _placed(launch: np.ndarray, earliest: int, windows: list[_Window]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Each record's window by its launch (``earliest``: the first): its position in ``windows``, None where there
    is one window; and which records are in a window at all, None where every one is (the usual drain)."""
    ends = [NEVER if w.end_ns is None else w.end_ns for w in windows]
    if len(windows) == 1:
        if windows[0].begin_ns <= earliest and int(launch.max()) <= ends[0]:
            return None, None
        return None, (launch >= windows[0].begin_ns) & (launch <= ends[0])
    at = np.searchsorted(np.array([w.begin_ns for w in windows], np.int64), launch, side="right") - 1
    inside = (at >= 0) & (launch <= np.array(ends, np.int64)[np.maximum(at, 0)])
    return at, None if inside.all() else inside


# by a record's function id (a byte): whether its count is one rank's share, whether it is a collective the
# profiler takes, whether it is a send or receive, and its row's name
PER_RANK = np.isin(np.arange(256), [FUNCTIONS.index(f) for f in PER_RANK_COUNT])
TAKEN = np.isin(np.arange(256), [FUNCTIONS.index(f) for f in COLLECTIVES])
IS_P2P = np.isin(np.arange(256), [FUNCTIONS.index(f) for f in P2P_FUNCTIONS])
ROW_NAMES = np.array([row_name(FUNCTIONS[i] if i < len(FUNCTIONS) else None) for i in range(256)], dtype=object)
# the same as lists, for the plain-Python rows of a small drain
PER_RANK_OF, TAKEN_OF, IS_P2P_OF, ROW_NAMES_OF = PER_RANK.tolist(), TAKEN.tolist(), IS_P2P.tolist(), ROW_NAMES.tolist()
PER_RANK_IDS = frozenset(np.flatnonzero(PER_RANK).tolist())
SMALL_DRAIN = 40  # records up to which a drain's rows are made in plain Python (``NcclCalls._rows``)


def _record_struct(fields: tuple[tuple[str, str], ...]) -> struct.Struct:
    """A struct that reads these fields (name, struct code; in the record's order) of one record, skipping the rest."""
    layout, at, offsets = "<", 0, RECORD_DTYPE.fields
    assert offsets is not None
    for name, code in fields:
        offset = offsets[name][1]
        assert offset >= at and struct.calcsize(code) == RECORD_DTYPE[name].itemsize
        layout += f"{offset - at}x{code}" if offset > at else code
        at = offset + struct.calcsize(code)
    return struct.Struct(layout + (f"{RECORD_DTYPE.itemsize - at}x" if at < RECORD_DTYPE.itemsize else ""))


# a record's fields that rows are made of (and n_ranks, read where a drain has a collective counted per rank): the
# hash as stored; the count and the times as the array path views them (int64), so that the two compute on the same
# integers
LISTED_FIELDS = (("comm_hash", "Q"), ("count", "q"), ("host_start_ns", "q"), ("host_stop_ns", "q"),
                 ("gpu_start_ns", "q"), ("gpu_stop_ns", "q"), ("func", "B"), ("type_size", "B"), ("channel_events", "B"))
LISTED = _record_struct(LISTED_FIELDS)
assert LISTED.size == RECORD_DTYPE.itemsize
_ZEROS = itertools.repeat(0)  # the one communicator's, or window's, position, for every record
_BILLIONS = itertools.repeat(1e9)


@dataclass(frozen=True)
class NcclGroup:
    """A process group whose collectives run on NCCL: its plan name, rank count and torch's names for it
    (``group_name``, ``group_desc``), which a communicator's commName may be."""

    name: str
    size: int
    aliases: tuple[str, ...] = ()


@dataclass(slots=True)  # not frozen: made once per step, and a frozen one's fields cost a setattr call each
class NcclRows:
    """One drain's rows as tuples of their fields (what ``CallRecord`` takes, which the recorder keeps as they are),
    in (step, seq) order; and each key's row durations in that order (``None``: add them up from the rows), so that
    the recorder's totals take a key's rows in one array operation, not one by one (a list, from a small drain's
    plain-Python rows: added one by one, to the same float)."""

    fields: list[tuple[Any, ...]] = field(default_factory=list)
    durations: list[tuple[tuple[str, str, int], Seconds]] | None = None


@dataclass
class _Window:
    index: int  # the recorder's count of steps begun: ownership is by this, since a job's step ids may repeat
    step: int
    begin_ns: int
    end_ns: int | None = None
    next_seq: int = 0  # the seq of this step's next row (after the tracked calls')


@dataclass
class _Signatures:
    """Per (window index, group or communicator hash): the (collective, bytes) calls seen, in launch order."""

    tracked: dict[tuple[int, str], list[tuple[str, int]]] = field(default_factory=dict)
    profiled: dict[tuple[int, int], list[tuple[int, str, int]]] = field(default_factory=dict)  # (launch ns, coll, bytes)

    def trim(self, oldest: int) -> None:
        if self.tracked:  # empty once every group's collectives are NCCL's: nothing to rebuild each step
            self.tracked = {k: v for k, v in self.tracked.items() if k[0] >= oldest}
        if self.profiled:
            self.profiled = {k: v for k, v in self.profiled.items() if k[0] >= oldest}


class NcclCalls:
    """One recorder's reader of the profiler's ring. ``groups``: the process's NCCL groups, asked again whenever
    NCCL has initialised a communicator the reader has not matched yet."""

    def __init__(self, reader: ProfilerDrain, groups: Callable[[], list[NcclGroup]]) -> None:
        self.reader, self._groups = reader, groups
        self.matches: dict[int, GroupMatch] = {}  # communicator hash -> group and method
        self.owned: dict[str, int] = {}  # group -> first window index whose collectives the profiler records
        self.owned_p2p: dict[str, int] = {}  # group -> first window index whose sends and receives it records
        self.p2p_to_tap: dict[str, int] = {}  # group -> monotonic ns from which the tap records its transfers again
        self.records: deque[np.ndarray] = deque()  # drained records of the job's steps, for what_ran (bounded)
        self._kept = 0
        self._windows: deque[_Window] = deque(maxlen=WINDOWS)
        self._index = 0
        self._communicators = 0
        self._signatures = _Signatures()
        self._sizes: dict[str, int] = {}  # group -> rank count, as last asked
        self._said: set[str] = set()
        self.loaded = False  # NCCL initialised this plugin in this process (at least one communicator)

    # -- the recorder's step -----------------------------------------------------------------------
    def begin(self, step: int) -> None:
        self._index += 1
        self._windows.append(_Window(self._index, step, time.monotonic_ns()))

    def takes(self, group: str, collective: str) -> bool:
        """Whether the profiler records this call from now on (the tap and adapters then leave it). An all-to-all
        the tap is about to record hands the group's sends and receives back to the tap."""
        if collective in COLLECTIVES:
            return group in self.owned
        if collective in P2P:
            return group in self.owned_p2p and group not in self.p2p_to_tap
        if collective in BUILT_ON_P2P and group not in self.p2p_to_tap:
            self._p2p_back_to_tap(group, collective)
        return False

    def _p2p_back_to_tap(self, group: str, collective: str) -> None:
        self.p2p_to_tap[group] = time.monotonic_ns()
        if group in self.owned_p2p and "p2p_back" not in self._said:
            self._said.add("p2p_back")
            log.info("NCCL profiler: %s ran %s, which NCCL runs as sends and receives its records cannot tell from the "
                     "job's own; the group's sends and receives are recorded through torch's hooks from now on (and "
                     "any other group's after its first such call)", group, collective)

    def end(self, tracked_seq: int, tracked: list[tuple[Any, ...]]) -> NcclRows:
        """The step ends: one drain; returns the rows of the records it holds (this step's and late ones of
        earlier steps). ``tracked``: the rows' fields of what the tap and adapters recorded at this end, in the order
        they were issued (for call-order matching);
        ``tracked_seq``: how many calls they numbered in this step (the profiler's rows are numbered after)."""
        window = self._windows[-1] if self._windows else None
        if window is not None and window.end_ns is None:
            window.end_ns, window.next_seq = time.monotonic_ns(), tracked_seq
        if not self.loaded:
            self.loaded = self.reader.stats().communicators > 0
            if not self.loaded:
                return NcclRows()
        drained = self.reader.drain()
        self._remember_tracked(tracked)
        rows = self._rows(drained)
        self._match()
        return rows

    # -- records to rows ---------------------------------------------------------------------------
    def _rows(self, drained: Drained) -> NcclRows:
        """Rows of the records of taken-over groups, in (step, seq) order; the rest feed call-order matching.
        This runs for every collective of the job. A drain of more than ``SMALL_DRAIN`` records is computed on
        arrays (``_array_rows``), one Python object per row; a smaller one, a step of few collectives, in plain
        Python (``_listed_rows``), where the array path's fixed cost (some 35 NumPy calls of about a microsecond on
        tiny arrays) would be most of the step's. The two give the same rows, to the bit, and leave the same state."""
        records = drained.records
        if not len(records) or not self._windows:
            return NcclRows()
        if len(records) <= SMALL_DRAIN:
            return self._listed_rows(records)
        return self._array_rows(records)

    def _array_rows(self, records: np.ndarray) -> NcclRows:
        """``_rows`` on arrays: each column is read once, and what every record of a drain usually shares (its window,
        its communicator) stays one value, not an array, with the general case's sorting and grouping skipped."""
        launch = records["host_start_ns"].view(np.int64)  # CLOCK_MONOTONIC ns: well inside int64
        earliest = int(launch.min())
        windows = self._windows_from(earliest)
        at, inside = _placed(launch, earliest, windows)
        if inside is not None:
            records, launch = records[inside], launch[inside]
            at = None if at is None else at[inside]
            if not len(records):
                return NcclRows()
        self._keep(records)
        func, comm = records["func"], records["comm_hash"]
        stop = records["host_stop_ns"].view(np.int64)
        gpu_start, gpu_stop = records["gpu_start_ns"].view(np.int64), records["gpu_stop_ns"].view(np.int64)
        nbytes = records["count"].view(np.int64) * records["type_size"]
        per_rank = PER_RANK.take(func)
        if per_rank.any():
            nbytes = np.where(per_rank, nbytes * records["n_ranks"], nbytes)
        gpu = (records["channel_events"] > 0) & (gpu_stop > gpu_start)
        took = np.where(gpu, gpu_stop - gpu_start, np.maximum(stop - launch, 0))
        # per communicator: its group, the first window whose collectives and whose transfers the profiler records
        # (else never), and until when it records the transfers
        of_hash: np.ndarray | None = None  # each record's communicator in ``hashes``; None: all of the one
        if comm[0] == comm[-1] and (comm == comm[0]).all():
            hashes = [int(comm[0])]
        else:
            unique, of_hash = np.unique(comm, return_inverse=True)
            hashes = unique.tolist()
        groups, trusted, owned, owned_p2p, p2p_to_tap = self._owners(hashes)
        since, since_p2p, until_p2p = _each(owned, of_hash), _each(owned_p2p, of_hash), _each(p2p_to_tap, of_hash)
        index = _each([w.index for w in windows], at)
        if None in groups:
            unmatched = TAKEN.take(func) & (groups[0] is None if of_hash is None
                                            else np.array([g is None for g in groups])[of_hash])
            mine = np.flatnonzero(unmatched)
            self._remember_unmatched(zip(itertools.repeat(cast(int, index)) if at is None
                                         else cast(np.ndarray, index)[mine].tolist(),
                                         comm[mine].tolist(), launch[mine].tolist(), func[mine].tolist(),
                                         nbytes[mine].tolist()))
        p2p = IS_P2P.take(func)
        wanted = TAKEN.take(func) & (index >= since)
        transfers = bool(p2p.any())
        if transfers:
            self._take_p2p_over(groups, trusted, [0] if of_hash is None else np.unique(of_hash[p2p]).tolist())
            wanted |= p2p & (index >= since_p2p) & (launch < until_p2p)
        taken: slice | np.ndarray = slice(None)  # every record, the usual drain
        if not wanted.all():
            taken = np.flatnonzero(wanted)
            if not len(taken):
                return NcclRows()
        colls = np.flatnonzero(wanted & ~p2p) if transfers else taken  # a send or receive is its own transfer
        if len(launch[colls]) > 1 and _shares_a_launch(launch[colls], stop[colls],
                                                       None if of_hash is None else comm[colls]):
            return self._joined_rows(Drained(records[taken], 0).collectives(), windows)  # a coalesced launch
        launched = launch[taken]
        if not (launched[1:] >= launched[:-1]).all():
            taken = np.arange(len(records))[taken][np.argsort(launched, kind="stable")]  # launch order, across comms
            launched = launch[taken]
        start_s, seq, steps, order = _numbered(launched, None if at is None else at[taken], windows)
        if order is not None:
            taken = np.arange(len(records))[taken][order]
        n = len(launched)
        names = cast(list[str], [groups[0]] * n if of_hash is None  # a taken row's group is a matched one
                     else np.array(groups, dtype=object)[of_hash[taken]].tolist())
        func, nbytes, end_s = func[taken], nbytes[taken], start_s + took[taken] / 1e9
        functions, sizes = ROW_NAMES.take(func).tolist(), nbytes.tolist()
        fields = list(zip(names, functions, sizes, seq, steps, start_s.tolist(), end_s.tolist(), gpu[taken].tolist(),
                          itertools.repeat(1)))  # one tensor each: only a coalesced launch joins several
        kinds = func if of_hash is None else of_hash[taken] * 256 + func  # each row's (communicator, function)
        return NcclRows(fields, _durations(names, functions, sizes, kinds, nbytes, end_s - start_s))

    def _listed_rows(self, records: np.ndarray) -> NcclRows:
        """``_rows`` in plain Python, for a small drain: ``_array_rows``' steps in its order, on its columns as tuples
        and lists (``LISTED`` reads the same integers from each record), with the same arithmetic. Whether a record
        is taken is decided once per (communicator, window, function) it has, and what every record of a drain
        usually shares (its window, its communicator, its function) stays one value, as there."""
        columns = _listed(records)
        launch = columns[2]
        ordered: bool | None = all(map(le, launch, launch[1:]))  # in launch order (usually): None, not known
        earliest, latest = (launch[0], launch[-1]) if ordered else (min(launch), max(launch))
        windows = self._windows_from(earliest)
        ends = [NEVER if w.end_ns is None else w.end_ns for w in windows]
        at: list[int] | None = None  # each record's window in ``windows``; None: all in the first (the usual drain)
        if len(windows) > 1 or not (windows[0].begin_ns <= earliest and latest <= ends[0]):
            begins = [w.begin_ns for w in windows]
            at = [bisect.bisect_right(begins, t) - 1 for t in launch]
            inside = [i for i, (w, t) in enumerate(zip(at, launch)) if w >= 0 and t <= ends[w]]
            if len(inside) < len(launch):
                if not inside:
                    return NcclRows()
                records, at = records[inside], [at[i] for i in inside]
                columns = _listed(records)
                latest, ordered = max(columns[2]), None
        self._keep(records)
        comm, count, launch, stop, gpu_start, gpu_stop, func, size, events = columns
        n = len(launch)
        hashes = [comm[0]] if comm.count(comm[0]) == n else sorted(set(comm))  # one, usually
        of_hash = None if len(hashes) == 1 else list(map({h: k for k, h in enumerate(hashes)}.__getitem__, comm))
        groups, trusted, since, since_p2p, until_p2p = self._owners(hashes)
        indices = [w.index for w in windows]
        functions_run = {func[0]} if func.count(func[0]) == n else set(func)
        if count.count(count[0]) == n and size.count(size[0]) == n:  # every record of one size, usually
            nbytes = [count[0] * size[0]] * n
        else:
            nbytes = [c * z for c, z in zip(count, size)]
        if not PER_RANK_IDS.isdisjoint(functions_run):
            nbytes = [b * r if PER_RANK_OF[f] else b for b, r, f in zip(nbytes, records["n_ranks"].tolist(), func)]
        took: list[int] | None = None  # each record's time, ns; None: its GPU time, every record's (the usual drain)
        if min(events) > 0 and all(map(gt, gpu_stop, gpu_start)):
            gpu = [True] * n
        else:
            gpu = [e > 0 and b > a for e, a, b in zip(events, gpu_start, gpu_stop)]
            took = [b - a if g else max(p - t, 0) for g, a, b, t, p in zip(gpu, gpu_start, gpu_stop, launch, stop)]
        # what decides whether a record is taken: its communicator, window and function (its function alone where
        # the drain has one communicator and one window); per such key, 1: taken, 2: taken where launched before the
        # tap took the group's transfers back (1 where every record of the drain was), 0: not taken
        simple = of_hash is None and at is None
        keys: Sequence[Hashable] = func if simple else list(zip(_ZEROS if of_hash is None else of_hash,
                                                                _ZEROS if at is None else at, func))
        verdict: dict[Hashable, int] = {}
        unmatched, reporting = set(), set()
        for key in functions_run if simple else set(keys):
            k, w, f = (0, 0, key) if simple else cast(tuple[int, int, int], key)
            if IS_P2P_OF[f]:
                reporting.add(k)
                verdict[key] = (1 if until_p2p[k] > latest else 2) if indices[w] >= since_p2p[k] else 0
            else:
                verdict[key] = int(TAKEN_OF[f] and indices[w] >= since[k])
                if TAKEN_OF[f] and groups[k] is None:
                    unmatched.add(key)
        if unmatched:
            self._remember_unmatched([(indices[0 if at is None else at[i]], comm[i], launch[i], func[i], nbytes[i])
                                      for i, key in enumerate(keys) if key in unmatched])
        if reporting:
            self._take_p2p_over(groups, trusted, sorted(reporting))
        every = set(verdict.values()) == {1}  # every record taken, the usual drain
        taken: Sequence[int] = range(n)
        if not every:
            taken = [i for i, key in enumerate(keys)
                     if (v := verdict[key]) == 1 or v == 2 and launch[i] < until_p2p[0 if of_hash is None else of_hash[i]]]
            if not taken:
                return NcclRows()
        launched = launch if every else [launch[i] for i in taken]
        later = launched[1:]
        in_order = ordered if every and ordered is not None else all(map(le, launched, later))
        colls = [i for i in taken if not IS_P2P_OF[func[i]]] if reporting else taken  # a transfer is its own
        if len(colls) > 1 and (any(map(le, later, stop if every else [stop[i] for i in taken]))
                               if of_hash is None and in_order and colls is taken
                               else _launches_overlap(of_hash, launch, stop, colls)):
            return self._joined_rows(Drained(records[list(taken)], 0).collectives(), windows)  # a coalesced launch
        if not in_order:
            taken = sorted(taken, key=launch.__getitem__)  # launch order, across communicators (stable)
            launched, every = [launch[i] for i in taken], False
        pick = _same if every else _Pick(taken)
        m = len(launched)
        seq: Sequence[int]
        there = None if at is None else pick(at)
        if there is None or there.count(there[0]) == m:  # one window: this step's, the usual case
            window = windows[0 if there is None else there[0]]
            window.next_seq += m
            seq, steps = range(window.next_seq - m, window.next_seq), [window.step] * m
            begin = window.begin_ns
            start_s = [(t - begin) / 1e9 for t in launched]
        else:  # each window numbers its rows in launch order, and the rows go in (step, seq) order
            seq, steps, start_s = [], [], []
            for t, w in zip(launched, there):
                window = windows[w]
                seq.append(window.next_seq)
                window.next_seq += 1
                steps.append(int(window.step))
                start_s.append((t - window.begin_ns) / 1e9)
            order = sorted(range(m), key=list(zip(steps, seq)).__getitem__)
            if not all(map(lt, order, order[1:])):
                pick = _Pick([pick(range(n))[j] for j in order])
                seq, steps, start_s = [seq[j] for j in order], [steps[j] for j in order], [start_s[j] for j in order]
        names = cast(list[str], [groups[0]] * m if of_hash is None  # a taken row's group is a matched one
                     else [groups[k] for k in pick(of_hash)])
        one_function = len(functions_run) == 1
        functions = [ROW_NAMES_OF[func[0]]] * m if one_function else [ROW_NAMES_OF[f] for f in pick(func)]
        sizes = pick(nbytes)
        if took is None:
            end_s = [a + (b - c) / 1e9 for a, c, b in zip(start_s, pick(gpu_start), pick(gpu_stop))]
        else:
            end_s = [a + t / 1e9 for a, t in zip(start_s, pick(took))]
        fields = list(zip(names, functions, sizes, seq, steps, start_s, end_s, pick(gpu),
                          itertools.repeat(1)))  # one tensor each: only a coalesced launch joins several
        seconds = [e - a for a, e in zip(start_s, end_s)]
        if of_hash is None and one_function and sizes.count(sizes[0]) == m:  # the usual drain: one key
            return NcclRows(fields, [((names[0], functions[0], sizes[0]), seconds)])
        runs: dict[tuple[int, int, int], list[int]] = {}  # the rows of each (communicator, function, bytes)
        for j, kind in enumerate(zip(_ZEROS if of_hash is None else pick(of_hash), pick(func), sizes)):
            runs.setdefault(kind, []).append(j)
        keyed = _keyed([runs[kind] for kind in sorted(runs)], names, functions, sizes)
        return NcclRows(fields, [(key, [seconds[j] for j in (rows[0] if len(rows) == 1 else sorted(
            itertools.chain.from_iterable(rows)))]) for key, rows in keyed.items()])

    def _owners(self, hashes: list[int]) -> tuple[list[str | None], list[bool], list[int], list[int], list[int]]:
        """Per communicator of ``hashes``: its group (None: none matched); whether its transfers may follow that
        match; the first window index whose collectives, and whose transfers, the profiler records (else NEVER); and
        the launch (monotonic ns) from which the tap records its transfers again (else NEVER)."""
        groups: list[str | None] = []
        trusted, since, since_p2p, until_p2p = [], [], [], []
        for h in hashes:
            match = self.matches.get(h)
            group = None if match is None else match.group
            groups.append(group)
            trusted.append(group is not None and cast(GroupMatch, match).method in P2P_TRUSTED)
            since.append(NEVER if group is None else self.owned.get(group, NEVER))
            since_p2p.append(self.owned_p2p.get(cast(str, group), NEVER) if trusted[-1] else NEVER)
            until_p2p.append(NEVER if group is None else self.p2p_to_tap.get(group, NEVER))
        return groups, trusted, since, since_p2p, until_p2p


    def _windows_from(self, earliest_ns: int) -> list[_Window]:
        """The windows a record launched at ``earliest_ns`` or later can be in: the last begun by then, and every
        later one (usually this step's alone, not all ``WINDOWS`` kept)."""
        windows = self._windows
        first = len(windows) - 1
        while first > 0 and windows[first].begin_ns > earliest_ns:
            first -= 1
        return [windows[i] for i in range(first, len(windows))]  # no walk over the deque to its tail

    def _joined_rows(self, records: list[CollectiveRecord], windows: list[_Window]) -> NcclRows:
        """Rows where a launch ran several collectives (a coalesced operation): one per aggregate NCCL planned
        (``drain.joined``), with its total bytes and its tensor count, as the tap and adapters record it."""
        begins = [w.begin_ns for w in windows]
        rows = []
        for r in sorted(joined(records), key=lambda r: r.host_start_ns):
            window = windows[bisect.bisect_right(begins, r.host_start_ns) - 1]
            start = (r.host_start_ns - window.begin_ns) / 1e9
            rows.append((self._group_of(r.comm_hash) or "?", row_name(r.function), r.bytes, window.next_seq, window.step,
                         start, start + r.duration_ns / 1e9, r.time_source == "gpu", r.tensors))
            window.next_seq += 1
        rows.sort(key=ORDER)
        return NcclRows(rows)

    def _take_p2p_over(self, groups: list[str | None], trusted: list[bool], reporting: list[int]) -> None:
        """The groups whose sends and receives the profiler records from the next step: those NCCL reported a
        transfer of, on a communicator matched to the group surely enough, whose transfers the tap has not taken back."""
        for i in reporting:
            group = groups[i]
            if group is None or not trusted[i] or group in self.owned_p2p or group in self.p2p_to_tap:
                continue
            self.owned_p2p[group] = self._index + 1  # this step's the tap has
            if "p2p" not in self._said:
                self._said.add("p2p")
                log.info("NCCL profiler: NCCL reports %s's sends and receives; they are recorded from its records "
                         "from the next step (and any other group's once it reports them)", group)

    def _group_of(self, comm_hash: int) -> str | None:
        match = self.matches.get(comm_hash)
        return match.group if match is not None else None

    def _remember_unmatched(self, calls: Iterable[tuple[int, int, int, int, int]]) -> None:
        """The collectives of communicators no group is matched to yet, for call-order matching: (window index,
        communicator hash, launch ns, function id, bytes) each, in record order. Sends and receives are left out
        (NCCL orders a launch's transfers by peer, not as they were called)."""
        table = self._signatures.profiled
        for index, comm_hash, launch, func, nbytes in calls:
            table.setdefault((index, comm_hash), []).append(
                (launch, FUNCTIONS[func] if func < len(FUNCTIONS) else "?", nbytes))

    def _keep(self, records: np.ndarray) -> None:
        if not len(records):
            return
        self.records.append(records)
        self._kept += len(records)
        while self._kept - len(self.records[0]) >= KEPT_RECORDS:
            self._kept -= len(self.records.popleft())

    def collectives(self) -> list[CollectiveRecord]:
        """The kept records of the job's steps, as objects (for the report)."""
        if not self.records:
            return []
        return Drained(np.concatenate(list(self.records)), 0).collectives()

    # -- communicators to groups -------------------------------------------------------------------
    def _remember_tracked(self, tracked: list[tuple[Any, ...]]) -> None:
        if tracked:
            by_step = {w.step: w.index for w in self._windows}
            for group, collective, nbytes, _, step, _, _, _, _ in tracked:
                index = by_step.get(step)
                if index is not None and group not in self.owned and collective in COLLECTIVES:
                    self._signatures.tracked.setdefault((index, group), []).append((collective, nbytes))
        if self._signatures.tracked or self._signatures.profiled:  # empty once every group is NCCL's
            self._signatures.trim(self._index - WINDOWS)

    def _match(self) -> None:
        """Match the communicators NCCL initialised since the last time, then any still unmatched by call order."""
        communicators = self.reader.drained_communicators  # as this step's drain read them
        if communicators != self._communicators:
            self._communicators = communicators
            groups = self._groups()
            known = {alias: g.name for g in groups for alias in g.aliases}
            found = group_names(self.reader.communicators(), {g.name: g.size for g in groups}, known_names=known)
            for comm_hash, match in found.items():
                if comm_hash not in self.matches or self.matches[comm_hash].group is None:
                    self._adopt(comm_hash, match)
            self._sizes = {g.name: g.size for g in groups}
        if None in [m.group for m in self.matches.values()]:
            self._match_by_order()

    def _match_by_order(self) -> None:
        ready = self._index - ORDER_LAG
        sizes = self._sizes
        comm_sizes = {c.comm_hash: c.n_ranks for c in self.reader.communicators()}
        taken = {m.group for m in self.matches.values() if m.group is not None}
        for comm_hash, match in list(self.matches.items()):
            if match.group is not None:
                continue
            candidates: set[str] | None = None
            for (index, h), calls in self._signatures.profiled.items():
                if h != comm_hash or index > ready:
                    continue
                sequence = [(c, b) for _, c, b in sorted(calls)]
                same = {g for (i, g), seen in self._signatures.tracked.items()
                        if i == index and seen == sequence and sizes.get(g) == comm_sizes.get(comm_hash)
                        and g not in taken}
                candidates = same if candidates is None else candidates & same
            if candidates is not None and len(candidates) == 1:
                self._adopt(comm_hash, GroupMatch(candidates.pop(), "call_order"))

    def _adopt(self, comm_hash: int, match: GroupMatch) -> None:
        self.matches[comm_hash] = match
        if match.group is not None and match.group not in self.owned:
            self.owned[match.group] = self._index + 1  # from the next step: this one's calls the tap has
        if match.method not in self._said:
            self._said.add(match.method)
            if match.group is None:
                log.info("NCCL profiler: communicator %x (and any other like it) matches several groups of its rank "
                         "count and none by name; its collectives stay recorded through torch's hooks until its call "
                         "order matches one group's", comm_hash)
            else:
                log.info("NCCL profiler: communicators matched to groups by %s (first: %x is %s); their collectives "
                         "are recorded from NCCL's own records from the next step", _METHODS[match.method], comm_hash,
                         match.group)


_METHODS = {"hash": "the hash torch gave", "comm_name": "NCCL's commName, a torch name of the group",
            "rank_count": "rank count (the only group of that size)",
            "call_order": "call order (the one group of that size whose calls in a step were the same)"}


_reading: weakref.ref[Any] | None = None  # the recorder that reads the ring: one reader per process


def attach(recorder: Any, groups: Callable[[], list[NcclGroup]], library: Path | None = None) -> bool:
    """Have ``recorder`` read NCCL's records once per step (``library``: default this install's profiler, the
    file NCCL_PROFILER_PLUGIN names). False where another live recorder of this process reads them already:
    the ring has one reader, so a second session records through torch's hooks."""
    global _reading
    if recorder.nccl is not None:
        return True
    other = _reading() if _reading is not None else None
    if other is not None and other is not recorder and other.nccl is not None:
        log.info("NCCL profiler: another Lagom session of this process reads NCCL's records; this one records "
                 "through torch's hooks")
        return False
    recorder.nccl = NcclCalls(ProfilerDrain(library), groups)
    _reading = weakref.ref(recorder)
    return True


def detach(recorder: Any) -> None:
    """``recorder`` stops reading NCCL's records (its session ends), so another session of the process may."""
    global _reading
    recorder.nccl = None
    if _reading is not None and _reading() is recorder:
        _reading = None
