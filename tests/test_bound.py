"""The dependency-aware step bound: the critical path with compute alone and comm at link peak."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagom.hardware import load_hardware
from lagom.model.bound import step_bound
from lagom.model.cost_model import CostModel
from lagom.plan.comm_config import SearchSpace
from lagom.search import Problem, run_strategy
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from tests.helpers import synthetic_problem

HW = load_hardware("a40-2x8-nvlink")
DP = Group("dp", 16, 8, 2)
TP = Group("tp", 8, 8, 1)


def _segments(device: int, *tflops: float) -> list[ComputeSegment]:
    return [ComputeSegment(f"d{device}s{i}", t * 1e12, 1e6, 840, device) for i, t in enumerate(tflops)]


def _graph(phases: list[Phase], devices: int = 1) -> StepGraph:
    return StepGraph("hand", HW.name, devices, phases)


def test_bound_is_the_hand_computed_critical_path_of_a_small_step():
    """Compute A B C; an all-reduce released by A and needed by C, then a second one on the same
    communicator released by B and needed by the step's end (it queues behind the first); a tp all-gather
    needed by B. Two micro-batches of this phase, then a last phase with one collective after all compute."""
    model = CostModel(HW)
    segs = _segments(0, 2.0, 1.0, 3.0)
    a, b, c = (model.compute_solo(s) for s in segs)
    first = OverlapPoint("ar0", Collective.ALL_REDUCE, DP, 1_600_000_000, after="d0s0", before="d0s2")
    second = OverlapPoint("ar1", Collective.ALL_REDUCE, DP, 100_000_000, after="d0s1", before=None)
    gather = OverlapPoint("ag", Collective.ALL_GATHER, TP, 300_000_000, after=None, before="d0s1")
    x0, x1, xg = (model.comm_peak_time(p.collective, p.group, p.bytes) for p in (first, second, gather))
    tail_segs = _segments(0, 1.5)
    tail = OverlapPoint("tail", Collective.ALL_GATHER, DP, 50_000_000, after="d0s0", before=None)
    xt = model.comm_peak_time(tail.collective, tail.group, tail.bytes)
    graph = _graph([Phase("micro", 2, {0: segs}, [first, second, gather]), Phase("last", 1, {0: tail_segs}, [tail])])

    b_start = max(a, xg)
    c_start = max(b_start + b, a + x0)
    second_start = max(b_start + b, a + x0)  # released by B, and behind the first on the dp communicator
    micro = max(c_start + c, second_start + x1)
    last = model.compute_solo(tail_segs[0]) + xt
    assert step_bound(graph, model) == pytest.approx(2 * micro + last, rel=1e-12)
    # the old bound per phase, max(compute alone, comm at peak per communicator), misses that C must wait
    # for the first all-reduce, which A releases: A, the all-reduce and C run one after another
    assert micro >= a + x0 + c > max(a + b + c, x0 + x1, xg)


def test_bound_follows_a_pipeline_send_to_the_other_stage():
    model = CostModel(HW)
    stage0, stage1 = _segments(0, 1.0), _segments(1, 2.0)
    link = Group("pp", 2, 1, 2)
    send = OverlapPoint("send", Collective.SEND_RECV, link, 200_000_000, after="d0s0", before="d1s0", device=0,
                        peer_device=1)
    graph = _graph([Phase("step", 1, {0: stage0, 1: stage1}, [send])], devices=2)
    expected = (model.compute_solo(stage0[0]) + model.comm_peak_time(Collective.SEND_RECV, link, send.bytes)
                + model.compute_solo(stage1[0]))
    assert step_bound(graph, model) == pytest.approx(expected, rel=1e-12)


def test_a_collective_that_may_be_decomposed_only_has_to_end_with_the_gemm_it_feeds():
    """An all-gather feeding GEMM B (Flash-Overlap may split B and stream the blocks in): plain, B waits for
    the whole gather; decomposed, only B's last piece waits for the last block. The bound keeps what both
    forms share: B ends after the gather ends."""
    model = CostModel(HW)
    segs = _segments(0, 1.0, 4.0)
    gather = OverlapPoint("ag", Collective.ALL_GATHER, TP, 100_000_000, after="d0s0", before="d0s1", fuse_with="d0s1")
    graph = _graph([Phase("step", 1, {0: segs}, [gather])])
    a, b = (model.compute_solo(s) for s in segs)
    x = model.comm_peak_time(gather.collective, gather.group, gather.bytes)
    assert x < b  # the gather can hide under B once decomposed
    assert step_bound(graph, model, decompose=False) == pytest.approx(a + x + b, rel=1e-12)
    assert step_bound(graph, model, decompose=True) == pytest.approx(a + b, rel=1e-12)
    # and a decomposition does beat the plain critical path, so the relaxation is needed
    best = run_strategy("exhaustive", Problem(graph, HW, SPACE)).result.step_s
    assert (a + b) * (1 - 1e-9) <= best < a + x + b


segment = st.tuples(st.floats(0.05, 3.0), st.floats(1.0, 400.0), st.sampled_from([84, 840, 4000]))
SPACE = SearchSpace(channels=(1, 4, 16), threads=(512,), chunks=(512 * 1024,), protocols=("Simple",), splits=(1, 2),
                    priorities=(0, 1))


@st.composite
def small_steps(draw):
    """Two collectives on random windows of a random compute stream; a gather may feed (and a reduce-scatter
    follow) a GEMM that Flash-Overlap could split."""
    segs = draw(st.lists(segment, min_size=2, max_size=5))
    points = []
    for j in range(2):
        coll = draw(st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"]))
        after = draw(st.sampled_from([None, *range(len(segs) - 1)]))
        lo = 0 if after is None else after + 1
        before = draw(st.sampled_from([None, *range(lo, len(segs))]))
        fuse = None
        if draw(st.booleans()):
            fuse = before if coll == "all_gather" else after if coll == "reduce_scatter" else None
        nodes = draw(st.sampled_from([1, 2]))
        points.append({"collective": coll, "mb": draw(st.floats(1.0, 300.0)), "after": after, "before": before,
                       "fuse": fuse, "nodes": nodes, "size": 8 * nodes, "group": draw(st.sampled_from(["dp", f"g{j}"]))})
    return synthetic_problem(segs, points, space=SPACE)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_steps())
def test_no_setting_beats_the_bound_on_random_small_steps(problem):
    """Every config's simulated step, the joint brute force's best included, is at least the bound (the
    simulator may finish a task up to 1e-9 of the longest task early); the bound is never looser than
    max(compute alone, comm at peak per communicator) when nothing may be decomposed."""
    bound = step_bound(problem.graph, problem.model, decompose=bool(problem.space.splits))
    best = run_strategy("exhaustive", problem).result
    for name in ("nccl", "autoccl", "lagom"):
        assert run_strategy(name, problem).result.step_s >= bound * (1 - 1e-9)
    assert best.step_s >= bound * (1 - 1e-9)
    plain = step_bound(problem.graph, problem.model, decompose=False)
    assert plain >= max(best.compute_s, best.comm_peak_s) * (1 - 1e-12)
    assert plain >= bound * (1 - 1e-12)
