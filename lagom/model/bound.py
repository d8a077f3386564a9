"""The shortest a step could possibly take, whatever the communication settings.

Every compute segment runs alone on the GPU (``CostModel.compute_solo``) and every collective at the
link's peak (``CostModel.comm_peak_time``), yet each still waits for what it waits for in the step graph:
a collective for the segment that releases it and for the one before it on its communicator, a segment
for the one before it on its stream and for the collectives it needs. The longest chain of such waits
(the critical path) is the bound. A DP all-reduce released by the last micro-batch's backward therefore
counts in full after it, where max(compute alone, comm at peak) would hide it under compute it cannot
overlap.

Why it is a lower bound on the simulated step of every config: the simulator starts each task as soon
as the task before it on its stream and its dependencies are done, so its step is the longest path of
the same graph with the tasks' actual durations; contention only lengthens them (a segment beside a
collective is never faster than alone, a collective never faster than its bus bytes at link peak, a
launch wait only adds). A Flash-Overlap decomposition changes the graph, so a collective that may be
decomposed keeps only the waits both forms share: an all-gather must end before the GEMM it feeds ends
(its last piece needs the last block), a reduce-scatter may start when its GEMM starts (its first piece
feeds the first send) and must end before the segment that needs it; neither holds its communicator.
"""

from __future__ import annotations

from collections import defaultdict
from operator import attrgetter

from lagom.errors import LagomError
from lagom.model.cost_model import CostModel
from lagom.model.phase_index import NONE, PhaseIndex, index_of
from lagom.step.graph import Collective, ComputeSegment, Phase, StepGraph

_SIGNATURE = attrgetter("flops", "bytes", "ctas")


def step_bound(graph: StepGraph, model: CostModel, decompose: bool = True) -> float:
    """Seconds no config can beat on this step graph. ``decompose``: whether the search space allows
    Flash-Overlap decompositions (then the collectives that may be decomposed are relaxed as above)."""
    return sum(phase.repeat * phase_bound(phase, model, decompose) for phase in graph.phases)


def phase_bound(phase: Phase, model: CostModel, decompose: bool = True) -> float:
    """The critical path of one phase (one repeat)."""
    return _CriticalPath(index_of(phase), model, decompose).length()


class _CriticalPath:
    """Tasks are nodes: compute segments (device, index) and collectives (point index). Every wait is an
    edge "start(v) >= start(u) + weight"; the weight is u's duration for "v starts after u ends", 0 for
    "v starts after u starts", and u's minus v's duration for "v ends after u ends"."""

    def __init__(self, ix: PhaseIndex, model: CostModel, decompose: bool) -> None:
        self.ix = ix
        solo: dict[tuple, float] = {}
        peak: dict[tuple, float] = {}
        self.duration: dict[tuple, float] = {}
        for d, segs in ix.segments.items():
            for i, seg in enumerate(segs):
                sig = _SIGNATURE(seg)
                if sig not in solo:
                    solo[sig] = model.compute_solo(ComputeSegment("", *sig))
                self.duration[("seg", d, i)] = solo[sig]
        for j, p in enumerate(ix.points):
            what = (p.collective, p.group, p.bytes)
            if what not in peak:
                peak[what] = model.comm_peak_time(*what)
            self.duration[("comm", j)] = peak[what]
        self.edges: dict[tuple, list[tuple[tuple, float]]] = defaultdict(list)
        for d, segs in ix.segments.items():
            for i in range(1, len(segs)):
                self._after_end(("seg", d, i - 1), ("seg", d, i))
        relaxed = {j for j in range(len(ix.points)) if decompose and ix.fuse[j] != NONE}
        for stream in ix.streams:
            held = [j for j in stream.points if j not in relaxed]
            for earlier, later in zip(held, held[1:]):
                self._after_end(("comm", earlier), ("comm", later))
        for j in range(len(ix.points)):
            if j in relaxed:
                self._relaxed(j)
                continue
            after, before = ix.after[j], ix.before[j]
            if after is not None:
                self._after_end(("seg", *after), ("comm", j))
            if before is not None:
                self._after_end(("comm", j), ("seg", *before))

    def _after_end(self, u: tuple, v: tuple) -> None:
        self.edges[u].append((v, self.duration[u]))

    def _relaxed(self, j: int) -> None:
        """The waits a collective keeps in both forms, plain and decomposed (see the module docstring)."""
        ix, comm = self.ix, ("comm", j)
        p = ix.points[j]
        after, before, fused = ix.after[j], ix.before[j], (p.device, ix.fuse[j])
        gemm = ("seg", *fused)
        if p.collective == Collective.ALL_GATHER:
            if after is not None:
                self._after_end(("seg", *after), comm)
            if before == fused:  # the GEMM it feeds ends after it
                self.edges[comm].append((gemm, self.duration[comm] - self.duration[gemm]))
        else:
            if after == fused:  # it may start with the GEMM that produces it
                self.edges[gemm].append((comm, 0.0))
            if before is not None:
                self._after_end(comm, ("seg", *before))

    def length(self) -> float:
        """The latest end over all tasks, every task starting as early as its waits allow (Kahn's order)."""
        incoming: dict[tuple, int] = dict.fromkeys(self.duration, 0)
        for outs in self.edges.values():
            for v, _ in outs:
                incoming[v] += 1
        start = dict.fromkeys(self.duration, 0.0)
        ready = [u for u, n in incoming.items() if n == 0]
        done = 0
        while ready:
            u = ready.pop()
            done += 1
            for v, weight in self.edges.get(u, ()):
                start[v] = max(start[v], start[u] + weight)
                incoming[v] -= 1
                if incoming[v] == 0:
                    ready.append(v)
        if done != len(incoming):
            raise LagomError(f"phase {self.ix.name}: the step graph's waits form a cycle")
        return max((start[u] + self.duration[u] for u in self.duration), default=0.0)
