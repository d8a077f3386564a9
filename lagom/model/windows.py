"""The window estimate: what one collective costs beside the compute it can hide under, without simulating the
step. For each instance of a key, its window is the compute between the collective's release and its need
(``windows``); ``estimate`` prices a setting on those windows with the cost model (the comm's own time, what it
adds to the compute beside it, what is left exposed). The priority search ranks candidates with it, and
``lagom validate`` checks it against published overlap measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lagom.model.cost_model import CostModel, RunningComm
from lagom.model.phase_index import NONE, first_seen, index_of
from lagom.plan.comm_config import CommConfig
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph


@dataclass
class Window:
    """The compute one instance of a collective can hide under."""

    point: OverlapPoint
    repeat: int  # occurrences per step
    segments: list[ComputeSegment]  # compute between release and need, in stream order
    fused: list[ComputeSegment]  # the GEMM a Flash-Overlap decomposition would split (empty if none)
    _costs: dict[bool, _WindowCost] = field(default_factory=dict, repr=False, compare=False)

    def costs(self, decomposed: bool, model: CostModel) -> _WindowCost:
        """What every candidate's estimate needs of the part it hides under, worked out once (a search
        uses one model throughout)."""
        if decomposed not in self._costs:
            self._costs[decomposed] = _WindowCost.of(self.fused if decomposed else self.segments, model)
        return self._costs[decomposed]


@dataclass
class _WindowCost:
    """A window's segments as indices into its distinct ones (layers repeat), each alone, the highest HBM
    share and the sum alone."""

    distinct: list[ComputeSegment]
    kinds: list[int]
    alone: list[float]
    util: float
    hide: float

    @staticmethod
    def of(segments: list[ComputeSegment], model: CostModel) -> _WindowCost:
        index: dict[tuple, int] = {}
        distinct: list[ComputeSegment] = []
        kinds = []
        for seg in segments:
            sig = (seg.flops, seg.bytes, seg.ctas)
            if sig not in index:
                index[sig] = len(distinct)
                distinct.append(seg)
            kinds.append(index[sig])
        alone = [model.compute_solo(s) for s in segments]
        return _WindowCost(distinct, kinds, alone, max((model.hbm_util(s) for s in segments), default=0.0), sum(alone))


class KeyOf(dict):
    """(group, collective, bytes) -> tuning key: ``OverlapPoint.key`` formatted once per distinct collective,
    not once per point (a cluster step has hundreds of thousands). One search builds one and shares it."""

    def __call__(self, p: OverlapPoint) -> str:
        what = (p.group.name, p.collective, p.bytes)
        key = self.get(what)
        if key is None:
            key = self[what] = p.key
        return key

    def numbered(self, phase: Phase) -> list[str]:
        """The phase's tuning keys by their number in its index (``PointColumns.key``)."""
        return [self(phase.points[j]) for j in index_of(phase).columns.key_first.tolist()]


def windows(graph: StepGraph, key_of: KeyOf | None = None) -> dict[str, list[Window]]:
    """Per key, the distinct windows its instances hide under, each weighted by how often it occurs.

    Identical layers give identical windows, so a 48-layer model has a handful per key, not hundreds. A
    window is told apart by its collective, group and size, the kinds of the segments it spans and the kind
    of the one it may split (none for a send: another stage waits for it, nothing here hides it). Worked out
    on the phase index's arrays (``_described``), numbered across phases by a stable sort.
    """
    key_of = KeyOf() if key_of is None else key_of
    ids: tuple[dict, dict, dict] = ({}, {}, {})  # segment kinds, longer windows' kinds, groups: numbers across phases
    described = [_described(phase, n, *ids) for n, phase in enumerate(graph.phases)]
    if not any(len(columns[0]) for columns, _ in described):
        return {}
    what, firsts = first_seen(*(np.concatenate(col) for col in zip(*(columns for columns, _ in described))))
    phase_of, point_of, lo, hi, fuse = (np.concatenate(col)[firsts].tolist() for col in zip(*(rows for _, rows in described)))
    repeat = np.zeros(len(firsts), dtype=np.int64)
    np.add.at(repeat, what, np.repeat([phase.repeat for phase in graph.phases], [len(phase.points) for phase in graph.phases]))
    out: dict[str, list[Window]] = {}
    for n, j, a, b, f, times in zip(phase_of, point_of, lo, hi, fuse, repeat.tolist()):
        p = graph.phases[n].points[j]
        segs = graph.phases[n].segments[p.device]
        out.setdefault(key_of(p), []).append(Window(p, times, segs[a:b], segs[f:f + 1] if f != NONE else []))
    return out


