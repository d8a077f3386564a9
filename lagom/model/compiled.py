"""The simulator's compiled event loop (event_loop.c), and the flat arrays a phase is lowered to for it.

A search simulates one step graph hundreds of times with different configs, and only the speeds of its
tasks change between runs, not the tasks: so each phase is lowered once per choice of decompositions into
arrays (``PhaseArrays``), and every run hands them to the C loop with this run's per-cost figures. The loop
asks the cost model (Python) for durations through one callback and memoises the answers, so the cost
model stays the one in ``lagom.model.cost_model`` and the two loops compute the same numbers.

``lagom.model.simulator`` is the reference the C loop is checked against (tests/test_simulator_compiled.py)
and the fallback: where the library was not built (no C compiler at install) Lagom says so once and plans on
the Python loop; ``LAGOM_SIMULATOR=python`` chooses it on purpose. The steady-state jumps are the reference's
too: the C loop pauses at the band's period boundaries (``LoopRun``), the reference's logic decides from the
state it reads there whether and how far to jump, and the C side moves the state and runs the probes. A run
that keeps no records saves checkpoints where it watches no boundary (``Checkpoint``, held in C), and a later run
whose changed keys had not started by one resumes from it, as the reference's runs do.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import weakref
from dataclasses import dataclass, field, fields
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lagom.errors import ConfigError, LagomError
from lagom.model.lowering import COMPUTE, END, P2P, Lowering
from lagom.model.phase_index import NONE, SLOT, first_seen
from lagom.nccl_tuner.build import EVENT_LOOP, LIBRARY_DIR
from lagom.step.graph import Collective
from lagom.step.points import collector_paused

if TYPE_CHECKING:
    from lagom.model.cost_model import CostModel

log = logging.getLogger(__name__)

ENV = "LAGOM_SIMULATOR"  # "compiled" (the default where built) or "python"
ABI = 4  # LAGOM_EVENT_LOOP_ABI in event_loop.h
OK, NOMEM, CALLBACK, DEADLOCK, STALLED, PAUSED, CHECKPOINT = range(7)
TILE_BLOCK = 64  # periods a lowering tests for copying at once (numpy over the block, not a call per period)
# Tasks a compiled run starts between checkpoints: ten times the Python loop's (simulator.CHECKPOINT_EVERY), as
# the loop is fifty times faster (a resumed run redoes about a millisecond); and at most so many checkpoints a
# run, further apart in a larger phase (each holds every queue's state: 15 kB at 94 queues, so 15 MB at most).
# Only the part of a run past the pipeline's steady band keeps any, so a run keeps far fewer than the cap.
_ALL_GATHER = list(Collective).index(Collective.ALL_GATHER)  # PhaseIndex numbers collectives by their place
CHECKPOINT_EVERY = 4096
CHECKPOINTS_PER_RUN = 1024


def checkpoint_interval(arrays: PhaseArrays) -> int:
    """Tasks started between a run's checkpoints on these arrays."""
    return max(CHECKPOINT_EVERY, -(-arrays.tasks // CHECKPOINTS_PER_RUN))

_i32, _u8, _f64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_double)
_i64 = ctypes.POINTER(ctypes.c_int64)
COST_FN = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int, ctypes.c_int, _f64)
# event_loop.h's lagom_task_t: a task's fields side by side
TASK = np.dtype([("queue", np.int32), ("device", np.int32), ("cost", np.int32), ("record", np.int32),
                 ("dev_off", np.int32), ("dep_off", np.int32), ("wake_off", np.int32),
                 ("comm", np.uint8), ("first", np.uint8), ("last", np.uint8), ("unused", np.uint8)])


class _Phase(ctypes.Structure):
    _fields_ = [("n_tasks", ctypes.c_int32), ("n_queues", ctypes.c_int32), ("n_devices", ctypes.c_int32),
                ("n_blame", ctypes.c_int32), ("queue_first", _i32), ("task", ctypes.c_void_p),
                ("dev_list", _i32), ("dep_list", _i32), ("wake_list", _i32),
                ("cost_key", _i32), ("cost_cross", _u8), ("cost_one_way", _u8),
                ("cost_solo", _f64), ("cost_launch", _f64), ("cost_util", _f64),
                ("compute_queue", _i32), ("blame_device", _i32),
                ("position", _i64), ("shift", _i64), ("span_off", _i32), ("span_lo", _i64), ("span_hi", _i64)]


class _Result(ctypes.Structure):
    _fields_ = [("now", ctypes.c_double), ("exposed_total", ctypes.c_double), ("tasks", ctypes.c_int64),
                ("totals", _f64), ("touched", _i32), ("first_start", _f64),
                ("start", _f64), ("end", _f64), ("solo", _f64), ("exposed", _f64), ("heads", _i32)]


def library_path() -> Path:
    return Path(__file__).resolve().parent / LIBRARY_DIR / EVENT_LOOP.name


@cache
def _library() -> Any:
    """The loaded library, or None (said once: planning then runs on the Python loop)."""
    path = library_path()
    if not path.is_file():
        log.warning("Lagom's compiled simulator was not built (no C compiler at install time?): planning runs on "
                    "the slow Python event loop; reinstall with a C compiler (pip install -e .) to build %s", path.name)
        return None
    lib = ctypes.CDLL(str(path))
    built = lib.lagom_event_loop_abi()
    if built != ABI:
        log.warning("Lagom's compiled simulator %s was built for ABI %d, not %d (an install older than its Python "
                    "code): planning runs on the slow Python event loop; reinstall (pip install -e .) to rebuild it",
                    path, built, ABI)
        return None
    sim = ctypes.c_void_p
    lib.lagom_sim_open.argtypes = [ctypes.POINTER(_Phase), COST_FN, ctypes.POINTER(_Result), _u8]
    lib.lagom_sim_open.restype = sim
    lib.lagom_sim_watch.argtypes = [sim, ctypes.c_int]
    lib.lagom_sim_watch.restype = None
    lib.lagom_sim_run.argtypes = [sim]
    lib.lagom_sim_run.restype = ctypes.c_int
    lib.lagom_sim_state.argtypes = [sim, _f64, ctypes.POINTER(ctypes.c_int64)]
    lib.lagom_sim_state.restype = None
    lib.lagom_sim_jump.argtypes = [sim, ctypes.c_double, ctypes.c_double, ctypes.c_double, _i32, _f64]
    lib.lagom_sim_jump.restype = ctypes.c_int
    lib.lagom_sim_probe.argtypes = [sim, ctypes.POINTER(_Result), _f64]
    lib.lagom_sim_probe.restype = sim
    lib.lagom_sim_close.argtypes = [sim]
    lib.lagom_sim_close.restype = None
    lib.lagom_sim_checkpoints.argtypes = [sim, ctypes.c_int64]
    lib.lagom_sim_checkpoints.restype = None
    lib.lagom_sim_save.argtypes = [sim]
    lib.lagom_sim_save.restype = ctypes.c_void_p
    lib.lagom_sim_resume.argtypes = [ctypes.POINTER(_Phase), COST_FN, ctypes.POINTER(_Result), _u8, ctypes.c_void_p]
    lib.lagom_sim_resume.restype = sim
    lib.lagom_checkpoint_free.argtypes = [ctypes.c_void_p]
    lib.lagom_checkpoint_free.restype = None
    return lib


