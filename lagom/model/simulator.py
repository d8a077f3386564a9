"""Discrete-event simulation of one training step over compute and communication streams.

Each device (one GPU per pipeline stage: data-parallel replicas are symmetric, so one stands for all
of them and the cost does not grow with dp or node count) has a compute stream and one stream per
communicator (collectives on one communicator serialise, as in ProcessGroupNCCL). A task starts when
it heads its stream and its dependencies are done. Rates are fluid: whenever the tasks running on a
GPU change, the tasks there are re-rated by the cost model with what runs beside them, so a collective
slows the GEMM under it and retuning one collective moves the windows of the rest.

Cost. An event touches only the streams it wakes and the tasks whose neighbours changed; the next
completion comes off a heap: O(E log E) for E tasks. Tasks are built lazily by position
(``lagom.model.lowering``), never a whole phase at once.

Steady state. In a periodic band (a 1F1B pipeline once it fills: every stage repeats one forward and
one backward per micro-batch) the simulator compares the state, once per period of one stage, with the
state one or more periods earlier (up to REPEAT_MOST: P2P steps whose length is no whole fraction of the
period bring the state back only after many): the same stream positions shifted by whole periods, the
same tasks running, with the same remaining work (to 1e-9). From then on every period repeats the last one, so the
simulator jumps over all but the last period of the band: the clock, exposed comm and per-key sums
advance by the measured period's, and running tasks hand their progress to their images. It then
simulates the cool-down. A pipeline converges to its steady state geometrically, so the jump is exact to
about the tolerance (tests compare it with the full simulation). A state that changes by the same factor
every cycle (of up to three periods) is extrapolated along that series: to its limit where it converges,
and where it drifts away (a backlog growing each cycle) as far as a probe cycle from the landing state
confirms it. A state whose running heads' remaining work moves by the same amount every cycle (a linear
drift: a collective running across many periods beside compute that repeats) is jumped the same way, to
before any of them would finish. If the state does none of these, the phase is simulated in full.

Twins. Preparing a phase for runs (its index, band and lowering) costs as much as its tasks, though the runs
jump over most of a long pipeline's. A pipeline of many micro-batches comes with its twin
(``lagom.step.points.points_for``): the same phase built for fewer, whose band is shorter by whole periods and
which is otherwise the same. The twin is prepared and run in the phase's place; its jumps pass over the periods
it lacks first (the clock and sums advance by them, the positions do not), so the run is the phase's (to the
bit fresh; resumed, to the rounding of resumed runs). A twin whose band ends before the phase would have jumped is not used again (``TwinTooShort``), and runs
that keep timings or simulate every period run the phase itself.

Incremental runs. A ``Simulator`` keeps checkpoints of its last runs. A run whose configs differ from
an earlier one's only in keys whose first collective started late in it (gradient buckets, parameter
gathers at the end of a step) resumes from the last checkpoint before that start: what came before
cannot depend on those keys. A phase none of the changed keys started in is reused whole.

Two loops. This module's event loop is the reference, and the fallback where the compiled one
(``lagom.model.compiled``, event_loop.c) was not built or LAGOM_SIMULATOR=python asks for it. A Simulator
runs phases on the compiled loop by default (``_CompiledPhaseRun``): the loop runs in C and pauses at the
band's period boundaries, where the steady-state logic here reads its state and decides the jumps, which C
then applies and probes. The two agree to 1e-9 with and without jumps (to the bit, today: same operations in
the same order). Both keep checkpoints and resume from them the same way (the compiled loop's live in C,
``compiled.Checkpoint``, at its own interval): a search changes one key at a time, and many keys' first
collective starts late in the step (gradient buckets), so many runs simulate only their last part. This is the
largest module (about 1,400 lines) because the steady-state logic is here once for both loops.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import weakref
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from lagom.errors import LagomError
from lagom.model import compiled, phase_arrays
from lagom.model.cost_model import CostModel, RunningComm
from lagom.model.lowering import COMPUTE, END, Lowering, Shape, split_of
from lagom.model.phase_index import SLOT, PhaseIndex, first_seen, index_of
from lagom.plan.comm_config import CommConfig, default_config
from lagom.step.graph import Collective, ComputeSegment, Phase, StepGraph

EPS = 1e-12
DONE = 1e-9  # a task whose remaining fraction falls to this is finished
REPEAT_TOLERANCE = 1e-9  # remaining fractions this close count as the same state
CYCLE_MOST = 3  # the longest cycle of periods extrapolated geometrically (a state alternating between two)
REPEAT_MOST = 64  # the longest cycle of periods an exact repetition is looked for over (P2P steps whose
# length is no whole fraction of the period come back to one state after many periods: 19 on a 1,024-GPU Llama)
UNITS_KEPT = max(REPEAT_MOST, 3 * CYCLE_MOST) + 1  # states remembered for this many periods back
RANK_ONE = 1e-7  # how closely successive differences must be one geometric series to extrapolate its limit
DRIFT_MOST = 1.5  # the fastest growth per cycle of a drifting state that is extrapolated
DRIFT_NEAR_ONE = 1e-6  # a ratio this close to 1 is a linear drift the geometric sums cannot take exactly
DRIFT_TRIES = 4  # landing probes of a drift's jump, each half as far as the last
ROUNDING = 1e-11  # rounding noise allowed in those differences, per unit of the sum they come from
CHECKPOINT_EVERY = 400  # tasks started between checkpoints
TRAILS_KEPT = 3  # earlier runs whose checkpoints a Simulator keeps
LOWERINGS_KEPT = 8  # decomposition choices whose task shapes a Simulator keeps
SHAPES_KEPT = 200_000  # task shapes a Simulator keeps over all its lowerings (about 400 bytes each)
DURATIONS_KEPT = 200_000  # compute durations a Simulator keeps across runs (Simulator._compute_durations)
ARRAYS_KEPT = 256 << 20  # bytes of arrays lowered for the compiled loop kept, all Simulators together (~51 a task)
INF = float("inf")

Configs = dict[str, CommConfig]


@dataclass
class PointTiming:
    name: str
    key: str
    device: int
    start: float
    end: float
    solo: float  # alone on the GPU, same config
    exposed: float  # compute-stream time spent waiting for it


@dataclass
class PhaseResult:
    name: str
    repeat: int
    time: float
    exposed_comm: float
    compute_solo: float
    comm_peak: float
    key_totals: dict[str, dict[str, float]]  # per key, one repeat: comm time, solo time, exposed time, count
    spans: list[tuple[int, str, str, float, float]]  # (device, stream, name, start, end), with keep_spans
    tasks_simulated: int = 0  # tasks run event by event (a resumed run counts those before its checkpoint)
    periods_skipped: int = 0  # steady-state periods advanced without simulating them
    resumed_at: float | None = None  # the checkpoint this run resumed an earlier one's from (None: from the start)
    _timings: Callable[[], list[PointTiming]] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def points(self) -> list[PointTiming]:
        """Every collective of the phase with its timing, in lowering order (skipped periods included)."""
        return self._timings() if self._timings else []


@dataclass
class StepResult:
    step_s: float
    exposed_comm_s: float
    compute_s: float  # uncontended compute on the busiest device
    comm_peak_s: float  # comm at link peak on the busiest stream
    phases: list[PhaseResult] = field(default_factory=list)

    @property
    def overlap_efficiency(self) -> float:
        return max(self.compute_s, self.comm_peak_s) / self.step_s if self.step_s > 0 else 1.0

    @property
    def tasks_simulated(self) -> int:
        return sum(ph.tasks_simulated for ph in self.phases)

    def per_key(self) -> dict[str, dict[str, float]]:
        """Comm seconds, solo seconds, exposed seconds and count per tuning key over the whole step."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"time": 0.0, "solo": 0.0, "exposed": 0.0, "count": 0})
        for ph in self.phases:
            for key, row in ph.key_totals.items():
                total = out[key]
                for name in ("time", "solo", "exposed", "count"):
                    total[name] += row[name] * ph.repeat
        return dict(out)


@dataclass
class _Jump:
    """Periods skipped in one go, and where what they held would have been.

    The state repeats (or converges) over a cycle of ``units`` periods. After the last simulated cycle
    the cycle lengths converge to ``units * period`` geometrically (ratio ``ratio``, first excess
    ``excess``; both 0 when the state repeated exactly)."""

    queues: dict[int, tuple[int, int, bool]]  # band queue -> (head, positions skipped, head was running)
    periods: int
    period: float
    excess: float
    ratio: float
    units: int = 1
    virtual: int = 0  # of ``periods``, those of the phase a twin stands for and its arrays lack (no positions moved)

    def shift(self, n: int) -> float:
        """Seconds from a task to its image n periods on (n a whole number of cycles)."""
        if not self.excess:
            return n * self.period
        cycles = n // self.units
        return n * self.period + self.excess * self.ratio * (1 - self.ratio ** cycles) / (1 - self.ratio)


