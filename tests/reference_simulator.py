"""The step simulator as it was before issue 11 (lagom/model/simulator.py at 3159d50), kept for tests only.

It re-rates every running task at every event and scans every stream for a task to start: simple, and
quadratic-ish on long pipelines. The library's simulator must give the same step, exposed comm and
per-key figures on every workload; tests compare the two. Only what those figures need is kept
(no spans, no per-window lists).
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from lagom.model.cost_model import CostModel, RunningComm
from lagom.plan.comm_config import CommConfig, can_decompose, default_config
from lagom.step.graph import Collective, ComputeSegment, OverlapPoint, Phase, StepGraph

EPS = 1e-12


@dataclass
class Task:
    id: int
    name: str
    device: int
    stream: str
    deps: list[int]
    segment: ComputeSegment | None = None
    point: OverlapPoint | None = None
    config: CommConfig | None = None
    nbytes: float = 0.0
    coll: Collective | None = None
    devices: tuple[int, ...] = ()
    remaining: float = 1.0
    start: float = -1.0
    end: float = -1.0

    @property
    def is_comm(self) -> bool:
        return self.segment is None


@dataclass
class ReferenceResult:
    step_s: float
    exposed_comm_s: float
    per_key: dict[str, dict[str, float]]
    phase_times: list[float]


class _Lowering:
    def __init__(self, phase: Phase, configs: dict[str, CommConfig], default: CommConfig) -> None:
        self.phase, self.configs, self.default = phase, configs, default
        self.tasks: list[Task] = []
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.order: dict[str, float] = {}
        self.waits: list[tuple[str, int, int]] = []  # (segment, task waited for, its point's device)

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
        for point in sorted(self.phase.points, key=lambda p: self.order[p.after] if p.after else -1):
            if fused.get(point.fuse_with) is not point:
                self._collective(point)
        for segment, done, _ in sorted(self.waits, key=lambda w: w[2]):  # device by device, as the library's
            self.tasks[self.first[segment]].deps.append(done)
        return self.tasks

    def _wait(self, point: OverlapPoint, done: int) -> None:
        if point.before is not None:
            self.waits.append((point.before, done, point.device))

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
        n, k = point.group.size, self.config(point).num_chunks
        labels = [f"s{s}c{c}" for s in range(n) for c in range(k)]
        pieces = self._pieces(seg, n * k, labels)
        ids = []
        for i, piece in enumerate(pieces):
            deps = []
            if i >= k:
                deps.append(self._p2p(point, labels[i], point.bytes / (n * k), self._released(point)).id)
            ids.append(self.add(name=piece.name, device=seg.device, stream="compute", deps=deps, segment=piece).id)
        self.first[seg.name], self.last[seg.name] = ids[0], ids[-1]

    def _compute_then_scatter(self, seg: ComputeSegment, point: OverlapPoint) -> None:
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


def reference_simulate(graph: StepGraph, configs: dict[str, CommConfig], model: CostModel) -> ReferenceResult:
    default = default_config(model.hw)
    per_key: dict[str, dict[str, float]] = defaultdict(lambda: {"time": 0.0, "solo": 0.0, "exposed": 0.0, "count": 0})
    step = exposed = 0.0
    times = []
    for phase in graph.phases:
        time, phase_exposed, rows = _simulate_phase(phase, configs, model, default)
        times.append(time)
        step += time * phase.repeat
        exposed += phase_exposed * phase.repeat
        for key, row in rows.items():
            for field, value in row.items():
                per_key[key][field] += value * phase.repeat
    return ReferenceResult(step, exposed, dict(per_key), times)


def _duration(task: Task, model: CostModel, compute_on: dict[int, Task], comms_on: dict[int, list[Task]],
              comm_rates: dict[int, float]) -> float:
    if task.is_comm:
        util = max((model.hbm_util(compute_on[d].segment) for d in task.devices if d in compute_on), default=0.0)
        # collectives of other communicators crossing nodes at the same time share the NIC equally; two
        # pipeline sends share it only when both leave (or both enter) the device
        crossing = max((sum(c.point.group.nodes > 1 and _same_way(task, c, d) for c in comms_on.get(d, ()))
                        for d in task.devices), default=1)
        share = 1.0 / max(1, crossing) if task.point.group.nodes > 1 else 1.0
        if task.coll != task.point.collective:
            return model.p2p_step_time(task.point.group, task.nbytes, task.config, util, share)
        return model.comm_time(task.coll, task.point.group, task.nbytes, task.config, util, share)
    running = tuple(RunningComm(c.config, comm_rates.get(c.id, 0.0), _ctas(c, model)) for c in comms_on.get(task.device, ()))
    return model.compute_time(task.segment, running)


def _one_way(task: Task) -> bool:
    return task.coll == Collective.SEND_RECV and task.point.collective == Collective.SEND_RECV


def _same_way(task: Task, other: Task, device: int) -> bool:
    if not (_one_way(task) and _one_way(other)):
        return True
    return (task.device == device) == (other.device == device)


def _ctas(task: Task, model: CostModel) -> int:
    """The CTAs NCCL runs for this transfer (fewer for small messages, none on copy engines)."""
    group = task.point.group if task.coll == task.point.collective else model.p2p_group(task.point.group)
    return model.launch_shape(task.coll, group, int(task.nbytes), task.config)[0]


def _solo(t: Task, model: CostModel, cache: dict[int, float]) -> float:
    if t.id not in cache:
        cache[t.id] = _duration(t, model, {}, {}, {})
    return cache[t.id]


def _simulate_phase(phase: Phase, configs, model: CostModel, default: CommConfig):
    tasks = _Lowering(phase, configs, default).run()
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
                if t.is_comm:
                    busy = any(r.device in t.devices and not r.is_comm for r in running)
                    t.remaining += model.launch_wait(t.config) / max(EPS, _solo(t, model, solo)) if busy else 0.0
                running.append(t)
        if not running:
            raise RuntimeError(f"reference simulation deadlock in phase {phase.name}")
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
                comm_rates[t.id] = model.comm_hbm_rate(t.coll, t.point.group, int(t.nbytes), durations[t.id])
        for t in running:
            if not t.is_comm:
                durations[t.id] = max(EPS, _duration(t, model, compute_on, comms_on, comm_rates))
        dt = min(t.remaining * durations[t.id] for t in running)
        for device in phase.segments:
            if device in compute_on:
                continue
            q = queues[(device, "compute")]
            blocker = None
            if q:
                blocker = next((tasks[d] for d in q[0].deps
                                if not done[d] and tasks[d].is_comm and startable(tasks[d])), None)
            else:
                blocker = next((t for t in running if t.is_comm and device in t.devices), None)
            if blocker is not None and blocker.start < 0:
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
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"time": 0.0, "solo": 0.0, "exposed": 0.0, "count": 0})
    by_point: dict[str, list[Task]] = defaultdict(list)
    for t in tasks:
        if t.is_comm:
            by_point[t.point.name].append(t)
    for parts in by_point.values():
        row = rows[parts[0].point.key]
        row["time"] += max(p.end for p in parts) - min(p.start for p in parts)
        row["solo"] += sum(_solo(p, model, solo) for p in parts)
        row["exposed"] += sum(exposed_by[p.id] for p in parts)
        row["count"] += 1
    return now, sum(exposed_by.values()), rows
