"""A phase lowered to the flat arrays the simulator's compiled event loop reads (``PhaseArrays``): its tasks
numbered queue by queue, each with its device, cost, dependencies and wakes.

Only which keys Flash-Overlap splits into P2P steps (and into how many chunks) changes a phase's tasks, so a
phase is lowered once per such choice (``lower``) and every run of a search hands the same arrays to the C loop
(``lagom.model.compiled``). The tasks are worked out at once with numpy on the phase index's arrays
(``_AtOnce``); the walk through the lowering's Python shapes, the ones the Python loop runs on, is what those
rows are checked against and the fallback where they would differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any

import numpy as np
import numpy.ma  # noqa: F401 - np.unique imports it on its first call: with this module, not inside a first step

from lagom.errors import LagomError
from lagom.model.lowering import COMPUTE, END, P2P, Lowering
from lagom.model.phase_index import NONE, SLOT, first_seen, places
from lagom.step.graph import Collective
from lagom.step.points import collector_paused

# event_loop.h's lagom_task_t: a task's fields side by side
TASK = np.dtype([("queue", np.int32), ("device", np.int32), ("cost", np.int32), ("record", np.int32),
                 ("dev_off", np.int32), ("dep_off", np.int32), ("wake_off", np.int32),
                 ("comm", np.uint8), ("first", np.uint8), ("last", np.uint8), ("unused", np.uint8)])
TILE_BLOCK = 64  # periods a lowering tests for copying at once (numpy over the block, not a call per period)
_ALL_GATHER = list(Collective).index(Collective.ALL_GATHER)  # PhaseIndex numbers collectives by their place


@dataclass
class PhaseArrays:
    """One phase under one choice of decompositions, as the C loop reads it: tasks numbered queue by queue."""

    lowering: Lowering
    position: np.ndarray  # per task: its position in the lowering
    positions: list[np.ndarray]  # per queue: its tasks' positions (views into ``position``)
    queue_first: np.ndarray
    task: np.ndarray  # per task and one more (its lists' ends), of dtype TASK: queue, dense device, cost, record...
    dev_list: np.ndarray
    dep_list: np.ndarray
    wake_list: np.ndarray
    costs: list[tuple]  # cost tuples by id
    cost_task: list[tuple[int, int]]  # per cost: a (queue, position) of that cost
    keys: list[str]
    cost_key: np.ndarray
    cost_cross: np.ndarray
    cost_one_way: np.ndarray
    compute_queue: np.ndarray
    blame_device: np.ndarray
    records: int  # comm tasks: each has a slot in a run's records
    _struct: Any = field(default=None, repr=False)  # the C loop's view of these arrays (compiled._struct)
    _costs: tuple | None = field(default=None, repr=False)
    _boundaries: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def tasks(self) -> int:
        return int(self.queue_first[-1])

    @property
    def nbytes(self) -> int:
        """Bytes its arrays take (what a Simulator's budget counts)."""
        return sum(v.nbytes for v in vars(self).values() if isinstance(v, np.ndarray)) + \
            sum(check.nbytes for check in self._boundaries.values())

    @cached_property
    def band(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The band as the C loop reads it: per queue its shift, then its spans as offsets, lows and highs."""
        queues = self.lowering.queues
        off = np.zeros(len(queues) + 1, dtype=np.int32)
        np.cumsum([len(queue.spans) for queue in queues], out=off[1:])
        spans = [span for queue in queues for span in queue.spans]
        return (np.asarray([queue.shift for queue in queues], dtype=np.int64), off,
                np.asarray([lo for lo, _ in spans], dtype=np.int64).reshape(-1), np.asarray([hi for _, hi in spans], dtype=np.int64).reshape(-1))

    def boundaries(self, ref: int) -> np.ndarray:
        """Per task, 1 where starting it is a period boundary of queue ``ref`` (what the loop pauses at)."""
        check = self._boundaries.get(ref)
        if check is None:
            check = self._boundaries[ref] = np.zeros(self.tasks, dtype=np.uint8)
            first, shift = int(self.queue_first[ref]), self.lowering.queues[ref].shift
            check[first:first + len(self.positions[ref])] = self.positions[ref] % shift == 0
        return check

    def where(self, task: int) -> tuple[int, int]:
        """(queue, position) of a task number."""
        q = int(np.searchsorted(self.queue_first, task, side="right")) - 1
        return q, int(self.positions[q][task - self.queue_first[q]])


@dataclass
class _Rows:
    """Tasks of one queue as arrays: per row its position and fields; its devices, dependencies and wakes as a
    count per row and one flat list each."""

    pos: np.ndarray
    comm: np.ndarray
    first: np.ndarray
    last: np.ndarray
    device: np.ndarray
    cost: np.ndarray
    n_dev: np.ndarray
    dev: np.ndarray
    n_dep: np.ndarray
    dep_queue: np.ndarray
    dep_pos: np.ndarray
    n_wake: np.ndarray
    wake: np.ndarray

    def since(self, position: int) -> _Rows:
        """The rows at ``position`` and after (views: their items counted from the end, since a tail is short
        and the rows before it may be many periods copied at once)."""
        i = int(np.searchsorted(self.pos, position))
        dev, dep, wake = (len(items) - int(n[i:].sum())
                          for n, items in ((self.n_dev, self.dev), (self.n_dep, self.dep_queue), (self.n_wake, self.wake)))
        return _Rows(self.pos[i:], self.comm[i:], self.first[i:], self.last[i:], self.device[i:], self.cost[i:],
                     self.n_dev[i:], self.dev[dev:], self.n_dep[i:], self.dep_queue[dep:], self.dep_pos[dep:],
                     self.n_wake[i:], self.wake[wake:])

    def periods(self, count: int, shift: int, dep_shift: np.ndarray) -> _Rows:
        """These rows repeated ``count`` times, each copy one period (``shift`` positions) on, its dependencies
        moved by their own queues' periods (``dep_shift``, per dependency)."""
        on = np.arange(1, count + 1, dtype=np.int64)[:, None]
        def tile(a: np.ndarray) -> np.ndarray:
            return np.tile(a, count)

        return _Rows((self.pos + on * shift).ravel(), tile(self.comm), tile(self.first), tile(self.last),
                     tile(self.device), tile(self.cost), tile(self.n_dev), tile(self.dev), tile(self.n_dep),
                     tile(self.dep_queue), (self.dep_pos + on * dep_shift).ravel(), tile(self.n_wake), tile(self.wake))

    def take(self, name: str) -> np.ndarray:
        """Field ``name``, no longer held here (an empty array in its place)."""
        out = getattr(self, name)
        setattr(self, name, out[:0].copy())
        return out

    @staticmethod
    def join(parts: list[_Rows]) -> _Rows:
        return _Rows(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(_Rows)))


class _Walk:
    """Rows of one queue worked out one at a time from the lowering's shapes, until they become arrays."""

    def __init__(self) -> None:
        self.pos: list[int] = []
        self.flags = bytearray()  # comm, first, last per row
        self.device: list[int] = []
        self.cost: list[int] = []
        self.n_dev: list[int] = []
        self.dev: list[int] = []
        self.n_dep: list[int] = []
        self.dep_queue: list[int] = []
        self.dep_pos: list[int] = []
        self.n_wake: list[int] = []
        self.wake: list[int] = []

    def add(self, pos: int, shape: Any, device: int, cost: int, devices: list[int]) -> None:
        self.pos.append(pos)
        self.flags += bytes((shape.comm, shape.first, shape.last))
        self.device.append(device)
        self.cost.append(cost)
        self.n_dev.append(len(devices))
        self.dev.extend(devices)
        self.n_dep.append(len(shape.deps))
        for dq, at in shape.deps:
            self.dep_queue.append(dq)
            self.dep_pos.append(at)
        self.n_wake.append(len(shape.wakes))
        self.wake.extend(shape.wakes)

    def rows(self) -> _Rows:
        flags = np.frombuffer(bytes(self.flags), dtype=np.uint8).reshape(-1, 3)
        i32 = np.int32
        out = _Rows(np.asarray(self.pos, dtype=np.int64), flags[:, 0].copy(), flags[:, 1].copy(), flags[:, 2].copy(),
                    np.asarray(self.device, dtype=i32), np.asarray(self.cost, dtype=i32),
                    np.asarray(self.n_dev, dtype=i32), np.asarray(self.dev, dtype=i32), np.asarray(self.n_dep, dtype=i32),
                    np.asarray(self.dep_queue, dtype=i32), np.asarray(self.dep_pos, dtype=np.int64),
                    np.asarray(self.n_wake, dtype=i32), np.asarray(self.wake, dtype=i32))
        self.__init__()  # type: ignore[misc]
        return out


class _Band:
    """What decides whether a period of a queue is the image of the one before (``Lowering._image``'s tests, on
    arrays): every queue's spans, and per device how many collectives each segment's end releases."""

    def __init__(self, lowering: Lowering) -> None:
        ix = lowering.ix
        self.shift = np.asarray([queue.shift for queue in lowering.queues], dtype=np.int64)
        self.spans = [(np.asarray([lo for lo, _ in queue.spans], dtype=np.int64),
                       np.asarray([hi for _, hi in queue.spans], dtype=np.int64)) for queue in lowering.queues]
        self.releases = {d: ix.releases.counts(d) for d in ix.segments}

    def in_spans(self, queue: np.ndarray, pos: np.ndarray, shift: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Per count c of ``counts``: whether every (queue, position) moved c times its ``shift`` lies in one of
        its queue's spans."""
        ok = np.ones(len(counts), dtype=bool)
        for q in np.unique(queue):
            los, his = self.spans[q]
            if not len(los):  # a queue outside the band: no position of it is in a span
                return np.zeros(len(counts), dtype=bool)
            mask = queue == q
            at = pos[mask][None, :] + counts[:, None] * shift[mask][None, :]
            i = np.searchsorted(los, at, side="right") - 1
            ok &= ~((i < 0) | (at >= his[np.maximum(i, 0)])).any(axis=1)
        return ok


def _tail(parts: list[_Rows], position: int) -> _Rows:
    """The rows at ``position`` and after, cut from the part that holds ``position`` before joining the parts after
    it (joining first would copy every period a tile had copied at once, at each retry)."""
    first = len(parts) - 1
    while first > 0 and not (len(parts[first].pos) and parts[first].pos[0] <= position):
        first -= 1
    return _Rows.join([parts[first].since(position), *parts[first + 1:]])


def _tile(lowering: Lowering, band: _Band, q: int, prev: _Rows, pos: int) -> tuple[_Rows, int] | None:
    """As many whole periods from ``pos`` on as are each the image of the period before (``prev``, the rows
    from one period back up to ``pos``): the copies ``Lowering._image`` would make, made for a period at once;
    with the position after them."""
    queue = lowering.queues[q]
    shift = queue.shift
    span = queue.span(pos - shift)
    if span is None or not len(prev.pos) or prev.pos[0] != pos - shift:
        return None
    nexts = np.append(prev.pos[1:], pos)  # each row's next position
    dep_shift = band.shift[prev.dep_queue]
    releases = band.releases.get(queue.device) if queue.kind == COMPUTE else None
    most = max(0, -(-(span[1] - int(nexts[-1])) // shift))  # copies whose last row's next stays in the span
    count = 0  # the base period is ``count`` periods past ``prev``; the first that fails a test ends the copies
    while count < most:
        counts = np.arange(count, min(most, count + TILE_BLOCK), dtype=np.int64)
        ok = band.in_spans(prev.dep_queue, prev.dep_pos, dep_shift, counts)
        if releases is not None:
            base = (prev.pos[None, :] + counts[:, None] * shift) // SLOT
            image = base + shift // SLOT
            inside = image[:, -1] < len(releases)
            same = (releases[np.minimum(image, len(releases) - 1)] == releases[np.minimum(base, len(releases) - 1)]).all(axis=1)
            ok &= inside & same
        failed = np.flatnonzero(~ok)
        if len(failed):
            count += int(failed[0])
            break
        count += len(counts)
    return (prev.periods(count, shift, dep_shift), pos + count * shift) if count else None


def lower(lowering: Lowering) -> PhaseArrays:
    """Every task of the phase as arrays, worked out at once on the phase index's arrays (``_AtOnce``).

    The walk (``_lower(at_once=False)``) is what those rows are checked against and the fallback where they would
    not be its rows (a split collective on a group of one rank): queue by queue from its first position through
    the lowering's shapes, the ones the Python loop runs on. In the periodic band a period whose every task is
    the image of one a period back is copied as arrays, a period at once; the shapes are dropped once the walk
    is a period past them, so memory holds the arrays, not the shapes."""
    with collector_paused():
        return _lower(lowering)


def _lower(lowering: Lowering, at_once: bool = True) -> PhaseArrays:
    """``at_once=False``: walk every queue (what ``_AtOnce`` is tested against)."""
    ix = lowering.ix
    queues = lowering.queues
    band = _Band(lowering)
    devices = sorted({*ix.devices, *(queue.device for queue in queues)})
    dense = {d: n for n, d in enumerate(devices)}
    cost_ids: dict[tuple, int] = {}
    cost_task: list[tuple[int, int]] = []
    per_queue: list[_Rows] = []
    if at_once:  # every queue's rows at once (what the walk below finds, task by task)
        whole = _AtOnce(lowering, devices, dense, cost_ids, cost_task)
        if whole.exact:
            return _arrays(lowering, [whole.rows(q) for q in range(len(queues))], devices, dense, cost_ids, cost_task)
    for q, queue in enumerate(queues):
        shapes = lowering.shapes[q]
        parts: list[_Rows] = []
        walk = _Walk()
        walked: list[int] = []  # positions whose shapes the lowering may still hold
        kept = 0
        pos = lowering.firsts[q]
        retry = pos + queue.shift  # where to try copying whole periods next
        while pos < END:
            if queue.shift and pos >= retry:
                parts.append(walk.rows())
                tiled = _tile(lowering, band, q, _tail(parts, pos - queue.shift), pos)
                retry = pos + queue.shift
                if tiled is not None:
                    parts.append(tiled[0])
                    pos = retry = tiled[1]
                    continue
            shape = lowering.shape(q, pos)
            c = cost_ids.get(shape.cost)
            if c is None:
                c = cost_ids[shape.cost] = len(cost_task)
                cost_task.append((q, pos))
            for d in shape.devices:
                if d not in dense:
                    dense[d] = len(devices)
                    devices.append(d)
            walk.add(pos, shape, dense[shape.device], c, [dense[d] for d in shape.devices])
            walked.append(pos)
            pos = shape.next
            while kept < len(walked) and walked[kept] < pos - queue.shift:  # the walk needs one period back
                shapes.pop(walked[kept], None)
                kept += 1
        for at in walked[kept:]:
            shapes.pop(at, None)
        parts.append(walk.rows())
        per_queue.append(_Rows.join(parts))
    return _arrays(lowering, per_queue, devices, dense, cost_ids, cost_task)


class _AtOnce:
    """Every queue's rows of a phase worked out at once on the index's arrays: the rows ``_lower``'s walk through
    the lowering's shapes finds task by task (tested against it), costs numbered in the same order (queue by
    queue, where each first appears). Per segment, the point whose decomposition splits it (the first candidate
    whose key the lowering splits) and so its pieces; then
      a compute queue: each segment's pieces, waiting for a split all-gather's P2P steps or a split
        reduce-scatter's partials, and the first piece for what the segment waits for (split reduce-scatters'
        reduces by device and segment, then collectives in the ``waits`` table's order); the last piece wakes
        the streams of what the segment releases;
      a P2P queue: the steps of each segment split on its group, after the segment releasing a split all-gather
        or after the piece a reduce-scatter's partial comes from;
      a communicator stream: its collectives not split, each after the last piece of the segment releasing it."""

    def __init__(self, lowering: Lowering, devices: list[int], dense: dict[int, int], cost_ids: dict[tuple, int],
                 cost_task: list[tuple[int, int]]) -> None:
        ix = self.ix = lowering.ix
        self.lowering, self.devices, self.dense, self.cost_ids, self.cost_task = lowering, devices, dense, cost_ids, cost_task
        self.stream_queue = np.full(len(ix.streams), -1, dtype=np.int64)
        self.stream_queue[list(lowering.stream_queue)] = list(lowering.stream_queue.values())
        self.compute_queue = np.full(max(ix.devices, default=0) + 1, -1, dtype=np.int64)
        self.compute_queue[list(lowering.compute_queue)] = list(lowering.compute_queue.values())
        self.key = ix.columns.key
        self.chunks = np.asarray([lowering.chunks.get(ix.key(j), 0) for j in ix.columns.key_first.tolist()], dtype=np.int64)
        groups, firsts = np.unique(ix._group, return_index=True)
        size = np.zeros(len(groups), dtype=np.int64)
        size[groups] = [ix.points[j].group.size for j in firsts.tolist()]
        names, firsts = np.unique(ix._group_name, return_index=True)
        self.group_name = dict(zip(names.tolist(), (ix.points[j].group.name for j in firsts.tolist())))  # number -> name
        self.rank = np.zeros(max(ix.devices, default=0) + 1, dtype=np.int64)
        self.rank[ix.devices] = np.arange(len(ix.devices))
        # Per segment (global id): the point whose decomposition splits it (the first candidate whose key is split;
        # NONE: left whole), its chunks per peer (k), whether it gathers, its pieces on the compute queue and its
        # steps on the P2P queue (``Lowering.pieces``)
        segments = len(ix._seg_device) - 1
        table = ix.candidates
        split = np.flatnonzero(self.chunks[self.key[table.flat]] > 0)
        by, first = np.unique(np.repeat(np.arange(segments), table.sizes)[split], return_index=True)
        self.fused = np.full(segments + 1, NONE, dtype=np.int64)  # one more: -1 reads NONE
        self.fused[by] = table.flat[split[first]]
        split_at = self.fused[:-1] >= 0
        self.k = np.where(split_at, _of_split(self.chunks, _of_split(self.key, self.fused[:-1])), 0)
        n_k = _of_split(size, _of_split(ix._group, self.fused[:-1])) * self.k
        self.ag = _of_split(ix._collective, self.fused[:-1]) == _ALL_GATHER
        self.count = np.where(split_at, np.where(self.ag, n_k, n_k + 1), 1)
        self.steps = np.where(split_at, n_k - self.k, 0)
        # per point: whether its decomposition is the one splitting its segment
        self.decomposed = (ix._fused >= 0) & (self.fused[ix._fused] == np.arange(len(ix.points)))
        # whether the rows are the walk's: not where a split point's group has one rank (no P2P steps)
        self.exact = not (split_at & (self.steps <= 0)).any()

    def rows(self, q: int) -> _Rows:
        queue = self.lowering.queues[q]
        if queue.kind == COMPUTE:
            return self._compute(q, queue.device)
        return self._p2p(q, queue.device, queue.group) if queue.kind == P2P else self._stream(q, queue.stream)

    def _last(self, segment: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(queue, position) of the task finishing each global segment: its last piece (``Lowering.last_of``)."""
        return (self.compute_queue[self.ix._seg_device[segment]],
                self.ix._seg_index[segment] * SLOT + self.count[segment] - 1)

    def _costs(self, q: int, pos: np.ndarray, columns: tuple[np.ndarray, ...], cost_of: Any) -> np.ndarray:
        """Cost ids of rows told apart by ``columns``: each distinct row's cost (``cost_of(row)``) numbered where it
        first appears."""
        found, firsts = first_seen(*columns)
        ids = [self.cost_ids.setdefault(cost, len(self.cost_ids)) for cost in map(cost_of, firsts.tolist())]
        for at, c in zip(pos[firsts].tolist(), ids):
            if c == len(self.cost_task):
                self.cost_task.append((q, at))
        return np.asarray(ids, dtype=np.int32)[found]

    def _p2p_queue(self, d: int, points: np.ndarray) -> np.ndarray:
        """The P2P queue of each point's group on device ``d``."""
        names, inverse = np.unique(self.ix._group_name[points], return_inverse=True)
        return np.asarray([self.lowering.p2p_queue[(d, self.group_name[n])] for n in names.tolist()], dtype=np.int64)[inverse]

    def _compute(self, q: int, d: int) -> _Rows:
        ix = self.ix
        segs = np.arange(ix._offset[d], ix._offset[d] + ix._size[d], dtype=np.int64)
        count = self.count[segs]
        seg = np.repeat(segs, count)  # each row's global segment
        row_of = np.cumsum(count) - count  # each segment's first row
        piece = places(count)
        i = ix._seg_index[seg]
        pos = i * SLOT + piece
        j = self.fused[seg]
        split = j >= 0
        last = piece == self.count[seg] - 1
        reduce = split & ~self.ag[seg] & last
        kinds = ix.kind_arrays[0]
        key = _of_split(self.key, j)

        def cost_of(r: int) -> tuple:
            s = ix.segments[d][int(i[r])]
            if not split[r]:
                return (s.flops, s.bytes, s.ctas)
            p = ix.points[int(j[r])]
            n, k = p.group.size, int(self.k[seg[r]])
            if reduce[r]:
                return (0.0, p.bytes / n * (n + 1), max(1, p.bytes // n // 4096))
            return (s.flops / (n * k), s.bytes / (n * k), max(1, s.ctas // (n * k)))

        cost = self._costs(q, pos, (kinds[d][i], key, reduce), cost_of)
        # dependencies: (row, order, minor, queue, position) entries sorted by row, order, minor
        entries: list[tuple[np.ndarray, ...]] = []
        sp = np.flatnonzero(split)
        p2p = np.full(len(seg), NONE, dtype=np.int64)
        if len(sp):
            p2p[sp] = self._p2p_queue(d, j[sp])
            k = self.k[seg]
            gather = np.flatnonzero(split & self.ag[seg] & (piece >= k))  # a peer's block waits for its transfer
            entries.append((gather, np.zeros_like(gather), np.zeros_like(gather), p2p[gather], pos[gather] - k[gather]))
            rs = np.flatnonzero(reduce)  # the reduce waits for every peer's partial
            steps = self.steps[seg[rs]]
            at = np.repeat(rs, steps)
            step = places(steps)
            entries.append((at, np.zeros_like(at), step, p2p[at], i[at] * SLOT + step))
        entries += self._waits(d, row_of)
        n_dep, dep_queue, dep_pos = _gathered(len(seg), entries)
        # wakes: the last piece wakes what the segment's end releases, then (a reduce) the compute waiting for it
        wakes = self._ending(d, row_of + count - 1)
        before = _of_split(ix._before, j)
        woken = np.flatnonzero(reduce & (before >= 0))
        wakes.append((woken, np.ones_like(woken), np.zeros_like(woken), self.compute_queue[ix._seg_device[before[woken]]],
                      np.zeros_like(woken)))
        partial = np.flatnonzero(split & ~self.ag[seg] & ~last & (piece < self.steps[seg]))  # its send waits for it
        wakes.append((partial, np.zeros_like(partial), np.zeros_like(partial), p2p[partial], np.zeros_like(partial)))
        n_wake, wake, _ = _gathered(len(seg), wakes)
        rows = len(seg)
        return _Rows(pos, np.zeros(rows, np.uint8), np.ones(rows, np.uint8), np.ones(rows, np.uint8),
                     np.full(rows, self.dense[d], np.int32), cost, np.ones(rows, np.int32), np.full(rows, self.dense[d], np.int32),
                     n_dep, dep_queue, dep_pos, n_wake, wake)

    def _waits(self, d: int, row: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        """What each segment of device ``d``'s first piece (row ``row``) waits for: split reduce-scatters' reduces by
        device rank and segment, then collectives not split in the ``waits`` table's order (a split all-gather feeds
        its pieces)."""
        ix, table = self.ix, self.ix.waits
        points, at = table.points_of(d), np.repeat(row, table.counts(d))
        order = np.arange(len(points), dtype=np.int64)
        decomposed = self.decomposed[points]
        colls = ~decomposed
        reduces = decomposed & (ix._collective[points] != _ALL_GATHER)
        fuse = ix._fused[points[reduces]]
        queue, pos = self._last(fuse)
        by_rank = self.rank[ix._seg_device[fuse]] * len(ix._seg_device) + ix._seg_index[fuse]
        return [(at[reduces], np.ones(len(fuse), np.int64), by_rank, queue, pos),
                (at[colls], np.full(int(colls.sum()), 2, np.int64), order[colls], self.stream_queue[ix._stream_of[points[colls]]],
                 ix._slot[points[colls]])]

    def _ending(self, d: int, row: np.ndarray) -> list[tuple[np.ndarray, ...]]:
        """What each segment of device ``d``'s last piece (row ``row``) wakes: the streams of the collectives its end
        releases and the P2P queues of split all-gathers it releases, each once, in issue order (``Lowering._ending``)."""
        ix, table = self.ix, self.ix.releases
        points, at = table.points_of(d), np.repeat(row, table.counts(d))
        queue = self.stream_queue[ix._stream_of[points]]
        gathers = np.flatnonzero(self.decomposed[points] & (ix._collective[points] == _ALL_GATHER))
        for d in np.unique(ix._device[points[gathers]]).tolist():
            mine = gathers[ix._device[points[gathers]] == d]
            queue[mine] = self._p2p_queue(d, points[mine])
        keep = ~self.decomposed[points] | (ix._collective[points] == _ALL_GATHER)
        at, queue = at[keep], queue[keep]
        _, once = np.unique(at * (len(self.lowering.queues) + 1) + queue, return_index=True)
        once.sort()
        return [(at[once], np.zeros(len(once), np.int64), once, queue[once], np.zeros(len(once), np.int64))]

    def _p2p(self, q: int, d: int, group: str) -> _Rows:
        ix = self.ix
        segs = np.arange(ix._offset[d], ix._offset[d] + ix._size[d], dtype=np.int64)
        j = self.fused[segs]
        number = next(n for n, name in self.group_name.items() if name == group)
        mine = _of_split(ix._group_name, j) == number
        segs, j = segs[mine], j[mine]
        steps = self.steps[segs]
        seg = np.repeat(segs, steps)
        jr = np.repeat(j, steps)
        step = places(steps)
        i = ix._seg_index[seg]
        pos = i * SLOT + step
        rows = len(seg)
        cost = self._costs(q, pos, (self.key[jr],), lambda r: (ix.key(int(jr[r])), True))
        gather = self.ag[seg]
        after = ix._after[jr]
        released = gather & (after >= 0)
        queue, last = self._last(after[released])
        dep_queue = np.full(rows, self.compute_queue[d], dtype=np.int64)
        dep_pos = i * SLOT + step
        dep_queue[released], dep_pos[released] = queue, last
        has_dep = ~gather | released
        return _Rows(pos, np.ones(rows, np.uint8), (step == 0).astype(np.uint8), (step == steps.repeat(steps) - 1).astype(np.uint8),
                     np.full(rows, self.dense[d], np.int32), cost, np.ones(rows, np.int32), np.full(rows, self.dense[d], np.int32),
                     has_dep.astype(np.int32), dep_queue[has_dep].astype(np.int32), dep_pos[has_dep],
                     np.ones(rows, np.int32), np.full(rows, self.compute_queue[d], np.int32))

    def _stream(self, q: int, k: int) -> _Rows:
        ix = self.ix
        points = ix._stream_points[k]
        points = points[~self.decomposed[points]]
        rows = len(points)
        pos = ix._slot[points].astype(np.int64)
        after, before = ix._after[points], ix._before[points]
        for d in ix.streams[k].devices:
            if d not in self.dense:
                self.dense[d] = len(self.devices)
                self.devices.append(d)
        devices = [self.dense[d] for d in ix.streams[k].devices]
        queue, last = self._last(after[after >= 0])
        return _Rows(pos, np.ones(rows, np.uint8), np.ones(rows, np.uint8), np.ones(rows, np.uint8),
                     np.full(rows, self.dense[ix.streams[k].device], np.int32),
                     self._costs(q, pos, (self.key[points],), lambda r: (ix.key(int(points[r])), False)),
                     np.full(rows, len(devices), np.int32), np.tile(np.asarray(devices, np.int32), rows),
                     (after >= 0).astype(np.int32), queue.astype(np.int32), last,
                     (before >= 0).astype(np.int32), self.compute_queue[ix._seg_device[before[before >= 0]]].astype(np.int32))


def _of_split(values: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``values[j]`` where ``j`` names a point or segment (>= 0), NONE where it is NONE (a phase may have no points)."""
    out = np.full(len(j), NONE, dtype=np.int64)
    at = j >= 0
    out[at] = values[j[at]]
    return out


def _gathered(rows: int, entries: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row its count of entries, and the entries' queues and positions in row order, then by order and minor
    (entries as (row, order, minor, queue, position) arrays)."""
    row, order, minor, queue, pos = (np.concatenate(column) for column in zip(*entries))
    by = np.lexsort((minor, order, row))
    return (np.bincount(row, minlength=rows).astype(np.int32), queue[by].astype(np.int32), pos[by].astype(np.int64))


def _arrays(lowering: Lowering, per_queue: list[_Rows], devices: list[int], dense: dict[int, int],
            cost_ids: dict[tuple, int], cost_task: list[tuple[int, int]]) -> PhaseArrays:
    """The queues' rows as the phase's arrays, joined one field at a time and each queue's copy of a field
    dropped once joined: a phase's rows run to hundreds of MB at cluster scale, and joining them whole held
    them twice (and their counts and the dependencies' (queue, position) pairs beside the arrays built from them)."""
    ix = lowering.ix
    queue_first = _offsets([len(r.pos) for r in per_queue])
    position = _join(per_queue, "pos")
    positions = [position[a:b] for a, b in zip(queue_first[:-1].tolist(), queue_first[1:].tolist())]
    task = np.zeros(int(queue_first[-1]) + 1, dtype=TASK)
    task["queue"][:-1] = np.repeat(np.arange(len(positions), dtype=np.int32), np.diff(queue_first))
    dep_list = np.empty(sum(len(r.dep_queue) for r in per_queue), dtype=np.int32)
    at = 0
    for r in per_queue:  # the dependencies' (queue, position) pairs as task numbers, a queue's at a time
        dep_queue, dep_pos = r.take("dep_queue"), r.take("dep_pos")
        dep_list[at:at + len(dep_queue)] = _task_numbers(positions, queue_first, dep_queue, dep_pos, ix.name)
        at += len(dep_queue)
    for name in ("comm", "first", "last", "device", "cost"):
        task[name][:-1] = _join(per_queue, name)
    for name, items in (("dev", "dev_off"), ("dep", "dep_off"), ("wake", "wake_off")):
        task[items] = _join(per_queue, f"n_{name}", counts=True)
    task["record"] = -1
    comm = np.flatnonzero(task["comm"])
    task["record"][comm] = np.arange(len(comm), dtype=np.int32)
    costs = list(cost_ids)
    keys = list(dict.fromkeys(c[0] for c in costs if isinstance(c[0], str)))
    key_ids = {k: n for n, k in enumerate(keys)}
    cost_key, cross, one_way = [], bytearray(), bytearray()
    for what, (q, pos) in zip(costs, cost_task):
        of = lowering.comm_of(q, pos)
        cost_key.append(-1 if of is None else key_ids[what[0]])
        cross.append(of is not None and ix.points[of[0]].group.nodes > 1)
        one_way.append(of is not None and not what[1] and of[1] == Collective.SEND_RECV)
    compute_queue = np.full(len(devices), -1, dtype=np.int32)
    for d, q in lowering.compute_queue.items():
        compute_queue[dense[d]] = q

    return PhaseArrays(
        lowering, position, positions, queue_first, task, _join(per_queue, "dev"), dep_list, _join(per_queue, "wake"),
        costs, cost_task, keys, np.asarray(cost_key, dtype=np.int32),
        np.frombuffer(bytes(cross), dtype=np.uint8).copy(), np.frombuffer(bytes(one_way), dtype=np.uint8).copy(),
        compute_queue, np.asarray([dense[d] for d in ix.devices], dtype=np.int32), len(comm))


def _offsets(counts: list[int]) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=out[1:])
    return out


def _join(per_queue: list[_Rows], name: str, counts: bool = False) -> np.ndarray:
    """Field ``name`` of every queue's rows as one array, each queue's copy dropped; ``counts``: a count per row,
    joined as the offsets of each row's items (one more than the rows)."""
    parts = [r.take(name) for r in per_queue]
    if not counts:
        return np.concatenate(parts)
    out = np.zeros(sum(len(p) for p in parts) + 1, dtype=np.int32)
    np.concatenate(parts, out=out[1:])
    np.cumsum(out[1:], out=out[1:])
    return out


def _task_numbers(positions: list[np.ndarray], queue_first: np.ndarray, queue: np.ndarray, pos: np.ndarray,
                  phase: str) -> np.ndarray:
    """Task numbers of (queue, position) pairs: positions rise along a queue, so a binary search per queue."""
    out = np.empty(len(queue), dtype=np.int32)
    for q in np.unique(queue):
        at = np.flatnonzero(queue == q)
        found = np.searchsorted(positions[q], pos[at])
        if (found >= len(positions[q])).any() or (positions[q][np.minimum(found, len(positions[q]) - 1)] != pos[at]).any():
            raise LagomError(f"lowering of phase {phase}: a task waits for a position queue {q} never reaches")
        out[at] = queue_first[q] + found
    return out