@dataclass
class _Checkpoint:
    """A run's state just before the tasks of one instant start: enough to continue it."""

    now: float
    heads: list[int]
    running: list[tuple]  # (queue, position, seq, start, remaining, duration, rate, exposed, solo)
    woken: set[int]
    dirty: set[int]
    totals: dict[str, list[float]]
    exposed: float
    records: int  # how many records the run had
    longest: float
    first_start: dict[str, float]
    jumps: list[_Jump]
    simulated: int
    seq: int


# checkpoints: _Checkpoint of the Python loop or compiled.Checkpoint (a Simulator runs one loop or the other)
# (result, when each key first started, checkpoints, records, whether its twin ran: the checkpoints are the twin's)
_PhaseTrail = tuple["PhaseResult", dict[str, float], list[Any], list[tuple], bool]


@dataclass
class _Trail:
    """What a finished run leaves for later runs to resume from."""

    configs: Configs
    model: CostModel
    state: tuple  # the model's settings then (a calibrated model's scales change between runs)
    extrapolate: bool
    phases: list[_PhaseTrail | None]


def _model_state(model: CostModel) -> tuple:
    """What a model's costs depend on besides its hardware: its own settings (a calibrated model's comm
    and compute scales). Runs resume only from runs under the same."""
    return tuple(sorted((name, tuple(sorted(value.items())) if isinstance(value, dict) else value)
                        for name, value in vars(model).items() if name != "hw" and not callable(value)))


class Simulator:
    """A step graph prepared for many runs (what a search does): phase indexes, periodic bands and task
    shapes are built on first use and kept, and runs resume from earlier runs' checkpoints where the
    changed configs cannot have mattered yet. The model may change between runs: a run resumes only
    from runs under the same model object with the same settings. The graph must not change."""

    def __init__(self, graph: StepGraph, *, compiled_loop: bool | None = None) -> None:
        """``compiled_loop``: run on the compiled event loop (None: where it is built and LAGOM_SIMULATOR does not
        say python). The Python loop is the reference, with steady-state jumps and resumable checkpoints."""
        self.graph = graph
        self.compiled_loop = compiled.enabled() if compiled_loop is None else compiled_loop
        self._lowerings: dict[tuple[int, frozenset, bool, bool], Lowering] = {}
        self._owner = next(_OWNERS)  # its arrays' key in _KEPT, dropped with it
        self._twin_owner = next(_OWNERS)  # and its twins'
        weakref.finalize(self, _KEPT.drop, self._owner)
        weakref.finalize(self, _KEPT.drop, self._twin_owner)
        self._virtual: dict[int, int] = {}  # phase -> the periods its twin lacks (0: no twin runs for it)
        self._statics: dict[tuple[int, bool], tuple[dict, dict]] = {}
        self._static_costs: dict[tuple[int, bool], tuple[CostModel, tuple, float, float]] = {}
        self._trails: list[_Trail] = []
        self._durations: tuple[CostModel, tuple, dict[tuple, float]] | None = None

    def _compute_durations(self, model: CostModel) -> dict[tuple, float]:
        """Compute durations under ``model`` kept across runs, keyed by the configs of the collectives beside each
        segment: a search's runs differ in a key or two, so most situations recur in every run, while a run's own
        memo (and the compiled loop's) start empty. Started afresh for another model or settings, and past
        DURATIONS_KEPT entries."""
        state = _model_state(model)
        kept = self._durations
        if kept is None or kept[0] is not model or kept[1] != state or len(kept[2]) > DURATIONS_KEPT:
            kept = self._durations = (model, state, {})
        return kept[2]

    def index(self, i: int, twin: bool = False) -> PhaseIndex:
        phase = self.graph.phases[i]
        return index_of(phase.derived["twin"] if twin else phase)

    def virtual(self, i: int) -> int:
        """The band periods phase i's twin lacks (``lagom.step.points.points_for``), where the twin may stand for
        it in runs that jump (0: the phase runs itself). Its band must be one stretch on every stream, and the
        phase's segments and collectives beyond the twin's whole periods of it. A twin that turns out too short
        for the jumps the phase makes (``TwinTooShort``) is not tried again, by any Simulator of the graph."""
        if i not in self._virtual:
            self._virtual[i] = _twin_periods(self.graph.phases[i])
        return self._virtual[i]

    def run(self, configs: Configs, model: CostModel, *, keep_spans: bool = False, extrapolate: bool = True,
            timings: bool = False) -> StepResult:
        """Simulate one step with the given per-key configs (missing keys get NCCL's defaults).

        ``keep_spans`` records every task's span for plots (and simulates every period);
        ``extrapolate=False`` simulates every period too (the steady-state check's reference);
        ``timings``: the compiled loop keeps every collective's timing for ``PhaseResult.points``; without, a
        search's runs keep none (tens of MB a run at cluster scale) and ``points`` simulates the phase again.
        """
        default = default_config(model.hw)
        extrapolate = extrapolate and not keep_spans
        split = split_of(configs)
        phases: list[PhaseResult] = []
        left: list[_PhaseTrail | None] = []
        resume = [] if keep_spans else self._resumable(configs, model, extrapolate, default)
        for i in range(len(self.graph.phases)):
            virtual = self.virtual(i) if extrapolate and not timings else 0
            reuse, start = None, None
            for changed, trail in resume:
                done = trail.phases[i]
                if done is None:
                    continue
                result, first_start, checkpoints, records, twin = done
                t = min((first_start.get(k, INF) for k in changed), default=INF)
                if t == INF and not (timings and twin):  # no changed key has a collective in this phase: nothing
                    reuse = done  # in it changes (but a twin's result has no timings of the phase's to give)
                    break
                if twin != bool(virtual):  # checkpoints of the other arrays
                    continue
                at = next((n for n in range(len(checkpoints) - 1, -1, -1) if checkpoints[n].now <= t), None)
                if at is not None and (start is None or checkpoints[at].now > start[0].now):
                    start = (checkpoints[at], records, checkpoints[:at + 1])
            if reuse is not None:
                phases.append(reuse[0])
                left.append(reuse)
                continue
            try:
                done = self._phase(i, split, configs, model, default, keep_spans, extrapolate, timings, start, virtual)
            except TwinTooShort:
                self._virtual[i] = 0
                self.graph.phases[i].derived["twin_too_short"] = True  # for every Simulator of the graph
                done = self._phase(i, split, configs, model, default, keep_spans, extrapolate, timings, None, 0)
            phases.append(done[0])
            left.append(None if keep_spans else done)
        if not keep_spans:
            self._trails.insert(0, _Trail(dict(configs), model, _model_state(model), extrapolate, left))
            del self._trails[TRAILS_KEPT:]
        if sum(lowering.kept() for lowering in self._lowerings.values()) > SHAPES_KEPT:
            for lowering in self._lowerings.values():  # each run lands its jumps elsewhere: new shapes every run
                lowering.forget()
        return StepResult(
            step_s=sum(p.time * p.repeat for p in phases),
            exposed_comm_s=sum(p.exposed_comm * p.repeat for p in phases),
            compute_s=sum(p.compute_solo * p.repeat for p in phases),
            comm_peak_s=sum(p.comm_peak * p.repeat for p in phases),
            phases=phases,
        )

    def _phase(self, i: int, split: frozenset, configs: Configs, model: CostModel, default: CommConfig,
               keep_spans: bool, extrapolate: bool, timings: bool, start: tuple | None, virtual: int) -> _PhaseTrail:
        """Phase ``i`` simulated (by its twin where ``virtual``), on the compiled loop or this module's."""
        if self.compiled_loop and not keep_spans:
            result, first_start, saved = self._compiled(i, split, configs, model, default, extrapolate, timings, start,
                                                        virtual)
            return result, first_start, saved, [], bool(virtual)
        run = _PhaseRun(self._lowering(i, split, extrapolate, bool(virtual)), configs, model, default, keep_spans,
                        self._compute_durations(model), virtual)
        result = run.simulate(*self._static(i, model, bool(virtual)), resume=start)
        if virtual:  # the twin's records are not the phase's collectives
            result._timings = self._again(i, split, configs, model, default, extrapolate)
        return result, run.first_start, run.checkpoints, run.records, bool(virtual)

    def _again(self, i: int, split: frozenset, configs: Configs, model: CostModel, default: CommConfig,
               extrapolate: bool) -> Callable[[], list[PointTiming]]:
        """Phase ``i``'s collectives' timings, from a run of the phase itself when asked for (a search's runs keep
        none, and a twin's are not the phase's)."""
        simulator, graph = weakref.ref(self), self.graph
        state, configs = _model_state(model), dict(configs)

        def again() -> list[PointTiming]:
            if _model_state(model) != state:
                raise LagomError(f"the collectives' timings of phase {graph.phases[i].name} were not kept, and the "
                                 "model has changed since the run: simulate the step again with timings=True")
            sim = simulator() or Simulator(graph)
            return sim._phase(i, split, configs, model, default, False, extrapolate, True, None, 0)[0].points

        return again

    def _resumable(self, configs: Configs, model: CostModel, extrapolate: bool,
                   default: CommConfig) -> list[tuple[set[str], _Trail]]:
        """Earlier runs this one may resume from, with the keys whose configs differ."""
        out = []
        state = _model_state(model)
        for trail in self._trails:
            if trail.model is not model or trail.state != state or trail.extrapolate != extrapolate \
                    or split_of(trail.configs) != split_of(configs):
                continue
            keys = set(trail.configs) | set(configs)
            out.append(({k for k in keys if trail.configs.get(k, default) != configs.get(k, default)}, trail))
        return out

    def _compiled(self, i: int, split: frozenset, configs: Configs, model: CostModel, default: CommConfig,
                  extrapolate: bool, timings: bool, resume: tuple[compiled.Checkpoint, list, list] | None = None,
                  virtual: int = 0) -> tuple[PhaseResult, dict[str, float], list[compiled.Checkpoint]]:
        """One phase on the compiled loop, from arrays lowered once per choice of decompositions, with the
        steady-state jumps where ``extrapolate``, from an earlier run's checkpoint where ``resume`` (a run with
        ``timings`` keeps records, so it neither resumes nor keeps checkpoints); with when each key's first
        collective started (what tells a later run whether it may reuse this phase) and its checkpoints. The
        result's ``points`` hold on to neither the arrays nor, without ``timings``, the records: a search's
        results outlive both (its trails and bests), and pinning them for timings that are rarely asked for held
        gigabytes."""
        resume = None if timings else resume
        run = _CompiledPhaseRun(self._lowered(i, split, bool(virtual)), configs, model, default, extrapolate, timings,
                                self._compute_durations(model), None if resume is None else resume[0],
                                [] if resume is None else resume[2], virtual)
        outcome = run.simulate_loop()
        simulator = weakref.ref(self)

        def recorded() -> list[PointTiming]:
            sim = simulator()
            run.records = outcome.records(sim._lowered(i, split) if sim is not None else phase_arrays.lower(run.lw))
            return run._point_timings()

        phase = self.graph.phases[i]
        return PhaseResult(phase.name, phase.repeat, outcome.now, outcome.exposed, *self._static(i, model, bool(virtual)),
                           outcome.key_totals, [], outcome.tasks, sum(j.periods for j in run.jumps),
                           None if resume is None else resume[0].now,
                           recorded if timings else self._again(i, split, configs, model, default, extrapolate)), \
            outcome.first_start, run.saved

    def _lowered(self, i: int, split: frozenset, twin: bool = False) -> phase_arrays.PhaseArrays:
        """Phase ``i`` (or its twin) lowered to arrays under ``split``: kept from an earlier run, or lowered now."""
        return _KEPT.arrays(self._twin_owner if twin else self._owner, i, split,
                            lambda: self._lowering(i, split, True, twin))

    def lowered(self) -> dict[tuple[int, frozenset], phase_arrays.PhaseArrays]:
        """The arrays kept for this Simulator's runs, by phase and choice of decompositions (a twin's where it runs
        for its phase)."""
        return {**_KEPT.of(self._owner), **_KEPT.of(self._twin_owner)}

    def _lowering(self, i: int, split: frozenset, band: bool, twin: bool = False) -> Lowering:
        key = (i, split, band, twin)
        lowering = self._lowerings.pop(key, None) or Lowering(self.index(i, twin), split, band)
        self._lowerings[key] = lowering  # most recently used last
        while len(self._lowerings) > LOWERINGS_KEPT:
            del self._lowerings[next(iter(self._lowerings))]
        return lowering

    def _static(self, i: int, model: CostModel, twin: bool = False) -> tuple[float, float]:
        """(uncontended compute of the busiest device, comm at link peak of the busiest stream): counted
        per distinct segment and collective once (in the order they first appear), then costed with the model,
        once per model and settings (a search runs one model throughout). Of the phase itself where its twin
        runs: the twin's counts and the periods it lacks times one period's."""
        at = (i, twin)
        if at not in self._statics:
            ix = self.index(i, twin)
            arrays, signatures = ix.kind_arrays
            segs = {d: _counted(of, signatures) for d, of in arrays.items()}
            c = ix.columns
            what, firsts = first_seen(c.device, c.group, c.collective, c.bytes)
            comms: dict = defaultdict(dict)
            for j, n in zip(firsts.tolist(), np.bincount(what, minlength=len(firsts)).tolist()):
                p = ix.points[j]
                comms[(p.device, p.group.name)][(p.collective, p.group, p.bytes)] = n
            if twin:
                band, lacked = ix.band, self.virtual(i)
                assert band is not None
                for d, period in band.period.items():
                    lo = band.segments[d][0][0]
                    for sig, n in _counted(arrays[d][lo:lo + period], signatures).items():
                        segs[d][sig] += lacked * n
                for j in ix.period_points().tolist():
                    p = ix.points[j]
                    comms[(p.device, p.group.name)][(p.collective, p.group, p.bytes)] += lacked
            self._statics[at] = (segs, comms)
        state = _model_state(model)
        costed = self._static_costs.get(at)
        if costed is None or costed[0] is not model or costed[1] != state:
            segs, comms = self._statics[at]
            compute = max((sum(n * model.compute_solo(ComputeSegment("", *sig)) for sig, n in counts.items())
                           for counts in segs.values()), default=0.0)
            peak = max((sum(n * model.comm_peak_time(*what) for what, n in counts.items()) for counts in comms.values()),
                       default=0.0)
            costed = self._static_costs[at] = (model, state, compute, peak)
        return costed[2], costed[3]