def enabled() -> bool:
    """Whether simulations run on the compiled loop: built, and not switched off with LAGOM_SIMULATOR=python."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice not in ("", "compiled", "python"):
        raise ConfigError(ENV, f"unknown simulator {choice!r}", "set it to 'compiled' (the default) or 'python'")
    return choice != "python" and _library() is not None


def _ptr(array: np.ndarray, kind: Any) -> Any:
    return array.ctypes.data_as(kind)


@dataclass
class PhaseArrays:
    """One phase under one choice of decompositions, as the C loop reads it: tasks numbered queue by queue."""

    lowering: Lowering
    position: np.ndarray  # per task: its position in the lowering
    positions: list[np.ndarray]  # per queue: its tasks' positions (views into ``position``)
    queue_first: np.ndarray
    task: np.ndarray  # per task and one more (its lists' ends), of dtype TASK: queue, dense device, cost, record...
    dev_list: np.ndarray
    dep_list: np.ndarray
    wake_list: np.ndarray
    costs: list[tuple]  # cost tuples by id
    cost_task: list[tuple[int, int]]  # per cost: a (queue, position) of that cost
    keys: list[str]
    cost_key: np.ndarray
    cost_cross: np.ndarray
    cost_one_way: np.ndarray
    compute_queue: np.ndarray
    blame_device: np.ndarray
    records: int  # comm tasks: each has a slot in a run's records
    _struct: _Phase | None = field(default=None, repr=False)
    _costs: tuple | None = field(default=None, repr=False)
    _boundaries: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def tasks(self) -> int:
        return int(self.queue_first[-1])

    @property
    def nbytes(self) -> int:
        """Bytes its arrays take (what a Simulator's budget counts)."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray)) + \
            sum(check.nbytes for check in self._boundaries.values())

    @cached_property
    def band(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The band as the C loop reads it: per queue its shift, then its spans as offsets, lows and highs."""
        queues = self.lowering.queues
        off = np.zeros(len(queues) + 1, dtype=np.int32)
        np.cumsum([len(queue.spans) for queue in queues], out=off[1:])
        spans = [span for queue in queues for span in queue.spans]
        return (np.asarray([queue.shift for queue in queues], dtype=np.int64), off,
                np.asarray([lo for lo, _ in spans], dtype=np.int64).reshape(-1), np.asarray([hi for _, hi in spans], dtype=np.int64).reshape(-1))

    def boundaries(self, ref: int) -> np.ndarray:
        """Per task, 1 where starting it is a period boundary of queue ``ref`` (what the loop pauses at)."""
        check = self._boundaries.get(ref)
        if check is None:
            check = self._boundaries[ref] = np.zeros(self.tasks, dtype=np.uint8)
            first, shift = int(self.queue_first[ref]), self.lowering.queues[ref].shift
            check[first:first + len(self.positions[ref])] = self.positions[ref] % shift == 0
        return check

    def where(self, task: int) -> tuple[int, int]:
        """(queue, position) of a task number."""
        q = int(np.searchsorted(self.queue_first, task, side="right")) - 1
        return q, int(self.positions[q][task - self.queue_first[q]])


@dataclass
class _Rows:
    """Tasks of one queue as arrays: per row its position and fields; its devices, dependencies and wakes as a
    count per row and one flat list each."""

    pos: np.ndarray
    comm: np.ndarray
    first: np.ndarray
    last: np.ndarray
    device: np.ndarray
    cost: np.ndarray
    n_dev: np.ndarray
    dev: np.ndarray
    n_dep: np.ndarray
    dep_queue: np.ndarray
    dep_pos: np.ndarray
    n_wake: np.ndarray
    wake: np.ndarray

    def since(self, position: int) -> _Rows:
        """The rows at ``position`` and after (views: their items counted from the end, since a tail is short
        and the rows before it may be many periods copied at once)."""
        i = int(np.searchsorted(self.pos, position))
        dev, dep, wake = (len(items) - int(n[i:].sum())
                          for n, items in ((self.n_dev, self.dev), (self.n_dep, self.dep_queue), (self.n_wake, self.wake)))
        return _Rows(self.pos[i:], self.comm[i:], self.first[i:], self.last[i:], self.device[i:], self.cost[i:],
                     self.n_dev[i:], self.dev[dev:], self.n_dep[i:], self.dep_queue[dep:], self.dep_pos[dep:],
                     self.n_wake[i:], self.wake[wake:])

    def periods(self, count: int, shift: int, dep_shift: np.ndarray) -> _Rows:
        """These rows repeated ``count`` times, each copy one period (``shift`` positions) on, its dependencies
        moved by their own queues' periods (``dep_shift``, per dependency)."""
        on = np.arange(1, count + 1, dtype=np.int64)[:, None]
        def tile(a: np.ndarray) -> np.ndarray:
            return np.tile(a, count)

        return _Rows((self.pos + on * shift).ravel(), tile(self.comm), tile(self.first), tile(self.last),
                     tile(self.device), tile(self.cost), tile(self.n_dev), tile(self.dev), tile(self.n_dep),
                     tile(self.dep_queue), (self.dep_pos + on * dep_shift).ravel(), tile(self.n_wake), tile(self.wake))

    def take(self, name: str) -> np.ndarray:
        """Field ``name``, no longer held here (an empty array in its place)."""
        out = getattr(self, name)
        setattr(self, name, out[:0].copy())
        return out

    @staticmethod
    def join(parts: list[_Rows]) -> _Rows:
        return _Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(_Rows)))


