"""Where every task of a phase sits, and which stretch of the phase repeats.

The simulator builds tasks lazily, by position, instead of lowering a whole phase up front: a compute
task by its segment's index (times ``SLOT``, plus the piece when a Flash-Overlap decomposition splits
the segment), a collective by its slot in its stream's host issue order. This index answers "what is
at position x" in O(1) and is built once per step graph, whatever the configs.

It also finds the phase's periodic band: the stretch where shifting every device's compute by its
period (one micro-batch per stage in a 1F1B pipeline, one layer on a single device) maps segments,
collectives and every dependency between them onto identical ones. Inside the band the simulator may
skip whole periods once it sees its state repeat (see ``lagom.model.simulator``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from itertools import repeat
from operator import attrgetter

from lagom.errors import LagomError
from lagom.plan.comm_config import can_decompose
from lagom.step.graph import Phase
from lagom.step.points import collector_paused

SLOT = 1 << 32  # compute and P2P positions: segment index * SLOT + piece (pieces of one segment < SLOT)
NONE = -1
MIN_PERIODS = 4  # a band must repeat at least this often: two periods to see the repetition, more to skip
PROBES = (2, 4, 4 / 3)  # where the period search starts: n / probe
MAX_CANDIDATES = 256  # candidate periods tried per probe
END = 1 << 62  # a position past every task
_SIGNATURE = attrgetter("flops", "bytes", "ctas")
_NAME, _AFTER, _BEFORE, _FUSE = attrgetter("name"), attrgetter("after"), attrgetter("before"), attrgetter("fuse_with")


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


class PhaseIndex:
    """Positions, dependencies and the periodic band of one phase (independent of configs and model)."""

    def __init__(self, phase: Phase) -> None:
        with collector_paused():
            self._build(phase)

    def _build(self, phase: Phase) -> None:
        self.phase = phase
        self.devices = list(phase.segments)
        self.rank = {d: r for r, d in enumerate(self.devices)}
        self.segments = phase.segments
        where: dict[str | None, tuple[int, int] | None] = {None: None}
        for d, segs in phase.segments.items():
            where.update(zip(map(_NAME, segs), zip(repeat(d), range(len(segs)))))
        pts = self.points = phase.points
        n = len(pts)
        self.after: list[tuple[int, int] | None] = list(map(where.__getitem__, map(_AFTER, pts)))
        self.before: list[tuple[int, int] | None] = list(map(where.__getitem__, map(_BEFORE, pts)))
        self.fuse: list[int] = [NONE] * n  # segment index on the point's device a decomposition splits
        self.candidates: dict[tuple[int, int], list[int]] = {}  # segment -> points that may split it, phase order
        first: dict[tuple, int] = {}  # (device, group, collective, bytes) -> first segment it may split
        for j, name in enumerate(map(_FUSE, pts)):
            if name is None or not can_decompose(pts[j]):
                continue
            p = pts[j]
            seg = where[name]
            if seg[0] != p.device:  # type: ignore[index]
                raise LagomError(f"point {p.name} fuses with {name}, a segment of another device")
            self.fuse[j] = seg[1]  # type: ignore[index]
            self.candidates.setdefault(seg, []).append(j)  # type: ignore[arg-type]
            what = (p.device, p.group.name, p.collective, p.bytes)
            if seg[1] < first.get(what, END):  # type: ignore[index]
                first[what] = seg[1]  # type: ignore[index]
        self.first_candidate: dict[int, dict[str, tuple[int, str]]] = {}  # device -> key -> (first segment, group)
        for (d, group, coll, nbytes), i in first.items():
            self.first_candidate.setdefault(d, {})[f"{group}/{coll.value}/{nbytes}"] = (i, group)
        self.candidate_segments = {d: sorted(i for dd, i in self.candidates if dd == d) for d in self.devices}
        # Host issue order: by the position of the segment that releases a point (phase start first).
        released_at = [a[1] if a else -1 for a in self.after]
        order = self.order = sorted(range(n), key=released_at.__getitem__)
        stream_keys = [(p.device, p.group.name) if p.peer_device is None else (p.device, f"pp{p.device}->{p.peer_device}")
                       for p in pts]
        found: dict[tuple[int, str], int] = {}  # stream key -> its index, by the issue rank of its first point
        ids = [found.setdefault(k, len(found)) for k in map(stream_keys.__getitem__, order)]
        members: list[list[int]] = [[] for _ in found]
        self.issue_rank = [0] * n
        self.stream_of = [0] * n
        self.slot = [0] * n
        issue_rank, stream_of, slot = self.issue_rank, self.stream_of, self.slot
        for r, (j, k) in enumerate(zip(order, ids)):
            issue_rank[j], stream_of[j] = r, k
            held = members[k]
            slot[j] = len(held)
            held.append(j)
        self.streams: list[Stream] = []
        for (d, name), held in zip(found, members):
            p = pts[held[0]]
            self.streams.append(Stream(d, name, (d,) if p.peer_device is None else (d, p.peer_device), held))
        # segment -> points it waits for: device by device (a pipeline stage's recv apart from its own
        # collectives), each device's in issue order. Issue order across devices compares segment indices of
        # stages whose periods differ, so it would flip once inside a pipeline's repeating stretch.
        self.waits = _grouped(sorted(order, key=lambda j: pts[j].device), self.before)
        self.releases = _grouped(order, self.after)  # segment -> points its end releases, issue order
        self._keys: list[str | None] = [None] * n
        self._band: Band | None | bool = False  # False: not searched yet

    @cached_property
    def kinds(self) -> tuple[dict[int, list[int]], list[tuple]]:
        """(per device each segment's kind, each kind's (flops, bytes, ctas)): segments with the same
        signature share a small int, so finding periods and counting segments compare ints, not tuples."""
        ids: dict[tuple, int] = {}
        out = {d: [ids.setdefault(sig, len(ids)) for sig in map(_SIGNATURE, segs)] for d, segs in self.segments.items()}
        return out, list(ids)

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


def _grouped(order: list[int], segment: list[tuple[int, int] | None]) -> dict[tuple[int, int], list[int]]:
    """Per segment, the points (in ``order``) whose ``segment`` entry it is."""
    out: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
    for j, seg in zip(order, map(segment.__getitem__, order)):
        if seg is not None:
            out[seg].append(j)
    return dict(out)


# ---------------------------------------------------------------------------------------------
# The periodic band


def _same(sig: list, a: int, b: int, length: int) -> bool:
    """sig[a:a+length] == sig[b:b+length], compared in growing chunks so that a mismatch costs little."""
    done, chunk = 0, 16
    while done < length:
        step = min(chunk, length - done)
        if sig[a + done:a + done + step] != sig[b + done:b + done + step]:
            return False
        done, chunk = done + step, chunk * 4
    return True


def _periodic_run(sig: list) -> tuple[int, int, int] | None:
    """(period, lo, hi) of the longest run [lo, hi) with sig[i] == sig[i + period] for lo <= i < hi - period,
    searched around a few probe positions; None when no run repeats MIN_PERIODS times.

    Candidate periods are the distances from the probe to the later occurrences of the rarest signature
    near it, so a pipeline stage (layers repeat inside a micro-batch, micro-batches repeat) tries few."""
    n = len(sig)
    if n < 2 * MIN_PERIODS:
        return None
    where: dict = {}
    for i, s in enumerate(sig):
        if s in where:
            where[s].append(i)
        else:
            where[s] = [i]
    best: tuple[int, int, int] | None = None
    for probe in PROBES:
        near = range(int(n / probe), min(n, int(n / probe) + 64))
        if not near:
            continue
        m = min(near, key=lambda i: len(where[sig[i]]))
        positions = where[sig[m]]
        tried = 0
        for j in positions[bisect_left(positions, m + 1):]:
            period = j - m
            if period > n // MIN_PERIODS or tried >= MAX_CANDIDATES:
                break
            if best is not None and best[0] == period or not _same(sig, m, j, min(period, n - j)):
                continue
            tried += 1
            hi = m
            while hi + 2 * period <= n and _same(sig, hi, hi + period, period):
                hi += period
            while hi + period < n and sig[hi] == sig[hi + period]:
                hi += 1
            lo = m
            while lo - period >= 0 and _same(sig, lo - period, lo, period):
                lo -= period
            while lo > 0 and sig[lo - 1] == sig[lo - 1 + period]:
                lo -= 1
            hi += period
            if hi - lo >= MIN_PERIODS * period and (best is None or hi - lo > best[2] - best[1]):
                best = (period, lo, hi)
            if best is not None and best[2] - best[1] >= n // 2:
                break  # covers most of the phase: longer periods would only repeat it
    return best


def _descriptions(index: PhaseIndex, js: list[int]) -> list[tuple]:
    """What must match between each point and its image one period on: stream, collective, size, and the
    segments it waits for and may fuse with, relative to the one that releases it (another device's
    segment only by device: ``_mark_irregular`` checks those one by one)."""
    pts, after, before, fuse = index.points, index.after, index.before, index.fuse
    rel = []
    for j in js:
        b, a = before[j], after[j][1]  # type: ignore[index]
        rel.append(None if b is None else (b[1] - a if b[0] == pts[j].device else ("device", b[0])))
    return list(zip([index.streams[index.stream_of[j]].name for j in js], [pts[j].collective for j in js],
                    [pts[j].group for j in js], [pts[j].bytes for j in js], rel,
                    [fuse[j] - after[j][1] if fuse[j] != NONE else None for j in js]))  # type: ignore[index]


def _find_band(index: PhaseIndex) -> Band | None:
    if [a[0] for a in index.after if a is not None] != [p.device for p, a in zip(index.points, index.after) if a is not None]:
        return None  # a point released by another device's segment: positions would not shift together
    runs = {d: run for d, kinds in index.kinds[0].items() if (run := _periodic_run(kinds))}
    if not runs:
        return None
    period = {d: run[0] for d, run in runs.items()}
    domain = {d: (lo, hi - p) for d, (p, lo, hi) in runs.items()}  # i and i + period both in the run
    # Points released by each band device, in issue order (their order within a stream).
    by_device: dict[int, list[int]] = {d: [] for d in runs}
    for j in index.order:
        a = index.after[j]
        if a is not None and a[0] in by_device:
            by_device[a[0]].append(j)
    released_at = {d: [index.after[j][1] for j in js] for d, js in by_device.items()}  # type: ignore[index]
    described = {d: _descriptions(index, js) for d, js in by_device.items()}
    counts = _relation_counts(index, runs)
    bad: dict[int, set[int]] = {d: set() for d in runs}
    image = _point_images(by_device, released_at, described, period, domain)
    _mark_irregular(index, by_device, released_at, counts, image, period, domain, bad)
    while True:  # a bad segment's collectives lose their images, so what waits for them turns bad too
        lost = [j for d, js in by_device.items() for j, a in zip(js, released_at[d]) if a in bad[d] and j in image]
        if not lost:
            break
        for j in lost:
            del image[j]
        _mark_unmapped(index, lost, image, domain, bad)
    spans = {d: _good_spans(*domain[d], bad[d], 3 * period[d]) for d in runs}
    spans = {d: s for d, s in spans.items() if s}
    if not spans:
        return None
    slots: list[tuple[int, list[tuple[int, int]]]] = [(0, [])] * len(index.streams)
    after = index.after
    for k, stream in enumerate(index.streams):
        d = stream.device
        if d not in spans:
            continue
        good_segment = [False] * len(index.segments[d])
        for lo, hi in spans[d]:
            good_segment[lo:hi] = [True] * (hi - lo)
        good = [j in image and good_segment[after[j][1]] for j in stream.points]  # type: ignore[index]
        mine = [j for j, ok in zip(stream.points, good) if ok]
        if not mine:
            continue
        shift = index.slot[image[mine[0]]] - index.slot[mine[0]]
        if any(index.slot[image[j]] - index.slot[j] != shift for j in mine):
            return None
        bad_slots = {s for s, ok in enumerate(good) if not ok}
        slots[k] = (shift, _good_spans(0, len(stream.points), bad_slots, 3 * shift))
    return Band({d: period[d] for d in spans}, spans, slots)


def _relation_counts(index: PhaseIndex, devices) -> dict[int, list[tuple[int, int]]]:
    """Per segment of each device: how many points it waits for and how many may fuse with it."""
    waits = {d: [0] * len(index.segments[d]) for d in devices}
    cands = {d: [0] * len(index.segments[d]) for d in devices}
    for table, counts in ((index.waits, waits), (index.candidates, cands)):
        for (d, i), js in table.items():
            if d in counts:
                counts[d][i] = len(js)
    return {d: list(zip(waits[d], cands[d])) for d in devices}


def _point_images(by_device, released_at, described, period, domain) -> dict[int, int]:
    """The image one period on of every point released inside a domain, where the description matches."""
    image: dict[int, int] = {}
    for d, (lo, hi) in domain.items():
        js, at, desc, p = by_device[d], released_at[d], described[d], period[d]
        first, last = bisect_left(at, lo), bisect_left(at, hi)
        per = bisect_left(at, lo + p) - first  # points released per period
        last_mapped = min(last, len(js) - per)
        shifted = [x + p for x in at[first:last_mapped]]
        if shifted == at[first + per:last_mapped + per] and desc[first:last_mapped] == desc[first + per:last_mapped + per]:
            image.update(zip(js[first:last_mapped], js[first + per:last_mapped + per]))
            continue
        for k in range(first, last_mapped):
            if at[k + per] == at[k] + p and desc[k + per] == desc[k]:
                image[js[k]] = js[k + per]
    return image


def _mark_irregular(index: PhaseIndex, by_device, released_at, counts, image, period, domain, bad) -> None:
    """Domain segments whose image one period on differs: in itself, in what it releases, in what it
    waits for or may fuse with (and in which order)."""
    for d, (lo, hi) in domain.items():
        p = period[d]
        sig = list(zip(index.kinds[0][d][lo:hi + p], counts[d][lo:hi + p]))
        if sig[:hi - lo] != sig[p:]:
            bad[d].update(lo + i for i in range(hi - lo) if sig[i] != sig[i + p])
        for j, a in zip(by_device[d], released_at[d]):
            if lo <= a < hi and j not in image:
                bad[d].add(a)  # what it releases has no matching image
    # A point waited for on another device: its image must be waited for one period on there.
    for j in cross_device(index):
        if j in image:
            (b, i), target = index.before[j], index.before[image[j]]  # type: ignore[misc]
            if b not in domain or not domain[b][0] <= i < domain[b][1] or target != (b, i + period[b]):
                bad[index.points[j].device].add(index.after[j][1])  # type: ignore[index]
    _mark_unmapped(index, set(range(len(index.points))).difference(image), image, domain, bad)
    # Mapped points waited for / fused with: the image segment must wait for / fuse with exactly their
    # images, in the same order. Same-device relations are in the descriptions and counts settle the
    # rest, except order across devices (waits) and among several candidates (fuse): checked one by one.
    for table in (index.waits, index.candidates):
        for (d, i), js in table.items():
            if d not in domain or not domain[d][0] <= i < domain[d][1]:
                continue
            if (len(js) > 1 or index.points[js[0]].device != d) and [image.get(j) for j in js] != table.get((d, i + period[d])):
                bad[d].add(i)


def cross_device(index: PhaseIndex) -> list[int]:
    """Points waited for on another device than their own (pipeline sends)."""
    return [j for j, b in enumerate(index.before) if b is not None and b[0] != index.points[j].device]


def _mark_unmapped(index: PhaseIndex, points, image, domain, bad) -> None:
    """A point without an image cannot be waited for or fused with inside a domain."""
    for j in points:
        for seg in (index.before[j], (index.points[j].device, index.fuse[j]) if index.fuse[j] != NONE else None):
            if seg is not None and seg[0] in domain and domain[seg[0]][0] <= seg[1] < domain[seg[0]][1]:
                bad[seg[0]].add(seg[1])


def _good_spans(lo: int, hi: int, bad: set[int], shortest: int) -> list[tuple[int, int]]:
    """The maximal spans of [lo, hi) without a bad position, at least ``shortest`` long."""
    spans, start = [], lo
    for i in sorted(b for b in bad if lo <= b < hi) + [hi]:
        if i - start >= max(1, shortest):
            spans.append((start, i))
        start = i + 1
    return spans
