"""The cost model and the step simulator against values derived by hand from the same formulas."""

import math
import signal
from dataclasses import replace

import pytest

from lagom.errors import LagomError
from lagom.hardware import load_hardware
from lagom.model.cost_model import CostModel, RunningComm
from lagom.model.simulator import simulate
from lagom.plan.comm_config import CommConfig, default_config
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from tests.helpers import synthetic_problem

HW = load_hardware("a40-2x8-nvlink")
MODEL = CostModel(HW)
G8 = Group("dp", 8, 8, 1)


def test_ring_all_reduce_time_from_first_principles():
    cfg = CommConfig(channels=64, chunk_bytes=4 * 2**20)  # enough channels to saturate the link
    nbytes = 256 * 2**20
    t = MODEL.comm_time(Collective.ALL_REDUCE, G8, nbytes, cfg)
    bus = nbytes * 2 * 7 / 8
    # NCCL's ring Simple base 8.4 us + 2(n-1) steps x its PCIe step latency 5.7 us: eight A40s span four
    # NVLink pairs, so the ring runs at the PCIe bridge's 31.5 GB/s
    latency = (8.4 + 14 * 5.7) * 1e-6
    assert t == pytest.approx(latency + bus / 31.5e9, rel=1e-12)


def test_bandwidth_grows_with_channels_until_the_link_saturates():
    pair = Group("tp", 2, 2, 1)  # one NVLink-bridged pair: a larger group runs at the PCIe bridge's speed
    times = [MODEL.comm_time(Collective.ALL_GATHER, pair, 64 * 2**20, replace(default_config(HW), channels=c))
             for c in (1, 2, 4, 8, 16)]
    # one A40 NVLink channel moves under 15 GB/s with 2 MiB chunks: four of them fill the 50 GB/s link; more
    # channels then only share out the per-chunk waits on the peer (each has fewer chunks to wait after)
    assert times[0] > times[1] > times[2] > times[3] > times[4]
    assert times[1] / times[2] > 1.5 and times[2] - times[4] < 0.02 * times[2]


def test_comm_ctas_slow_a_gemm_by_whole_waves():
    seg = ComputeSegment("gemm", 2e12, 1e8, 840)  # 10 full waves on 84 SMs
    solo = MODEL.compute_solo(seg)
    running = (RunningComm(replace(default_config(HW), channels=12), 0.0, 12),)
    # 12 SMs taken: 72 left, ceil(840/72) = 12 waves instead of 10 for the math; each tile's pipeline fill
    # (5 stages x 256 x 32 x 2 B + the 128 x 128 x 2 B output tile) is not hidden and does not scale with the
    # waves; it pays the L2 term of the 12 CTAs' staged chunks (12 x 2 x 2 MiB, more than the A40's 6 MB L2: x 1.3)
    fill = 840 * (5 * 256 * 32 * 2 + 128 * 128 * 2) / (696e9 * 0.85)
    assert MODEL.compute_time(seg, running) == pytest.approx((solo - fill) * 12 / 10 + fill * 1.3, rel=1e-12)
    small = ComputeSegment("small", 1e9, 1e6, 40)  # one partial wave: its math unaffected by 12 comm CTAs, its fills x 1.3
    small_fill = 40 * (5 * 256 * 32 * 2 + 128 * 128 * 2) / (696e9 * 0.85)
    assert MODEL.compute_time(small, running) == pytest.approx(MODEL.compute_solo(small) + small_fill * 0.3, rel=1e-12)


def test_fluid_overlap_of_one_collective_and_one_gemm():
    problem = synthetic_problem([(0.5, 10, 840), (3.0, 10, 840)],
                                [{"collective": "all_gather", "mb": 200, "after": 0, "size": 8}])
    cfg = replace(default_config(HW), priority=1)  # high priority: no launch wait, keeps the sum exact
    key = problem.graph.points[0].key
    res = simulate(problem.graph, {key: cfg}, MODEL)
    a, b = problem.graph.phases[0].segments[0]
    pt = problem.graph.points[0]
    util = MODEL.hbm_util(b)
    d_comm = MODEL.comm_time(pt.collective, pt.group, pt.bytes, cfg, util)
    rate = MODEL.comm_hbm_rate(pt.collective, pt.group, pt.bytes, d_comm)
    ctas = MODEL.launch_shape(pt.collective, pt.group, pt.bytes, cfg)[0]
    d_b = MODEL.compute_time(b, (RunningComm(cfg, rate, ctas),))
    assert d_comm < d_b  # the collective finishes first, then the GEMM runs alone
    expected = MODEL.compute_solo(a) + d_comm + (1 - d_comm / d_b) * MODEL.compute_solo(b)
    assert res.step_s == pytest.approx(expected, rel=1e-9)
    assert res.exposed_comm_s == 0.0
    bound = max(MODEL.compute_solo(a) + MODEL.compute_solo(b), MODEL.comm_peak_time(pt.collective, pt.group, pt.bytes))
    assert res.overlap_efficiency == pytest.approx(bound / expected, rel=1e-9)


