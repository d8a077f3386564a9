"""Discrete-event simulation of one training step over compute and communication streams.

Each device (one GPU per pipeline stage) has a compute stream and one stream per communicator
(collectives on one communicator serialise, as in ProcessGroupNCCL). A task starts when it heads
its stream and its dependencies are done. Rates are fluid: whenever the set of running tasks on a
GPU changes, every task's remaining work is re-rated by the cost model with what runs beside it,
so a collective slows the GEMM under it and retuning one collective moves the windows of the rest.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from lagom.comm_config import CommConfig, can_decompose, default_config
from lagom.cost_model import CostModel, RunningComm
from lagom.errors import LagomError
from lagom.points import Collective, ComputeSegment, OverlapPoint, Phase, StepGraph

EPS = 1e-12


@dataclass
class Task:
    id: int
    name: str
    device: int
    stream: str
    deps: list[int]
    segment: ComputeSegment | None = None  # compute task
    point: OverlapPoint | None = None  # comm task (whole collective or one P2P step)
    config: CommConfig | None = None
    nbytes: float = 0.0
    coll: Collective | None = None
    devices: tuple[int, ...] = ()  # GPUs whose resources a comm task uses
    remaining: float = 1.0
    start: float = -1.0
    end: float = -1.0

    @property
    def is_comm(self) -> bool:
        return self.segment is None


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
class WindowTiming:
    """A compute segment and what ran beside it."""

    name: str
    device: int
    start: float
    end: float
    solo: float
    comm: list[str]


@dataclass
class PhaseResult:
    name: str
    repeat: int
    time: float
    exposed_comm: float
    compute_solo: float
    comm_peak: float
    points: list[PointTiming]
    windows: list[WindowTiming]
    spans: list[tuple[int, str, str, float, float]]  # (device, stream, name, start, end) for plots


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

    def per_key(self) -> dict[str, dict[str, float]]:
        """Comm seconds, solo seconds, exposed seconds and count per tuning key over the whole step."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"time": 0.0, "solo": 0.0, "exposed": 0.0, "count": 0})
        for ph in self.phases:
            for pt in ph.points:
                row = out[pt.key]
                row["time"] += (pt.end - pt.start) * ph.repeat
                row["solo"] += pt.solo * ph.repeat
                row["exposed"] += pt.exposed * ph.repeat
                row["count"] += ph.repeat
        return dict(out)


Configs = dict[str, CommConfig]


