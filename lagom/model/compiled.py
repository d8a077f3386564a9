"""The simulator's compiled event loop (event_loop.c), and the flat arrays a phase is lowered to for it.

A search simulates one step graph hundreds of times with different configs, and only the speeds of its
tasks change between runs, not the tasks: so each phase is lowered once per choice of decompositions into
arrays (``PhaseArrays``), and every run hands them to the C loop with this run's per-cost figures. The loop
asks the cost model (Python) for durations through one callback and memoises the answers, so the cost
model stays the one in ``lagom.model.cost_model`` and the two loops compute the same numbers.

``lagom.model.simulator`` is the reference the C loop is checked against (tests/test_simulator_compiled.py)
and the fallback: where the library was not built (no C compiler at install) Lagom says so once and plans on
the Python loop; ``LAGOM_SIMULATOR=python`` chooses it on purpose. The C loop simulates every task: it has
none of the reference's steady-state jumps or checkpoints, which it does not need at its speed.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import math
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lagom.errors import ConfigError, LagomError
from lagom.model.lowering import END, Lowering
from lagom.nccl_tuner.build import EVENT_LOOP, LIBRARY_DIR
from lagom.step.graph import Collective

if TYPE_CHECKING:
    from lagom.model.cost_model import CostModel

log = logging.getLogger(__name__)

ENV = "LAGOM_SIMULATOR"  # "compiled" (the default where built) or "python"
ABI = 1  # LAGOM_EVENT_LOOP_ABI in event_loop.h
OK, NOMEM, CALLBACK, DEADLOCK, STALLED = range(5)

_i32, _u8, _f64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_double)
COST_FN = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int, ctypes.c_int, _f64)


class _Phase(ctypes.Structure):
    _fields_ = [("n_tasks", ctypes.c_int32), ("n_queues", ctypes.c_int32), ("n_devices", ctypes.c_int32),
                ("n_blame", ctypes.c_int32), ("queue_first", _i32),
                ("comm", _u8), ("first", _u8), ("last", _u8), ("device", _i32), ("cost", _i32), ("record", _i32),
                ("dev_off", _i32), ("dev_list", _i32), ("dep_off", _i32), ("dep_list", _i32),
                ("wake_off", _i32), ("wake_list", _i32),
                ("cost_key", _i32), ("cost_cross", _u8), ("cost_one_way", _u8),
                ("cost_solo", _f64), ("cost_launch", _f64), ("cost_util", _f64),
                ("compute_queue", _i32), ("blame_device", _i32)]


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
    lib.lagom_simulate_phase.argtypes = [ctypes.POINTER(_Phase), COST_FN, ctypes.POINTER(_Result)]
    lib.lagom_simulate_phase.restype = ctypes.c_int
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
    positions: list[np.ndarray]  # per queue: its tasks' positions in the lowering
    queue_first: np.ndarray
    comm: np.ndarray
    first: np.ndarray
    last: np.ndarray
    device: np.ndarray  # dense device index
    cost: np.ndarray
    record: np.ndarray  # a comm task's slot in the results, else -1
    dev_off: np.ndarray
    dev_list: np.ndarray
    dep_off: np.ndarray
    dep_list: np.ndarray
    wake_off: np.ndarray
    wake_list: np.ndarray
    costs: list[tuple]  # cost tuples by id
    cost_task: list[tuple[int, int]]  # per cost: a (queue, position) of that cost
    keys: list[str]
    cost_key: np.ndarray
    cost_cross: np.ndarray
    cost_one_way: np.ndarray
    compute_queue: np.ndarray
    blame_device: np.ndarray
    record_task: np.ndarray  # per record: its task
    _struct: _Phase | None = field(default=None, repr=False)

    @property
    def tasks(self) -> int:
        return int(self.queue_first[-1])

    def where(self, task: int) -> tuple[int, int]:
        """(queue, position) of a task number."""
        q = int(np.searchsorted(self.queue_first, task, side="right")) - 1
        return q, int(self.positions[q][task - self.queue_first[q]])


def lower(lowering: Lowering) -> PhaseArrays:
    """Every task of the phase, walked queue by queue from its first position. Shapes are built through the
    lowering (so a period's image is copied, not worked out again) and dropped once the walk is a period past
    them, so memory holds the arrays, not the shapes."""
    ix = lowering.ix
    queues = lowering.queues
    devices = sorted({*ix.devices, *(queue.device for queue in queues)})
    dense = {d: n for n, d in enumerate(devices)}
    positions: list[np.ndarray] = []
    comm, first, last = bytearray(), bytearray(), bytearray()
    device: list[int] = []
    cost: list[int] = []
    dev_off, dev_list, dep_off, dep_queue, dep_pos, wake_off = [0], [], [0], [], [], [0]
    wake_list: list[int] = []
    cost_ids: dict[tuple, int] = {}
    cost_task: list[tuple[int, int]] = []
    for q, queue in enumerate(queues):
        shapes = lowering.shapes[q]
        walked: list[int] = []
        pos = lowering.firsts[q]
        kept = 0
        while pos < END:
            shape = lowering.shape(q, pos)
            walked.append(pos)
            comm.append(shape.comm)
            first.append(shape.first)
            last.append(shape.last)
            device.append(dense[shape.device])
            c = cost_ids.get(shape.cost)
            if c is None:
                c = cost_ids[shape.cost] = len(cost_task)
                cost_task.append((q, pos))
            cost.append(c)
            for d in shape.devices:
                if d not in dense:
                    dense[d] = len(devices)
                    devices.append(d)
                dev_list.append(dense[d])
            dev_off.append(len(dev_list))
            for dq, at in shape.deps:
                dep_queue.append(dq)
                dep_pos.append(at)
            dep_off.append(len(dep_queue))
            wake_list.extend(shape.wakes)
            wake_off.append(len(wake_list))
            pos = shape.next
            while kept < len(walked) and walked[kept] < pos - queue.shift:  # the walk needs one period back
                shapes.pop(walked[kept], None)
                kept += 1
        for at in walked[kept:]:
            shapes.pop(at, None)
        positions.append(np.asarray(walked, dtype=np.int64))
    queue_first = np.zeros(len(queues) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in positions], out=queue_first[1:])
    dep_list = _task_numbers(positions, queue_first, np.asarray(dep_queue, dtype=np.int32),
                             np.asarray(dep_pos, dtype=np.int64), ix.phase.name)
    comm_arr = np.frombuffer(bytes(comm), dtype=np.uint8).copy()
    record = np.full(len(comm_arr), -1, dtype=np.int32)
    record_task = np.flatnonzero(comm_arr).astype(np.int32)
    record[record_task] = np.arange(len(record_task), dtype=np.int32)
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
        lowering, positions, queue_first, comm_arr, np.frombuffer(bytes(first), dtype=np.uint8).copy(),
        np.frombuffer(bytes(last), dtype=np.uint8).copy(), np.asarray(device, dtype=np.int32),
        np.asarray(cost, dtype=np.int32), record, np.asarray(dev_off, dtype=np.int32),
        np.asarray(dev_list, dtype=np.int32), np.asarray(dep_off, dtype=np.int32), dep_list,
        np.asarray(wake_off, dtype=np.int32), np.asarray(wake_list, dtype=np.int32), costs, cost_task, keys,
        np.asarray(cost_key, dtype=np.int32), np.frombuffer(bytes(cross), dtype=np.uint8).copy(),
        np.frombuffer(bytes(one_way), dtype=np.uint8).copy(), compute_queue,
        np.asarray([dense[d] for d in ix.devices], dtype=np.int32), record_task)


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
    (record) its start, end, solo and exposed time."""

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
        """The reference's records: (queue, position, start, end, solo, exposed) per comm task."""
        out = []
        for r, task in enumerate(arrays.record_task.tolist()):
            q, pos = arrays.where(task)
            out.append((q, pos, float(self.start[r]), float(self.end[r]), float(self.solo[r]),
                        float(self.exposed_by_record[r])))
        return out


def simulate_phase(arrays: PhaseArrays, run: Any, model: CostModel) -> Outcome:
    """Simulate the phase with this run's configs (``run``: the reference's ``_PhaseRun`` for them, whose
    memoised cost methods answer the C loop's callback, so both loops ask the model the same questions)."""
    lib = _library()
    if lib is None:
        raise LagomError("the compiled simulator is not built")
    costs = arrays.costs
    reps: list[Any] = [run.task(q, pos) for q, pos in arrays.cost_task]
    n = len(costs)
    solo, launch, util = np.zeros(n), np.zeros(n), np.zeros(n)
    for c, t in enumerate(reps):
        if t.comm:
            solo[c] = run.solo(t)
            launch[c] = model.launch_wait(t.config)
        else:
            util[c] = run.util(t)
    failed: list[BaseException] = []

    def answer(kind: int, count: int, key: Any) -> float:
        try:
            t = reps[int(key[0])]
            if kind == 0:
                return run.comm_duration(t, key[1], key[2])
            if kind == 1:
                t = copy.copy(t)
                t.dur = key[1]
                return run.comm_rate(t)
            beside = []
            for i in range(1, count, 2):
                c = copy.copy(reps[int(key[i])])
                c.rate = key[i + 1]
                beside.append(c)
            return run.compute_duration(t, beside)
        except BaseException as err:  # noqa: BLE001 - handed back to Python once the C loop unwinds
            failed.append(err)
            return math.nan

    struct = arrays._struct
    if struct is None:
        a = arrays
        struct = arrays._struct = _Phase(
            a.tasks, len(a.positions), len(a.compute_queue), len(a.blame_device), _ptr(a.queue_first, _i32),
            _ptr(a.comm, _u8), _ptr(a.first, _u8), _ptr(a.last, _u8), _ptr(a.device, _i32), _ptr(a.cost, _i32),
            _ptr(a.record, _i32), _ptr(a.dev_off, _i32), _ptr(a.dev_list, _i32), _ptr(a.dep_off, _i32),
            _ptr(a.dep_list, _i32), _ptr(a.wake_off, _i32), _ptr(a.wake_list, _i32), _ptr(a.cost_key, _i32),
            _ptr(a.cost_cross, _u8), _ptr(a.cost_one_way, _u8), None, None, None, _ptr(a.compute_queue, _i32),
            _ptr(a.blame_device, _i32))
    struct.cost_solo, struct.cost_launch, struct.cost_util = _ptr(solo, _f64), _ptr(launch, _f64), _ptr(util, _f64)
    keys = arrays.keys
    records = len(arrays.record_task)
    totals, touched = np.zeros(4 * len(keys)), np.zeros(len(keys), dtype=np.int32)
    first_start = np.full(len(keys), np.inf)
    start, end, solo_out, exposed = (np.zeros(records) for _ in range(4))
    heads = np.zeros(len(arrays.positions), dtype=np.int32)
    result = _Result(0.0, 0.0, 0, _ptr(totals, _f64), _ptr(touched, _i32), _ptr(first_start, _f64), _ptr(start, _f64),
                     _ptr(end, _f64), _ptr(solo_out, _f64), _ptr(exposed, _f64), _ptr(heads, _i32))
    rc = lib.lagom_simulate_phase(ctypes.byref(struct), COST_FN(answer), ctypes.byref(result))
    lw, phase = arrays.lowering, arrays.lowering.ix.phase.name
    if rc == CALLBACK and failed:
        raise failed[0]
    if rc == NOMEM:
        raise MemoryError(f"the compiled simulator ran out of memory in phase {phase}")
    if rc in (DEADLOCK, STALLED):
        stuck = [lw.name(*arrays.where(int(t))) for q, t in enumerate(heads) if t < arrays.queue_first[q + 1]]
        if rc == DEADLOCK:
            raise LagomError(f"simulation deadlock in phase {phase}: {stuck[:4]}")
        raise LagomError(f"simulation made no progress in phase {phase} at {result.now!r} s: {stuck[:4]}")
    if rc != OK:
        raise LagomError(f"the compiled simulator failed in phase {phase} (code {rc})")
    order = sorted((int(touched[k]), k) for k in range(len(keys)) if touched[k])
    key_totals = {keys[k]: dict(zip(("time", "solo", "exposed", "count"), totals[4 * k:4 * k + 4].tolist()))
                  for _, k in order}
    return Outcome(result.now, result.exposed_total, int(result.tasks), key_totals,
                   {keys[k]: float(first_start[k]) for k in range(len(keys)) if math.isfinite(first_start[k])},
                   start, end, solo_out, exposed)