class _Walk:
    """Rows of one queue worked out one at a time from the lowering's shapes, until they become arrays."""

    def __init__(self) -> None:
        self.pos: list[int] = []
        self.flags = bytearray()  # comm, first, last per row
        self.device: list[int] = []
        self.cost: list[int] = []
        self.n_dev: list[int] = []
        self.dev: list[int] = []
        self.n_dep: list[int] = []
        self.dep_queue: list[int] = []
        self.dep_pos: list[int] = []
        self.n_wake: list[int] = []
        self.wake: list[int] = []

    def add(self, pos: int, shape: Any, device: int, cost: int, devices: list[int]) -> None:
        self.pos.append(pos)
        self.flags += bytes((shape.comm, shape.first, shape.last))
        self.device.append(device)
        self.cost.append(cost)
        self.n_dev.append(len(devices))
        self.dev.extend(devices)
        self.n_dep.append(len(shape.deps))
        for dq, at in shape.deps:
            self.dep_queue.append(dq)
            self.dep_pos.append(at)
        self.n_wake.append(len(shape.wakes))
        self.wake.extend(shape.wakes)

    def rows(self) -> _Rows:
        flags = np.frombuffer(bytes(self.flags), dtype=np.uint8).reshape(-1, 3)
        i32 = np.int32
        out = _Rows(np.asarray(self.pos, dtype=np.int64), flags[:, 0].copy(), flags[:, 1].copy(), flags[:, 2].copy(),
                    np.asarray(self.device, dtype=i32), np.asarray(self.cost, dtype=i32),
                    np.asarray(self.n_dev, dtype=i32), np.asarray(self.dev, dtype=i32), np.asarray(self.n_dep, dtype=i32),
                    np.asarray(self.dep_queue, dtype=i32), np.asarray(self.dep_pos, dtype=np.int64),
                    np.asarray(self.n_wake, dtype=i32), np.asarray(self.wake, dtype=i32))
        self.__init__()  # type: ignore[misc]
        return out


