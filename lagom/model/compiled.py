"""The simulator's compiled event loop (event_loop.c).

A search simulates one step graph hundreds of times with different configs, and only the speeds of its
tasks change between runs, not the tasks: so each phase is lowered once per choice of decompositions into
arrays (``lagom.model.phase_arrays``), and every run hands them to the C loop with this run's per-cost figures. The loop
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
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lagom.errors import ConfigError, LagomError
from lagom.model.phase_arrays import PhaseArrays
from lagom.model.phase_index import END
from lagom.nccl_tuner.build import EVENT_LOOP, LIBRARY_DIR

if TYPE_CHECKING:
    from lagom.model.cost_model import CostModel

log = logging.getLogger(__name__)

ENV = "LAGOM_SIMULATOR"  # "compiled" (the default where built) or "python"
ABI = 4  # LAGOM_EVENT_LOOP_ABI in event_loop.h
OK, NOMEM, CALLBACK, DEADLOCK, STALLED, PAUSED, CHECKPOINT = range(7)
# Tasks a compiled run starts between checkpoints: ten times the Python loop's (simulator.CHECKPOINT_EVERY), as
# the loop is fifty times faster (a resumed run redoes about a millisecond); and at most so many checkpoints a
# run, further apart in a larger phase (each holds every queue's state: 15 kB at 94 queues, so 15 MB at most).
# Only the part of a run past the pipeline's steady band keeps any, so a run keeps far fewer than the cap.
CHECKPOINT_EVERY = 4096
CHECKPOINTS_PER_RUN = 1024


def checkpoint_interval(arrays: PhaseArrays) -> int:
    """Tasks started between a run's checkpoints on these arrays."""
    return max(CHECKPOINT_EVERY, -(-arrays.tasks // CHECKPOINTS_PER_RUN))

_i32, _u8, _f64 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_double)
_i64 = ctypes.POINTER(ctypes.c_int64)
COST_FN = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_int, ctypes.c_int, _f64)

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
