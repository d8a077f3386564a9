"""The window estimate: what one collective costs beside the compute it can hide under, without simulating the
step. For each instance of a key, its window is the compute between the collective's release and its need
(``windows``); ``estimate`` prices a setting on those windows with the cost model (the comm's own time, what it
adds to the compute beside it, what is left exposed). The priority search ranks candidates with it, and
``lagom validate`` checks it against published overlap measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from lagom.model.cost_model import CostModel, RunningComm
from lagom.plan.comm_config import CommConfig, can_decompose
from lagom.step.graph import Collective, ComputeSegment, OverlapPoint, StepGraph

SEGMENT_SIGNATURE = attrgetter("flops", "bytes", "ctas")  # compute segments that cost alike


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


def point_span(point: OverlapPoint, pos: dict[str, int], count: int) -> tuple[int, int]:
    """The positions of the compute segments a collective can hide under on its device's stream: from
    the one after its release to the one before its need."""
    return pos[point.after] + 1 if point.after else 0, pos[point.before] if point.before else count


class KeyOf(dict):
    """(group, collective, bytes) -> tuning key: ``OverlapPoint.key`` formatted once per distinct collective,
    not once per point (a cluster step has hundreds of thousands). One search builds one and shares it."""

    def __call__(self, p: OverlapPoint) -> str:
        what = (p.group.name, p.collective, p.bytes)
        key = self.get(what)
        if key is None:
            key = self[what] = p.key
        return key


def windows(graph: StepGraph, key_of: KeyOf | None = None) -> dict[str, list[Window]]:
    """Per key, the distinct windows its instances hide under, each weighted by how often it occurs.

    Identical layers give identical windows, so a 48-layer model has a handful per key, not hundreds.
    """
    key_of = KeyOf() if key_of is None else key_of
    out: dict[str, dict[tuple, Window]] = {}
    ids: dict[tuple, int] = {}  # equal segments, equal ids
    for phase in graph.phases:
        pos: dict[str, int] = {}
        kinds: dict[int, list[int]] = {}
        for d, segs in phase.segments.items():
            pos.update(zip([s.name for s in segs], range(len(segs))))
            kinds[d] = [ids.setdefault(sig, len(ids)) for sig in map(SEGMENT_SIGNATURE, segs)]
        for p in phase.points:
            segs, kind = phase.segments[p.device], kinds[p.device]
            if p.peer_device is not None:  # a pipeline send: another stage waits for it, nothing here hides it
                lo = hi = f_lo = f_hi = 0
            else:
                lo, hi = point_span(p, pos, len(segs))
                f_lo = pos[p.fuse_with] if p.fuse_with and can_decompose(p) else 0
                f_hi = f_lo + 1 if p.fuse_with and can_decompose(p) else 0
            key = key_of(p)
            sig = (p.collective, p.group, p.bytes, tuple(kind[lo:hi]), tuple(kind[f_lo:f_hi]))
            known = out.setdefault(key, {})
            if sig in known:
                known[sig].repeat += phase.repeat
            else:
                known[sig] = Window(p, phase.repeat, segs[lo:hi], segs[f_lo:f_hi])
    return {key: list(wins.values()) for key, wins in out.items()}


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
    for w in wins:
        decomposed = cfg.decomposition == "p2p" and bool(w.fused)
        cost = w.costs(decomposed, model)
        x, first, running = running_instance(cfg, w.point, decomposed, cost.util, bool(cost.alone), model)
        slow = _inflation(x, cost, (running,), model)
        X += x * w.repeat
        Y += slow * w.repeat
        added += (first + max(x - cost.hide, slow)) * w.repeat
        beyond += (first + max(x - cost.hide, 0.0)) * w.repeat
    return Estimate(X, Y, added, beyond)


def running_instance(cfg: CommConfig, p: OverlapPoint, decomposed: bool, util: float, beside_compute: bool,
              model: CostModel) -> tuple[float, float, RunningComm]:
    """One instance of a collective beside compute of HBM share ``util``: its seconds (a decomposition's
    steps after the first), its first P2P step's seconds (0 undecomposed), and what it takes from the
    compute beside it (HBM rate, CTAs)."""
    wait = model.launch_wait(cfg) if beside_compute else 0.0
    if decomposed:
        n = p.group.size * cfg.num_chunks
        step = model.p2p_step_time(p.group, p.bytes / n, cfg, util)
        step = _waited(step, model.p2p_step_time(p.group, p.bytes / n, cfg), wait)
        x, first = step * (n - cfg.num_chunks), step
        ctas = model.launch_shape(Collective.SEND_RECV, model.p2p_group(p.group), int(p.bytes / n), cfg)[0]
    else:
        x = model.comm_time(p.collective, p.group, p.bytes, cfg, util)
        x, first = _waited(x, model.comm_time(p.collective, p.group, p.bytes, cfg), wait), 0.0
        ctas = model.launch_shape(p.collective, p.group, int(p.bytes), cfg)[0]
    rate = model.comm_hbm_rate(p.collective, p.group, p.bytes, x) if x > 0 else 0.0
    return x, first, RunningComm(cfg, rate, ctas)