def _twin_periods(phase: Phase) -> int:
    """The band periods phase's twin lacks, where the twin can stand for it (see ``Simulator.virtual``), else 0."""
    twin = phase.derived.get("twin")
    if twin is None or phase.derived.get("twin_too_short") or set(twin.segments) != set(phase.segments):
        return 0
    ix = index_of(twin)
    band = ix.band
    if band is None or any(len(spans) != 1 for spans in band.segments.values()) \
            or any(len(spans) > 1 for _, spans in band.slots):
        return 0
    extra = {d: len(phase.segments[d]) - len(segments) for d, segments in twin.segments.items()}
    if any(n for d, n in extra.items() if d not in band.period):
        return 0
    periods = {extra[d] // p if extra[d] % p == 0 else 0 for d, p in band.period.items()}
    lacked = periods.pop() if len(periods) == 1 else 0
    if lacked < 1 or len(phase.points) - len(twin.points) != lacked * len(ix.period_points()):
        return 0
    return lacked


def _counted(kinds: np.ndarray, signatures: list[tuple]) -> dict[tuple, int]:
    """Each segment kind's signature with how often it occurs, in the order the kinds first appear."""
    which, firsts = first_seen(kinds)
    return dict(zip([signatures[k] for k in kinds[firsts].tolist()], np.bincount(which, minlength=len(firsts)).tolist()))


class _KeptArrays:
    """The arrays lowered for the compiled loop, kept for the runs to come of every Simulator in the process within
    one budget (ARRAYS_KEPT bytes): a tune keeps several Simulators alive (one per bucket scale), and each keeping
    its own hundreds of MB was most of its peak. The least used are dropped first and, of those used as often, the
    most recently lowered: a search's stages go over the same splits in the same order, and where they exceed the
    budget, dropping the least recently used dropped each one just before its next use. Before a lowering, room is
    made for the largest arrays lowered so far, so the new arrays and the lowering's transient do not come on
    top of a full budget. Simulators may run in threads of
    their own (a search beside the job): the bookkeeping holds a lock, the lowering does not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[int, int, frozenset], phase_arrays.PhaseArrays] = OrderedDict()  # (owner, phase, split)
        self._largest = 0  # bytes of the largest arrays lowered so far
        self._uses: Counter[tuple[int, int, frozenset]] = Counter()  # runs per (owner, phase, split), kept or not

    def arrays(self, owner: int, i: int, split: frozenset, lowering: Callable[[], Lowering]) -> phase_arrays.PhaseArrays:
        key = (owner, i, split)
        with self._lock:
            self._uses[key] += 1
            arrays = self._kept.pop(key, None)
            if arrays is None:
                self._fit(self._largest, 0)
        if arrays is None:
            arrays = phase_arrays.lower(lowering())
        with self._lock:
            self._kept[key] = arrays  # most recently used last
            self._largest = max(self._largest, arrays.nbytes)
            self._fit(0, 1)
        return arrays

    def _fit(self, room: int, keep: int) -> None:
        """Drop arrays, the least used and then the most recent first, until ``room`` more bytes fit, keeping the
        ``keep`` most recent."""
        held = sum(a.nbytes for a in self._kept.values())
        order = list(self._kept)  # least recently used first
        recent = {k: n for n, k in enumerate(order)}
        for key in sorted(order[:len(order) - keep], key=lambda k: (self._uses[k], -recent[k])):
            if held + room <= ARRAYS_KEPT:
                break
            held -= self._kept.pop(key).nbytes

    def of(self, owner: int) -> dict[tuple[int, frozenset], phase_arrays.PhaseArrays]:
        with self._lock:
            return {(i, split): a for (o, i, split), a in self._kept.items() if o == owner}

    def drop(self, owner: int) -> None:
        """Everything of a Simulator that is gone."""
        with self._lock:
            for key in [k for k in self._kept if k[0] == owner]:
                del self._kept[key]
            for key in [k for k in self._uses if k[0] == owner]:
                del self._uses[key]


_KEPT = _KeptArrays()
_OWNERS = itertools.count()


def simulate(graph: StepGraph, configs: Configs, model: CostModel, *, keep_spans: bool = False) -> StepResult:
    """Simulate one step with the given per-key configs (missing keys get NCCL's defaults). Callers that
    simulate one graph many times (a search, a calibration) keep a Simulator instead."""
    return Simulator(graph).run(configs, model, keep_spans=keep_spans, timings=True)


# ---------------------------------------------------------------------------------------------
# One phase


class _Task:
    """A task of this run: its shape and where it stands."""

    __slots__ = ("queue", "pos", "shape", "comm", "device", "devices", "deps", "config", "cost", "key", "seq", "start",
                 "rem", "since", "dur", "rate", "version", "exposed", "solo", "rated", "util", "cross", "one_way")

    def __init__(self, queue: int, pos: int, shape: Shape, run: _PhaseRun) -> None:
        self.queue, self.pos, self.shape = queue, pos, shape
        self.comm, self.device, self.devices, self.deps, self.cost = shape.comm, shape.device, shape.devices, shape.deps, shape.cost
        self.key: str = shape.cost[0] if shape.comm else ""
        self.config: CommConfig | None = (run.config_memo.get(self.key) or run.config(self.key)) if shape.comm else None
        self.cross = shape.comm and run.ix.points[shape.point].group.nodes > 1  # uses the node's NIC
        # a pipeline send uses its NIC one way only (out of its device, into its peer); collectives both ways
        self.one_way = shape.comm and not shape.cost[1] and shape.coll == Collective.SEND_RECV
        self.seq = 0
        self.start = -1.0
        self.rem = 1.0  # remaining fraction at time ``since``
        self.since = 0.0
        self.dur = 0.0  # seconds for the whole task at the current rate
        self.rate = 0.0  # comm: HBM bytes/s it takes
        self.version = 0
        self.exposed = 0.0
        self.solo = 0.0
        self.rated = 0  # the event it was last re-rated in
        self.util = 0.0  # compute: the HBM share it uses alone (what slows the comm beside it)


@dataclass
class _Seen:
    """The state at a period boundary of the band, to compare with the state whole periods later."""

    unit: int  # periods of the reference stream so far
    key: tuple  # stream positions less ``unit`` periods, and which heads run
    remaining: list[float]  # remaining fraction of each running head, in queue order
    spans: list[tuple[int, int] | None]  # the band span each stream is in
    now: float
    totals: dict[str, list[float]]
    exposed: float
    room: int  # periods left before a stream leaves its span (a twin's: with the periods it lacks still to come)
    virtual: int = 0  # of ``room``, the periods a twin lacks (``_PhaseRun.virtual``)


@dataclass
class _Plan:
    """A jump: per period ``period`` seconds and ``increments`` of the sums, plus a geometric transient."""

    units: int  # reference periods per period
    period: float
    increments: dict[str, list[float]]
    exposed: float
    excess: float  # last simulated period less the steady one (0: exact repetition)
    excess_increments: dict[str, list[float]]
    excess_exposed: float
    ratio: float
    fixed: list[float]  # remaining fractions at the fixed point
    remaining: list[float]  # remaining fractions now
    most: int | None = None  # the most periods it may skip (None: to the band's end)
    drift: list[float] | None = None  # a linear drift: each running head's change per cycle (ratio 0, fixed = now)


class _PhaseRun:
    def __init__(self, lowering: Lowering, configs: Configs, model: CostModel, default: CommConfig, keep_spans: bool,
                 shared_compute: dict[tuple, float] | None = None, virtual: int = 0) -> None:
        self.lw, self.ix = lowering, lowering.ix
        # a twin's run (``Simulator.virtual``): the band periods its phase has and its arrays lack; its jumps pass
        # over them as if they were there, so the run is the phase's, but for the tasks' positions
        self.virtual = virtual
        self.configs, self.model, self.default = configs, model, default
        self.keep_spans = keep_spans
        self.heads = list(lowering.firsts)
        self.tasks: list[dict[int, _Task]] = [{} for _ in lowering.queues]
        self.comm_memo: dict[tuple, float] = {}
        self.rate_memo: dict[tuple, float] = {}
        self.compute_memo: dict[tuple, float] = {}
        # compute durations kept across runs (the Simulator's, ``Simulator._compute_durations``), else this run's
        self.shared_compute: dict[tuple, float] = {} if shared_compute is None else shared_compute
        self.solo_memo: dict[tuple, float] = {}
        self.util_memo: dict[tuple, float] = {}
        self.config_memo: dict[str, CommConfig] = {}
        self.records: list[tuple] = []  # comm tasks: (queue, position, start, end, solo, exposed)
        self.spans: list[tuple[tuple, tuple[int, str, str, float, float]]] = []
        self.first_start: dict[str, float] = {}  # key -> when its first collective started
        self.checkpoints: list[_Checkpoint] = []
        self.simulated = 0
        self.jumps: list[_Jump] = []
        self.history: list[_Seen] = []  # the period boundaries of the band, UNITS_KEPT back
        self.probe_unit: int | None = None  # a probe: stop at this period boundary and report the state

    def virtual_left(self) -> int:
        """The periods a twin lacks that no jump has passed over yet."""
        return self.virtual - sum(j.virtual for j in self.jumps)

    def _check_twin(self) -> None:
        """A twin's run stands for its phase's only if its jumps passed over every period it lacks."""
        if self.virtual_left():
            raise TwinTooShort(f"phase {self.ix.name}: the run left the band with {self.virtual_left()} periods still "
                               "to jump")

    def config(self, key: str) -> CommConfig:
        cfg = self.config_memo.get(key)
        if cfg is None:
            cfg = self.config_memo[key] = self.configs.get(key, self.default)
        return cfg

    def task(self, q: int, pos: int) -> _Task:
        t = self.tasks[q].get(pos)
        if t is None:
            t = self.tasks[q][pos] = _Task(q, pos, self.lw.shape(q, pos), self)
        return t

    # -- durations (memoised: layers and periods repeat the same few situations)

    def comm_duration(self, t: _Task, util: float, share: float = 1.0) -> float:
        key = (t.cost, util, share)
        dur = self.comm_memo.get(key)
        if dur is None:
            group = self.ix.points[t.shape.point].group
            if t.cost[1]:  # one P2P step of a decomposition
                raw = self.model.p2p_step_time(group, t.shape.nbytes, t.config, util, share)  # type: ignore[arg-type]
            else:
                raw = self.model.comm_time(t.shape.coll, group, t.shape.nbytes, t.config, util, share)  # type: ignore[arg-type]
            self._check_duration(t, raw)
            if util == 0.0 and share == 1.0:
                self.solo_memo[t.cost] = raw
            dur = self.comm_memo[key] = max(EPS, raw)
        return dur

    def comm_rate(self, t: _Task, dur: float) -> float:
        """HBM bytes a second a comm task moves when it takes ``dur`` seconds."""
        key = (t.cost, dur)
        rate = self.rate_memo.get(key)
        if rate is None:
            rate = self.rate_memo[key] = self.model.comm_hbm_rate(
                t.shape.coll, self.ix.points[t.shape.point].group, int(t.shape.nbytes), dur, t.config)  # type: ignore[arg-type]
        return rate

    def compute_duration(self, t: _Task, beside: list[tuple[_Task, float]]) -> float:
        """A compute task's seconds beside comm tasks running at the given HBM rates."""
        key = (t.cost, tuple([(c.cost, rate) for c, rate in beside]))
        dur = self.compute_memo.get(key)
        if dur is None:
            shared = (t.cost, tuple([(c.cost, c.config, rate) for c, rate in beside]))
            dur = self.shared_compute.get(shared)
            if dur is None:
                running = tuple(RunningComm(c.config, rate, self.ctas(c)) for c, rate in beside)  # type: ignore[arg-type]
                raw = self.model.compute_time(_segment(t.cost), running)
                self._check_duration(t, raw)
                dur = self.shared_compute[shared] = max(EPS, raw)
            self.compute_memo[key] = dur
        return dur

    def _check_duration(self, t: _Task, raw: float) -> None:
        """A NaN would pass max(EPS, ...) as EPS and an infinity would stall the clock: both are cost-model
        faults to name, never a step to report."""
        if not (math.isfinite(raw) and raw >= 0.0):
            raise LagomError(f"cost model gave duration {raw!r} for {self.lw.name(t.queue, t.pos)} "
                             f"in phase {self.ix.name}")

    def solo(self, t: _Task) -> float:
        """Alone on the GPU: comm with no compute beside it, compute with no comm."""
        s = self.solo_memo.get(t.cost)
        if s is None:
            if t.comm:
                self.comm_duration(t, 0.0)
                s = self.solo_memo[t.cost]
            else:
                s = self.solo_memo[t.cost] = self.model.compute_time(_segment(t.cost), ())
        return s

    def ctas(self, t: _Task) -> int:
        """CTAs a comm task runs (NCCL trims channels for small messages; copy engines run none)."""
        group = self.ix.points[t.shape.point].group
        if t.cost[1]:
            return self.model.launch_shape(t.shape.coll, self.model.p2p_group(group), int(t.shape.nbytes), t.config)[0]  # type: ignore[arg-type]
        return self.model.launch_shape(t.shape.coll, group, int(t.shape.nbytes), t.config)[0]  # type: ignore[arg-type]

    def util(self, t: _Task) -> float:
        u = self.util_memo.get(t.cost)
        if u is None:
            u = self.util_memo[t.cost] = self.model.hbm_util(_segment(t.cost))
        return u

    # -- the event loop

    def simulate(self, compute_solo: float, comm_peak: float,
                 resume: tuple[_Checkpoint, list[tuple], list[_Checkpoint]] | None = None) -> PhaseResult:
        lw, ix, model = self.lw, self.ix, self.model
        queues, heads, tasks = lw.queues, self.heads, self.tasks
        nq = len(queues)
        devices = ix.devices
        compute_on: dict[int, _Task | None] = {d: None for d in devices}
        comms_on: dict[int, list[_Task]] = {d: [] for d in devices}
        for queue in queues:  # a send's peer may be a device without compute
            comms_on.setdefault(queue.device, [])
            compute_on.setdefault(queue.device, None)
        compute_queue = [lw.compute_queue[d] for d in devices]
        heap: list[tuple[float, int, int, _Task]] = []
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])  # time, solo, exposed, count
        first_start = self.first_start
        exposed_total = 0.0
        longest = 0.0  # longest duration seen: how far past the next completion a DONE-close task may lie
        counter = seq = 0
        now = 0.0
        woken = set(range(nq))
        dirty: set[int] = set()
        band_ref = next((q for q, queue in enumerate(queues) if queue.kind == COMPUTE and queue.shift), None)
        check_every = queues[band_ref].shift if band_ref is not None else 0
        watching = band_ref is not None
        since_checkpoint = 0
        event = 0
        comm_memo, rate_memo, compute_memo, util_memo = self.comm_memo, self.rate_memo, self.compute_memo, self.util_memo
        shapes = lw.shapes
        if resume is not None:
            cp, records, earlier = resume
            now, exposed_total, longest, seq = cp.now, cp.exposed, cp.longest, cp.seq
            heads[:] = cp.heads
            for key, row in cp.totals.items():
                totals[key] = list(row)
            first_start.update(cp.first_start)
            self.records = records[:cp.records]
            self.checkpoints = list(earlier)  # the run it resumes is this run up to here
            self.jumps, self.simulated = list(cp.jumps), cp.simulated
            watching = self.probe_unit is not None
            for q, pos, t_seq, start, rem, dur, rate, exposed, solo in cp.running:
                t = self.task(q, pos)
                t.seq, t.start, t.rem, t.since, t.dur, t.rate, t.exposed, t.solo = t_seq, start, rem, now, dur, rate, exposed, solo
                t.util = 0.0 if t.comm else self.util(t)
                if t.comm:
                    for d in t.devices:
                        comms_on[d].append(t)
                else:
                    compute_on[t.device] = t
                counter += 1
                heapq.heappush(heap, (now + rem * dur, counter, t.version, t))
            woken, dirty = set(cp.woken), set(cp.dirty)
        live = sum(pos < END for pos in heads)
        while live:
            if not watching and since_checkpoint >= CHECKPOINT_EVERY and not self.keep_spans:
                since_checkpoint = 0
                self._checkpoint(now, seq, compute_on, comms_on, woken, dirty, totals, exposed_total, longest)
            # Start every stream head whose dependencies are done, in queue order.
            check = False
            for q in sorted(woken):
                pos = heads[q]
                if pos >= END:
                    continue
                t = tasks[q].get(pos) or self.task(q, pos)
                if t.start >= 0:
                    continue
                for dep in t.deps:
                    if dep[1] >= heads[dep[0]]:
                        break
                else:
                    t.start = t.since = now
                    seq += 1
                    t.seq = seq
                    self.simulated += 1
                    since_checkpoint += 1
                    if t.comm:
                        busy = False
                        for d in t.devices:
                            if compute_on[d] is not None:
                                busy = True
                        t.solo = self.solo(t)
                        t.rem = 1.0 + (model.launch_wait(t.config) / max(EPS, t.solo) if busy else 0.0)  # type: ignore[arg-type]
                        for d in t.devices:
                            comms_on[d].append(t)
                        row = totals[t.key]
                        row[1] += t.solo
                        if t.shape.first:
                            row[0] -= now
                            row[3] += 1
                            if t.key not in first_start:
                                first_start[t.key] = now
                    else:
                        t.util = util_memo.get(t.cost) or self.util(t)
                        compute_on[t.device] = t
                        if q == band_ref and watching and pos % check_every == 0:
                            check = True
                    dirty.update(t.devices)
                    t.dur = 0.0
            woken.clear()
            # Re-rate the tasks whose neighbours changed: comms first (their HBM rates feed compute).
            event += 1
            rate_dirty: set[int] = set()
            for d in dirty:
                for c in comms_on[d]:
                    if c.rated == event:
                        continue
                    c.rated = event
                    util = 0.0
                    sharing = 1
                    for dd in c.devices:
                        ct = compute_on[dd]
                        if ct is not None and ct.util > util:
                            util = ct.util
                        if c.cross:  # collectives of other communicators crossing nodes share the NIC
                            on_nic = 0
                            for other in comms_on[dd]:
                                if other.cross and (not (c.one_way and other.one_way)
                                                    or (c.device == dd) == (other.device == dd)):
                                    on_nic += 1
                            if on_nic > sharing:
                                sharing = on_nic
                    share = 1.0 / sharing
                    dur = comm_memo.get((c.cost, util, share)) or self.comm_duration(c, util, share)
                    if dur != c.dur:
                        if c.dur:
                            c.rem -= (now - c.since) / c.dur
                        c.since, c.dur = now, dur
                        c.version += 1
                        counter += 1
                        heapq.heappush(heap, (now + c.rem * dur, counter, c.version, c))
                        if dur > longest:
                            longest = dur
                        rate = rate_memo.get((c.cost, dur))
                        if rate is None:
                            rate = self.comm_rate(c, dur)
                        if rate != c.rate:
                            c.rate = rate
                            rate_dirty.update(c.devices)
            for d in dirty | rate_dirty if rate_dirty else dirty:
                ct = compute_on[d]
                if ct is None:
                    continue
                beside = comms_on[d]
                dur = compute_memo.get((ct.cost, tuple([(c.cost, c.rate) for c in beside]))) or self.compute_duration(ct, [(c, c.rate) for c in beside])
                if dur != ct.dur:
                    if ct.dur:
                        ct.rem -= (now - ct.since) / ct.dur
                    ct.since, ct.dur = now, dur
                    ct.version += 1
                    counter += 1
                    heapq.heappush(heap, (now + ct.rem * dur, counter, ct.version, ct))
                    if dur > longest:
                        longest = dur
            dirty.clear()
            while heap and heap[0][2] != heap[0][3].version:
                heapq.heappop(heap)
            if not heap:
                stuck = [lw.name(q, heads[q]) for q in range(nq) if heads[q] < END]
                raise LagomError(f"simulation deadlock in phase {ix.name}: {stuck[:4]}")
            # The steady state: compare with the state whole periods ago and skip the periods that repeat it.
            if check:
                seen = self._observe(now, totals, exposed_total, band_ref)  # type: ignore[arg-type]
                if self.probe_unit is not None:
                    if heads[band_ref] // check_every >= self.probe_unit:  # type: ignore[index]
                        return seen  # type: ignore[return-value]
                elif seen is None:
                    watching = not self._band_over()
                else:
                    decided = self._decide(seen, compute_on, comms_on, longest)
                    if decided is not None:
                        now, exposed_total = self._jump(*decided, now, totals, exposed_total, compute_on, comms_on)
                        woken.update(range(nq))
                        heap = []
                        for d in devices:
                            for held in [compute_on[d], *comms_on[d]]:
                                if held is not None and held.device == d:
                                    counter += 1
                                    heap.append((held.since + held.rem * held.dur, counter, held.version, held))
                        heapq.heapify(heap)
                        self.history = []
            # Exposed communication: a compute stream idle while it waits on a released collective (one
            # still waiting for another stage's compute is a pipeline bubble, not exposed comm).
            blockers = []
            for d, cq in zip(devices, compute_queue):
                if compute_on[d] is not None:
                    continue
                blocker = None
                pos = heads[cq]
                if pos < END:
                    for dq, at in (tasks[cq].get(pos) or self.task(cq, pos)).deps:
                        if at < heads[dq]:
                            continue
                        waited = shapes[dq].get(at) or lw.shape(dq, at)
                        if waited.comm:
                            for x in waited.deps:
                                if x[1] >= heads[x[0]]:
                                    break
                            else:
                                blocker = tasks[dq].get(at) or self.task(dq, at)
                                break
                elif comms_on[d]:  # compute finished: trailing collectives of this device
                    blocker = comms_on[d][0]
                if blocker is not None and blocker.start < 0:  # queued: blame what holds its communicator
                    blocker = self.task(blocker.queue, heads[blocker.queue])
                if blocker is not None:
                    blockers.append(blocker)
            end = heap[0][0]
            if blockers:
                dt = end - now
                for b in blockers:
                    b.exposed += dt
                    totals[b.key][2] += dt
                    exposed_total += dt
            now = end
            # Finish every task within DONE of its end.
            limit = end + DONE * longest
            finished, later = [], []
            while heap and heap[0][0] <= limit:
                entry = heapq.heappop(heap)
                t = entry[3]
                if entry[2] != t.version:
                    continue
                # an entry at or before now has ended by its own clock: the fraction alone would lose it
                # where the task is shorter than DONE of a float step of now (now - since cancels)
                if entry[0] <= now or t.rem - (now - t.since) / t.dur <= DONE:
                    finished.append(t)
                else:
                    later.append(entry)
            if not finished:  # the clock reached the earliest end and nothing ended: it would never move again
                raise LagomError(f"simulation made no progress in phase {ix.name} at {now!r} s: "
                                 f"{[lw.name(e[3].queue, e[3].pos) for e in later[:4]]}")
            for entry in later:
                heapq.heappush(heap, entry)
            for t in finished:
                q = t.queue
                if t.comm:
                    for d in t.devices:
                        comms_on[d].remove(t)
                    if t.shape.last:
                        totals[t.key][0] += now
                    self.records.append((q, t.pos, t.start, now, t.solo, t.exposed))
                else:
                    compute_on[t.device] = None
                if self.keep_spans:
                    self.spans.append((lw.creation_order(q, t.pos), (t.device, lw.stream_name(q), lw.name(q, t.pos), t.start, now)))
                dirty.update(t.devices)
                nxt = t.shape.next
                heads[q] = nxt
                del tasks[q][t.pos]
                woken.add(q)
                woken.update(t.shape.wakes)
                t.version += 1  # no heap entry of it is live any more
                if nxt >= END:
                    live -= 1
        self.history = []  # the run is kept for its timings: not the states it compared
        if self.probe_unit is None:
            self._check_twin()
        return PhaseResult(ix.name, ix.repeat, now, exposed_total, compute_solo, comm_peak,
                           {k: dict(zip(("time", "solo", "exposed", "count"), row)) for k, row in totals.items()},
                           [span for _, span in sorted(self.spans, key=lambda s: s[0])], self.simulated,
                           sum(j.periods for j in self.jumps), resume[0].now if resume else None, self._point_timings)

    def _checkpoint(self, now, seq, compute_on, comms_on, woken, dirty, totals, exposed_total, longest) -> None:
        running = {t.seq: t for t in compute_on.values() if t is not None}
        running.update((t.seq, t) for ts in comms_on.values() for t in ts)
        self.checkpoints.append(_Checkpoint(
            now, list(self.heads),
            [(t.queue, t.pos, t.seq, t.start, t.rem - (now - t.since) / t.dur, t.dur, t.rate, t.exposed, t.solo)
             for _, t in sorted(running.items())],
            set(woken), set(dirty), {k: list(v) for k, v in totals.items()}, exposed_total, len(self.records), longest,
            dict(self.first_start), list(self.jumps), self.simulated, seq))

    # -- steady state

    def _observe(self, now: float, totals, exposed_total: float, ref: int) -> _Seen | None:
        """The state at a period boundary of the reference stream; None when a stream is outside the band."""
        running = {}
        for q, pos in enumerate(self.heads):
            t = self.tasks[q].get(pos) if pos < END else None
            if t is not None and t.start >= 0:
                running[q] = t.rem - (now - t.since) / t.dur
        return _seen(self.lw, self.heads, running, now, lambda: {k: list(v) for k, v in totals.items()}, exposed_total, ref,
                     self.virtual_left())

    def _band_over(self) -> bool:
        """Whether every stream of the band is past its last span (no jump can come any more)."""
        return all(self.heads[q] + queue.shift > queue.spans[-1][1]
                   for q, queue in enumerate(self.lw.queues) if queue.shift and queue.spans)

    def _decide(self, seen: _Seen, compute_on, comms_on, longest: float) -> tuple[_Plan, int] | None:
        """At a period boundary in the band (both loops): remember the state, and the jump to make from it with
        the periods it skips, if any. The steady-state logic is asked only with room for a jump."""
        plan = self._steady(seen, compute_on, comms_on, longest) if seen.room >= 2 else None
        self.history = [h for h in self.history if h.unit > seen.unit - UNITS_KEPT] + [seen]
        if plan is None:
            return None
        periods = min(seen.room // plan.units - 1, plan.most or END)
        return (plan, periods) if periods >= 1 else None

    def _steady(self, now: _Seen, compute_on, comms_on, longest: float) -> _Plan | None:
        """A jump from this period boundary: where the state repeats one seen whole periods ago (a cycle of
        up to REPEAT_MOST periods), or where the last periods' states converge geometrically (one mode,
        checked over three periods) to a fixed point that a probe period confirms. Callers ask only with room
        for two periods: a jump skips at least one cycle and lands a period short of the band's end."""
        alike = [h for h in self.history if h.key == now.key and h.spans == now.spans]
        for old in reversed(alike):
            if _close(now.remaining, old.remaining):
                return _Plan(now.unit - old.unit, now.now - old.now, _minus(now.totals, old.totals),
                             now.exposed - old.exposed, 0.0, {}, 0.0, 0.0, now.remaining, now.remaining)
        by_unit = {h.unit: h for h in alike}
        for units in range(1, CYCLE_MOST + 1):
            if all(now.unit - n * units in by_unit for n in (1, 2, 3)):
                plan = self._converging(now, [now, *(by_unit[now.unit - n * units] for n in (1, 2, 3))], units,
                                        compute_on, comms_on, longest)
                if plan is not None:
                    return plan
        return None

    def _converging(self, now: _Seen, states: list[_Seen], units: int, compute_on, comms_on, longest: float) -> _Plan | None:
        """A jump where the states a cycle of ``units`` periods apart (newest first) converge geometrically."""
        diffs = [[a - b for a, b in zip(x.remaining, y.remaining)] for x, y in zip(states, states[1:])]
        periods = [x.now - y.now for x, y in zip(states, states[1:])]
        exposed = [x.exposed - y.exposed for x, y in zip(states, states[1:])]
        increments = [_minus(x.totals, y.totals) for x, y in zip(states, states[1:])]
        biggest = max(range(len(diffs[1])), key=lambda i: abs(diffs[1][i]), default=None)
        if biggest is None or not diffs[1][biggest]:
            return None
        ratio = diffs[0][biggest] / diffs[1][biggest]
        linear = abs(ratio - 1) <= DRIFT_NEAR_ONE
        if not (linear or -0.999 < ratio < 0.999 or 0.999 <= ratio <= DRIFT_MOST):
            return None
        # each series with the size of the sum it is taken from: its rounding noise grows with that sum (a
        # clock of seconds, sums over thousands of events), and noise is no second mode
        series = [diffs[0], [periods[0] - periods[1]], [exposed[0] - exposed[1]]]
        earlier = [diffs[1], [periods[1] - periods[2]], [exposed[1] - exposed[2]]]
        sizes = [1.0, now.now, now.exposed]
        for key in increments[0]:
            rows = [inc.get(key, [0.0] * 4) for inc in increments]
            series.append([a - b for a, b in zip(rows[0], rows[1])])
            earlier.append([a - b for a, b in zip(rows[1], rows[2])])
            sizes.append(max(map(abs, now.totals[key])))
        for later, sooner, size in zip(series, earlier, sizes):
            scale = max(map(abs, later + sooner), default=0.0)
            if any(abs(a - ratio * b) > RANK_ONE * scale + ROUNDING * max(1.0, size) for a, b in zip(later, sooner)):
                return None
        if linear:
            return self._linear(now, units, diffs[0], periods, exposed, increments, compute_on, comms_on, longest)
        fixed = [x + d * ratio / (1 - ratio) for x, d in zip(now.remaining, diffs[0])]
        if ratio >= 0.999:
            return self._drifting(now, units, ratio, fixed, periods, exposed, increments, compute_on, comms_on, longest)
        if min(fixed, default=1.0) <= DONE:
            return None
        probe = self._probe(now, fixed, units, compute_on, comms_on, longest)
        if probe is None or probe.key != now.key or not _close(probe.remaining, fixed):
            return None
        period = probe.now - now.now
        steady = _minus(probe.totals, now.totals)
        return _Plan(units, period, steady, probe.exposed - now.exposed, periods[0] - period, _minus(increments[0], steady),
                     exposed[0] - (probe.exposed - now.exposed), ratio, fixed, now.remaining)

    def _drifting(self, now: _Seen, units: int, ratio: float, fixed: list[float], periods: list[float],
                  exposed: list[float], increments: list[dict[str, list[float]]], compute_on, comms_on,
                  longest: float) -> _Plan | None:
        """A jump where the state drifts away from the last cycles' (a backlog that grows each cycle: ratio
        above 1), or converges too slowly to wait for: each cycle's change is the last one's times
        ``ratio``, so the state, the cycle length and the sums follow a geometric series from here. It
        holds while the cycles run the same events in the same order, so the jump lands short of where a
        running task's remaining work would leave (0, 1], and a probe cycle from the landing state must
        give the state and cycle length the series gives; else half as far, a few times."""
        g = ratio / (1 - ratio)
        period = periods[0] + (periods[0] - periods[1]) * g
        steady = {key: [a + (a - b) * g for a, b in zip(row, increments[1].get(key, [0.0] * 4))]
                  for key, row in increments[0].items()}
        steady_exposed = exposed[0] + (exposed[0] - exposed[1]) * g
        plan = _Plan(units, period, steady, steady_exposed, periods[0] - period, _minus(increments[0], steady),
                     exposed[0] - steady_exposed, ratio, fixed, now.remaining)
        top = max(1.0, *now.remaining)

        def state(cycles: int) -> list[float]:
            return [f + ratio ** cycles * (r - f) for f, r in zip(fixed, now.remaining)]

        return self._landing(now, plan, state, lambda cycles: period + plan.excess * ratio ** (cycles + 1), top,
                             compute_on, comms_on, longest)

    def _linear(self, now: _Seen, units: int, drift: list[float], periods: list[float], exposed: list[float],
                increments: list[dict[str, list[float]]], compute_on, comms_on, longest: float) -> _Plan | None:
        """A jump where each cycle repeats the last one but for the running heads' remaining work, which moves
        by the same amount every cycle: a collective that runs across many periods beside compute that does
        not change (a gradient all-reduce under identical layers) finishes no sooner than its work runs out,
        and the state repeats only after it. The cycle's length and sums must be the last cycle's; the jump
        lands where no running head would finish or start over, and a probe cycle from there must give the
        drifted state and the same length; else half as far, a few times."""
        period = periods[0]
        if abs(period - periods[1]) > REPEAT_TOLERANCE * period or abs(exposed[0] - exposed[1]) > ROUNDING * max(1.0, now.exposed):
            return None
        for key, row in increments[0].items():
            size = max(1.0, *map(abs, now.totals[key]))
            if any(abs(a - b) > ROUNDING * size for a, b in zip(row, increments[1].get(key, [0.0] * 4))):
                return None
        plan = _Plan(units, period, increments[0], exposed[0], 0.0, {}, 0.0, 0.0, list(now.remaining), now.remaining,
                     drift=drift)

        def state(cycles: int) -> list[float]:
            return [r + cycles * d for r, d in zip(now.remaining, drift)]

        return self._landing(now, plan, state, lambda cycles: period, max(1.0, *now.remaining),
                             compute_on, comms_on, longest)

    def _landing(self, now: _Seen, plan: _Plan, state: Callable[[int], list[float]], length: Callable[[int], float],
                 top: float, compute_on, comms_on, longest: float) -> _Plan | None:
        """The plan, jumping the most whole cycles (within the band's room) that keep every running head's
        remaining work in (DONE, top] and that a probe cycle from the landing state confirms: it must reach
        the state and take the length (of the cycle after the landing) the extrapolation gives."""
        units = plan.units
        cycles = now.room // units - 1
        while cycles >= 2 and not all(DONE < x <= top for x in state(cycles)):
            cycles //= 2
        for _ in range(DRIFT_TRIES):
            if cycles < 2:
                return None
            probe = self._probe(now, state(cycles), units, compute_on, comms_on, longest)
            if probe is not None and probe.key == now.key and _close(probe.remaining, state(cycles + 1)) \
                    and abs(probe.now - now.now - length(cycles)) <= REPEAT_TOLERANCE * length(cycles):
                plan.most = cycles
                return plan
            cycles //= 2
        return None

    def _probe(self, now: _Seen, fixed: list[float], units: int, compute_on, comms_on, longest: float) -> _Seen | None:
        """Simulate ``units`` periods from this boundary with the running heads at ``fixed``: the boundary then."""
        _probe_fits(now, units)
        running = sorted({t.seq: t for t in [*compute_on.values(), *(c for ts in comms_on.values() for c in ts)]
                          if t is not None}.values(), key=lambda t: t.seq)
        heads_running = [self.tasks[q][self.heads[q]] for q, (_, on) in enumerate(now.key) if on]
        at = {id(t): r for t, r in zip(heads_running, fixed)}
        cp = _Checkpoint(now.now, list(self.heads),
                         [(t.queue, t.pos, t.seq, t.start, at.get(id(t), t.rem - (now.now - t.since) / t.dur), t.dur,
                           t.rate, t.exposed, t.solo) for t in running],
                         set(), set(), now.totals, now.exposed, len(self.records), longest, dict(self.first_start),
                         list(self.jumps), self.simulated, max((t.seq for t in running), default=0))
        probe = _PhaseRun(self.lw, self.configs, self.model, self.default, False, self.shared_compute, self.virtual)
        probe.probe_unit = now.unit + units
        try:
            seen = probe.simulate(0.0, 0.0, resume=(cp, self.records, []))
        except LagomError:  # the extrapolated state is not one the step can be in: no jump, simulate on
            return None
        return seen if isinstance(seen, _Seen) else None  # None: the period left the band

    def _jump(self, plan: _Plan, periods: int, now: float, totals, exposed_total: float, compute_on, comms_on):
        """Skip ``periods`` periods: the clock and the sums advance by the steady period's and the transient's;
        every stream of the band moves on by as many periods' positions, and each running head hands its
        progress (where the transient has brought it) to its image."""
        ratio = plan.ratio
        transient = ratio * (1 - ratio ** periods) / (1 - ratio) if plan.excess or ratio else 0.0
        for key, row in totals.items():
            steady, excess = plan.increments.get(key, [0.0] * 4), plan.excess_increments.get(key, [0.0] * 4)
            for n in range(4):
                row[n] += periods * steady[n] + transient * excess[n]
        exposed_total += periods * plan.exposed + transient * plan.excess_exposed
        delta = periods * plan.period + transient * plan.excess
        later = now + delta
        running = self._running_queues()
        drift = plan.drift or [0.0] * len(running)
        where = {q: f + ratio ** periods * (r - f) + periods * d
                 for q, f, r, d in zip(running, plan.fixed, plan.remaining, drift)}
        virtual = min(periods * plan.units, self.virtual_left())  # a twin's periods passed over first: no positions
        skipped = {q: (self.heads[q], (periods * plan.units - virtual) * queue.shift, q in where)
                   for q, queue in enumerate(self.lw.queues) if queue.shift}
        self._move(skipped, where, plan.drift is not None, now, later, exposed_total, delta, compute_on, comms_on)
        self.jumps.append(_Jump(skipped, periods * plan.units, plan.period / plan.units, plan.excess, ratio, plan.units,
                                virtual))
        return later, exposed_total

    def _running_queues(self) -> list[int]:
        """The queues whose head is running, in queue order."""
        return [q for q in range(len(self.lw.queues))
                if self.heads[q] < END and self.heads[q] in self.tasks[q] and self.tasks[q][self.heads[q]].start >= 0]

    def _move(self, skipped: dict[int, tuple[int, int, bool]], where: dict[int, float], drifting: bool, now: float,
              later: float, exposed_total: float, delta: float, compute_on, comms_on) -> None:
        """A jump's state transfer: each band stream's head moves on by its step, a running one's task handed to
        its image (at its remaining fraction in ``where``); with a drift, running heads outside the band take
        theirs too."""
        moved: dict[int, _Task] = {}
        for q, (pos, step, running) in skipped.items():
            old = self.tasks[q].get(pos)
            self.tasks[q] = {}
            self.heads[q] = pos + step
            if old is None or not running:
                continue
            t = self.task(q, pos + step)
            t.seq, t.start, t.since = old.seq, old.start + delta, later
            t.rem = where.get(q, old.rem - (now - old.since) / old.dur)
            t.dur, t.rate, t.exposed, t.solo, t.util = old.dur, old.rate, old.exposed, old.solo, old.util
            moved[id(old)] = t
        if drifting:  # a head outside the band keeps its task: its remaining work drifted
            for q, rem in where.items():
                if q not in skipped:
                    t = self.tasks[q][self.heads[q]]
                    t.rem, t.since = rem, later
        for d, t in compute_on.items():
            if t is not None and id(t) in moved:
                compute_on[d] = moved[id(t)]
        for d, running_on in comms_on.items():
            comms_on[d] = [moved.get(id(c), c) for c in running_on]

    # -- per-point timings, on demand

    def _point_timings(self) -> list[PointTiming]:
        """Every point's timing; a skipped period's collectives take theirs from the same collective whole
        periods earlier (or, for one running at the jump, from its image after it)."""
        records = {(q, pos): (start, end, solo, exposed) for q, pos, start, end, solo, exposed in self.records}
        lw, ix = self.lw, self.ix
        out: list[PointTiming] = []

        def record(q: int, pos: int) -> tuple[float, float, float, float]:
            rec = records.get((q, pos))
            if rec is not None:
                return rec
            for jump in self.jumps:
                head, step, running = jump.queues.get(q, (0, 0, False))
                if not head <= pos < head + step:
                    continue
                if running and pos == head:  # it handed its progress over: it ends as its image, a jump earlier
                    start, end, solo, exposed = record(q, pos + step)
                    delta = jump.shift(jump.periods)
                    return start - delta, end - delta, solo, exposed
                per = step // jump.periods * jump.units  # positions per cycle: images are whole cycles back
                back = -(-(pos - head + 1) // per)
                start, end, solo, exposed = record(q, pos - back * per)
                return start + jump.shift(back * jump.units), end + jump.shift(back * jump.units), solo, exposed
            raise LagomError(f"no timing for task {pos} of stream {lw.stream_name(q)} in phase {ix.name}")

        split = sorted((ix.rank[ix.points[j].device], ix.fuse[j], j) for j in range(len(ix.points)) if lw.decomposed(j))
        for _, i, j in split:
            p = ix.points[j]
            q = lw.p2p_queue[(p.device, p.group.name)]
            out.append(self._timing(j, [record(q, i * SLOT + s) for s in range(lw.pieces(p.device, i)[1])]))
        for j in ix.order:
            if not lw.decomposed(j):
                out.append(self._timing(j, [record(lw.stream_queue[ix.stream_of[j]], ix.slot[j])]))
        return out

    def _timing(self, j: int, parts: list[tuple[float, float, float, float]]) -> PointTiming:
        p = self.ix.points[j]
        return PointTiming(p.name, self.ix.key(j), p.device, min(r[0] for r in parts), max(r[1] for r in parts),
                           sum(r[2] for r in parts), sum(r[3] for r in parts))


class _CompiledPhaseRun(_PhaseRun):
    """A phase on the compiled loop (``compiled.LoopRun``), under this module's steady-state logic: the loop
    pauses at the band's period boundaries, and the states it reports there are compared, probed and jumped
    over exactly as the Python loop's are (``_steady``, ``_converging``, ``_landing`` are shared; only reading
    the state, probing and moving it run in C). A run without records keeps checkpoints where it watches no
    boundary, as the Python loop does, and ``resume`` starts one from an earlier run's (``earlier``: those
    before it, which this run's own follow)."""

    def __init__(self, arrays: phase_arrays.PhaseArrays, configs: Configs, model: CostModel, default: CommConfig,
                 extrapolate: bool, records: bool, shared_compute: dict[tuple, float],
                 resume: compiled.Checkpoint | None = None, earlier: list[compiled.Checkpoint] | None = None,
                 virtual: int = 0) -> None:
        super().__init__(arrays.lowering, configs, model, default, False, shared_compute, virtual)
        self.arrays = arrays
        queues = arrays.lowering.queues
        self.band_ref = next((q for q, queue in enumerate(queues) if queue.kind == COMPUTE and queue.shift), None) \
            if extrapolate else None
        self.resumed = resume is not None
        if resume is not None:
            self.jumps = list(resume.jumps)
        self.loop = compiled.LoopRun(arrays, self, model, None if self.band_ref is None else arrays.boundaries(self.band_ref),
                                     records=records, resume=resume,
                                     checkpoint_every=0 if records else compiled.checkpoint_interval(arrays))
        self.saved = list(earlier or [])  # the run's checkpoints: those it resumed from, then its own (at the end)

    def simulate_loop(self) -> compiled.Outcome:
        loop, ref = self.loop, self.band_ref
        try:
            loop.watch(ref is not None and not self.resumed)  # a checkpoint is where the run watches nothing
            while not loop.run():
                self.heads = loop.positions()
                seen = self._seen_of(loop, self.heads)
                assert seen is not None  # the loop pauses only in the band (and stops watching when it is over)
                decided = self._decide(seen, None, None, 0.0)
                if decided is not None:
                    totals = loop.key_totals()
                    self._jump(*decided, loop.now, totals, loop.exposed_total, None, None)
                    loop.set_totals(totals)
                    self.history = []
            self._check_twin()
            jumps = list(self.jumps)  # over once it keeps checkpoints: theirs are the run's
            for checkpoint in loop.checkpoints:
                checkpoint.jumps = jumps
            self.saved += loop.checkpoints
            return loop.outcome()
        finally:
            loop.close()
            self.history = []  # the run is kept for its timings: not the states it compared, nor the arrays
            del self.loop, self.arrays

    def _seen_of(self, loop: compiled.LoopRun, heads: list[int]) -> _Seen | None:
        running = {q: float(r) for q, r in enumerate(loop.remaining.tolist()) if not math.isnan(r)}
        return _seen(self.lw, heads, running, loop.now, loop.key_totals, loop.exposed_total, self.band_ref,  # type: ignore[arg-type]
                     self.virtual_left())

    def _running_queues(self) -> list[int]:
        return [q for q, r in enumerate(self.loop.remaining.tolist()) if not math.isnan(r)]

    def _move(self, skipped: dict[int, tuple[int, int, bool]], where: dict[int, float], drifting: bool, now: float,
              later: float, exposed_total: float, delta: float, compute_on, comms_on) -> None:
        a, loop = self.arrays, self.loop
        heads = loop.heads.copy()
        remaining = np.full(len(heads), np.nan)
        for q, (pos, step, _) in skipped.items():
            heads[q] = a.queue_first[q] + int(np.searchsorted(a.positions[q], pos + step))
            self.heads[q] = pos + step
        for q, rem in where.items():
            if q in skipped or drifting:
                remaining[q] = rem
        loop.jump(later, exposed_total, delta, heads, remaining)

    def _probe(self, now: _Seen, fixed: list[float], units: int, compute_on, comms_on, longest: float) -> _Seen | None:
        """``units`` periods from this boundary with the running heads at ``fixed``, on a copy of the loop."""
        _probe_fits(now, units)
        remaining = np.full(len(self.lw.queues), np.nan)
        for q, f in zip([q for q, (_, on) in enumerate(now.key) if on], fixed):
            remaining[q] = f
        ref = self.band_ref
        shift = self.lw.queues[ref].shift  # type: ignore[index]
        probe = self.loop.probe(remaining)
        try:
            while not probe.run():
                heads = probe.positions()
                if heads[ref] // shift >= now.unit + units:  # type: ignore[index]
                    return self._seen_of(probe, heads)
            return None  # the phase ended first
        except LagomError:  # the extrapolated state is not one the step can be in: no jump, simulate on
            return None
        finally:
            probe.close()


def _seen(lw: Lowering, heads: list[int], running: dict[int, float], now: float,
          totals: Callable[[], dict[str, list[float]]], exposed_total: float, ref: int, virtual: int = 0) -> _Seen | None:
    """The state at a period boundary of stream ``ref`` (``running``: each running head's remaining fraction, in
    queue order; ``totals``: a copy of the per-key sums, taken only for a state in the band); None when a stream
    is outside the band. ``virtual``: the periods a twin lacks still to come (its phase's band goes on that much
    longer: a twin whose band ends first no longer runs as its phase would)."""
    queues = lw.queues
    unit = heads[ref] // queues[ref].shift
    key: list[tuple[int, bool]] = []
    spans: list[tuple[int, int] | None] = []
    room = END
    for q, queue in enumerate(queues):
        pos = heads[q]
        if queue.shift:
            span = queue.span(pos)
            if span is None or pos + queue.shift > span[1]:
                if virtual and (not queue.spans or pos + queue.shift > queue.spans[-1][1]):
                    raise TwinTooShort(f"phase {lw.ix.name}: a stream left the band with {virtual} periods to jump")
                return None
            spans.append(span)
            room = min(room, (span[1] - pos) // queue.shift)
            pos -= unit * queue.shift
        else:
            spans.append(None)
        key.append((pos, q in running))
    return _Seen(unit, tuple(key), list(running.values()), spans, now, totals(), exposed_total, room + virtual, virtual)


def _probe_fits(now: _Seen, units: int) -> None:
    """A probe runs ``units`` periods of the arrays from ``now``: a twin whose band ends sooner cannot probe
    where its phase would (the probe would leave the band, and the run would go on without the jump)."""
    if now.virtual and now.room - now.virtual <= units:
        raise TwinTooShort(f"a probe of {units} periods with {now.room - now.virtual} left in the twin's band")


class TwinTooShort(Exception):
    """A twin's run could not stand for its phase's (its band too short for the jumps the phase would make):
    the phase itself is simulated instead."""


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= REPEAT_TOLERANCE for x, y in zip(a, b))


def _minus(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, list[float]]:
    return {key: [x - y for x, y in zip(row, b.get(key, [0.0] * 4))] for key, row in a.items()}


def _segment(cost: tuple) -> ComputeSegment:
    """A segment with these (flops, bytes, ctas): all the cost model reads of one."""
    return ComputeSegment("", *cost)
