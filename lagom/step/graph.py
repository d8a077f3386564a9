"""The step graph as data: collectives (``Collective``) on process groups (``Group``), compute segments, overlap
points, phases and the step that holds them; and the groups a workload's layout makes on a machine
(``make_groups``). ``lagom.step.points`` builds a graph from a workload; the model prices it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from lagom.hardware import Hardware
from lagom.step.calls import TuningKey
from lagom.step.workload import Workload


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"  # no modelled point issues one; measured ones become points (lagom.model.reconcile)


@dataclass(frozen=True)
class Group:
    """A process group as the cost model sees it: its name (megatron's: dp, tp, pp, ...) and span."""

    name: str
    size: int
    ranks_per_node: int
    nodes: int


@dataclass(slots=True)
class ComputeSegment:
    """A group of kernels between two communication events on one device's compute stream."""

    name: str
    flops: float
    bytes: float  # HBM traffic
    ctas: int  # CTAs of the dominant kernel: what wave quantisation works on
    device: int = 0


@dataclass(slots=True)
class OverlapPoint:
    """One collective call of the step.

    ``bytes`` is the whole buffer: the gathered output of an all-gather, the unreduced input of a
    reduce-scatter, what one rank sends in total for all-to-all and send/recv.
    """

    name: str
    collective: Collective
    group: Group
    bytes: int
    after: str | None  # segment whose end releases it; None: the phase start
    before: str | None  # segment that waits for it; None: the phase end
    device: int = 0
    peer_device: int | None = None  # send/recv: the receiving stage
    fuse_with: str | None = None  # segment a P2P decomposition may split and fuse (Flash-Overlap)
    phase: str = ""

    @property
    def key(self) -> str:
        """Tuning key: the finest unit stock NCCL can configure (communicator, collective, size)."""
        return str(TuningKey(self.group.name, self.collective.value, self.bytes))


@dataclass
class Phase:
    name: str
    repeat: int
    segments: dict[int, list[ComputeSegment]]  # device -> compute-stream order
    points: list[OverlapPoint]
    # what the model works out from the phase alone, kept with it (its index: ``lagom.model.phase_index.index_of``);
    # a phase is not changed once built
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)


@dataclass
class StepGraph:
    workload: str
    hardware: str
    devices: int
    phases: list[Phase]
    groups: dict[str, Group] = field(default_factory=dict)

    @property
    def points(self) -> list[OverlapPoint]:
        return [p for ph in self.phases for p in ph.points]

    def keys(self) -> dict[str, list[OverlapPoint]]:
        """Points grouped by tuning key, in first-seen order."""
        out: dict[str, list[OverlapPoint]] = {}
        named: dict[tuple[str, Collective, int], list[OverlapPoint]] = {}  # the key's parts: no string per point
        for p in self.points:
            what = (p.group.name, p.collective, p.bytes)
            found = named.get(what)
            if found is None:
                found = named[what] = out.setdefault(p.key, [])
            found.append(p)
        return out


def group_span(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of a group whose ranks are ``stride`` apart in the global order."""
    if size <= 1:
        return 1, 1
    per_node = 1 if stride >= gpus_per_node else max(1, min(size, gpus_per_node // stride))
    return per_node, math.ceil(size / per_node)


def make_groups(wl: Workload, hw: Hardware) -> dict[str, Group]:
    """Megatron's default rank order tp-cp-ep-dp-pp: tp varies fastest, pp slowest."""
    p = wl.parallel
    gpn = hw.cluster.gpus_per_node
    strides = {"tp": 1, "cp": p.tp, "dp": p.tp * p.cp, "pp": p.tp * p.cp * p.dp}
    sizes = {"tp": p.tp, "cp": p.cp, "dp": p.dp, "pp": p.pp}
    groups = {n: Group(n, sizes[n], *group_span(sizes[n], strides[n], gpn)) for n in sizes}
    groups["ep"] = Group("ep", p.ep, *group_span(p.ep, p.tp * p.cp, gpn))  # size 1: no all-to-all points
    if p.cp > 1:
        groups["dp_cp"] = Group("dp_cp", p.dp * p.cp, *group_span(p.dp * p.cp, p.tp, gpn))
    if p.ep > 1:  # expert gradients reduce over the data-parallel ranks that hold the same experts
        edp = p.dp * p.cp // p.ep
        groups["expt_dp"] = Group("expt_dp", edp, *group_span(edp, p.tp * p.cp * p.ep, gpn))
    return groups
