"""Where every task of a phase sits, and which stretch of the phase repeats.

The simulator builds tasks lazily, by position, instead of lowering a whole phase up front: a compute
task by its segment's index (times ``SLOT``, plus the piece when a Flash-Overlap decomposition splits
the segment), a collective by its slot in its stream's host issue order. This index answers "what is
at position x" in O(1) and is built once per step graph, whatever the configs.

It also finds the phase's periodic band: the stretch where shifting every device's compute by its
period (one micro-batch per stage in a 1F1B pipeline, one layer on a single device) maps segments,
collectives and every dependency between them onto identical ones. Inside the band the simulator may
skip whole periods once it sees its state repeat (see ``lagom.model.simulator``).

A phase holds up to hundreds of thousands of segments and points, so both are worked out on numpy
arrays: each point's segments as global segment ids (a device's segments are numbered one after the
other, devices in the phase's order), each grouping by a stable sort. The arrays are the phase's columns
(``lagom.step.graph.PhaseColumns``: written by the builder as it builds, read off the objects for any other
phase) and the tables the lowering reads are made from them.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

from lagom.errors import LagomError
from lagom.step.graph import NOT_A_SEGMENT, Collective, Phase, phase_columns
from lagom.step.points import collector_paused

SLOT = 1 << 32  # compute and P2P positions: segment index * SLOT + piece (pieces of one segment < SLOT)
NONE = -1
MIN_PERIODS = 4  # a band must repeat at least this often: two periods to see the repetition, more to skip
PROBES = (2, 4, 4 / 3)  # where the period search starts: n / probe
MAX_CANDIDATES = 256  # candidate periods tried per probe
END = 1 << 62  # a position past every task
_SIGNATURE = attrgetter("flops", "bytes", "ctas")
_COLLECTIVES = list(Collective)
_DECOMPOSABLE = np.asarray([c in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER) for c in _COLLECTIVES])  # can_decompose
_I64 = np.int64


@dataclass
class Stream:
    """One communicator stream on one device: its collectives in host issue order."""

    device: int
    name: str
    devices: tuple[int, ...]  # GPUs its collectives occupy
    points: list[int]  # point indices, in issue order


@dataclass
class Band:
    """Shifting device d's segments by ``period[d]`` (and each stream by its slot shift) maps every position
    in the good spans onto an identical task with identical dependencies. A band may be interrupted
    (where issue order between devices' collectives flips, say), so the good positions are spans."""

    period: dict[int, int]  # device -> segments per period
    segments: dict[int, list[tuple[int, int]]]  # device -> [lo, hi) spans of segment indices mapped one period on
    slots: list[tuple[int, list[tuple[int, int]]]]  # per stream: (points per period, [lo, hi) slot spans)


@dataclass(frozen=True)
class PointColumns:
    """Per point of a phase, in phase order, what a pass over every point reads, as arrays: the search's windows
    and its sets of keys (``lagom.model.windows``, ``lagom.search.priority``) are worked out on these, not by a
    Python loop over hundreds of thousands of points."""

    device: np.ndarray
    peer: np.ndarray  # the receiving device of a send/recv, NONE for a collective
    key: np.ndarray  # the tuning key (group name, collective, bytes), numbered by first appearance
    key_first: np.ndarray  # each key number's first point
    group: np.ndarray  # the group, equal groups (by value) equal numbers
    collective: np.ndarray  # place in ``Collective``
    bytes: np.ndarray
    first_segment: np.ndarray  # the global segment id of its device's first segment (``kind_arrays`` in one array)
    count: np.ndarray  # its device's number of segments
    # The span of compute it can hide under on its device's stream, [lo, hi): from the segment after the one
    # releasing it (0: released at the start) to the one that waits for it (that segment's index on its own
    # device; the device's count where the phase's end waits)
    lo: np.ndarray
    hi: np.ndarray
    fuse: np.ndarray  # the segment a decomposition may split, its index on the point's device (NONE: none)
    before: np.ndarray  # the segment that waits for it, a number per segment name (NONE: the phase end)


class SegmentTable(Mapping[tuple[int, int], list[int]]):
    """Points grouped by a segment, each group in a given order of the points: segment (device, index) ->
    points, one of the index's tables. Kept as arrays (what the band search reads); a segment's list is made
    when the lowering asks for it (a cold step asks for a few thousand of tens of thousands), all of them
    only when the table is iterated with its values."""

    def __init__(self, seq: np.ndarray, segment: np.ndarray, ix: PhaseIndex) -> None:
        seq = seq[segment[seq] >= 0]
        of = segment[seq]
        by = np.argsort(of, kind="stable")
        sizes = np.bincount(of, minlength=len(ix._seg_device) - 1)
        self.start = np.zeros(len(sizes) + 1, dtype=_I64)  # per global segment id, where its points start in flat
        np.cumsum(sizes, out=self.start[1:])
        self.flat = seq[by]  # point indices, by segment, each segment's in the given order
        present = np.flatnonzero(sizes)
        self.present = present[np.argsort(by[self.start[present]])]  # segments with points, by their first point
        self._seg_device, self._seg_index, self._offset, self._size = ix._seg_device, ix._seg_index, ix._offset, ix._size

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.start)

    def counts(self, d: int) -> np.ndarray:
        """Per segment of device ``d``, in order, how many points it holds (no lists made)."""
        first = self._offset[d]
        return self.sizes[first:first + self._size[d]]

    def points_of(self, d: int) -> np.ndarray:
        """The points of device ``d``'s segments, segment after segment, each segment's in the table's order
        (``counts`` says how many are each segment's)."""
        first = self._offset[d]
        return self.flat[self.start[first]:self.start[first + self._size[d]]]

    def get(self, key: tuple[int, int], default: Any = None) -> Any:
        d, i = key
        first = self._offset.get(d)
        if first is None or not 0 <= i < self._size[d]:
            return default
        lo, hi = self.start[first + i:first + i + 2].tolist()
        return self.flat[lo:hi].tolist() if hi > lo else default

    def __getitem__(self, key: tuple[int, int]) -> list[int]:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(_pairs(self._seg_device, self._seg_index, self.present))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.present)

    def items(self) -> ItemsView[tuple[int, int], list[int]]:
        return self._whole.items()

    def values(self) -> ValuesView[list[int]]:
        return self._whole.values()

    @cached_property
    def _whole(self) -> dict[tuple[int, int], list[int]]:
        flat, start = self.flat.tolist(), self.start
        return dict(zip(self, map(flat.__getitem__, map(slice, start[self.present].tolist(),
                                                          start[self.present + 1].tolist()))))