def test_blocking_collective_is_exposed_and_serialised_on_its_stream():
    problem = synthetic_problem([(0.5, 10, 840), (0.5, 10, 840)],
                                [{"collective": "all_reduce", "mb": 100, "after": 0, "before": 1, "group": "dp"},
                                 {"collective": "all_reduce", "mb": 50, "after": 0, "before": 1, "group": "dp"}])
    cfg = replace(default_config(HW), priority=1)
    res = simulate(problem.graph, {p.key: cfg for p in problem.graph.points}, MODEL)
    p0, p1 = res.phases[0].points
    assert p1.start == pytest.approx(p0.end)  # same communicator: one after the other
    solo = sum(MODEL.compute_solo(s) for s in problem.graph.phases[0].segments[0])
    assert res.exposed_comm_s == pytest.approx(p1.end - p0.start, rel=1e-9)
    assert res.step_s == pytest.approx(solo + res.exposed_comm_s, rel=1e-9)


def test_flash_overlap_decomposition_computes_local_shard_first_and_hides_the_rest():
    # all-gather feeding a long GEMM: decomposed, only the first P2P step can be exposed
    problem = synthetic_problem([(0.1, 1, 84), (8.0, 10, 8400)],
                                [{"collective": "all_gather", "mb": 64, "after": 0, "before": 1, "fuse": 1, "size": 4}])
    key = problem.graph.points[0].key
    coll = simulate(problem.graph, {key: default_config(HW)}, MODEL, keep_spans=True)
    p2p_cfg = replace(default_config(HW), decomposition="p2p", num_chunks=1)
    dec = simulate(problem.graph, {key: p2p_cfg}, MODEL, keep_spans=True)
    compute = [s for s in dec.phases[0].spans if s[1] == "compute"]
    names = [s[2] for s in compute]
    assert names[1] == "s1[s0c0]"  # the local shard's GEMM runs first, before any transfer lands
    assert names[1:] == ["s1[s0c0]", "s1[s1c0]", "s1[s2c0]", "s1[s3c0]"]
    assert coll.exposed_comm_s > 0 and dec.exposed_comm_s == 0.0  # the local shard hides the first step too
    assert dec.step_s < coll.step_s


def test_reduce_scatter_decomposition_keeps_the_local_partial_last():
    problem = synthetic_problem([(8.0, 10, 8400), (0.1, 1, 84)],
                                [{"collective": "reduce_scatter", "mb": 64, "after": 0, "before": 1, "fuse": 0, "size": 4}])
    key = problem.graph.points[0].key
    dec = simulate(problem.graph, {key: replace(default_config(HW), decomposition="p2p")}, MODEL, keep_spans=True)
    names = [s[2] for s in dec.phases[0].spans if s[1] == "compute"]
    assert names[:5] == ["s0[s1c0]", "s0[s2c0]", "s0[s3c0]", "s0[s0c0]", "s0[reduce]"]
    assert math.isfinite(dec.step_s)


def _gemm_then_reduce_scatter(decomposition: str) -> tuple[StepGraph, dict[str, CommConfig], OverlapPoint]:
    """A GEMM, then a zero-work edge segment; a reduce-scatter released after the GEMM and needed before the
    edge, fusable with the GEMM (the Flash-Overlap benchmark's graph)."""
    gemm, edge = ComputeSegment("gemm", 2e12, 1e8, 840), ComputeSegment("edge", 0.0, 0.0, 1)
    point = OverlapPoint("tp.comm", Collective.REDUCE_SCATTER, Group("tp", 4, 4, 1), 1 << 28,
                         after="gemm", before="edge", fuse_with="gemm")
    graph = StepGraph("flash-overlap", HW.name, 1, [Phase("op", 1, {0: [gemm, edge]}, [point])])
    return graph, {point.key: CommConfig(decomposition=decomposition, num_chunks=4, priority=1)}, point


def _alarm(seconds: int):
    def expired(signum, frame):
        raise TimeoutError(f"simulate did not return within {seconds} s")
    signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)


def test_zero_work_segment_after_a_collective_ends_the_step():
    # the edge segment lasts the simulator's floor of 1e-12 s, ending milliseconds into the phase: its
    # remaining fraction, (now - since) / 1e-12, is only good to a float step of now over 1e-12 (~4e-7),
    # far above the 1e-9 that counts as done, and the event loop once spun on it forever
    graph, configs, point = _gemm_then_reduce_scatter("collective")
    cfg = configs[point.key]
    _alarm(10)
    try:
        res = simulate(graph, configs, MODEL)
        fused = simulate(*_gemm_then_reduce_scatter("p2p")[:2], MODEL)
    finally:
        signal.alarm(0)
    gemm = graph.phases[0].segments[0][0]
    # serial: the GEMM alone, then the reduce-scatter alone (nothing beside it), then the edge's 1e-12 s
    hand = MODEL.compute_solo(gemm) + MODEL.comm_time(point.collective, point.group, point.bytes, cfg) + 1e-12
    assert res.step_s == pytest.approx(hand, rel=1e-12)
    assert MODEL.compute_solo(gemm) < fused.step_s < res.step_s


def test_a_cost_model_that_gives_no_finite_duration_is_named_not_simulated():
    class Broken(CostModel):
        def compute_time(self, seg, running=()):
            return math.nan if not seg.flops else super().compute_time(seg, running)  # the edge

    graph, configs, _ = _gemm_then_reduce_scatter("collective")
    with pytest.raises(LagomError, match=r"duration nan for .*edge.* in phase op"):
        simulate(graph, configs, Broken(HW))
