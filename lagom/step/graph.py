"""The step graph as data: collectives (``Collective``) on process groups (``Group``), compute segments, overlap
points, phases and the step that holds them; and the groups a workload's layout makes on a machine
(``make_groups``). ``lagom.step.points`` builds a graph from a workload; the model prices it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import count, repeat
from operator import attrgetter
from typing import Any

import numpy as np

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
    # what is worked out from the phase alone, kept with it (its columns, ``phase_columns``; the model's index,
    # ``lagom.model.phase_index.index_of``); a phase is not changed once built
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)


# PhaseColumns' segment ids besides global ones: the phase's start or end (or nothing to fuse with); a name no segment has
NO_SEGMENT, NOT_A_SEGMENT = -1, -2
COLLECTIVE_ID = {c: k for k, c in enumerate(Collective)}  # a collective's number in the columns: its place in Collective


@dataclass(frozen=True)
class PhaseColumns:
    """A phase as arrays, in its own order, for the model's index to read instead of a Python pass over hundreds of
    thousands of objects. Segments are numbered one device after another, in the order of ``Phase.segments``
    (global segment ids); per segment its flops, bytes and CTAs; per point the segments releasing it, waiting for
    it and its decomposition may split (global ids, NO_SEGMENT or NOT_A_SEGMENT), its device, peer (-1: none),
    place in ``Collective``, bytes and group (numbered by first appearance, equal groups equal numbers).
    ``lagom.step.points`` writes them as it builds a graph; ``columns_of`` reads them off any phase's objects."""

    flops: np.ndarray
    bytes: np.ndarray
    ctas: np.ndarray
    after: np.ndarray
    before: np.ndarray
    fuse: np.ndarray
    device: np.ndarray
    peer: np.ndarray
    collective: np.ndarray
    point_bytes: np.ndarray
    group: np.ndarray
    groups: list[Group]  # by number

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PhaseColumns) and self.groups == other.groups and all(
            np.array_equal(getattr(self, name), getattr(other, name)) for name in _ARRAYS)


_ARRAYS = [name for name in PhaseColumns.__dataclass_fields__ if name != "groups"]


def phase_columns(phase: Phase) -> PhaseColumns:
    """The phase's columns: the builder's, else read off its objects once and kept with it."""
    found = phase.derived.get("columns")
    if found is None:
        found = phase.derived["columns"] = columns_of(phase)
    return found


def columns_of(phase: Phase) -> PhaseColumns:
    """The columns read off the phase's objects: an attribute per pass over them, segments found by name (a
    KeyError names a point's ``after`` or ``before`` that no segment has)."""
    segments = [seg for segs in phase.segments.values() for seg in segs]
    names: dict[str | None, int] = {None: NO_SEGMENT}
    names.update(zip(map(attrgetter("name"), segments), count()))
    pts = phase.points
    n = len(pts)

    def column(attr: str, values: list[ComputeSegment] | list[OverlapPoint], dtype: type = np.int64) -> np.ndarray:
        return np.fromiter(map(attrgetter(attr), values), dtype=dtype, count=len(values))

    peers = list(map(attrgetter("peer_device"), pts))
    group, groups = _group_ids(list(map(attrgetter("group"), pts)))
    return PhaseColumns(
        column("flops", segments, np.float64), column("bytes", segments, np.float64), column("ctas", segments, np.float64),
        np.fromiter(map(names.__getitem__, map(attrgetter("after"), pts)), dtype=np.int64, count=n),
        np.fromiter(map(names.__getitem__, map(attrgetter("before"), pts)), dtype=np.int64, count=n),
        np.fromiter(map(names.get, map(attrgetter("fuse_with"), pts), repeat(NOT_A_SEGMENT)), dtype=np.int64, count=n),
        column("device", pts), np.fromiter(map({None: -1}.get, peers, peers), dtype=np.int64, count=n),
        _collective_ids(list(map(attrgetter("collective"), pts))), column("bytes", pts), group, groups)


def _collective_ids(collectives: list) -> np.ndarray:
    """Each collective's place in ``Collective`` (members looked up by identity, anything else by value)."""
    by_id = {id(c): k for c, k in COLLECTIVE_ID.items()}
    out = np.fromiter(map(by_id.get, map(id, collectives), repeat(-1)), dtype=np.int64, count=len(collectives))
    for j in np.flatnonzero(out < 0).tolist():
        out[j] = COLLECTIVE_ID[Collective(collectives[j])]
    return out


def _group_ids(groups: list[Group]) -> tuple[np.ndarray, list[Group]]:
    """Each group's number among the distinct groups (equal by value, numbered by first appearance), and the
    groups by number. Groups are shared objects, so values are compared once per object."""
    objects = dict(zip(map(id, groups), groups))
    numbers: dict[Group, int] = {}
    of_object = {key: numbers.setdefault(g, len(numbers)) for key, g in objects.items()}
    return (np.fromiter(map(of_object.__getitem__, map(id, groups)), dtype=np.int64, count=len(groups)), list(numbers))


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
