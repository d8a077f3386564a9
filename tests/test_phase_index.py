"""The phase index (built on arrays) against a straightforward construction of the same tables and band.

``reference_index`` builds every table the lowering, the compiled lowering, the simulator and the bound read
with plain loops over the points, and ``reference_band`` searches the periodic band as the index's docstring
describes it, one segment and one point at a time. Both must agree exactly with ``PhaseIndex`` on shipped
workloads and on randomised phases: pipelines whose stages wait for each other, decompositions, streams to
peers, and irregularities sprinkled into a repeating pattern so that bands are cut into spans.
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lagom.errors import LagomError
from lagom.hardware import load_hardware
from lagom.model.phase_index import MAX_CANDIDATES, MIN_PERIODS, NONE, PROBES, Band, PhaseIndex, Stream, index_of
from lagom.plan.comm_config import can_decompose
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from lagom.step.workload import load_workload
from lagom.tune import problem_for

# ---------------------------------------------------------------------------------------------
# The straightforward construction


def reference_index(phase: Phase) -> dict:
    where: dict = {None: None}
    for d, segs in phase.segments.items():
        for i, seg in enumerate(segs):
            where[seg.name] = (d, i)
    pts = phase.points
    after, before = [where[p.after] for p in pts], [where[p.before] for p in pts]
    fuse: list[int] = []
    candidates: dict[tuple[int, int], list[int]] = {}
    first: dict[tuple, int] = {}
    for j, p in enumerate(pts):
        if p.fuse_with is None or not can_decompose(p):
            fuse.append(NONE)
            continue
        d, i = where[p.fuse_with]
        fuse.append(i)
        candidates.setdefault((d, i), []).append(j)
        what = (p.device, p.group.name, p.collective, p.bytes)
        first[what] = min(first.get(what, i), i)
    first_candidate: dict = {}
    for (d, group, coll, nbytes), i in first.items():
        first_candidate.setdefault(d, {})[f"{group}/{coll.value}/{nbytes}"] = (i, group)
    order = sorted(range(len(pts)), key=lambda j: after[j][1] if after[j] else -1)
    streams: dict = {}
    for j in order:
        p = pts[j]
        name = p.group.name if p.peer_device is None else f"pp{p.device}->{p.peer_device}"
        occupied = (p.device,) if p.peer_device is None else (p.device, p.peer_device)
        streams.setdefault((p.device, name), Stream(p.device, name, occupied, [])).points.append(j)
    stream_of, slot = [0] * len(pts), [0] * len(pts)
    for k, stream in enumerate(streams.values()):
        for s, j in enumerate(stream.points):
            stream_of[j], slot[j] = k, s
    waits: dict = {}
    for j in sorted(order, key=lambda j: pts[j].device):
        if before[j] is not None:
            waits.setdefault(before[j], []).append(j)
    releases: dict = {}
    for j in order:
        if after[j] is not None:
            releases.setdefault(after[j], []).append(j)
    signatures: dict = {}
    kinds = {d: [signatures.setdefault((s.flops, s.bytes, s.ctas), len(signatures)) for s in segs]
             for d, segs in phase.segments.items()}
    return {"after": after, "before": before, "fuse": fuse, "candidates": candidates, "first_candidate": first_candidate,
            "candidate_segments": {d: sorted(i for dd, i in candidates if dd == d) for d in phase.segments},
            "order": order, "issue_rank": [order.index(j) for j in range(len(pts))], "streams": list(streams.values()),
            "stream_of": stream_of, "slot": slot, "waits": waits, "releases": releases,
            "kinds": (kinds, list(signatures))}


def reference_run(sig: list[int]) -> tuple[int, int, int] | None:
    """The longest run repeating at some period, tried from the rarest signature near each probe."""
    n, best = len(sig), None
    if n < 2 * MIN_PERIODS:
        return None
    for probe in PROBES:
        near = range(int(n / probe), min(n, int(n / probe) + 64))
        m = min(near, key=lambda i: sig.count(sig[i]))
        tried = 0
        for j in [j for j in range(m + 1, n) if sig[j] == sig[m]]:
            period = j - m
            if period > n // MIN_PERIODS or tried >= MAX_CANDIDATES:
                break
            if best is not None and best[0] == period or sig[m:m + min(period, n - j)] != sig[j:j + min(period, n - j)]:
                continue
            tried += 1
            hi, lo = m, m
            while hi + period < n and sig[hi] == sig[hi + period]:
                hi += 1
            while lo > 0 and sig[lo - 1] == sig[lo - 1 + period]:
                lo -= 1
            if hi + period - lo >= MIN_PERIODS * period and (best is None or hi + period - lo > best[2] - best[1]):
                best = (period, lo, hi + period)
            if best is not None and best[2] - best[1] >= n // 2:
                break
    return best


def reference_band(phase: Phase, ix: dict) -> Band | None:
    pts, after, before, fuse = phase.points, ix["after"], ix["before"], ix["fuse"]
    if any(a is not None and a[0] != p.device for p, a in zip(pts, after)):
        return None
    runs = {d: run for d, kinds in ix["kinds"][0].items() if (run := reference_run(kinds))}
    period = {d: p for d, (p, _, _) in runs.items()}
    domain = {d: range(lo, hi - p) for d, (p, lo, hi) in runs.items()}

    def inside(seg) -> bool:
        return seg is not None and seg[0] in domain and seg[1] in domain[seg[0]]

    def describe(j: int) -> tuple:
        a, b = after[j][1], before[j]
        rel = None if b is None else (b[1] - a if b[0] == pts[j].device else ("device", b[0]))
        return (ix["streams"][ix["stream_of"][j]].name, pts[j].collective, pts[j].group, pts[j].bytes, rel,
                fuse[j] - a if fuse[j] != NONE else None)

    image: dict[int, int] = {}
    bad: set = set()
    for d, (p, lo, _) in runs.items():
        mine = [j for j in ix["order"] if after[j] is not None and after[j][0] == d]
        per = sum(1 for j in mine if lo <= after[j][1] < lo + p)
        for k, j in enumerate(mine):
            if after[j][1] in domain[d] and k + per < len(mine):
                other = mine[k + per]
                if after[other][1] == after[j][1] + p and describe(other) == describe(j):
                    image[j] = other
    for d, p in period.items():
        for i in domain[d]:
            counts = [(ix["kinds"][0][d][x], len(ix["waits"].get((d, x), ())), len(ix["candidates"].get((d, x), ())))
                      for x in (i, i + p)]
            if counts[0] != counts[1]:
                bad.add((d, i))
    for j, point in enumerate(pts):
        if inside(after[j]) and j not in image:
            bad.add(after[j])
        if j in image and before[j] is not None and before[j][0] != point.device:
            b, i = before[j]
            if not inside(before[j]) or before[image[j]] != (b, i + period[b]):
                bad.add(after[j])
    unmapped = [j for j in range(len(pts)) if j not in image]
    for table in (ix["waits"], ix["candidates"]):
        for (d, i), js in table.items():
            if inside((d, i)) and (len(js) > 1 or pts[js[0]].device != d) \
                    and [image.get(j) for j in js] != table.get((d, i + period[d])):
                bad.add((d, i))
    while unmapped:
        for j in unmapped:
            for seg in (before[j], (pts[j].device, fuse[j]) if fuse[j] != NONE else None):
                if inside(seg):
                    bad.add(seg)
        unmapped = [j for j in image if after[j] in bad or (fuse[j] != NONE and (pts[j].device, fuse[j]) in bad)]
        for j in unmapped:
            del image[j]

    def spans(size: int, good, shortest: int) -> list[tuple[int, int]]:
        out, start = [], None
        for i in range(size + 1):
            if i < size and good(i):
                start = i if start is None else start
            elif start is not None:
                if i - start >= max(1, shortest):
                    out.append((start, i))
                start = None
        return out

    segments = {d: found for d, (p, lo, hi) in runs.items()
                if (found := spans(hi - p, lambda i, d=d, lo=lo: i >= lo and (d, i) not in bad, 3 * p))}
    if not segments:
        return None
    slots: list[tuple[int, list[tuple[int, int]]]] = []
    for stream in ix["streams"]:
        good = [j in image and any(a <= after[j][1] < b for a, b in segments.get(stream.device, ())) for j in stream.points]
        mine = [j for j, ok in zip(stream.points, good) if ok]
        if stream.device not in segments or not mine:
            slots.append((0, []))
            continue
        shifts = {ix["slot"][image[j]] - ix["slot"][j] for j in mine}
        if len(shifts) > 1:
            return None
        (shift,) = shifts
        slots.append((shift, spans(len(good), good.__getitem__, 3 * shift)))
    return Band({d: period[d] for d in segments}, segments, slots)


def assert_same_index(phase: Phase) -> PhaseIndex:
    ix, ref = PhaseIndex(phase), reference_index(phase)
    for name, expected in ref.items():
        if name == "kinds":
            arrays, signatures = ix.kind_arrays
            got = ({d: kinds.tolist() for d, kinds in arrays.items()}, signatures)
        else:
            got = getattr(ix, name)
        assert got == expected, name
        if isinstance(expected, dict):
            assert list(got) == list(expected), f"{name}: key order"
    assert [list(v) for v in ix.first_candidate.values()] == [list(v) for v in ref["first_candidate"].values()]
    assert ix.band == reference_band(phase, ref)
    for d, segs in phase.segments.items():  # what the lowering's band tests read instead of the lists
        assert ix.releases.counts(d).tolist() == [len(ref["releases"].get((d, i), ())) for i in range(len(segs))]
    return ix


# ---------------------------------------------------------------------------------------------
# Phases


def shipped(name: str, micro_batches: int | None = None) -> list[Phase]:
    wl = load_workload(name)
    if micro_batches is not None:
        wl = wl.with_microbatches(micro_batches)
    return problem_for(wl, load_hardware(wl.hardware)).graph.phases


@pytest.mark.parametrize("name, micro_batches", [("gpt3-13b-pp4", 8), ("bert-pp4", None), ("gpt2-tp8", None),
                                                 ("t5-dp-tp", None), ("deepseek-moe-16b-ep8", None)])
def test_shipped_phases_index_as_the_straightforward_construction(name, micro_batches):
    for phase in shipped(name, micro_batches):
        assert_same_index(phase)


def test_a_pipeline_has_a_band_on_every_stage():
    """Not only equal to the reference: the band the simulator relies on is there (a reference that found
    none would agree with an index that found none)."""
    (phase,) = shipped("gpt3-13b-pp4", 16)
    band = assert_same_index(phase).band
    assert band is not None and set(band.period) == set(phase.segments)
    assert all(band.segments[d] and band.period[d] > 1 for d in band.period)
    assert any(spans for _, spans in band.slots)


TP, DP, PP = Group("tp", 4, 4, 1), Group("dp", 8, 4, 2), Group("pp", 2, 1, 2)
KINDS = [(4e11, 6e7, 840), (1e11, 4e7, 300), (2e11, 5e7, 512), (0.0, 1e7, 128), (3e11, 6e7, 840), (1e10, 2e7, 132)]


def random_phase(seed: int) -> Phase:
    """Stages of one repeating pattern (a few segment kinds per period, the same collectives released at the
    same places of each period), a few segments and collectives changed, stages that wait for the next one's
    sends, points sometimes listed shuffled."""
    rng = random.Random(seed)
    per = rng.randint(2, 5)
    kinds = rng.sample(range(len(KINDS)), per)  # a period of ``per`` segments, as the collectives' pattern
    released = [[(rng.choice([Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE]), rng.choice([TP, DP]),
                  rng.choice([1 << 20, 1 << 22]), rng.choice([1, 2, 3, None]), rng.choice(["before", "after", None]))
                 for _ in range(rng.randint(0, 2))] for _ in range(per)]
    sizes = [per * rng.randint(MIN_PERIODS + 4, 20) + rng.randint(0, per) for _ in range(rng.randint(1, 3))]
    segments = {d: [ComputeSegment(f"d{d}.s{i}", *KINDS[kinds[i % per] if rng.random() > 0.02 else rng.randrange(len(KINDS))],
                                   device=d) for i in range(n)] for d, n in enumerate(sizes)}
    points: list[OverlapPoint] = []
    dropped = rng.choice([0.0, 0.0, 0.02])  # a collective missing from one period: streams shift
    for d, n in enumerate(sizes):
        for i in range(n):
            for coll, group, nbytes, wait, fuse in released[i % per]:
                if rng.random() < dropped:
                    continue
                before = f"d{d}.s{i + wait}" if wait is not None and i + wait < n else None
                fused = {"before": before, "after": f"d{d}.s{i}", None: None}[fuse]
                points.append(OverlapPoint(f"d{d}.p{i}.{len(points)}", coll, group, nbytes if rng.random() > 0.03 else 3,
                                           after=f"d{d}.s{i}", before=before, device=d, fuse_with=fused))
            if d + 1 < len(sizes) and i % per == per - 1 and rng.random() >= dropped:
                points.append(OverlapPoint(f"d{d}.send{i}", Collective.SEND_RECV, PP, 1 << 21, after=f"d{d}.s{i}",
                                           before=f"d{d + 1}.s{min(i + 1, sizes[d + 1] - 1)}", device=d, peer_device=d + 1))
    if rng.random() < 0.5:
        points.append(OverlapPoint("grad", Collective.ALL_REDUCE, DP, 1 << 24, after=None, before=None))
    if rng.random() < 0.25:
        rng.shuffle(points)  # issue order then ties points released by one segment in this order
    return Phase("step", 1, segments, points)


@pytest.mark.parametrize("seed", range(40))
def test_random_phases_index_as_the_straightforward_construction(seed):
    assert_same_index(random_phase(seed))


def test_random_phases_have_bands_cut_into_spans():
    """The randomised phases exercise the band: most have one, and some are cut into several spans."""
    bands = [PhaseIndex(random_phase(seed)).band for seed in range(40)]
    found = [band for band in bands if band is not None]
    assert len(found) >= 15 and any(len(band.period) > 1 for band in found)
    assert any(len(spans) > 1 for band in found for spans in band.segments.values())
    assert any(len(spans) > 1 for band in found for _, spans in band.slots)


def test_a_point_fusing_with_another_devices_segment_is_refused():
    segments = {0: [ComputeSegment("a", *KINDS[0])], 1: [ComputeSegment("b", *KINDS[1], device=1)]}
    point = OverlapPoint("ag", Collective.ALL_GATHER, TP, 1 << 20, after="a", before=None, device=0, fuse_with="b")
    with pytest.raises(LagomError, match="fuses with b, a segment of another device"):
        PhaseIndex(Phase("step", 1, segments, [point]))


@pytest.mark.parametrize("compiled_loop", [True, False])
def test_a_device_that_only_communicates_has_an_idle_compute_stream(compiled_loop):
    """A collective on a device with no compute in the phase (released at the phase start, needed at its end):
    the device gets a compute stream with nothing on it, and its collective runs at once and is exposed whole,
    as a trailing collective is; the search runs over it."""
    from lagom.model import compiled
    from lagom.model.simulator import Simulator
    from lagom.search import Problem, run_strategy
    from lagom.search.base import nccl_configs

    if compiled_loop and not compiled.enabled():
        pytest.skip("no compiled loop")
    hw = load_hardware("a40-2x8-nvlink")
    dp = Group("dp", 8, 8, 1)
    segments = {0: [ComputeSegment("a", 1e12, 1e6, 100)]}
    points = [OverlapPoint("ar0", Collective.ALL_REDUCE, dp, 1 << 20, after="a", before=None, device=0),
              OverlapPoint("ar1", Collective.ALL_REDUCE, dp, 1 << 20, after=None, before=None, device=1)]
    problem = Problem(StepGraph("idle", hw.name, 2, [Phase("step", 1, segments, points)]), hw)
    assert index_of(problem.graph.phases[0]).devices == [0, 1]
    result = Simulator(problem.graph, compiled_loop=compiled_loop).run(nccl_configs(problem), problem.model, timings=True)
    idle = next(t for t in result.phases[0].points if t.device == 1)
    assert idle.start == 0.0 and idle.exposed == pytest.approx(idle.end)
    assert run_strategy("lagom", problem).result.step_s <= result.step_s


def test_a_phase_and_its_index_go_with_their_last_reference():
    """A phase keeps its index (``index_of``); the index must not refer back to the phase, or a forgotten step
    graph (a bucket scale a tune is done with: hundreds of MB at cluster scale) stays until the collector's next
    full pass. With the collector off, the last reference going frees both."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        phase = random_phase(3)
        index = index_of(phase)
        index.columns, index.band  # noqa: B018 - what the search and the lowering build on it
        phase_gone, index_gone = weakref.ref(phase), weakref.ref(index)
        del phase, index
        assert phase_gone() is None and index_gone() is None
    finally:
        if enabled:
            gc.enable()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(-3, 5), st.integers(0, 2**40), st.floats(0, 4, allow_nan=False)),
                min_size=1, max_size=60),
       st.sampled_from([(0, 1, 2), (1, 2), (0, 3), (3,), (2, 1, 0, 3)]))
def test_first_seen_numbers_rows_by_the_first_appearance_of_their_values(rows, which):
    """Rows told apart by the chosen columns (integer ones packed into one sort key, float ones lexsorted) get the
    numbers a dict of tuples gives them, and each number's first row."""
    import numpy as np

    from lagom.model.phase_index import first_seen

    columns = [np.asarray([row[c] for row in rows]) for c in which]
    numbers: dict[tuple, int] = {}
    expected = [numbers.setdefault(tuple(row[c] for c in which), len(numbers)) for row in rows]
    firsts = [expected.index(k) for k in range(len(numbers))]
    got, got_firsts = first_seen(*columns)
    assert got.tolist() == expected and got_firsts.tolist() == firsts