class _Lowering:
    """Turns a phase and its configs into tasks, splitting Flash-Overlap points into P2P steps."""

    def __init__(self, phase: Phase, configs: Configs, model: CostModel, default: CommConfig) -> None:
        self.phase, self.configs, self.model, self.default = phase, configs, model, default
        self.tasks: list[Task] = []
        self.first: dict[str, int] = {}  # segment name -> id of its first task
        self.last: dict[str, int] = {}  # segment name -> id of its last task
        self.order: dict[str, float] = {}  # segment name -> position in its device's compute order
        self.waits: list[tuple[str, int]] = []  # (segment, task it waits for), wired once all are lowered

    def add(self, **kw) -> Task:
        task = Task(id=len(self.tasks), **kw)
        self.tasks.append(task)
        return task

    def config(self, point: OverlapPoint) -> CommConfig:
        return self.configs.get(point.key, self.default)

    def run(self) -> list[Task]:
        fused = {}
        for point in self.phase.points:
            cfg = self.config(point)
            if cfg.decomposition == "p2p" and can_decompose(point) and point.fuse_with not in fused:
                fused[point.fuse_with] = point
        for device, segs in self.phase.segments.items():
            for pos, seg in enumerate(segs):
                self.order[seg.name] = pos
                point = fused.get(seg.name)
                if point is None:
                    t = self.add(name=seg.name, device=device, stream="compute", deps=[], segment=seg)
                    self.first[seg.name] = self.last[seg.name] = t.id
                elif point.collective == Collective.ALL_GATHER:
                    self._gather_then_compute(seg, point)
                else:
                    self._compute_then_scatter(seg, point)
        # Host issue order on each communicator: by the position of the segment that releases it.
        for point in sorted(self.phase.points, key=lambda p: self.order[p.after] if p.after else -1):
            if fused.get(point.fuse_with) is not point:
                self._collective(point)
        for segment, done in self.waits:
            self.tasks[self.first[segment]].deps.append(done)
        return self.tasks

    def _wait(self, point: OverlapPoint, done: int) -> None:
        if point.before is not None:
            self.waits.append((point.before, done))

    def _released(self, point: OverlapPoint) -> list[int]:
        return [self.last[point.after]] if point.after else []

    def _collective(self, point: OverlapPoint) -> None:
        stream = point.group.name if point.peer_device is None else f"pp{point.device}->{point.peer_device}"
        devices = (point.device,) if point.peer_device is None else (point.device, point.peer_device)
        t = self.add(name=point.name, device=point.device, stream=stream, deps=self._released(point),
                     point=point, config=self.config(point), nbytes=point.bytes, coll=point.collective, devices=devices)
        self._wait(point, t.id)

    def _pieces(self, seg: ComputeSegment, n: int, labels: list[str]) -> list[ComputeSegment]:
        return [ComputeSegment(f"{seg.name}[{lab}]", seg.flops / n, seg.bytes / n, max(1, seg.ctas // n), seg.device)
                for lab in labels]

    def _p2p(self, point: OverlapPoint, label: str, nbytes: float, deps: list[int]) -> Task:
        return self.add(name=f"{point.name}[{label}]", device=point.device, stream=f"{point.group.name}.p2p",
                        deps=deps, point=point, config=self.config(point), nbytes=nbytes,
                        coll=Collective.SEND_RECV, devices=(point.device,))

    def _gather_then_compute(self, seg: ComputeSegment, point: OverlapPoint) -> None:
        """All-gather + GEMM: the local shard's GEMM first, then each peer shard's as it lands."""
        n, k = point.group.size, self.config(point).num_chunks
        labels = [f"s{s}c{c}" for s in range(n) for c in range(k)]
        pieces = self._pieces(seg, n * k, labels)
        ids = []
        for i, piece in enumerate(pieces):
            deps = []
            if i >= k:  # a peer's block: wait for its transfer
                deps.append(self._p2p(point, labels[i], point.bytes / (n * k), self._released(point)).id)
            ids.append(self.add(name=piece.name, device=seg.device, stream="compute", deps=deps, segment=piece).id)
        self.first[seg.name], self.last[seg.name] = ids[0], ids[-1]

    def _compute_then_scatter(self, seg: ComputeSegment, point: OverlapPoint) -> None:
        """GEMM + reduce-scatter: peers' partials first, each sent when done; the local one last; then reduce."""
        n, k = point.group.size, self.config(point).num_chunks
        labels = [f"s{s}c{c}" for s in range(1, n) for c in range(k)] + [f"s0c{c}" for c in range(k)]
        sends, ids = [], []
        for i, piece in enumerate(self._pieces(seg, n * k, labels)):
            task = self.add(name=piece.name, device=seg.device, stream="compute", deps=[], segment=piece)
            ids.append(task.id)
            if i < (n - 1) * k:
                sends.append(self._p2p(point, labels[i], point.bytes / (n * k), [task.id]).id)
        reduce_seg = ComputeSegment(f"{seg.name}[reduce]", 0.0, point.bytes / n * (n + 1), max(1, point.bytes // n // 4096), seg.device)
        red = self.add(name=reduce_seg.name, device=seg.device, stream="compute", deps=sends, segment=reduce_seg)
        self.first[seg.name], self.last[seg.name] = ids[0], red.id
        self._wait(point, red.id)


def simulate(graph: StepGraph, configs: Configs, model: CostModel, *, keep_spans: bool = False) -> StepResult:
    """Simulate one step with the given per-key configs (missing keys get NCCL's defaults)."""
    default = default_config(model.hw)
    phases = [_simulate_phase(ph, configs, model, default, keep_spans) for ph in graph.phases]
    return StepResult(
        step_s=sum(p.time * p.repeat for p in phases),
        exposed_comm_s=sum(p.exposed_comm * p.repeat for p in phases),
        compute_s=sum(p.compute_solo * p.repeat for p in phases),
        comm_peak_s=sum(p.comm_peak * p.repeat for p in phases),
        phases=phases,
    )


def _duration(task: Task, model: CostModel, compute_on: dict[int, Task], comms_on: dict[int, list[Task]],
              comm_rates: dict[int, float]) -> float:
    if task.is_comm:
        util = max((model.hbm_util(compute_on[d].segment) for d in task.devices if d in compute_on), default=0.0)
        if task.coll != task.point.collective:  # one P2P step of a Flash-Overlap decomposition
            return model.p2p_step_time(task.point.group, task.nbytes, task.config, util)
        return model.comm_time(task.coll, task.point.group, task.nbytes, task.config, util)
    running = tuple(RunningComm(c.config, comm_rates.get(c.id, 0.0)) for c in comms_on.get(task.device, ()))
    return model.compute_time(task.segment, running)


def _simulate_phase(phase: Phase, configs: Configs, model: CostModel, default: CommConfig, keep_spans: bool) -> PhaseResult:
    tasks = _Lowering(phase, configs, model, default).run()
    queues: dict[tuple[int, str], deque[Task]] = defaultdict(deque)
    for t in tasks:
        queues[(t.device, t.stream)].append(t)
    done = [False] * len(tasks)
    running: list[Task] = []
    now, finished = 0.0, 0
    exposed_by: dict[int, float] = defaultdict(float)
    solo: dict[int, float] = {}

    def startable(t: Task) -> bool:
        return all(done[d] for d in t.deps)

    while finished < len(tasks):
        for q in queues.values():
            if q and q[0].start < 0 and startable(q[0]):
                t = q[0]
                t.start = now
                if t.is_comm:  # a normal-priority kernel queues behind compute CTAs
                    busy = any(r.device in t.devices and not r.is_comm for r in running)
                    t.remaining += model.launch_wait(t.config) / max(EPS, _solo(t, model, solo)) if busy else 0.0
                running.append(t)
        if not running:
            stuck = [q[0].name for q in queues.values() if q]
            raise LagomError(f"simulation deadlock in phase {phase.name}: {stuck[:4]}")
        compute_on = {t.device: t for t in running if not t.is_comm}
        comms_on: dict[int, list[Task]] = defaultdict(list)
        for t in running:
            if t.is_comm:
                for d in t.devices:
                    comms_on[d].append(t)
        comm_rates: dict[int, float] = {}
        durations: dict[int, float] = {}
        for t in running:
            if t.is_comm:
                durations[t.id] = max(EPS, _duration(t, model, compute_on, comms_on, comm_rates))
                comm_rates[t.id] = _hbm_rate(t, model, durations[t.id])
        for t in running:
            if not t.is_comm:
                durations[t.id] = max(EPS, _duration(t, model, compute_on, comms_on, comm_rates))
        dt = min(t.remaining * durations[t.id] for t in running)
        # Exposed communication: a compute stream idle while it waits on a released collective (one
        # still waiting for another stage's compute is a pipeline bubble, not exposed comm).
        for device in phase.segments:
            if device in compute_on:
                continue
            q = queues[(device, "compute")]
            blocker = None
            if q:
                blocker = next((tasks[d] for d in q[0].deps
                                if not done[d] and tasks[d].is_comm and startable(tasks[d])), None)
            else:  # compute finished: trailing collectives of this device
                blocker = next((t for t in running if t.is_comm and device in t.devices), None)
            if blocker is not None and blocker.start < 0:  # queued: blame what holds its communicator
                blocker = queues[(blocker.device, blocker.stream)][0]
            if blocker is not None:
                exposed_by[blocker.id] += dt
        now += dt
        still = []
        for t in running:
            t.remaining -= dt / durations[t.id]
            if t.remaining <= 1e-9:
                t.end = now
                done[t.id] = True
                finished += 1
                queues[(t.device, t.stream)].popleft()
            else:
                still.append(t)
        running = still
    return _summarise(phase, tasks, model, exposed_by, solo, now, keep_spans)


def _solo(t: Task, model: CostModel, cache: dict[int, float]) -> float:
    if t.id not in cache:
        cache[t.id] = _duration(t, model, {}, {}, {})
    return cache[t.id]


def _hbm_rate(t: Task, model: CostModel, seconds: float) -> float:
    return model.comm_hbm_rate(t.coll, t.point.group, int(t.nbytes), seconds)


def _summarise(phase: Phase, tasks: list[Task], model: CostModel, exposed_by: dict[int, float],
               solo: dict[int, float], end: float, keep_spans: bool) -> PhaseResult:
    by_point: dict[str, list[Task]] = defaultdict(list)
    for t in tasks:
        if t.is_comm:
            by_point[t.point.name].append(t)
    points = []
    for name, parts in by_point.items():
        pt = parts[0].point
        points.append(PointTiming(name, pt.key, pt.device, min(p.start for p in parts), max(p.end for p in parts),
                                  sum(_solo(p, model, solo) for p in parts), sum(exposed_by[p.id] for p in parts)))
    comm_tasks = [t for t in tasks if t.is_comm]
    windows = []
    for t in tasks:
        if not t.is_comm:
            beside = [c.name for c in comm_tasks if c.start < t.end and c.end > t.start and t.device in c.devices]
            windows.append(WindowTiming(t.name, t.device, t.start, t.end, _solo(t, model, solo), beside))
    compute_solo = max(sum(model.compute_solo(s) for s in segs) for segs in phase.segments.values())
    peak: dict[tuple[int, str], float] = defaultdict(float)
    for p in phase.points:
        peak[(p.device, p.group.name)] += model.comm_peak_time(p.collective, p.group, p.bytes)
    spans = [(t.device, t.stream, t.name, t.start, t.end) for t in tasks] if keep_spans else []
    return PhaseResult(phase.name, phase.repeat, end, sum(exposed_by.values()), compute_solo,
                       max(peak.values(), default=0.0), points, windows, spans)