def _described(phase: Phase, n: int, kind_ids: dict[tuple, int], long_ids: dict[tuple, int],
               group_ids: dict[Group, int]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Per point of phase ``n``, what tells its window apart (group, collective, bytes, the kind of a
    one-segment window, the number of a longer one's kinds, the kind of the segment it may split), and where
    it is (phase, point, span, fused segment). Windows span a segment or none nearly always, so only the few
    longer ones make a tuple of their kinds."""
    ix = index_of(phase)
    c = ix.columns
    to_global = np.asarray([kind_ids.setdefault(sig, len(kind_ids)) for sig in ix.kind_arrays[1]], dtype=np.int64)
    kinds = to_global[ix.all_kinds] if len(to_global) else ix.all_kinds
    send = c.peer != NONE
    lo, hi = np.minimum(c.lo, c.count), np.minimum(c.hi, c.count)
    lo[send] = hi[send] = 0
    length = np.maximum(hi - lo, 0)
    one, longer, fused = (np.full(len(lo), NONE, dtype=np.int64) for _ in range(3))
    single = length == 1
    one[single] = kinds[c.first_segment[single] + lo[single]]
    for j in np.flatnonzero(length > 1).tolist():
        at = c.first_segment[j]
        longer[j] = long_ids.setdefault(tuple(kinds[at + lo[j]:at + hi[j]].tolist()), len(long_ids))
    splits = c.fuse != NONE  # a decomposable collective's own segment (never a send's)
    fused[splits] = kinds[c.first_segment[splits] + c.fuse[splits]]
    _, group_first = np.unique(c.group, return_index=True)
    to_group = np.asarray([group_ids.setdefault(phase.points[j].group, len(group_ids)) for j in group_first.tolist()],
                          dtype=np.int64)
    return ((to_group[c.group], c.collective, c.bytes, one, longer, fused),
            (np.full(len(lo), n, dtype=np.int64), np.arange(len(lo), dtype=np.int64), lo, hi, c.fuse))


@dataclass
class Estimate:
    comm: float  # X: seconds of communication per step
    compute: float  # Y: seconds the compute beside it is slowed by per step
    added: float  # seconds the windows take beyond their compute alone: exposed comm plus slowdown
    beyond: float = 0.0  # seconds of comm beyond the compute that hides it: exposed comm alone


def _inflation(comm_s: float, window: _WindowCost, running: tuple[RunningComm, ...], model: CostModel) -> float:
    """Extra compute seconds while a collective runs from the window's start for comm_s seconds."""
    extra, left = 0.0, comm_s
    slowed_by_kind: list[float | None] = [None] * len(window.distinct)
    for kind, solo in zip(window.kinds, window.alone):
        if left <= 0:
            break
        slowed = slowed_by_kind[kind]
        if slowed is None:
            slowed = slowed_by_kind[kind] = model.compute_time(window.distinct[kind], running)
        if slowed <= left:
            extra, left = extra + slowed - solo, left - slowed
        else:  # the collective ends inside this segment
            extra, left = extra + left * (1 - solo / slowed), 0.0
    return extra


def _waited(seconds: float, solo: float, wait: float) -> float:
    """A comm kernel's time when it first waits ``wait`` seconds for SMs: the simulator adds the wait as
    extra work at the kernel's solo rate, so it stretches by the same factor as the kernel."""
    return seconds * (1 + wait / solo) if wait and solo > 0 else seconds


def estimate(cfg: CommConfig, wins: list[Window], model: CostModel) -> Estimate:
    """The windows of one key under one config, each in isolation.

    A collective hides under the compute between its release and its need; a decomposition hides
    under the GEMM it splits, all but its first step. Either way the window adds max(comm beyond the
    compute, the compute's slowdown), plus the first P2P step for a decomposition. A comm kernel
    launched while compute holds the SMs (a window with compute in it) first waits for them
    (``CostModel.launch_wait``; none on the high-priority stream), every P2P step of a decomposition too.
    The compute beside it loses the SMs of the CTAs NCCL launches, as in the simulator: fewer than the
    channels for a small message, none for copy engines (CTA policy ZERO).
    """
    X = Y = added = beyond = 0.0
    alone: dict[bool, tuple[float, int]] = {}  # the windows are one key's: its instance alone is the same in each
    for w in wins:
        decomposed = cfg.decomposition == "p2p" and bool(w.fused)
        cost = w.costs(decomposed, model)
        solo = alone.get(decomposed)
        if solo is None:
            solo = alone[decomposed] = instance_alone(cfg, w.point, decomposed, model)
        x, first, running = running_instance(cfg, w.point, decomposed, cost.util, bool(cost.alone), model, solo)
        slow = _inflation(x, cost, (running,), model)
        X += x * w.repeat
        Y += slow * w.repeat
        added += (first + max(x - cost.hide, slow)) * w.repeat
        beyond += (first + max(x - cost.hide, 0.0)) * w.repeat
    return Estimate(X, Y, added, beyond)


def instance_alone(cfg: CommConfig, p: OverlapPoint, decomposed: bool, model: CostModel) -> tuple[float, int]:
    """What does not depend on the compute beside one instance of a collective: its seconds alone (a
    decomposition's: one P2P step's) and the CTAs NCCL launches for it."""
    if decomposed:
        n = p.group.size * cfg.num_chunks
        return (model.p2p_step_time(p.group, p.bytes / n, cfg),
                model.launch_shape(Collective.SEND_RECV, model.p2p_group(p.group), int(p.bytes / n), cfg)[0])
    return model.comm_time(p.collective, p.group, p.bytes, cfg), model.launch_shape(p.collective, p.group, int(p.bytes), cfg)[0]


def running_instance(cfg: CommConfig, p: OverlapPoint, decomposed: bool, util: float, beside_compute: bool,
                     model: CostModel, alone: tuple[float, int] | None = None) -> tuple[float, float, RunningComm]:
    """One instance of a collective beside compute of HBM share ``util``: its seconds (a decomposition's
    steps after the first), its first P2P step's seconds (0 undecomposed), and what it takes from the
    compute beside it (HBM rate, CTAs). ``alone``: its ``instance_alone``, where the caller has it."""
    wait = model.launch_wait(cfg) if beside_compute else 0.0
    solo, ctas = alone or instance_alone(cfg, p, decomposed, model)
    if decomposed:
        n = p.group.size * cfg.num_chunks
        step = _waited(model.p2p_step_time(p.group, p.bytes / n, cfg, util), solo, wait)
        x, first = step * (n - cfg.num_chunks), step
    else:
        x, first = _waited(model.comm_time(p.collective, p.group, p.bytes, cfg, util), solo, wait), 0.0
    rate = model.comm_hbm_rate(p.collective, p.group, p.bytes, x, None if decomposed else cfg) if x > 0 else 0.0
    return x, first, RunningComm(cfg, rate, ctas)
