"""The priority search's windows and sets of keys (worked out on the phase index's arrays) against
straightforward loops over the points.

``reference_windows``, ``reference_shared`` and ``reference_blocked`` walk every point and segment as the
docstrings of ``windows``, ``shared_segments`` and ``blocked_together`` describe them. They must agree exactly
(same windows in the same order with the same points and repeats; same sets, same compute seconds to the
bit, same segments) on shipped workloads and on randomised multi-phase graphs: pipelines whose stages wait
for each other's sends, collectives waited for by another stage, decompositions, and spans that run past
their device's last segment.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace
from operator import attrgetter

import pytest

from lagom.hardware import load_hardware
from lagom.model.windows import KeyOf, windows
from lagom.plan.comm_config import can_decompose
from lagom.search import Problem
from lagom.search.base import SearchSpace
from lagom.search.priority import blocked_together, shared_segments
from lagom.step.graph import Collective, OverlapPoint, Phase, StepGraph
from lagom.step.workload import load_workload
from lagom.tune import problem_for
from tests.test_phase_index import TP, random_phase

SEGMENT_KIND = attrgetter("flops", "bytes", "ctas")


def span(p: OverlapPoint, pos: dict[str, int], count: int) -> tuple[int, int]:
    return pos[p.after] + 1 if p.after is not None else 0, pos[p.before] if p.before is not None else count


def positions(phase: Phase) -> dict[str, int]:
    return {seg.name: i for segs in phase.segments.values() for i, seg in enumerate(segs)}


def reference_windows(graph: StepGraph) -> dict[str, list[tuple]]:
    """Per key, (point, repeat, segments, fused) of each distinct window, in first-seen order."""
    out: dict[str, dict[tuple, list]] = {}
    for phase in graph.phases:
        pos = positions(phase)
        for p in phase.points:
            segs = phase.segments[p.device]
            lo, hi = (0, 0) if p.peer_device is not None else span(p, pos, len(segs))
            f = pos[p.fuse_with] if p.peer_device is None and p.fuse_with is not None and can_decompose(p) else None
            fused = [] if f is None else segs[f:f + 1]
            what = (p.collective, p.group, p.bytes, tuple(map(SEGMENT_KIND, segs[lo:hi])), tuple(map(SEGMENT_KIND, fused)))
            known = out.setdefault(p.key, {})
            if what in known:
                known[what][1] += phase.repeat
            else:
                known[what] = [p, phase.repeat, segs[lo:hi], fused]
    return {key: [tuple(w) for w in wins.values()] for key, wins in out.items()}


def reference_shared(problem: Problem) -> dict[frozenset[str], tuple[float, list]]:
    """Segment by segment, the keys whose spans hold it (two or more): the largest such sets, with the compute
    seconds of their distinct segments and every (segment, keys, occurrences) within them."""
    beside: dict[frozenset[str], dict[tuple, list]] = {}
    for phase in problem.graph.phases:
        pos = positions(phase)
        for device, segs in phase.segments.items():
            spans = [(p.key, *span(p, pos, len(segs))) for p in phase.points
                     if p.device == device and p.peer_device is None]
            if not spans:
                continue
            events = defaultdict(list)
            for key, a, b in spans:
                events[a].append((key, 1))
                events[b].append((key, -1))
            ends = sorted(events)
            open_: dict[str, int] = defaultdict(int)  # per key, how many of its spans hold the stretch
            for lo, hi in zip(ends, [*ends[1:], len(segs)]):  # stretches between span ends (maybe past the last segment)
                for key, step in events[lo]:
                    open_[key] += step
                keys = frozenset(k for k, n in open_.items() if n > 0)
                if len(keys) < 2:
                    continue
                found = beside.setdefault(keys, {})
                for seg in segs[lo:hi]:
                    found.setdefault(SEGMENT_KIND(seg), [seg, 0])[1] += phase.repeat
    covered = {keys: sum(problem.model.compute_solo(seg) * n for seg, n in found.values()) for keys, found in beside.items()}
    return {keys: (seconds, [(seg, within, n) for within, found in beside.items() if within <= keys for seg, n in found.values()])
            for keys, seconds in covered.items() if not any(keys < other for other in covered)}


def reference_blocked(problem: Problem) -> list[set[str]]:
    blocked: dict[tuple, set[str]] = defaultdict(set)
    for n, phase in enumerate(problem.graph.phases):
        for p in phase.points:
            blocked[(n, p.device if p.peer_device is None else p.peer_device, p.before)].add(p.key)
    out: list[set[str]] = []
    for keys in blocked.values():
        if len(keys) > 1 and keys not in out:
            out.append(keys)
    return out


def assert_same(problem: Problem) -> None:
    got = windows(problem.graph, KeyOf())
    assert {key: [(w.point, w.repeat, w.segments, w.fused) for w in wins] for key, wins in got.items()} \
        == reference_windows(problem.graph)
    assert list(got) == list(reference_windows(problem.graph))  # keys in first-seen order: the estimate sums in it
    shared, reference = shared_segments(problem), reference_shared(problem)
    assert list(shared) == list(reference)
    for keys, (seconds, segments) in shared.items():
        assert seconds == reference[keys][0]  # the same sum in the same order: equal to the bit
        assert [(seg.name, within, n) for seg, within, n in segments] \
            == [(seg.name, within, n) for seg, within, n in reference[keys][1]]
    sets, group = blocked_together(problem)
    assert sets == reference_blocked(problem)
    assert group == {key: points[0].group.name for key, points in problem.keys.items()}


@pytest.mark.parametrize("name", ["gpt3-13b-pp4", "llama3-8b-tp8", "deepseek-moe-16b-ep8", "t5-dp-tp", "bert-pp4"])
def test_shipped_workloads_as_the_straightforward_loops(name):
    wl = load_workload(name)
    problem = problem_for(wl, load_hardware(wl.hardware))
    assert_same(problem)
    assert any(len(w.segments) > 1 for wins in windows(problem.graph).values() for w in wins) or name != "gpt3-13b-pp4"


def random_graph(seed: int) -> StepGraph:
    """Two or three random phases (``random_phase``) repeated 1-3 times, some collectives waited for by the next
    stage's segment and some spans running past their device's last segment."""
    rng = random.Random(seed)
    phases = []
    for n in range(rng.randint(2, 3)):
        phase = random_phase(seed * 7 + n)
        devices = sorted(phase.segments)
        points = []
        for p in phase.points:
            nxt = p.device + 1
            if p.peer_device is None and nxt in phase.segments and rng.random() < 0.05:
                later = phase.segments[nxt]
                p = replace(p, before=later[rng.randrange(len(later))].name)  # another stage waits for it
            points.append(p)
        if len(devices) > 1 and rng.random() < 0.5:  # a device's collective waited for past its own last segment
            longest = max(devices, key=lambda d: len(phase.segments[d]))
            short = min(devices, key=lambda d: len(phase.segments[d]))
            points.append(OverlapPoint("late", Collective.ALL_GATHER, TP, 1 << 20,
                                       after=phase.segments[short][-1].name, before=phase.segments[longest][-1].name,
                                       device=short))
        phases.append(Phase(f"phase{n}", rng.randint(1, 3), phase.segments, points))
    return StepGraph("random", "h100-sxm-8x-400g", 8, phases)


@pytest.mark.parametrize("seed", range(30))
def test_random_graphs_as_the_straightforward_loops(seed):
    hw = load_hardware("h100-sxm-8x-400g")
    assert_same(Problem(random_graph(seed), hw, SearchSpace()))