class PhaseIndex:
    """Positions, dependencies and the periodic band of one phase (independent of configs and model)."""

    def __init__(self, phase: Phase) -> None:
        with collector_paused():
            self._build(phase)

    def _build(self, phase: Phase) -> None:
        # the phase's parts, not the phase: a phase keeps its index (``index_of``), and a reference back would make
        # a cycle that holds a whole step graph until the garbage collector's next full pass
        self.name, self.repeat = phase.name, phase.repeat
        pts = self.points = phase.points
        cols = self._columns = phase_columns(phase)
        # a device that only communicates in this phase (its collectives released at the phase start) has a compute
        # stream with nothing on it
        idle = sorted(set(np.unique(cols.device).tolist()) - set(phase.segments))
        self.segments = {**phase.segments, **{d: [] for d in idle}} if idle else phase.segments
        self.devices = list(self.segments)
        self.rank = {d: r for r, d in enumerate(self.devices)}
        # Global segment ids: ``_seg_device`` and ``_seg_index`` say where each is (one more entry, NONE, so that -1
        # reads NONE)
        sizes = [len(segs) for segs in self.segments.values()]
        self._seg_device = np.append(np.repeat(np.asarray(self.devices, dtype=_I64), sizes), NONE)
        self._seg_index = np.concatenate([np.arange(size, dtype=_I64) for size in sizes] + [np.asarray([NONE])])
        self._offset = dict(zip(self.devices, np.cumsum([0, *sizes]).tolist()))
        self._size = dict(zip(self.devices, sizes))
        self._after, self._before = cols.after, cols.before
        self._device, self._collective, self._bytes, self._peer = cols.device, cols.collective, cols.point_bytes, cols.peer
        has_peer = self._peer >= 0
        self._group, group_names = cols.group, [g.name for g in cols.groups]
        self._group_name = _ids(group_names)[self._group]
        self._fused_segment(pts, cols.fuse)
        self._issue_order(pts, has_peer, group_names)
        self._keys: list[str | None] = [None] * len(pts)
        self._band: Band | None | bool = False  # False: not searched yet

    def _fused_segment(self, pts: list, fuse: np.ndarray) -> None:
        """``fuse`` (the segment on the point's own device a decomposition splits) and ``first_candidate``: only
        for points whose collective a decomposition applies to (``can_decompose``)."""
        fused = np.where(_DECOMPOSABLE[self._collective], fuse, NONE)
        wrong = (fused == NOT_A_SEGMENT) | (fused >= 0) & (self._seg_device[fused] != self._device)
        if wrong.any():
            j = int(np.argmax(wrong))
            if fused[j] == NOT_A_SEGMENT:
                raise KeyError(pts[j].fuse_with)
            raise LagomError(f"point {pts[j].name} fuses with {pts[j].fuse_with}, a segment of another device")
        self._fused = fused  # global segment id, -1 where nothing is split
        js = np.flatnonzero(fused >= 0)
        self.first_candidate: dict[int, dict[str, tuple[int, str]]] = {}  # device -> key -> (first segment, group)
        if not len(js):
            return
        what, firsts = first_seen(self._device[js], self._group_name[js], self._collective[js], self._bytes[js])
        lowest = np.full(len(firsts), np.iinfo(_I64).max)
        np.minimum.at(lowest, what, self._seg_index[fused[js]])
        for j, i in zip(js[firsts].tolist(), lowest.tolist()):
            p = pts[j]
            self.first_candidate.setdefault(p.device, {})[f"{p.group.name}/{p.collective.value}/{p.bytes}"] = (i, p.group.name)

    def _issue_order(self, pts: list, has_peer: np.ndarray, group_names: list[str]) -> None:
        """Host issue order (by the position of the segment that releases a point, phase start first), the
        streams in it and each point's slot in its stream; and the segment -> points tables."""
        n = len(pts)
        order = np.argsort(self._seg_index[self._after], kind="stable")
        self._order = order
        # Streams: a device's communicator, or its P2P stream to one peer; numbered by their first point.
        kind, firsts = first_seen(has_peer[order], self._device[order],
                                   np.where(has_peer, self._peer, self._group_name)[order])
        found: dict[tuple[int, str], int] = {}
        stream_of_kind = []
        for j in order[firsts].tolist():
            p = pts[j]
            key = (p.device, p.group.name) if p.peer_device is None else (p.device, f"pp{p.device}->{p.peer_device}")
            stream_of_kind.append(found.setdefault(key, len(found)))
        in_order = np.asarray(stream_of_kind, dtype=_I64)[kind] if n else kind
        by = np.argsort(in_order, kind="stable")
        bounds = np.zeros(len(found) + 1, dtype=_I64)
        np.cumsum(np.bincount(in_order, minlength=len(found)), out=bounds[1:])
        slot = np.empty(n, dtype=_I64)
        slot[order[by]] = np.arange(n, dtype=_I64) - bounds[in_order[by]]
        stream_of = np.empty(n, dtype=_I64)
        stream_of[order] = in_order
        self._stream_of, self._slot = stream_of, slot
        by_stream = order[by]
        members = by_stream.tolist()
        self._stream_points = [by_stream[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
        self.streams: list[Stream] = []
        for (d, name), a, b in zip(found, bounds[:-1].tolist(), bounds[1:].tolist()):
            p = pts[members[a]]
            self.streams.append(Stream(d, name, (d,) if p.peer_device is None else (d, p.peer_device), members[a:b]))
        self._stream_name = _ids([s.name for s in self.streams])
        # segment -> points it waits for: device by device (a pipeline stage's recv apart from its own
        # collectives), each device's in issue order. Issue order across devices compares segment indices of
        # stages whose periods differ, so it would flip once inside a pipeline's repeating stretch.
        self.waits = SegmentTable(order[np.argsort(self._device[order], kind="stable")], self._before, self)
        self.releases = SegmentTable(order, self._after, self)  # segment -> points its end releases, issue order
        self.candidates = SegmentTable(np.arange(n, dtype=_I64), self._fused, self)  # may split it, phase order

    # Per point, as lists (the lowering's shapes, the bound and timings read them a point at a time; a cold step on
    # the compiled loop reads none): the segments releasing it and waiting for it as (device, index) or None, the
    # segment on its device its decomposition may split (NONE: none), host issue order and each point's place in
    # it, its stream and slot in that stream
    @cached_property
    def after(self) -> list[tuple[int, int] | None]:
        return _pairs(self._seg_device, self._seg_index, self._after)

    @cached_property
    def before(self) -> list[tuple[int, int] | None]:
        return _pairs(self._seg_device, self._seg_index, self._before)

    @cached_property
    def fuse(self) -> list[int]:
        return self._seg_index[self._fused].tolist()

    @cached_property
    def order(self) -> list[int]:
        return self._order.tolist()

    @cached_property
    def issue_rank(self) -> list[int]:
        rank = np.empty(len(self._order), dtype=_I64)
        rank[self._order] = np.arange(len(self._order), dtype=_I64)
        return rank.tolist()

    @cached_property
    def stream_of(self) -> list[int]:
        return self._stream_of.tolist()

    @cached_property
    def slot(self) -> list[int]:
        return self._slot.tolist()

    @cached_property
    def candidate_segments(self) -> dict[int, list[int]]:
        """device -> the segments some point may split, in order."""
        keys = np.sort(self.candidates.present)
        return {d: (self._seg_index[keys[self._seg_device[keys] == d]]).tolist() for d in self.devices}

    @cached_property
    def kind_arrays(self) -> tuple[dict[int, np.ndarray], list[tuple]]:
        """(per device each segment's kind, each kind's (flops, bytes, ctas)): segments with the same
        signature share a small int (numbered by first appearance, devices in order), so finding periods and
        counting segments compare ints, not tuples. Told apart on arrays of the three values, not by hashing a
        tuple per segment."""
        cols = self._columns
        kind, firsts = first_seen(cols.flops, cols.bytes, cols.ctas)
        bounds = np.cumsum([0, *map(len, self.segments.values())]).tolist()
        out = {d: kind[a:b] for d, a, b in zip(self.devices, bounds[:-1], bounds[1:])}
        devices = self._seg_device[firsts].tolist()
        return out, [_SIGNATURE(self.segments[d][i]) for d, i in zip(devices, self._seg_index[firsts].tolist())]

    @cached_property
    def columns(self) -> PointColumns:
        key, key_first = first_seen(self._group_name, self._collective, self._bytes)
        devices = np.asarray(self.devices, dtype=_I64)
        by = np.argsort(devices)
        place = by[np.searchsorted(devices[by], self._device)]  # each point's device, its place in self.devices
        first = np.asarray([self._offset[d] for d in self.devices], dtype=_I64)[place]
        count = np.asarray([self._size[d] for d in self.devices], dtype=_I64)[place]
        return PointColumns(
            self._device, self._peer, key, key_first, self._group, self._collective, self._bytes, first, count,
            np.where(self._after >= 0, self._seg_index[self._after] + 1, 0),
            np.where(self._before >= 0, self._seg_index[self._before], count), self._seg_index[self._fused], self._before)

    @cached_property
    def all_kinds(self) -> np.ndarray:
        """Every segment's kind (``kinds``) by global segment id: devices one after the other."""
        per_device = self.kind_arrays[0]
        return np.concatenate([per_device[d] for d in self.devices]) if self.devices else np.zeros(0, dtype=_I64)

    def key(self, j: int) -> str:
        """The tuning key of point j (cached: OverlapPoint.key builds a string each time)."""
        key = self._keys[j]
        if key is None:
            key = self._keys[j] = self.points[j].key
        return key

    @property
    def band(self) -> Band | None:
        if self._band is False:
            with collector_paused():
                self._band = _find_band(self)
        return self._band  # type: ignore[return-value]

    def period_points(self) -> np.ndarray:
        """The points one period of the band releases (its first on each device): what every further period adds."""
        band = self.band
        assert band is not None
        window = np.zeros(len(self._seg_device), dtype=bool)
        for d, period in band.period.items():
            lo = self._offset[d] + band.segments[d][0][0]
            window[lo:lo + period] = True
        return np.flatnonzero((self._after >= 0) & window[self._after])


def _pairs(seg_device: np.ndarray, seg_index: np.ndarray, ids: np.ndarray) -> list[tuple[int, int] | None]:
    """Global segment ids as (device, index on it), None for NONE: made from the arrays for the ids asked for, not
    kept for every segment (a tuple each for a phase's hundreds of thousands)."""
    pairs: list[tuple[int, int] | None] = list(zip(seg_device[ids].tolist(), seg_index[ids].tolist()))
    for j in np.flatnonzero(ids < 0).tolist():
        pairs[j] = None
    return pairs


def index_of(phase: Phase) -> PhaseIndex:
    """The phase's index, built on first use and kept with the phase: the simulator, the bound and the search's
    windows and sets of keys all read it."""
    found = phase.derived.get("index")
    if found is None:
        found = phase.derived["index"] = PhaseIndex(phase)
    return found


def drop_index(phase: Phase) -> None:
    """Let the phase's index go (hundreds of MB at cluster scale) while other graphs are searched; it is built
    again where it is needed again. Its twin's too (``lagom.step.points.points_for``)."""
    phase.derived.pop("index", None)
    twin = phase.derived.get("twin")
    if twin is not None:
        twin.derived.pop("index", None)


def _ids(values: list) -> np.ndarray:
    """Each value's number among the distinct values (numbered by first appearance)."""
    numbers: dict = {}
    return np.fromiter(map(numbers.setdefault, values, map(len, repeat(numbers))), dtype=_I64, count=len(values))


def places(counts: np.ndarray) -> np.ndarray:
    """Each item's place within its run, for runs of ``counts`` items laid one after the other: 0, 1, ... per run."""
    return np.arange(int(counts.sum()), dtype=_I64) - np.repeat(np.cumsum(counts) - counts, counts)


def first_seen(*columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the number of its distinct combination of the columns (numbered by first appearance), and
    each number's first row."""
    n = len(columns[0])
    if not n:
        return np.zeros(0, dtype=_I64), np.zeros(0, dtype=_I64)
    new = np.zeros(n, dtype=bool)
    new[0] = True
    key = _packed(columns)
    if key is not None:  # one stable sort of one integer rather than a lexsort over every column
        by = np.argsort(key, kind="stable")
        ordered = key[by]
        new[1:] = ordered[1:] != ordered[:-1]
    else:
        by = np.lexsort(columns[::-1])
        for col in columns:
            c = col[by]
            new[1:] |= c[1:] != c[:-1]
    firsts = by[new]  # both sorts are stable: the first row of each combination
    number = np.empty(len(firsts), dtype=_I64)
    number[np.argsort(firsts)] = np.arange(len(firsts), dtype=_I64)
    out = np.empty(n, dtype=_I64)
    out[by] = number[np.cumsum(new) - 1]
    return out, np.sort(firsts)


def _packed(columns: tuple[np.ndarray, ...]) -> np.ndarray | None:
    """Integer columns as one integer per row that orders rows as the columns do (each column's offset from its
    least value, the first column most significant); None where a column is not integer or they do not fit."""
    key = np.zeros(len(columns[0]), dtype=_I64)
    span = 1
    for col in columns:
        if col.dtype.kind not in "biu":
            return None
        col = col.astype(_I64, copy=False)
        low, high = int(col.min()), int(col.max())
        span *= high - low + 1
        if span >= 1 << 62:
            return None
        key *= high - low + 1
        key += col - low
    return key


# ---------------------------------------------------------------------------------------------
# The periodic band


def _mismatch_after(sig: np.ndarray, period: int, at: int) -> int:
    """The first i >= at with sig[i] != sig[i + period] (len(sig) - period if none), in growing chunks so that
    a near mismatch costs little."""
    end, chunk = len(sig) - period, 64
    while at < end:
        stop = min(end, at + chunk)
        differ = np.flatnonzero(sig[at:stop] != sig[at + period:stop + period])
        if len(differ):
            return at + int(differ[0])
        at, chunk = stop, chunk * 4
    return end


def _mismatch_before(sig: np.ndarray, period: int, at: int) -> int:
    """One past the last i < at with sig[i] != sig[i + period] (0 if none)."""
    chunk = 64
    while at > 0:
        start = max(0, at - chunk)
        differ = np.flatnonzero(sig[start:at] != sig[start + period:at + period])
        if len(differ):
            return start + int(differ[-1]) + 1
        at, chunk = start, chunk * 4
    return 0


def _periodic_run(sig: np.ndarray) -> tuple[int, int, int] | None:
    """(period, lo, hi) of the longest run [lo, hi) with sig[i] == sig[i + period] for lo <= i < hi - period,
    searched around a few probe positions; None when no run repeats MIN_PERIODS times.

    Candidate periods are the distances from the probe to the later occurrences of the rarest signature
    near it, so a pipeline stage (layers repeat inside a micro-batch, micro-batches repeat) tries few."""
    n = len(sig)
    if n < 2 * MIN_PERIODS:
        return None
    occurrences = np.bincount(sig)
    best: tuple[int, int, int] | None = None
    for probe in PROBES:
        near = int(n / probe)
        if near >= n:
            continue
        m = near + int(np.argmin(occurrences[sig[near:near + 64]]))
        periods = np.flatnonzero(sig[m + 1:m + 1 + n // MIN_PERIODS] == sig[m]) + 1
        if not len(periods):
            continue
        # Candidates whose first 16 signatures already differ are dropped at once.
        lengths = np.minimum(periods, n - m - periods)
        head = np.arange(16)
        differ = (sig[np.minimum(m + head, n - 1)][None, :] != sig[np.minimum(m + periods[:, None] + head, n - 1)]) \
            & (head < lengths[:, None])
        tried = 0
        for period, length in zip(periods[~differ.any(axis=1)].tolist(), lengths[~differ.any(axis=1)].tolist()):
            if tried >= MAX_CANDIDATES:
                break
            if best is not None and best[0] == period:
                continue
            hi = _mismatch_after(sig, period, m)
            if hi < m + length:
                continue  # its first period does not repeat
            tried += 1
            hi += period
            lo = _mismatch_before(sig, period, m)
            if hi - lo >= MIN_PERIODS * period and (best is None or hi - lo > best[2] - best[1]):
                best = (period, lo, hi)
            if best is not None and best[2] - best[1] >= n // 2:
                break  # covers most of the phase: longer periods would only repeat it
    return best


def _find_band(ix: PhaseIndex) -> Band | None:
    released = ix._after >= 0
    if (ix._seg_device[ix._after[released]] != ix._device[released]).any():
        return None  # a point released by another device's segment: positions would not shift together
    kinds = ix.kind_arrays[0]
    runs = {d: run for d, of in kinds.items() if (run := _periodic_run(of))}
    if not runs:
        return None
    # Per global segment: whether it is in its device's domain (i and i + period both in the run), the period.
    n_segments = len(ix._seg_device) - 1
    domain = np.zeros(n_segments, dtype=bool)
    period = np.zeros(n_segments, dtype=_I64)
    for d, (p, lo, hi) in runs.items():
        first = ix._offset[d]
        domain[first + lo:first + hi - p] = True
        period[first:first + len(kinds[d])] = p
    image = _point_images(ix, runs)
    bad = _irregular(ix, runs, image, domain, period)
    spans = {}
    for d, (p, lo, hi) in runs.items():
        first = ix._offset[d]
        if found := _good_spans(lo, bad[first + lo:first + hi - p], 3 * p):
            spans[d] = found
    if not spans:
        return None
    good_segment = np.zeros(n_segments + 1, dtype=bool)  # (the extra one: a point released at the phase start)
    for d, found in spans.items():
        for lo, hi in found:
            good_segment[ix._offset[d] + lo:ix._offset[d] + hi] = True
    slots: list[tuple[int, list[tuple[int, int]]]] = [(0, [])] * len(ix.streams)
    for k, (stream, members) in enumerate(zip(ix.streams, ix._stream_points)):
        if stream.device not in spans:
            continue
        good = (image[members] >= 0) & good_segment[ix._after[members]]
        mine = members[good]
        if not len(mine):
            continue
        shifts = ix._slot[image[mine]] - ix._slot[mine]
        if (shifts != shifts[0]).any():
            return None
        shift = int(shifts[0])
        slots[k] = (shift, _good_spans(0, ~good, 3 * shift))
    return Band({d: runs[d][0] for d in spans}, spans, slots)


def _point_images(ix: PhaseIndex, runs: dict[int, tuple[int, int, int]]) -> np.ndarray:
    """Per point, its image one period on (-1: none): the point released as many places on in its device's
    issue order as a period releases, by the segment one period on, with the same description (stream,
    collective, group, size, and the segments it waits for and may fuse with relative to the one that
    releases it; another device's segment only by device: ``_irregular`` checks those one by one)."""
    order = ix._order
    image = np.full(len(ix.points), NONE, dtype=_I64)
    at_all = ix._seg_index[ix._after]
    before_device = np.where(ix._before >= 0, ix._seg_device[ix._before], NONE)
    same = before_device == ix._device
    description = (ix._stream_name[ix._stream_of], ix._collective, ix._group, ix._bytes,
                   np.where(ix._before < 0, 0, np.where(same, 1, 2)),
                   np.where(same, ix._seg_index[ix._before] - at_all, before_device),
                   np.where(ix._fused >= 0, ix._seg_index[ix._fused] - at_all, END))
    released_by = ix._seg_device[ix._after[order]]
    for d, (p, lo, hi) in runs.items():
        js = order[(ix._after[order] >= 0) & (released_by == d)]
        at = at_all[js]
        hi -= p
        first, last, per = np.searchsorted(at, [lo, hi, lo + p]).tolist()
        per -= first
        ks = np.arange(first, min(last, len(js) - per), dtype=_I64)
        mine, theirs = js[ks], js[ks + per]
        ok = at[ks + per] == at[ks] + p
        for field in description:
            ok &= field[mine] == field[theirs]
        image[mine[ok]] = theirs[ok]
    return image


def _irregular(ix: PhaseIndex, runs: dict[int, tuple[int, int, int]], image: np.ndarray, domain: np.ndarray,
               period: np.ndarray) -> np.ndarray:
    """Per global segment, whether it is a domain segment whose image one period on differs: in itself, in
    what it releases, in what it waits for or may fuse with (and in which order). Drops the images of the
    collectives such a segment releases, and so on, since what waits for those turns bad too."""
    bad = np.zeros(len(domain), dtype=bool)
    waits, cands = ix.waits.sizes, ix.candidates.sizes
    for d, (p, lo, hi) in runs.items():
        first = ix._offset[d]
        kinds, i = ix.kind_arrays[0][d], np.arange(first + lo, first + hi - p)
        bad[i] |= (kinds[lo:hi - p] != kinds[lo + p:hi]) | (waits[i] != waits[i + p]) | (cands[i] != cands[i + p])
    released = ix._after >= 0
    bad[ix._after[released & domain[ix._after] & (image < 0)]] = True  # what it releases has no matching image
    # A point waited for on another device: its image must be waited for one period on there.
    crossing = (ix._before >= 0) & (ix._seg_device[ix._before] != ix._device) & (image >= 0)
    j = np.flatnonzero(crossing)
    b = ix._before[j]
    bad[ix._after[j[~domain[b] | (ix._before[image[j]] != b + period[b])]]] = True
    _mark_unmapped(ix, image < 0, domain, bad)
    # Mapped points waited for / fused with: the image segment must wait for / fuse with exactly their
    # images, in the same order. Same-device relations are in the descriptions and counts settle the
    # rest, except order across devices (waits) and among several candidates (fuse): checked one by one.
    for table in (ix.waits, ix.candidates):
        keys = table.present[domain[table.present]]
        sizes = table.sizes
        keys = keys[(sizes[keys] > 1) | (ix._device[table.flat[table.start[keys]]] != ix._seg_device[keys])]
        images = keys + period[keys]
        differ = sizes[images] != sizes[keys]
        bad[keys[differ]] = True
        keys, images = keys[~differ], images[~differ]
        each = np.repeat(np.arange(len(keys)), sizes[keys])
        within = places(sizes[keys])
        mismatch = image[table.flat[table.start[keys][each] + within]] != table.flat[table.start[images][each] + within]
        bad[keys[each[mismatch]]] = True
    # A bad segment's collectives lose their images, so what waits for them turns bad too; so do the collectives
    # that may split a bad segment (whether one does depends on the segment's candidates, which differ from its
    # image's), and what they wait for or may split in turn.
    fusing = ix._fused >= 0
    while True:
        lost = (image >= 0) & (released & bad[ix._after] | fusing & bad[ix._fused])
        if not lost.any():
            return bad
        image[lost] = NONE
        _mark_unmapped(ix, lost, domain, bad)


def _mark_unmapped(ix: PhaseIndex, points: np.ndarray, domain: np.ndarray, bad: np.ndarray) -> None:
    """A point without an image cannot be waited for or fused with inside a domain (``points``: a mask)."""
    for segment in (ix._before[points], ix._fused[points]):
        segment = segment[segment >= 0]
        bad[segment[domain[segment]]] = True


def _good_spans(lo: int, bad: np.ndarray, shortest: int) -> list[tuple[int, int]]:
    """The maximal spans of [lo, lo + len(bad)) without a bad position, at least ``shortest`` long."""
    ends = np.append(np.flatnonzero(bad), len(bad))
    starts = np.append(0, ends[:-1] + 1)
    keep = ends - starts >= max(1, shortest)
    return list(zip((starts[keep] + lo).tolist(), (ends[keep] + lo).tolist()))
