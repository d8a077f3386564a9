"""How a phase's tasks look under one choice of decompositions: streams, and each task's shape by position.

A phase lowers to task queues: per device its compute stream and the P2P streams of Flash-Overlap
decompositions, then one stream per communicator. Only which keys are split into P2P steps (and into
how many chunks) changes the tasks; every other knob only changes their speed. So a ``Lowering`` is
built per such choice, fills in task shapes as the simulator reaches them, and is reused by every later
run with the same choice (a search tries many configs with the same decompositions). Inside the
periodic band a shape is copied from its image a period back rather than worked out again.

The order of queues, of tasks in them and of each task's dependencies is the order in which the
pre-issue-11 simulator lowered a whole phase: it decides which task starts first at the same instant
and which collective is blamed for a wait, so results match it exactly.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from lagom.model.phase_index import END, NONE, SLOT, PhaseIndex
from lagom.plan.comm_config import CommConfig, Decomposition
from lagom.step.graph import Collective

COMPUTE, P2P, STREAM = 0, 1, 2  # kinds of task queue

Split = frozenset[tuple[str, int]]  # keys decomposed into P2P steps, with their chunks per peer


def split_of(configs: dict[str, CommConfig]) -> Split:
    return frozenset((key, cfg.num_chunks) for key, cfg in configs.items() if cfg.decomposition == Decomposition.P2P)


@dataclass
class Queue:
    kind: int
    device: int
    group: str = ""  # P2P queues: the decomposed points' group
    stream: int = NONE  # STREAM queues: index into PhaseIndex.streams
    shift: int = 0  # periodic band: positions per period (0: outside the band)
    spans: list[tuple[int, int]] = field(default_factory=list)  # band: [lo, hi) positions mapped one period on

    def span(self, pos: int) -> tuple[int, int] | None:
        for lo, hi in self.spans:
            if lo <= pos < hi:
                return lo, hi
        return None


@dataclass(slots=True)
class Shape:
    """A task apart from its timing: where it runs, what it waits for, what it costs."""

    comm: bool
    device: int
    devices: tuple[int, ...]  # GPUs whose resources it uses
    deps: tuple[tuple[int, int], ...]  # (queue, position) of the tasks it waits for, in lowering order
    cost: tuple  # what its durations depend on: compute (flops, bytes, ctas); comm (key, a P2P step or not)
    point: int  # comm: index of its overlap point
    coll: Collective | None  # comm: the collective, or SEND_RECV for one P2P step
    nbytes: float
    first: bool  # comm: the point's first part (a decomposition has several)
    last: bool
    next: int  # the next position in its queue (END: none)
    wakes: tuple[int, ...]  # queues whose tasks may wait for it, besides its own


class Lowering:
    def __init__(self, index: PhaseIndex, split: Split, band: bool) -> None:
        self.ix, self.split = index, split
        self.chunks = dict(split)
        self.fused_memo: dict[tuple[int, int], int] = {}
        self.queues: list[Queue] = []
        self.compute_queue: dict[int, int] = {}
        self.p2p_queue: dict[tuple[int, str], int] = {}
        self.stream_queue: dict[int, int] = {}
        self._build_queues()
        self.band = index.band if band else None
        if self.band is not None:
            for q in self.queues:
                if q.kind == STREAM:
                    q.shift, q.spans = self.band.slots[q.stream]
                elif q.device in self.band.period:
                    q.shift = self.band.period[q.device] * SLOT
                    q.spans = [(lo * SLOT, hi * SLOT) for lo, hi in self.band.segments[q.device]]
            if not any(q.shift for q in self.queues):
                self.band = None
        self.shapes: list[dict[int, Shape]] = [{} for _ in self.queues]
        self.firsts = [self._first(q) for q in range(len(self.queues))]

    # -- decompositions

    def fused(self, d: int, i: int) -> int:
        """The point whose decomposition splits segment (d, i): the first candidate set to P2P, or NONE."""
        if not self.chunks:  # nothing is split
            return NONE
        found = self.fused_memo.get((d, i))
        if found is None:
            found = next((j for j in self.ix.candidates.get((d, i), ()) if self.ix.key(j) in self.chunks), NONE)
            self.fused_memo[(d, i)] = found
        return found

    def decomposed(self, j: int) -> bool:
        i = self.ix.fuse[j]
        return i != NONE and self.fused(self.ix.points[j].device, i) == j

    def pieces(self, d: int, i: int) -> tuple[int, int, int]:
        """(tasks on the compute stream, P2P steps, chunks per peer) of segment (d, i)."""
        return self._pieces(self.fused(d, i))

    def _pieces(self, j: int) -> tuple[int, int, int]:
        """``pieces`` of the segment that point ``j``'s decomposition splits (NONE: a segment left whole)."""
        if j == NONE:
            return 1, 0, 0
        p = self.ix.points[j]
        n, k = p.group.size, self.chunks[self.ix.key(j)]
        return (n * k if p.collective == Collective.ALL_GATHER else n * k + 1), n * k - k, k

    # -- queues

    def _build_queues(self) -> None:
        """Per device its compute stream then its P2P streams (by first split segment); then the
        communicator streams by the issue rank of their first collective."""
        ix = self.ix
        for d in ix.devices:
            found: dict[str, int] = {}
            for key, (i, group) in ix.first_candidate.get(d, {}).items():
                if key in self.chunks:
                    found[group] = min(found.get(group, i), i)
            first = {g: self._next_split_segment(d, g, i - 1) for g, i in found.items()}
            self.compute_queue[d] = len(self.queues)
            self.queues.append(Queue(COMPUTE, d))
            for g in sorted((g for g in first if first[g] < END), key=first.__getitem__):
                self.p2p_queue[(d, g)] = len(self.queues)
                self.queues.append(Queue(P2P, d, group=g))
        firsts = []
        for k, stream in enumerate(ix.streams):
            first_point = next((j for j in stream.points if not self.decomposed(j)), None)
            if first_point is not None:
                firsts.append((ix.issue_rank[first_point], k))
        for _, k in sorted(firsts):
            self.stream_queue[k] = len(self.queues)
            self.queues.append(Queue(STREAM, ix.streams[k].device, stream=k))

    def _first(self, q: int) -> int:
        queue = self.queues[q]
        if queue.kind == COMPUTE:
            return 0 if self.ix.segments[queue.device] else END
        if queue.kind == P2P:
            return self._next_split_segment(queue.device, queue.group, -1)
        return self._next_slot(queue, 0)

    def _next_slot(self, queue: Queue, slot: int) -> int:
        points = self.ix.streams[queue.stream].points
        while slot < len(points) and self.decomposed(points[slot]):
            slot += 1
        return slot if slot < len(points) else END

    def _next_split_segment(self, device: int, group: str, after: int) -> int:
        """Position of the first segment past ``after`` that a decomposition of ``group`` splits."""
        segs = self.ix.candidate_segments[device]
        for i in segs[bisect_right(segs, after):]:
            j = self.fused(device, i)
            if j != NONE and self.ix.points[j].group.name == group:
                return i * SLOT
        return END

    def _next(self, q: int, pos: int) -> int:
        queue = self.queues[q]
        if queue.kind == STREAM:
            return self._next_slot(queue, pos + 1)
        i, piece = divmod(pos, SLOT)
        return self._after(queue, i, piece, self.pieces(queue.device, i)[0 if queue.kind == COMPUTE else 1])

    def _after(self, queue: Queue, i: int, piece: int, count: int) -> int:
        """The position after piece ``piece`` of segment ``i`` on a compute or P2P queue that has ``count``
        pieces (or steps) there."""
        if piece + 1 < count:
            return i * SLOT + piece + 1
        if queue.kind == COMPUTE:
            return (i + 1) * SLOT if i + 1 < len(self.ix.segments[queue.device]) else END
        return self._next_split_segment(queue.device, queue.group, i)

    # -- dependencies

    def last_of(self, d: int, i: int) -> tuple[int, int]:
        """The task that finishes segment (d, i): the segment, its last piece, or its reduce."""
        return self.compute_queue[d], i * SLOT + self.pieces(d, i)[0] - 1

    def released(self, j: int) -> tuple[tuple[int, int], ...]:
        after = int(self.ix._after[j])  # the index's arrays: a representative task (the C loop's costs) builds no lists
        return (self.last_of(int(self.ix._seg_device[after]), int(self.ix._seg_index[after])),) if after >= 0 else ()

    def _waiting_compute(self, j: int) -> tuple[int, ...]:
        """The compute queue of the segment that waits for point j (none: the phase's end)."""
        before = int(self.ix._before[j])
        return (self.compute_queue[int(self.ix._seg_device[before])],) if before >= 0 else ()

    def waits(self, d: int, i: int) -> tuple[tuple[int, int], ...]:
        """What segment (d, i) waits for: split reduce-scatters' reduces (lowered with the compute, device
        by device), then collectives in issue order. A split all-gather's steps feed its pieces instead."""
        reduces, colls = [], []
        for j in self.ix.waits.get((d, i), ()):
            if self.decomposed(j):
                p = self.ix.points[j]
                if p.collective != Collective.ALL_GATHER:
                    fuse = self.ix.fuse[j]
                    reduces.append((self.ix.rank[p.device], fuse, self.last_of(p.device, fuse)))
            else:
                colls.append((self.stream_queue[self.ix.stream_of[j]], self.ix.slot[j]))
        return tuple(dep for *_, dep in sorted(reduces)) + tuple(colls)

    # -- shapes

    def kept(self) -> int:
        """How many task shapes are memoised."""
        return sum(map(len, self.shapes))

    def forget(self) -> None:
        """Drop the memoised shapes and fused segments (worked out again as runs reach them): what keeps
        the memory of a long search bounded."""
        for shapes in self.shapes:
            shapes.clear()
        self.fused_memo.clear()

    def shape(self, q: int, pos: int) -> Shape:
        shape = self.shapes[q].get(pos)
        if shape is None:
            shape = self.shapes[q][pos] = self._image(q, pos) or self._shape(q, pos)
        return shape

    def _image(self, q: int, pos: int) -> Shape | None:
        """The shape one period on of the task a period back, where the band maps that one onto this one
        (an identical task whose dependencies are their images) and its shape is known: a copy with every
        position moved by its queue's period, instead of working it out again. None: work it out. The band
        does not map what a segment releases beyond the images (a gradient bucket released by the last
        micro-batch's layers), so a segment releasing more than its image a period back is worked out."""
        queues = self.queues
        queue = queues[q]
        base = self.shapes[q].get(pos - queue.shift) if queue.shift else None
        if base is None:
            return None
        span = queue.span(pos - queue.shift)
        if span is None or not span[0] <= base.next < span[1]:
            return None
        deps = []
        for dq, at in base.deps:
            other = queues[dq]
            if other.span(at) is None:
                return None
            deps.append((dq, at + other.shift))
        if queue.kind == COMPUTE and len(self.ix.releases.get((queue.device, pos // SLOT), ())) \
                != len(self.ix.releases.get((queue.device, (pos - queue.shift) // SLOT), ())):
            return None  # it also releases a collective without an image (a gradient bucket): wakes differ
        point = base.point
        if queue.kind == STREAM:
            point = self.ix.streams[queue.stream].points[pos]
        elif queue.kind == P2P:
            point = self.fused(queue.device, pos // SLOT)
        return Shape(base.comm, base.device, base.devices, tuple(deps), base.cost, point, base.coll, base.nbytes,
                     base.first, base.last, base.next + queue.shift, base.wakes)

    def comm_of(self, q: int, pos: int) -> tuple[int, Collective] | None:
        """The overlap point and collective (SEND_RECV for a P2P step) of the task at (q, pos), None for compute:
        what its shape's ``point`` and ``coll`` say, without working out the shape."""
        queue = self.queues[q]
        if queue.kind == STREAM:
            j = self.ix.streams[queue.stream].points[pos]
            return j, self.ix.points[j].collective
        return (self.fused(queue.device, pos // SLOT), Collective.SEND_RECV) if queue.kind == P2P else None

    def _shape(self, q: int, pos: int) -> Shape:
        queue, ix = self.queues[q], self.ix
        d = queue.device
        if queue.kind == STREAM:
            j = ix.streams[queue.stream].points[pos]
            p = ix.points[j]
            return Shape(True, d, ix.streams[queue.stream].devices, self.released(j), (ix.key(j), False), j, p.collective,
                         float(p.bytes), True, True, self._next(q, pos), self._waiting_compute(j))
        i, piece = divmod(pos, SLOT)
        seg = ix.segments[d][i]
        j = self.fused(d, i)
        count, steps, k = self._pieces(j)
        nxt = self._after(queue, i, piece, count if queue.kind == COMPUTE else steps)
        if queue.kind == P2P:
            p = ix.points[j]
            step_deps = self.released(j) if p.collective == Collective.ALL_GATHER else ((self.compute_queue[d], i * SLOT + piece),)
            return Shape(True, d, (d,), step_deps, (ix.key(j), True), j, Collective.SEND_RECV, p.bytes / (p.group.size * k),
                         piece == 0, piece == steps - 1, nxt, (self.compute_queue[d],))
        if j == NONE:
            return Shape(False, d, (d,), self.waits(d, i), (seg.flops, seg.bytes, seg.ctas), NONE, None, 0.0, True, True, nxt,
                         self._ending(d, i))
        p = ix.points[j]
        n = p.group.size
        deps: tuple[tuple[int, int], ...] = ()
        if p.collective == Collective.ALL_GATHER:
            if piece >= k:  # a peer's block: wait for its transfer
                deps = ((self.p2p_queue[(d, p.group.name)], i * SLOT + piece - k),)
        elif piece == count - 1:  # the reduce, once every peer's partial is sent
            deps = tuple((self.p2p_queue[(d, p.group.name)], i * SLOT + s) for s in range(steps))
        if piece == 0:
            deps += self.waits(d, i)
        wakes: tuple[int, ...] = ()
        if piece == count - 1:
            wakes = self._ending(d, i)
            if p.collective != Collective.ALL_GATHER:  # what waits for the reduce
                wakes += self._waiting_compute(j)
        elif p.collective != Collective.ALL_GATHER and piece < steps:  # a peer's partial: its send waits
            wakes = (self.p2p_queue[(d, p.group.name)],)
        if p.collective != Collective.ALL_GATHER and piece == count - 1:  # the reduce
            cost: tuple = (0.0, p.bytes / n * (n + 1), max(1, p.bytes // n // 4096))
        else:
            cost = (seg.flops / (n * k), seg.bytes / (n * k), max(1, seg.ctas // (n * k)))
        return Shape(False, d, (d,), deps, cost, NONE, None, 0.0, True, True, nxt, wakes)

    def _ending(self, d: int, i: int) -> tuple[int, ...]:
        """Queues whose tasks wait for the end of segment (d, i): the collectives it releases (a split
        all-gather's steps)."""
        out = []
        for j in self.ix.releases.get((d, i), ()):
            if not self.decomposed(j):
                out.append(self.stream_queue[self.ix.stream_of[j]])
            elif self.ix.points[j].collective == Collective.ALL_GATHER:
                p = self.ix.points[j]
                out.append(self.p2p_queue[(p.device, p.group.name)])
        return tuple(dict.fromkeys(out))

    # -- names and plot order

    def stream_name(self, q: int) -> str:
        queue = self.queues[q]
        if queue.kind == COMPUTE:
            return "compute"
        if queue.kind == P2P:
            return f"{queue.group}.p2p"
        return self.ix.streams[queue.stream].name

    def name(self, q: int, pos: int) -> str:
        shape = self.shape(q, pos)
        if not shape.comm:
            i, piece = divmod(pos, SLOT)
            seg = self.ix.segments[shape.device][i]
            j = self.fused(shape.device, i)
            if j == NONE:
                return seg.name
            p = self.ix.points[j]
            count, _, k = self.pieces(shape.device, i)
            if p.collective != Collective.ALL_GATHER and piece == count - 1:
                return f"{seg.name}[reduce]"
            return f"{seg.name}[{label(p.collective, piece, p.group.size, k)}]"
        p = self.ix.points[shape.point]
        if self.queues[q].kind == STREAM:
            return p.name
        i, step = divmod(pos, SLOT)
        _, _, k = self.pieces(shape.device, i)
        piece = step + (k if p.collective == Collective.ALL_GATHER else 0)  # the piece this step feeds / drains
        return f"{p.name}[{label(p.collective, piece, p.group.size, k)}]"

    def creation_order(self, q: int, pos: int) -> tuple:
        """Where the whole-phase lowering created this task: device by device, a segment's pieces with its
        P2P steps interleaved (a step just before the piece it feeds, just after the piece it sends); then
        collectives in issue order."""
        queue = self.queues[q]
        if queue.kind == STREAM:
            return 1, self.ix.issue_rank[self.ix.streams[queue.stream].points[pos]], 0
        i, piece = divmod(pos, SLOT)
        if queue.kind == COMPUTE:
            sub = 2 * piece + 1
        elif self.ix.points[self.fused(queue.device, i)].collective == Collective.ALL_GATHER:
            sub = 2 * (piece + self.pieces(queue.device, i)[2])
        else:
            sub = 2 * piece + 2
        return 0, self.ix.rank[queue.device], i, sub


def label(coll: Collective, piece: int, n: int, k: int) -> str:
    """Names of decomposition pieces: s<shard>c<chunk>; a reduce-scatter computes peers' shards first."""
    if coll == Collective.ALL_GATHER:
        return f"s{piece // k}c{piece % k}"
    if piece < (n - 1) * k:
        return f"s{1 + piece // k}c{piece % k}"
    return f"s0c{piece - (n - 1) * k}"