class _Band:
    """What decides whether a period of a queue is the image of the one before (``Lowering._image``'s tests, on
    arrays): every queue's spans, and per device how many collectives each segment's end releases."""

    def __init__(self, lowering: Lowering) -> None:
        ix = lowering.ix
        self.shift = np.asarray([queue.shift for queue in lowering.queues], dtype=np.int64)
        self.spans = [(np.asarray([lo for lo, _ in queue.spans], dtype=np.int64),
                       np.asarray([hi for _, hi in queue.spans], dtype=np.int64)) for queue in lowering.queues]
        self.releases = {d: ix.releases.counts(d) for d in ix.segments}

    def in_spans(self, queue: np.ndarray, pos: np.ndarray, shift: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per count c of ``counts``: whether every (queue, position) moved c times its ``shift`` lies in one of
        its queue's spans."""
        ok = np.ones(len(counts), dtype=bool)
        for q in np.unique(queue):
            los, his = self.spans[q]
            if not len(los):  # a queue outside the band: no position of it is in a span
                return np.zeros(len(counts), dtype=bool)
            mask = queue == q
            at = pos[mask][None, :] + counts[:, None] * shift[mask][None, :]
            i = np.searchsorted(los, at, side="right") - 1
            ok &= ~((i < 0) | (at >= his[np.maximum(i, 0)])).any(axis=1)
        return ok


def _tail(parts: list[_Rows], position: int) -> _Rows:
    """The rows at ``position`` and after, cut from the part that holds ``position`` before joining the parts after
    it (joining first would copy every period a tile had copied at once, at each retry)."""
    first = len(parts) - 1
    while first > 0 and not (len(parts[first].pos) and parts[first].pos[0] <= position):
        first -= 1
    return _Rows.join([parts[first].since(position), *parts[first + 1:]])


def _tile(lowering: Lowering, band: _Band, q: int, prev: _Rows, pos: int) -> tuple[_Rows, int] | None:
    """As many whole periods from ``pos`` on as are each the image of the period before (``prev``, the rows
    from one period back up to ``pos``): the copies ``Lowering._image`` would make, made for a period at once;
    with the position after them."""
    queue = lowering.queues[q]
    shift = queue.shift
    span = queue.span(pos - shift)
    if span is None or not len(prev.pos) or prev.pos[0] != pos - shift:
        return None
    nexts = np.append(prev.pos[1:], pos)  # each row's next position
    dep_shift = band.shift[prev.dep_queue]
    releases = band.releases.get(queue.device) if queue.kind == COMPUTE else None
    most = max(0, -(-(span[1] - int(nexts[-1])) // shift))  # copies whose last row's next stays in the span
    count = 0  # the base period is ``count`` periods past ``prev``; the first that fails a test ends the copies
    while count < most:
        counts = np.arange(count, min(most, count + TILE_BLOCK), dtype=np.int64)
        ok = band.in_spans(prev.dep_queue, prev.dep_pos, dep_shift, counts)
        if releases is not None:
            base = (prev.pos[None, :] + counts[:, None] * shift) // SLOT
            image = base + shift // SLOT
            inside = image[:, -1] < len(releases)
            same = (releases[np.minimum(image, len(releases) - 1)] == releases[np.minimum(base, len(releases) - 1)]).all(axis=1)
            ok &= inside & same
        failed = np.flatnonzero(~ok)
        if len(failed):
            count += int(failed[0])
            break
        count += len(counts)
    return (prev.periods(count, shift, dep_shift), pos + count * shift) if count else None


def lower(lowering: Lowering) -> PhaseArrays:
    """Every task of the phase as arrays, worked out at once on the phase index's arrays (``_AtOnce``).

    The walk (``_lower(at_once=False)``) is what those rows are checked against and the fallback where they would
    not be its rows (a split collective on a group of one rank): queue by queue from its first position through
    the lowering's shapes, the ones the Python loop runs on. In the periodic band a period whose every task is
    the image of one a period back is copied as arrays, a period at once; the shapes are dropped once the walk
    is a period past them, so memory holds the arrays, not the shapes."""
    with collector_paused():
        return _lower(lowering)


def _lower(lowering: Lowering, at_once: bool = True) -> PhaseArrays:
    """``at_once=False``: walk every queue (what ``_AtOnce`` is tested against)."""
    ix = lowering.ix
    queues = lowering.queues
    band = _Band(lowering)
    devices = sorted({*ix.devices, *(queue.device for queue in queues)})
    dense = {d: n for n, d in enumerate(devices)}
    cost_ids: dict[tuple, int] = {}
    cost_task: list[tuple[int, int]] = []
    per_queue: list[_Rows] = []
    if at_once:  # every queue's rows at once (what the walk below finds, task by task)
        whole = _AtOnce(lowering, devices, dense, cost_ids, cost_task)
        if whole.exact:
            return _arrays(lowering, [whole.rows(q) for q in range(len(queues))], devices, dense, cost_ids, cost_task)
    for q, queue in enumerate(queues):
        shapes = lowering.shapes[q]
        parts: list[_Rows] = []
        walk = _Walk()
        walked: list[int] = []  # positions whose shapes the lowering may still hold
        kept = 0
        pos = lowering.firsts[q]
        retry = pos + queue.shift  # where to try copying whole periods next
        while pos < END:
            if queue.shift and pos >= retry:
                parts.append(walk.rows())
                tiled = _tile(lowering, band, q, _tail(parts, pos - queue.shift), pos)
                retry = pos + queue.shift
                if tiled is not None:
                    parts.append(tiled[0])
                    pos = retry = tiled[1]
                    continue
            shape = lowering.shape(q, pos)
            c = cost_ids.get(shape.cost)
            if c is None:
                c = cost_ids[shape.cost] = len(cost_task)
                cost_task.append((q, pos))
            for d in shape.devices:
                if d not in dense:
                    dense[d] = len(devices)
                    devices.append(d)
            walk.add(pos, shape, dense[shape.device], c, [dense[d] for d in shape.devices])
            walked.append(pos)
            pos = shape.next
            while kept < len(walked) and walked[kept] < pos - queue.shift:  # the walk needs one period back
                shapes.pop(walked[kept], None)
                kept += 1
        for at in walked[kept:]:
            shapes.pop(at, None)
        parts.append(walk.rows())
        per_queue.append(_Rows.join(parts))
    return _arrays(lowering, per_queue, devices, dense, cost_ids, cost_task)


class _AtOnce:
    """Every queue's rows of a phase worked out at once on the index's arrays: the rows ``_lower``'s walk through
    the lowering's shapes finds task by task (tested against it), costs numbered in the same order (queue by
    queue, where each first appears). Per segment, the point whose decomposition splits it (the first candidate
    whose key the lowering splits) and so its pieces; then
      a compute queue: each segment's pieces, waiting for a split all-gather's P2P steps or a split
        reduce-scatter's partials, and the first piece for what the segment waits for (split reduce-scatters'
        reduces by device and segment, then collectives in the ``waits`` table's order); the last piece wakes
        the streams of what the segment releases;
      a P2P queue: the steps of each segment split on its group, after the segment releasing a split all-gather
        or after the piece a reduce-scatter's partial comes from;
      a communicator stream: its collectives not split, each after the last piece of the segment releasing it."""

    def __init__(self, lowering: Lowering, devices: list[int], dense: dict[int, int], cost_ids: dict[tuple, int],
                 cost_task: list[tuple[int, int]]) -> None:
        ix = self.ix = lowering.ix
        self.lowering, self.devices, self.dense, self.cost_ids, self.cost_task = lowering, devices, dense, cost_ids, cost_task
        self.stream_queue = np.full(len(ix.streams), -1, dtype=np.int64)
        self.stream_queue[list(lowering.stream_queue)] = list(lowering.stream_queue.values())
        self.compute_queue = np.full(max(ix.devices, default=0) + 1, -1, dtype=np.int64)
        self.compute_queue[list(lowering.compute_queue)] = list(lowering.compute_queue.values())
        self.key = ix.columns.key
        self.chunks = np.asarray([lowering.chunks.get(ix.key(j), 0) for j in ix.columns.key_first.tolist()], dtype=np.int64)
        groups, firsts = np.unique(ix._group, return_index=True)
        size = np.zeros(len(groups), dtype=np.int64)
        size[groups] = [ix.points[j].group.size for j in firsts.tolist()]
        names, firsts = np.unique(ix._group_name, return_index=True)
        self.group_name = dict(zip(names.tolist(), (ix.points[j].group.name for j in firsts.tolist())))  # number -> name
        self.rank = np.zeros(max(ix.devices, default=0) + 1, dtype=np.int64)
        self.rank[ix.devices] = np.arange(len(ix.devices))
        # Per segment (global id): the point whose decomposition splits it (the first candidate whose key is split;
        # NONE: left whole), its chunks per peer (k), whether it gathers, its pieces on the compute queue and its
        # steps on the P2P queue (``Lowering.pieces``)
        segments = len(ix._seg_device) - 1
        table = ix.candidates
        split = np.flatnonzero(self.chunks[self.key[table.flat]] > 0)
        by, first = np.unique(np.repeat(np.arange(segments), table.sizes)[split], return_index=True)
        self.fused = np.full(segments + 1, NONE, dtype=np.int64)  # one more: -1 reads NONE
        self.fused[by] = table.flat[split[first]]
        split_at = self.fused[:-1] >= 0
        self.k = np.where(split_at, _of_split(self.chunks, _of_split(self.key, self.fused[:-1])), 0)
        n_k = _of_split(size, _of_split(ix._group, self.fused[:-1])) * self.k
        self.ag = _of_split(ix._collective, self.fused[:-1]) == _ALL_GATHER
        self.count = np.where(split_at, np.where(self.ag, n_k, n_k + 1), 1)
        self.steps = np.where(split_at, n_k - self.k, 0)
        # per point: whether its decomposition is the one splitting its segment
        self.decomposed = (ix._fused >= 0) & (self.fused[ix._fused] == np.arange(len(ix.points)))
        # whether the rows are the walk's: not where a split point's group has one rank (no P2P steps)
        self.exact = not (split_at & (self.steps <= 0)).any()

    def rows(self, q: int) -> _Rows:
        queue = self.lowering.queues[q]
        if queue.kind == COMPUTE:
            return self._compute(q, queue.device)
        return self._p2p(q, queue.device, queue.group) if queue.kind == P2P else self._stream(q, queue.stream)

    def _last(self, segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(queue, position) of the task finishing each global segment: its last piece (``Lowering.last_of``)."""
        return (self.compute_queue[self.ix._seg_device[segment]],
                self.ix._seg_index[segment] * SLOT + self.count[segment] - 1)

    def _costs(self, q: int, pos: np.ndarray, columns: tuple[np.ndarray, ...], cost_of: Any) -> np.ndarray:
        """Cost ids of rows told apart by ``columns``: each distinct row's cost (``cost_of(row)``) numbered where it
        first appears."""
        found, firsts = first_seen(*columns)
        ids = [self.cost_ids.setdefault(cost, len(self.cost_ids)) for cost in map(cost_of, firsts.tolist())]
        for at, c in zip(pos[firsts].tolist(), ids):
            if c == len(self.cost_task):
                self.cost_task.append((q, at))
        return np.asarray(ids, dtype=np.int32)[found]

    def _p2p_queue(self, d: int, points: np.ndarray) -> np.ndarray:
        """The P2P queue of each point's group on device ``d``."""
        names, inverse = np.unique(self.ix._group_name[points], return_inverse=True)
        return np.asarray([self.lowering.p2p_queue[(d, self.group_name[n])] for n in names.tolist()], dtype=np.int64)[inverse]

    def _compute(self, q: int, d: int) -> _Rows:
        ix = self.ix
        segs = np.arange(ix._offset[d], ix._offset[d] + ix._size[d], dtype=np.int64)
        count = self.count[segs]
        seg = np.repeat(segs, count)  # each row's global segment
        row_of = np.cumsum(count) - count  # each segment's first row
        piece = np.arange(len(seg), dtype=np.int64) - np.repeat(row_of, count)
        i = ix._seg_index[seg]
        pos = i * SLOT + piece
        j = self.fused[seg]
        split = j >= 0
        last = piece == self.count[seg] - 1
        reduce = split & ~self.ag[seg] & last
        kinds, signatures = ix.kind_arrays
        key = _of_split(self.key, j)

        def cost_of(r: int) -> tuple:
            s = ix.segments[d][int(i[r])]
            if not split[r]:
                return (s.flops, s.bytes, s.ctas)
            p = ix.points[int(j[r])]
            n, k = p.group.size, int(self.k[seg[r]])
            if reduce[r]:
                return (0.0, p.bytes / n * (n + 1), max(1, p.bytes // n // 4096))
            return (s.flops / (n * k), s.bytes / (n * k), max(1, s.ctas // (n * k)))

        cost = self._costs(q, pos, (kinds[d][i], key, reduce), cost_of)
        # dependencies: (row, order, minor, queue, position) entries sorted by row, order, minor
        entries: list[tuple[np.ndarray, ...]] = []
        sp = np.flatnonzero(split)
        p2p = np.full(len(seg), NONE, dtype=np.int64)
        if len(sp):
            p2p[sp] = self._p2p_queue(d, j[sp])
            k = self.k[seg]
            gather = np.flatnonzero(split & self.ag[seg] & (piece >= k))  # a peer's block waits for its transfer
            entries.append((gather, np.zeros_like(gather), np.zeros_like(gather), p2p[gather], pos[gather] - k[gather]))
            rs = np.flatnonzero(reduce)  # the reduce waits for every peer's partial
            steps = self.steps[seg[rs]]
            at = np.repeat(rs, steps)
            step = np.arange(len(at), dtype=np.int64) - np.repeat(np.cumsum(steps) - steps, steps)
            entries.append((at, np.zeros_like(at), step, p2p[at], i[at] * SLOT + step))
        entries += self._waits(segs, row_of)
        n_dep, dep_queue, dep_pos = _gathered(len(seg), entries)
        # wakes: the last piece wakes what the segment's end releases, then (a reduce) the compute waiting for it
        wakes = self._ending(segs, row_of + count - 1)
        before = _of_split(ix._before, j)
        woken = np.flatnonzero(reduce & (before >= 0))
        wakes.append((woken, np.ones_like(woken), np.zeros_like(woken), self.compute_queue[ix._seg_device[before[woken]]],
                      np.zeros_like(woken)))
        partial = np.flatnonzero(split & ~self.ag[seg] & ~last & (piece < self.steps[seg]))  # its send waits for it
        wakes.append((partial, np.zeros_like(partial), np.zeros_like(partial), p2p[partial], np.zeros_like(partial)))
        n_wake, wake, _ = _gathered(len(seg), wakes)
        rows = len(seg)
        return _Rows(pos, np.zeros(rows, np.uint8), np.ones(rows, np.uint8), np.ones(rows, np.uint8),
                     np.full(rows, self.dense[d], np.int32), cost, np.ones(rows, np.int32), np.full(rows, self.dense[d], np.int32),
                     n_dep, dep_queue, dep_pos, n_wake, wake)

    def _waits(self, segs: np.ndarray, row: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        """What each segment's first piece (row ``row``) waits for: split reduce-scatters' reduces by device rank and
        segment, then collectives not split in the ``waits`` table's order (a split all-gather feeds its pieces)."""
        ix, table = self.ix, self.ix.waits
        lo, hi = int(table.start[segs[0]]) if len(segs) else 0, int(table.start[segs[-1] + 1]) if len(segs) else 0
        points = table.flat[lo:hi]
        at = np.repeat(row, table.sizes[segs])
        order = np.arange(len(points), dtype=np.int64)
        decomposed = self.decomposed[points]
        colls = ~decomposed
        reduces = decomposed & (ix._collective[points] != _ALL_GATHER)
        fuse = ix._fused[points[reduces]]
        queue, pos = self._last(fuse)
        by_rank = self.rank[ix._seg_device[fuse]] * len(ix._seg_device) + ix._seg_index[fuse]
        return [(at[reduces], np.ones(len(fuse), np.int64), by_rank, queue, pos),
                (at[colls], np.full(int(colls.sum()), 2, np.int64), order[colls], self.stream_queue[ix._stream_of[points[colls]]],
                 ix._slot[points[colls]])]

    def _ending(self, segs: np.ndarray, row: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        """What each segment's last piece (row ``row``) wakes: the streams of the collectives its end releases and the
        P2P queues of split all-gathers it releases, each once, in issue order (``Lowering._ending``)."""
        ix, table = self.ix, self.ix.releases
        lo, hi = int(table.start[segs[0]]) if len(segs) else 0, int(table.start[segs[-1] + 1]) if len(segs) else 0
        points = table.flat[lo:hi]
        at = np.repeat(row, table.sizes[segs])
        queue = self.stream_queue[ix._stream_of[points]]
        gathers = np.flatnonzero(self.decomposed[points] & (ix._collective[points] == _ALL_GATHER))
        for d in np.unique(ix._device[points[gathers]]).tolist():
            mine = gathers[ix._device[points[gathers]] == d]
            queue[mine] = self._p2p_queue(d, points[mine])
        keep = ~self.decomposed[points] | (ix._collective[points] == _ALL_GATHER)
        at, queue = at[keep], queue[keep]
        _, once = np.unique(at * (len(self.lowering.queues) + 1) + queue, return_index=True)
        once.sort()
        return [(at[once], np.zeros(len(once), np.int64), once, queue[once], np.zeros(len(once), np.int64))]

    def _p2p(self, q: int, d: int, group: str) -> _Rows:
        ix = self.ix
        segs = np.arange(ix._offset[d], ix._offset[d] + ix._size[d], dtype=np.int64)
        j = self.fused[segs]
        number = next(n for n, name in self.group_name.items() if name == group)
        mine = _of_split(ix._group_name, j) == number
        segs, j = segs[mine], j[mine]
        steps = self.steps[segs]
        seg = np.repeat(segs, steps)
        jr = np.repeat(j, steps)
        step = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(steps) - steps, steps)
        i = ix._seg_index[seg]
        pos = i * SLOT + step
        rows = len(seg)
        cost = self._costs(q, pos, (self.key[jr],), lambda r: (ix.key(int(jr[r])), True))
        gather = self.ag[seg]
        after = ix._after[jr]
        released = gather & (after >= 0)
        queue, last = self._last(after[released])
        dep_queue = np.full(rows, self.compute_queue[d], dtype=np.int64)
        dep_pos = i * SLOT + step
        dep_queue[released], dep_pos[released] = queue, last
        has_dep = ~gather | released
        return _Rows(pos, np.ones(rows, np.uint8), (step == 0).astype(np.uint8), (step == steps.repeat(steps) - 1).astype(np.uint8),
                     np.full(rows, self.dense[d], np.int32), cost, np.ones(rows, np.int32), np.full(rows, self.dense[d], np.int32),
                     has_dep.astype(np.int32), dep_queue[has_dep].astype(np.int32), dep_pos[has_dep],
                     np.ones(rows, np.int32), np.full(rows, self.compute_queue[d], np.int32))

    def _stream(self, q: int, k: int) -> _Rows:
        ix = self.ix
        points = ix._stream_points[k]
        points = points[~self.decomposed[points]]
        rows = len(points)
        pos = ix._slot[points].astype(np.int64)
        after, before = ix._after[points], ix._before[points]
        for d in ix.streams[k].devices:
            if d not in self.dense:
                self.dense[d] = len(self.devices)
                self.devices.append(d)
        devices = [self.dense[d] for d in ix.streams[k].devices]
        queue, last = self._last(after[after >= 0])
        return _Rows(pos, np.ones(rows, np.uint8), np.ones(rows, np.uint8), np.ones(rows, np.uint8),
                     np.full(rows, self.dense[ix.streams[k].device], np.int32),
                     self._costs(q, pos, (self.key[points],), lambda r: (ix.key(int(points[r])), False)),
                     np.full(rows, len(devices), np.int32), np.tile(np.asarray(devices, np.int32), rows),
                     (after >= 0).astype(np.int32), queue.astype(np.int32), last,
                     (before >= 0).astype(np.int32), self.compute_queue[ix._seg_device[before[before >= 0]]].astype(np.int32))


def _of_split(values: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``values[j]`` where ``j`` names a point or segment (>= 0), NONE where it is NONE (a phase may have no points)."""
    out = np.full(len(j), NONE, dtype=np.int64)
    at = j >= 0
    out[at] = values[j[at]]
    return out


def _gathered(rows: int, entries: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row its count of entries, and the entries' queues and positions in row order, then by order and minor
    (entries as (row, order, minor, queue, position) arrays)."""
    row, order, minor, queue, pos = (np.concatenate(column) for column in zip(*entries))
    by = np.lexsort((minor, order, row))
    return (np.bincount(row, minlength=rows).astype(np.int32), queue[by].astype(np.int32), pos[by].astype(np.int64))


def _arrays(lowering: Lowering, per_queue: list[_Rows], devices: list[int], dense: dict[int, int],
            cost_ids: dict[tuple, int], cost_task: list[tuple[int, int]]) -> PhaseArrays:
    """The queues' rows as the phase's arrays, joined one field at a time and each queue's copy of a field
    dropped once joined: a phase's rows run to hundreds of MB at cluster scale, and joining them whole held
    them twice (and their counts and the dependencies' (queue, position) pairs beside the arrays built from them)."""
    ix = lowering.ix
    queue_first = _offsets([len(r.pos) for r in per_queue])
    position = _join(per_queue, "pos")
    positions = [position[a:b] for a, b in zip(queue_first[:-1].tolist(), queue_first[1:].tolist())]
    task = np.zeros(int(queue_first[-1]) + 1, dtype=TASK)
    task["queue"][:-1] = np.repeat(np.arange(len(positions), dtype=np.int32), np.diff(queue_first))
    dep_list = np.empty(sum(len(r.dep_queue) for r in per_queue), dtype=np.int32)
    at = 0
    for r in per_queue:  # the dependencies' (queue, position) pairs as task numbers, a queue's at a time
        dep_queue, dep_pos = r.take("dep_queue"), r.take("dep_pos")
        dep_list[at:at + len(dep_queue)] = _task_numbers(positions, queue_first, dep_queue, dep_pos, ix.name)
        at += len(dep_queue)
    for name in ("comm", "first", "last", "device", "cost"):
        task[name][:-1] = _join(per_queue, name)
    for name, items in (("dev", "dev_off"), ("dep", "dep_off"), ("wake", "wake_off")):
        task[items] = _join(per_queue, f"n_{name}", counts=True)
    task["record"] = -1
    comm = np.flatnonzero(task["comm"])
    task["record"][comm] = np.arange(len(comm), dtype=np.int32)
    costs = list(cost_ids)
    keys = list(dict.fromkeys(c[0] for c in costs if isinstance(c[0], str)))
    key_ids = {k: n for n, k in enumerate(keys)}
    cost_key, cross, one_way = [], bytearray(), bytearray()
    for what, (q, pos) in zip(costs, cost_task):
        shape = lowering.shape(q, pos)
        cost_key.append(key_ids[what[0]] if shape.comm else -1)
        cross.append(shape.comm and ix.points[shape.point].group.nodes > 1)
        one_way.append(shape.comm and not what[1] and shape.coll == Collective.SEND_RECV)
    compute_queue = np.full(len(devices), -1, dtype=np.int32)
    for d, q in lowering.compute_queue.items():
        compute_queue[dense[d]] = q

    return PhaseArrays(
        lowering, position, positions, queue_first, task, _join(per_queue, "dev"), dep_list, _join(per_queue, "wake"),
        costs, cost_task, keys, np.asarray(cost_key, dtype=np.int32),
        np.frombuffer(bytes(cross), dtype=np.uint8).copy(), np.frombuffer(bytes(one_way), dtype=np.uint8).copy(),
        compute_queue, np.asarray([dense[d] for d in ix.devices], dtype=np.int32), len(comm))


def _offsets(counts: list[int]) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out


def _join(per_queue: list[_Rows], name: str, counts: bool = False) -> np.ndarray:
    """Field ``name`` of every queue's rows as one array, each queue's copy dropped; ``counts``: a count per row,
    joined as the offsets of each row's items (one more than the rows)."""
    parts = [r.take(name) for r in per_queue]
    if not counts:
        return np.concatenate(parts)
    out = np.zeros(sum(len(p) for p in parts) + 1, dtype=np.int32)
    np.concatenate(parts, out=out[1:])
    np.cumsum(out[1:], out=out[1:])
    return out


def _task_numbers(positions: list[np.ndarray], queue_first: np.ndarray, queue: np.ndarray, pos: np.ndarray,
                  phase: str) -> np.ndarray:
    """Task numbers of (queue, position) pairs: positions rise along a queue, so a binary search per queue."""
    out = np.empty(len(queue), dtype=np.int32)
    for q in np.unique(queue):
        at = np.flatnonzero(queue == q)
        found = np.searchsorted(positions[q], pos[at])
        if (found >= len(positions[q])).any() or (positions[q][np.minimum(found, len(positions[q]) - 1)] != pos[at]).any():
            raise LagomError(f"lowering of phase {phase}: a task waits for a position queue {q} never reaches")
        out[at] = queue_first[q] + found
    return out


@dataclass
class Outcome:
    """One compiled run of a phase: what the reference's ``_PhaseRun.simulate`` sums, and per comm task
    (record) its start, end, solo and exposed time (empty arrays where the run kept no records)."""

    now: float
    exposed: float
    tasks: int
    key_totals: dict[str, dict[str, float]]
    first_start: dict[str, float]
    start: np.ndarray
    end: np.ndarray
    solo: np.ndarray
    exposed_by_record: np.ndarray

    def records(self, arrays: PhaseArrays) -> list[tuple]:
        """The reference's records: (queue, position, start, end, solo, exposed) per comm task simulated (those of
        periods a jump skipped take their images' timings, as the reference's do)."""
        if len(self.start) != arrays.records:
            raise LagomError(f"a compiled run of phase {arrays.lowering.ix.name} kept no records")
        out = []
        for r, task in enumerate(np.flatnonzero(arrays.task["comm"]).tolist()):
            if math.isnan(self.start[r]):
                continue
            q, pos = arrays.where(task)
            out.append((q, pos, float(self.start[r]), float(self.end[r]), float(self.solo[r]),
                        float(self.exposed_by_record[r])))
        return out


@dataclass(eq=False)
class Checkpoint:
    """A compiled run's state at the top of its loop (held in C until this is dropped), with its per-key sums
    by then and its steady-state jumps: what a later run whose changed keys had not started yet resumes from."""

    now: float
    queues: int
    totals: np.ndarray
    touched: np.ndarray
    first_start: np.ndarray
    handle: int
    jumps: list = field(default_factory=list)  # the run's, final once it keeps checkpoints (set by its owner)

    def __post_init__(self) -> None:
        weakref.finalize(self, _library().lagom_checkpoint_free, self.handle)


class LoopRun:
    """One run of a phase on the compiled loop, kept between calls: it pauses at the band's period boundaries
    while ``watch``ed (``check``: per task, 1 where starting it is one), so that the reference's steady-state
    logic can read the state (``state``), try periods from a copy (``probe``) and skip them (``jump``).

    ``run`` is the reference's ``_PhaseRun`` for this run's configs: its memoised cost methods answer the C
    loop's callback, so both loops ask the model the same questions. A probe (``parent`` given, with its running
    heads' ``remaining``) keeps no per-collective records and shares its parent's boundaries, callback and memo
    of durations; close it before its parent. ``records=False``: no run keeps them either (a search reads sums,
    and a step's records at cluster scale are tens of MB a run). ``check`` is the arrays' (``PhaseArrays.boundaries``), which keep
    it alive as long as the C run reads it. ``checkpoint_every`` tasks started while it watches nothing, a run
    without records keeps a ``Checkpoint`` (in ``checkpoints``); ``resume`` starts a run from one."""

    def __init__(self, arrays: PhaseArrays, run: Any, model: CostModel | None, check: np.ndarray | None,
                 parent: LoopRun | None = None, remaining: np.ndarray | None = None, records: bool = True,
                 resume: Checkpoint | None = None, checkpoint_every: int = 0) -> None:
        lib = _library()
        if lib is None:
            raise LagomError("the compiled simulator is not built")
        self.lib, self.arrays = lib, arrays
        self.failed: list[BaseException] = []
        recorded = parent is None and records
        keys, kept = len(arrays.keys), arrays.records if recorded else 0
        if resume is not None and (recorded or resume.queues != len(arrays.positions)):
            raise LagomError(f"a compiled run of phase {arrays.lowering.ix.name} cannot resume this checkpoint "
                             "(one of another lowering, or a run that keeps records)")
        if checkpoint_every and recorded:
            raise LagomError("a compiled run that keeps records keeps no checkpoints (it could not resume them)")
        self.checkpoints: list[Checkpoint] = []
        if resume is not None:
            self.totals, self.touched = resume.totals.copy(), resume.touched.copy()
            self.first_start = resume.first_start.copy()
            self.start = self.end = self.solo = self.exposed = np.zeros(0)
        elif parent is None:
            self.totals, self.touched = np.zeros(4 * keys), np.zeros(keys, dtype=np.int32)
            self.first_start = np.full(keys, np.inf)
            self.start = np.full(kept, np.nan)  # NaN: a record the run skipped (a jump) or never reached
            self.end, self.solo, self.exposed = np.zeros(kept), np.zeros(kept), np.zeros(kept)
        else:
            self.totals, self.touched = parent.totals.copy(), parent.touched.copy()
            self.first_start = parent.first_start.copy()
        self.heads = np.zeros(len(arrays.positions), dtype=np.int32)
        self.remaining = np.zeros(len(arrays.positions))
        self.seq = np.zeros(len(arrays.positions), dtype=np.int64)
        self._state_out = (_ptr(self.remaining, _f64), _ptr(self.seq, _i64))  # read at every pause
        self._result = _Result(0.0, 0.0, 0, _ptr(self.totals, _f64), _ptr(self.touched, _i32),
                               _ptr(self.first_start, _f64), *(
                                   (_ptr(a, _f64) for a in (self.start, self.end, self.solo, self.exposed))
                                   if recorded else (None,) * 4), _ptr(self.heads, _i32))
        self._callback: Any
        self._sim: Any
        if parent is not None and remaining is not None:
            self._callback = parent._callback
            self.failed = parent.failed
            self._sim = lib.lagom_sim_probe(parent._sim, ctypes.byref(self._result), _ptr(remaining, _f64))
        else:
            assert model is not None
            self._callback = COST_FN(_answer(arrays, run, model, self.failed))
            phase, check_ptr = ctypes.byref(_struct(arrays, run, model)), None if check is None else _ptr(check, _u8)
            if resume is not None:
                self._sim = lib.lagom_sim_resume(phase, self._callback, ctypes.byref(self._result), check_ptr, resume.handle)
            else:
                self._sim = lib.lagom_sim_open(phase, self._callback, ctypes.byref(self._result), check_ptr)
        if not self._sim:
            raise MemoryError(f"the compiled simulator ran out of memory in phase {arrays.lowering.ix.name}")
        if checkpoint_every:
            lib.lagom_sim_checkpoints(self._sim, checkpoint_every)

    def watch(self, watching: bool) -> None:
        self.lib.lagom_sim_watch(self._sim, int(watching))

    def run(self) -> bool:
        """Go on until the phase is done (True) or a watched boundary (False); errors raise as the reference's."""
        rc = self.lib.lagom_sim_run(self._sim)
        while rc == CHECKPOINT:
            self.checkpoints.append(self._save())
            rc = self.lib.lagom_sim_run(self._sim)
        self.state()
        if rc == PAUSED:
            return False
        lw, phase = self.arrays.lowering, self.arrays.lowering.ix.name
        if rc == CALLBACK and self.failed:
            err = self.failed[0]
            self.failed.clear()  # a probe's failure (shared list) is not its parent's
            raise err
        if rc == NOMEM:
            raise MemoryError(f"the compiled simulator ran out of memory in phase {phase}")
        if rc in (DEADLOCK, STALLED):
            a = self.arrays
            stuck = [lw.name(*a.where(int(t))) for q, t in enumerate(self.heads) if t < a.queue_first[q + 1]]
            if rc == DEADLOCK:
                raise LagomError(f"simulation deadlock in phase {phase}: {stuck[:4]}")
            raise LagomError(f"simulation made no progress in phase {phase} at {self._result.now!r} s: {stuck[:4]}")
        if rc != OK:
            raise LagomError(f"the compiled simulator failed in phase {phase} (code {rc})")
        return True

    def _save(self) -> Checkpoint:
        handle = self.lib.lagom_sim_save(self._sim)
        if not handle:
            raise MemoryError(f"the compiled simulator ran out of memory in phase {self.arrays.lowering.ix.name}")
        self.state()
        return Checkpoint(self.now, len(self.arrays.positions), self.totals.copy(), self.touched.copy(),
                          self.first_start.copy(), handle)

    def state(self) -> None:
        """Refresh ``now``, ``exposed_total``, ``heads`` and per queue ``remaining`` (NaN: not running) and ``seq``."""
        self.lib.lagom_sim_state(self._sim, *self._state_out)

    @property
    def now(self) -> float:
        return float(self._result.now)

    @property
    def exposed_total(self) -> float:
        return float(self._result.exposed_total)

    @property
    def tasks(self) -> int:
        return int(self._result.tasks)

    def positions(self) -> list[int]:
        """Each queue's head as the lowering's position (END past its last task)."""
        a = self.arrays
        at = a.position[np.minimum(self.heads, a.tasks - 1)]
        at[self.heads >= a.queue_first[1:]] = END
        return at.tolist()

    def key_totals(self) -> dict[str, list[float]]:
        """Per key touched so far, in the order first touched: comm time, solo, exposed and count."""
        keys, totals = self.arrays.keys, self.totals
        order = sorted((int(self.touched[k]), k) for k in range(len(keys)) if self.touched[k])
        return {keys[k]: totals[4 * k:4 * k + 4].tolist() for _, k in order}

    def set_totals(self, rows: dict[str, list[float]]) -> None:
        index = {k: n for n, k in enumerate(self.arrays.keys)}
        for key, row in rows.items():
            self.totals[4 * index[key]:4 * index[key] + 4] = row

    def jump(self, later: float, exposed: float, delta: float, heads: np.ndarray, remaining: np.ndarray) -> None:
        """Skip periods: the clock to ``later``, each queue's head to ``heads`` (task numbers), running heads to
        ``remaining`` where not NaN (event_loop.c: lagom_sim_jump)."""
        if self.lib.lagom_sim_jump(self._sim, later, exposed, delta, _ptr(heads, _i32), _ptr(remaining, _f64)):
            raise MemoryError(f"the compiled simulator ran out of memory in phase {self.arrays.lowering.ix.name}")
        self.state()

    def probe(self, remaining: np.ndarray) -> LoopRun:
        """A copy from this state, its running heads restarted at ``remaining`` (per queue), watching."""
        return LoopRun(self.arrays, None, None, None, parent=self, remaining=remaining)

    def close(self) -> None:
        """Free the C run, and the callback (whose closure holds the reference run that holds this one: a cycle
        that would keep every run's records until the garbage collector's rare full pass)."""
        if self._sim:
            self.lib.lagom_sim_close(self._sim)
            self._sim = None
        self._callback = None

    def outcome(self) -> Outcome:
        keys = self.arrays.keys
        return Outcome(self.now, self.exposed_total, self.tasks,
                       {k: dict(zip(("time", "solo", "exposed", "count"), row)) for k, row in self.key_totals().items()},
                       {keys[k]: float(self.first_start[k]) for k in range(len(keys)) if math.isfinite(self.first_start[k])},
                       self.start, self.end, self.solo, self.exposed)


def _answer(arrays: PhaseArrays, run: Any, model: CostModel, failed: list[BaseException]) -> Any:
    """The C loop's cost callback: the reference run's memoised cost methods for a representative task of the
    cost asked about. A failure is kept in ``failed`` and NaN returned, so the loop unwinds and Python raises."""
    reps: list[Any] = [run.task(q, pos) for q, pos in arrays.cost_task]

    def answer(kind: int, count: int, key: Any) -> float:
        try:
            t = reps[int(key[0])]
            if kind == 0:
                return run.comm_duration(t, key[1], key[2])
            if kind == 1:
                return run.comm_rate(t, key[1])
            return run.compute_duration(t, [(reps[int(key[i])], key[i + 1]) for i in range(1, count, 2)])
        except BaseException as err:  # noqa: BLE001 - handed back to Python once the C loop unwinds
            failed.append(err)
            return math.nan

    return answer


def _struct(arrays: PhaseArrays, run: Any, model: CostModel) -> _Phase:
    """The arrays as the C struct, with this run's per-cost solo times, launch waits and HBM shares."""
    n = len(arrays.costs)
    solo, launch, util = np.zeros(n), np.zeros(n), np.zeros(n)
    for c, (q, pos) in enumerate(arrays.cost_task):
        t = run.task(q, pos)
        if t.comm:
            solo[c] = run.solo(t)
            launch[c] = model.launch_wait(t.config)
        else:
            util[c] = run.util(t)
    struct = arrays._struct
    if struct is None:
        a = arrays
        struct = arrays._struct = _Phase(
            a.tasks, len(a.positions), len(a.compute_queue), len(a.blame_device), _ptr(a.queue_first, _i32),
            a.task.ctypes.data, _ptr(a.dev_list, _i32), _ptr(a.dep_list, _i32), _ptr(a.wake_list, _i32), _ptr(a.cost_key, _i32),
            _ptr(a.cost_cross, _u8), _ptr(a.cost_one_way, _u8), None, None, None, _ptr(a.compute_queue, _i32),
            _ptr(a.blame_device, _i32), _ptr(a.position, _i64), *(_ptr(x, kind) for x, kind in zip(a.band, (_i64, _i32, _i64, _i64))))
    arrays._costs = (solo, launch, util)  # the struct points into them: they live as long as the arrays' struct
    struct.cost_solo, struct.cost_launch, struct.cost_util = _ptr(solo, _f64), _ptr(launch, _f64), _ptr(util, _f64)
    return struct
