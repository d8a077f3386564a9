"""Each term of the cost model against a case computed by hand from its sources (NCCL's tuning model,
CUDA occupancy limits, the presets' datasheet figures)."""

import math
from dataclasses import replace

import pytest

from lagom.hardware import load_hardware, preset_names, with_cluster
from lagom.model.choices import nccl_choice
from lagom.model.cost_model import CostModel, RunningComm
from lagom.plan.comm_config import Algorithm, CommConfig, CTAPolicy, Protocol
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint

A100 = load_hardware("a100-8x-100g")
A100X2 = load_hardware("a100-2x8-100g")
A40 = load_hardware("a40-2x8-nvlink")
H100 = load_hardware("h100-sxm-8x-400g")
GIB = 2**30
AG, AR, A2A = Collective.ALL_GATHER, Collective.ALL_REDUCE, Collective.ALL_TO_ALL


# -- NCCL's latency model


def test_network_latency_only_on_the_steps_that_cross_nodes():
    # 16 ranks on 2 nodes, ring Simple all-reduce: base 8.4 + 28 NVLink steps x 3.4 + 2 network steps x 14
    model = CostModel(A100X2)
    assert model.latency(AR, Group("dp", 16, 8, 2), CommConfig()) == pytest.approx(131.6e-6, rel=1e-12)


def test_each_protocol_has_its_own_base_and_step_latency():
    model, group = CostModel(A100), Group("tp", 8, 8, 1)
    got = {p: model.latency(AG, group, CommConfig(protocol=p)) for p in Protocol}
    assert got[Protocol.LL] == pytest.approx((6.6 + 7 * 0.6) * 1e-6, rel=1e-12)
    assert got[Protocol.LL128] == pytest.approx((14.0 + 7 * 1.9) * 1e-6, rel=1e-12)
    assert got[Protocol.SIMPLE] == pytest.approx((8.4 + 7 * 3.4) * 1e-6, rel=1e-12)


def test_a_tiny_all_reduce_across_nodes_costs_nccls_latency():
    # 8 bytes, tree LL, 16 ranks on 2 H100 nodes: 6.8 + 2 (7 x 0.6 + 5.0) us, plus the network fill of a
    # 1 KiB chunk (two transmissions on one 64-thread IB channel: 6 GB/s x 64/256) and the tree's 2 x 8
    # bytes through that channel at its wire rate (one chunk per step: no overhead beyond NCCL's step
    # latency) at NCCL's tree factor 0.92 and LL's half rate
    model = CostModel(load_hardware("h100-sxm-4x8-400g"))
    group, cfg = Group("dp", 16, 8, 2), CommConfig(algorithm=Algorithm.TREE, protocol=Protocol.LL, channels=32)
    assert model.launch_shape(AR, group, 8, cfg) == (1, 64)
    got = model.comm_time(AR, group, 8, cfg)
    peak = 6e9 * 64 / 256
    channel = peak * 0.92 * 0.5
    assert got == pytest.approx(25.2e-6 + 2 * 1024 / peak + 2 * 8 / channel, rel=1e-12)


def test_tree_latency_is_a_chain_per_node_and_log_nodes_across():
    model = CostModel(A100X2)
    lat = model.latency(AR, Group("dp", 16, 8, 2), CommConfig(algorithm=Algorithm.TREE))
    assert lat == pytest.approx((8.4 + 2 * (7 * 4.0 + 1 * 14.0)) * 1e-6, rel=1e-12)


# -- NCCL's bandwidth refinements


def _ring_fill(steps: int, nbytes: int, ranks: int) -> float:
    """The A100's published-fit ring fill: per step, its full value times a step's slice (the buffer over the ranks)
    over the slice plus the half size."""
    nccl, piece = A100.nccl, nbytes / ranks
    return steps * nccl.ring_fill_us * 1e-6 * piece / (piece + nccl.ring_fill_half_mib * 2**20)


def test_ll_bandwidth_is_capped_at_llmaxbw():
    # without the chunks' waits, which at 64 channels would bring LL under its cap
    model = CostModel(replace(A100, nccl=replace(A100.nccl, step_overhead_us=0.0)))
    group = Group("tp", 8, 8, 1)
    nbytes = GIB
    cfg = CommConfig(protocol=Protocol.LL, channels=64)
    # half of NCCL's 240 GB/s A100 NVLink is 120 GB/s of payload, above Ampere's single-node LL cap of 87.7 GB/s
    expected = (6.6 + 7 * 0.6) * 1e-6 + _ring_fill(7, nbytes, 8) + nbytes * 7 / 8 / 87.7e9
    assert model.comm_time(AG, group, nbytes, cfg) == pytest.approx(expected, rel=1e-12)


def test_ll128_bandwidth_is_capped_per_channel():
    protocols = dict(A100.nccl.protocols)
    protocols["LL128"] = replace(protocols["LL128"], channel_max_gbps=[10.0, 10.0, 10.0])
    model = CostModel(replace(A100, nccl=replace(A100.nccl, protocols=protocols)))
    cfg, nbytes = CommConfig(protocol=Protocol.LL128, channels=4), GIB
    expected = (14.0 + 7 * 1.9) * 1e-6 + _ring_fill(7, nbytes, 8) + nbytes * 7 / 8 / (4 * 10e9)
    assert model.comm_time(AG, Group("tp", 8, 8, 1), nbytes, cfg) == pytest.approx(expected, rel=1e-12)


def test_small_messages_run_on_fewer_channels_and_only_those_take_sms():
    model, group, cfg = CostModel(A100), Group("tp", 8, 8, 1), CommConfig(channels=16, threads=512)
    # Simple: 64 bytes per thread; 100000 B // (512 x 64) = 3 channels, and 100000 >= 3 x 512 x 64 keeps 512 threads
    assert model.launch_shape(AG, group, 100_000, cfg) == (3, 512)
    # 20000 B: one channel, then threads halve while 20000 < 1 x threads x 64: 256 threads
    assert model.launch_shape(AG, group, 20_000, cfg) == (1, 256)
    assert model.launch_shape(AG, group, GIB, cfg) == (16, 512)
    seg = ComputeSegment("gemm", 1e12, 1e8, 1080)
    few = model.compute_time(seg, (RunningComm(cfg, 0.0, 3),))
    many = model.compute_time(seg, (RunningComm(cfg, 0.0, 16),))
    assert few < many


def test_efficiency_policy_keeps_the_channels_that_add_bandwidth():
    model, group = CostModel(A100), Group("tp", 8, 8, 1)
    cfg = CommConfig(channels=32, cta_policy=CTAPolicy.EFFICIENCY)
    # 240 GB/s link / 20 GB/s per NVLink channel = 12 channels
    assert model.launch_shape(AG, group, GIB, cfg) == (12, 512)


SR = Collective.SEND_RECV


@pytest.mark.parametrize(("nbytes", "channels"), [(128 * 2**20, 8), (256 * 2**20, 16), (512 * 2**20, 32), (GIB, 32)])
def test_a_send_spreads_over_more_channels_only_as_its_parts_pass_32_p2p_chunks(nbytes, channels):
    # NCCL's addP2pToPlan on 8 ranks with 24 channels (32 for P2P, 32 per NVLink peer): it starts on 32 halved
    # until 8 ranks x it <= 32, i.e. 4, and doubles while a part is above 32 x 512 KiB = 16 MiB
    model, cfg = CostModel(A100), CommConfig(channels=24)
    assert model.launch_shape(SR, Group("pp", 8, 8, 1), nbytes, cfg)[0] == channels


def test_a_small_send_runs_on_its_share_of_the_p2p_channels_and_parts_of_at_least_an_eighth_chunk():
    model, cfg = CostModel(A100), CommConfig(channels=16)
    assert model.launch_shape(SR, Group("pp", 2, 2, 1), 4 * 2**20, cfg)[0] == 8  # 16 / 2 ranks
    assert model.launch_shape(SR, Group("tp", 8, 8, 1), 4 * 2**20, cfg)[0] == 2  # 16 / 8 ranks
    # a decomposition's step is a 2-rank group that keeps its communicator's 8 ranks per node
    assert model.launch_shape(SR, model.p2p_group(Group("tp", 8, 8, 1)), 4 * 2**20, cfg)[0] == 2
    assert model.launch_shape(SR, Group("pp", 2, 2, 1), 100_000, cfg)[0] == 2  # 64 KiB parts at least
    few = model.comm_time(SR, Group("tp", 8, 8, 1), 64 * 2**20, cfg)
    assert few > model.comm_time(SR, Group("pp", 2, 2, 1), 64 * 2**20, cfg)


def test_a_send_over_pcie_gets_two_channels_per_peer():
    # A40 pairs: a group of 4 crosses the PCIe bridge, where NCCL gives a peer 2 channels
    model, cfg = CostModel(A40), CommConfig(channels=16)
    assert model.launch_shape(SR, Group("tp", 4, 4, 1), GIB, cfg)[0] == 2
    assert model.launch_shape(SR, Group("tp", 2, 2, 1), GIB, cfg)[0] == 16


def test_tree_all_reduce_halves_what_the_nic_carries_on_two_nodes():
    model, group, nbytes = CostModel(A100X2), Group("dp", 16, 8, 2), GIB
    ring = model.comm_time(AR, group, nbytes, CommConfig(channels=16))
    tree = model.comm_time(AR, group, nbytes, CommConfig(algorithm=Algorithm.TREE, channels=16))
    chunk = 512 * 2**10  # NCCL's own tree chunk: one step of the 4 MiB buffer a 2 MiB ring chunk sizes
    # three store-and-forward stages: two chunks' transmission on one IB channel
    fill = 2 * chunk / (A100X2.nccl.channel_gbps["ib"] * 1e9)
    # each node's NIC carries 2 (N-1)/N = 1 buffer per direction at 12.5 GB/s
    latency = (8.4 + 2 * (7 * 4.0 + 14.0)) * 1e-6
    assert tree == pytest.approx(latency + fill + nbytes / 12.5e9, rel=1e-12)
    assert ring > 1.8 * (tree - latency - fill)  # the ring's NIC carries 2 (n-1)/n = 1.875 buffers
    assert model.comm_peak_time(AR, group, nbytes) == pytest.approx(nbytes / 12.5e9, rel=1e-12)  # the tree's


def _nvls_fill(nbytes: int) -> float:
    """The H100's published-fit NVLS fill: its full value at large messages, half of it at the half size."""
    nccl = H100.nccl
    return nccl.nvls_fill_us * 1e-6 * nbytes / (nbytes + nccl.nvls_fill_half_mib * 2**20)


def test_nvls_each_gpu_carries_the_buffer_once():
    model, nbytes = CostModel(H100), GIB
    cfg = CommConfig(algorithm=Algorithm.NVLS, channels=16)
    # 16 CTAs x 36 GB/s exceed NCCL's 370.8 GB/s NVLink4 figure: the link, at the NVLS efficiency of it
    expected = 25e-6 + _nvls_fill(nbytes) + nbytes * 7 / 8 / (370.8e9 * H100.nccl.nvls_efficiency)
    assert model.comm_time(AR, Group("tp", 8, 8, 1), nbytes, cfg) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("ctas", [1, 2, 4, 8])
def test_nvls_under_a_cta_limit_runs_on_that_many_ctas_with_no_floor_of_two(ctas):
    # NCCL clamps its NVLS CTAs to NCCL_MAX_CTAS, down to one (ncclNvlsTuning); below ~10 CTAs they, not the
    # 370.8 GB/s link, bind: 36 GB/s each at the NVLS efficiency, so halving the CTAs doubles the transfer
    model, nbytes = CostModel(H100), GIB
    got = model.comm_time(AR, Group("tp", 8, 8, 1), nbytes, CommConfig(algorithm=Algorithm.NVLS, channels=ctas))
    expected = 25e-6 + _nvls_fill(nbytes) + nbytes * 7 / 8 / (ctas * 36e9 * H100.nccl.nvls_efficiency)
    assert got == pytest.approx(expected, rel=1e-12)


def test_the_nvls_fill_grows_with_the_message_and_levels_off():
    """Published 8-GPU sweeps run slower than latency plus bytes at the NVLS rate from 2 MiB up, by a fill that
    levels off at large messages: half of it at the half size, nearly all of it at 8 GiB, none without a fit."""
    group, cfg = Group("tp", 8, 8, 1), CommConfig(algorithm=Algorithm.NVLS, channels=16)
    fitted, bare = CostModel(H100), CostModel(replace(H100, nccl=replace(H100.nccl, nvls_fill_us=0.0)))
    half = int(H100.nccl.nvls_fill_half_mib * 2**20)
    fill = {n: fitted.comm_time(AR, group, n, cfg) - bare.comm_time(AR, group, n, cfg) for n in (1 << 20, half, 1 << 33)}
    assert H100.nccl.nvls_fill_us > 0
    assert fill[half] == pytest.approx(H100.nccl.nvls_fill_us * 1e-6 / 2, rel=1e-6)
    assert fill[1 << 20] < fill[half] < fill[1 << 33] < H100.nccl.nvls_fill_us * 1e-6
    assert fill[1 << 33] == pytest.approx(H100.nccl.nvls_fill_us * 1e-6, rel=0.01)


def test_nccls_pick_does_not_see_the_nvls_fill():
    """NCCL picks by its own tables, which have no fill: 8 H100s run NVLS from 2 MiB (NVIDIA/nccl-tests #309, its
    TUNING log) although, with the fill, ring LL is priced faster there; the pick is then priced with the fill."""
    point = OverlapPoint("ar", AR, Group("tp", 8, 8, 1), 2 << 20, None, None)
    model = CostModel(H100)
    ring = CommConfig(algorithm=Algorithm.RING, protocol=Protocol.LL, channels=32)
    nvls = CommConfig(algorithm=Algorithm.NVLS, protocol=Protocol.SIMPLE, channels=16)
    priced = {c.algorithm: model.comm_time(AR, point.group, point.bytes, c) for c in (ring, nvls)}
    assert priced[Algorithm.RING] < priced[Algorithm.NVLS]
    picked = nccl_choice(point, H100, CommConfig(channels=32), model)
    assert (picked.algorithm, picked.protocol) == (Algorithm.NVLS, Protocol.SIMPLE)
    assert model.as_nccl_tunes.hw.nccl.nvls_fill_us == 0 < model.hw.nccl.nvls_fill_us


def test_the_ring_fill_is_paid_per_step_at_a_known_size():
    """A fill of 10 us per step at large messages and half of it at a 1 MiB slice: 8 ranks on 8 MiB have 1 MiB slices,
    so an all-reduce (14 steps) pays 70 us more than without it, an all-gather (7 steps) 35 us, on every protocol;
    a send/recv, a two-node ring and NVLS pay nothing."""
    fill = replace(A100.nccl, ring_fill_us=10.0, ring_fill_half_mib=1.0)
    filled, bare = CostModel(replace(A100, nccl=fill)), CostModel(replace(A100, nccl=replace(fill, ring_fill_us=0.0)))
    node, nbytes = Group("tp", 8, 8, 1), 8 * 2**20
    for proto in Protocol:
        cfg = CommConfig(protocol=proto, channels=16)
        assert filled.comm_time(AR, node, nbytes, cfg) - bare.comm_time(AR, node, nbytes, cfg) == pytest.approx(70e-6, rel=1e-9)
        assert filled.comm_time(AG, node, nbytes, cfg) - bare.comm_time(AG, node, nbytes, cfg) == pytest.approx(35e-6, rel=1e-9)
    for coll, group in ((Collective.SEND_RECV, Group("pp", 2, 2, 1)), (AR, Group("dp", 16, 8, 2))):
        assert filled.comm_time(coll, group, nbytes, CommConfig()) == bare.comm_time(coll, group, nbytes, CommConfig())
    nvls_hw = replace(H100, nccl=replace(H100.nccl, ring_fill_us=10.0, ring_fill_half_mib=1.0))
    nvls = CommConfig(algorithm=Algorithm.NVLS, channels=16)
    assert CostModel(nvls_hw).comm_time(AR, node, nbytes, nvls) == CostModel(H100).comm_time(AR, node, nbytes, nvls)


def test_the_a100_ring_fill_levels_off_at_its_fitted_value():
    """The A100's published fit: 5.626 us per step once the slice is large (79 us on an 8-rank all-reduce of 1 GiB,
    14 steps of 128 MiB slices), half of it where the slice is 0.119 MiB (a 0.95 MiB buffer on 8 ranks)."""
    group, cfg = Group("tp", 8, 8, 1), CommConfig(channels=16)
    bare = CostModel(replace(A100, nccl=replace(A100.nccl, ring_fill_us=0.0)))
    added = {n: CostModel(A100).comm_time(AR, group, n, cfg) - bare.comm_time(AR, group, n, cfg)
             for n in (GIB, int(8 * 0.119 * 2**20))}
    assert added[GIB] == pytest.approx(14 * 5.626e-6 * 128 / (128 + 0.119), rel=1e-9)
    assert added[int(8 * 0.119 * 2**20)] == pytest.approx(14 * 5.626e-6 / 2, rel=1e-5)


def test_nccls_pick_does_not_see_the_ring_fill():
    """NCCL's tables have no ring fill: on 8 H100s given one, NCCL still runs ring LL at 1 MiB (its pick without the
    fill) although NVLS is then priced faster; the pick is priced with the fill."""
    hw = replace(H100, nccl=replace(H100.nccl, ring_fill_us=10.0, ring_fill_half_mib=0.01))
    point = OverlapPoint("ar", AR, Group("tp", 8, 8, 1), 1 << 20, None, None)
    model = CostModel(hw)
    ring = CommConfig(algorithm=Algorithm.RING, protocol=Protocol.LL, channels=32)
    nvls = CommConfig(algorithm=Algorithm.NVLS, protocol=Protocol.SIMPLE, channels=16)
    assert model.comm_time(AR, point.group, point.bytes, ring) > model.comm_time(AR, point.group, point.bytes, nvls)
    picked = nccl_choice(point, hw, CommConfig(channels=32), model)
    assert (picked.algorithm, picked.protocol) == (Algorithm.RING, Protocol.LL)
    assert model.as_nccl_tunes.hw.nccl.ring_fill_us == 0 < model.hw.nccl.ring_fill_us


def test_nccls_pick_prices_a_tree_beyond_two_nodes_at_the_network_rate():
    """NCCL's tuning (tuning.cc) takes a tree's bus bandwidth from its graph's network rate beyond two nodes (at 0.92,
    halved into the algorithm's), so it prices the buffer twice over the NICs where a ring moves 2 (n - 1) / n of it:
    on 3 A100 nodes it runs ring at 128 MiB though the tree, as it runs, is priced faster (NVIDIA/nccl-tests #119
    measured 96 GB/s, the NICs' rate). On two nodes, where its search raises the tree's rate to the NVLink side, it
    keeps the tree."""
    hw = with_cluster(A100X2, 8, 3)
    model = CostModel(hw)
    three, two = Group("dp", 24, 8, 3), Group("dp", 16, 8, 2)
    for group, want in ((three, Algorithm.RING), (two, Algorithm.TREE)):
        point = OverlapPoint("ar", AR, group, 128 << 20, None, None)
        tree = CommConfig(algorithm=Algorithm.TREE, channels=16)
        ring = CommConfig(algorithm=Algorithm.RING, channels=16)
        assert model.comm_time(AR, group, point.bytes, tree) < model.comm_time(AR, group, point.bytes, ring)
        assert nccl_choice(point, hw, CommConfig(channels=16), model).algorithm == want
    nic = hw.cluster.inter.gbps * 1e9
    tunes = model.as_nccl_tunes
    assert tunes._tree_time(three, 1 << 30, CommConfig(algorithm=Algorithm.TREE, channels=16), math.inf, 1.0) == \
        pytest.approx(2 * 2**30 / (0.92 * nic), rel=1e-12)
    assert model._tree_time(three, 1 << 30, CommConfig(algorithm=Algorithm.TREE, channels=16), math.inf, 1.0) == \
        pytest.approx(2 * 2**30 * 2 / 3 / nic, rel=1e-12)  # as it runs: 2 (N - 1) / N of it over the NICs


def test_a_tree_pays_its_protocols_payload_efficiency_on_the_network_as_a_ring_does():
    """LL sends a flag with each 4 bytes of payload, on the NIC as on NVLink: a NIC-bound tree on LL takes twice
    Simple's time, as a NIC-bound ring does, so NCCL's pick for T5's 156 MiB data-parallel all-reduce (2 ranks, one a
    node, 8 sharing the node's 100 Gb/s) is not LL, which the tree used to price as Simple less its latency."""
    model, group, nbytes = CostModel(A100X2), Group("dp", 2, 1, 2), 163790848
    for algo in (Algorithm.RING, Algorithm.TREE):
        t = {p: model.comm_time(AR, group, nbytes, CommConfig(algorithm=algo, protocol=p, channels=24)) for p in Protocol}
        assert t[Protocol.LL] == pytest.approx(2 * t[Protocol.SIMPLE], rel=0.01)
    point = OverlapPoint("ar", AR, group, nbytes, None, None)
    assert nccl_choice(point, A100X2, CommConfig(channels=24), model).protocol == Protocol.SIMPLE


def test_copy_engines_take_no_sms_but_still_move_hbm():
    model, group, nbytes = CostModel(H100), Group("tp", 8, 8, 1), GIB
    cfg = CommConfig(cta_policy=CTAPolicy.ZERO, channels=16)
    assert model.launch_shape(AG, group, nbytes, cfg) == (0, 0)
    t = model.comm_time(AG, group, nbytes, cfg)
    assert t == pytest.approx(7 * 2e-6 + nbytes * 7 / 8 / 360e9, rel=1e-12)
    assert model.sm_taken(cfg, model.launch_shape(AG, group, nbytes, cfg)[0]) == 0.0
    # copy engines read each byte from its source and write it to its peer: 2 HBM bytes per payload byte, where an
    # all-gather on SMs moves 3 (its FIFO written and read, the output written)
    assert model.comm_hbm_rate(AG, group, nbytes, t, cfg) == pytest.approx(nbytes * 7 / 8 * 2 / t)
    assert model.comm_hbm_rate(AG, group, nbytes, t, CommConfig(channels=16)) == pytest.approx(nbytes * 7 / 8 * 3 / t)
    assert model.comm_hbm_rate(AG, group, nbytes, t) == pytest.approx(nbytes * 7 / 8 * 3 / t)
    # a reduce-scatter under the same policy still runs on SMs and reduces: 3
    assert model.comm_hbm_rate(Collective.REDUCE_SCATTER, group, nbytes, t, cfg) == pytest.approx(nbytes * 7 / 8 * 3 / t)
    # reduce-scatter has no copy-engine version: it runs on SMs as under the default policy
    assert model.launch_shape(Collective.REDUCE_SCATTER, group, nbytes, cfg) == (16, 512)
    assert model.sm_taken(cfg, model.launch_shape(Collective.REDUCE_SCATTER, group, nbytes, cfg)[0]) > 0


def test_the_simulator_and_the_window_estimate_price_a_copy_engine_all_gather_at_two_hbm_bytes():
    """The step simulator and the search's window estimate pass the setting to the HBM rate: a GEMM beside a
    copy-engine all-gather is slowed by 2 HBM bytes per payload byte, not by an SM all-gather's 3."""
    from lagom.model.simulator import simulate
    from lagom.model.windows import running_instance
    from tests.helpers import synthetic_problem

    problem = synthetic_problem([(0.5, 10, 840), (0.5, 8000, 840)],
                                [{"collective": "all_gather", "mb": 500, "after": 0, "size": 8}], "h100-sxm-8x-400g")
    model, pt = CostModel(problem.hw), problem.graph.points[0]
    cfg = CommConfig(cta_policy=CTAPolicy.ZERO, priority=1)
    a, b = problem.graph.phases[0].segments[0]
    d_comm = model.comm_time(pt.collective, pt.group, pt.bytes, cfg, model.hbm_util(b))
    rate = {k: pt.bytes * 7 / 8 * k / d_comm for k in (2, 3)}
    d_b = {k: model.compute_time(b, (RunningComm(cfg, r, 0),)) for k, r in rate.items()}
    assert d_b[3] > d_b[2] * 1.01  # the rate shows in the GEMM's time
    assert d_comm < d_b[2]
    step = simulate(problem.graph, {pt.key: cfg}, model).step_s
    assert step == pytest.approx(model.compute_solo(a) + d_comm + (1 - d_comm / d_b[2]) * model.compute_solo(b), rel=1e-9)
    _, _, running = running_instance(cfg, pt, False, model.hbm_util(b), True, model)
    assert running.hbm_rate == pytest.approx(rate[2], rel=1e-12)


def test_chunks_after_the_first_of_each_step_pay_the_step_overhead():
    model, group = CostModel(A40), Group("tp", 2, 2, 1)
    cfg = CommConfig(channels=1, chunk_bytes=64 * 1024, by_tuner=True)  # the plugin asks for the chunk
    nbytes = 2**20  # one step of 512 KiB: 8 chunks, the first covered by NCCL's step latency
    rate = nbytes / 2 / (nbytes / 2 / 15e9 + 7 * 3e-6)
    assert model.comm_time(AG, group, nbytes, cfg) == pytest.approx((8.4 + 3.4) * 1e-6 + nbytes / 2 / rate, rel=1e-12)


def test_a_link_bound_channel_still_pays_its_waits():
    """8 A100 on NVSwitch, 1 GiB ring Simple all-reduce on NCCL's 24 channels: 24 x 20 GB/s would exceed the 240 GB/s
    link, so each channel copies its 78 MiB share at 10 GB/s, and still waits after each of its 2 MiB chunks but the
    first of each of the 14 steps (the fitted 3.033 us): the link no longer hides them. The ring fill is on top."""
    model, group, nbytes = CostModel(A100), Group("tp", 8, 8, 1), GIB
    assert A100.nccl.default_channels == 24
    share = nbytes * 14 / 8 / 24
    waits = (math.ceil(share / 2**20 / 2) - 14) * A100.nccl.step_overhead_us * 1e-6
    expected = (8.4 + 14 * 3.4) * 1e-6 + share / 10e9 + waits + _ring_fill(14, nbytes, 8)
    assert A100.nccl.step_overhead_us == 3.033
    assert model.comm_time(AR, group, nbytes, CommConfig(channels=24)) == pytest.approx(expected, rel=1e-12)
    # across nodes the link still bounds the channels together after their waits (the proxy forwards meanwhile)
    assert model.channel_bandwidth(group, CommConfig(channels=24), 2**21, share * 24, 14) > 10e9


def test_chunk_size_costs_both_ways():
    model, group = CostModel(A40), Group("dp", 16, 8, 2)
    times = {c: model.comm_time(AG, group, 64 * 2**20, CommConfig(channels=2, chunk_bytes=c, by_tuner=True))
             for c in (64 * 1024, 512 * 1024, 4 * 2**20)}
    # small chunks: the 3 us step overhead per chunk dominates one channel; large: the network fill grows
    assert times[64 * 1024] > times[512 * 1024] < times[4 * 2**20]


# -- links


def test_a40_nvlink_joins_pairs_and_larger_groups_go_at_pcie_speed():
    model, nbytes, cfg = CostModel(A40), GIB, CommConfig(channels=16)
    pair = model.comm_time(AG, Group("tp", 2, 2, 1), nbytes, cfg)
    four = model.comm_time(AG, Group("tp", 4, 4, 1), nbytes, cfg)
    # each of 16 channels copies 32 MiB at 1/16 of the 50 GB/s NVLink pair in 16 chunks of 2 MiB, then waits 3 us
    # after each chunk but the first (NCCL's step latency covers it)
    assert pair == pytest.approx((8.4 + 3.4) * 1e-6 + nbytes / 2 / 50e9 + 15 * 3e-6, rel=1e-12)
    assert four == pytest.approx((8.4 + 3 * 5.7) * 1e-6 + nbytes * 3 / 4 / 31.5e9 + 21 * 3e-6, rel=1e-12)  # 24 chunks, 3 steps
    pcie = load_hardware("a40-2x8-pcie")
    assert pcie.cluster.link_within_node(2).kind == "pcie"


def test_a40_fsdp_all_gather_two_channels_fill_the_bridge_and_more_only_take_sms():
    """Phi-2 FSDP's all-gather on the paper's cluster A: 16 ranks, 8 a node, 2 nodes. A ring crosses each
    node's NICs once, so the node's 2 x 400 Gbps (100 GB/s) caps all channels together, not 1/8 of it; the
    PCIe bridge between NVLink pairs (31.5 GB/s) is the bound. One channel moves 20 GB/s (the CTA's copy
    rate on PCIe and on the network hop alike), so two channels already reach the bridge."""
    model, group, nbytes = CostModel(A40), Group("dp", 16, 8, 2), 157_306_880
    bus = nbytes * 15 / 16
    assert model._links(group, "p2p")[0] == 31.5e9
    assert model.channel_peak(group, CommConfig()) == 20e9
    # Simple ring: base 8.4 + 14 PCIe steps x 5.7 + 1 network step x 14 us
    latency = (8.4 + 14 * 5.7 + 14.0) * 1e-6
    for channels, chunk in ((2, 684 * 1024), (8, 2 * 2**20), (61, 2 * 2**20)):
        # a chunk is at most a channel's share of one step's slice; it is staged through 3 proxy stages
        fill = 2 * min(chunk, bus / 15 / channels) / 20e9
        got = model.comm_time(AG, group, nbytes, CommConfig(channels=channels, chunk_bytes=chunk, by_tuner=True))
        assert got == pytest.approx(latency + fill + bus / 31.5e9, rel=1e-12), channels
    assert model.comm_time(AG, group, nbytes, CommConfig(channels=1)) > bus / 20e9
    # what the extra channels cost: one GEMM CTA slot (a whole A40 SM: 80 KiB + 80.3 KiB > 100 KiB) each
    assert [model.sm_taken(CommConfig(channels=c), c) for c in (2, 8, 61)] == [2, 8, 61]


def test_collectives_sharing_the_nic_each_get_their_share():
    model, group, nbytes = CostModel(A100X2), Group("dp", 2, 1, 2), GIB
    cfg = CommConfig(channels=64)
    alone = model.comm_time(AR, group, nbytes, cfg)
    shared = model.comm_time(AR, group, nbytes, cfg, nic_share=0.5)
    # one rank per node: 1/8 of the 12.5 GB/s NIC alone, 1/16 beside another communicator's collective
    bus = nbytes * 2 * 1 / 2
    assert shared - alone == pytest.approx(bus / (12.5e9 / 16) - bus / (12.5e9 / 8), rel=1e-9)


def test_all_to_all_peak_counts_the_cross_node_path():
    model, nbytes = CostModel(A100X2), GIB
    group = Group("ep", 16, 8, 2)
    # 8 of 15 peers are off-node: 8/16 of the buffer over 1/8 of the node's 12.5 GB/s NIC
    off = nbytes * 8 / 16 / (12.5e9 / 8)
    on = nbytes * 7 / 16 / 240e9
    assert model.comm_peak_time(A2A, group, nbytes) == pytest.approx(max(off, on), rel=1e-12)


# -- computation beside communication


def test_a_comm_cta_costs_the_gemm_ctas_it_leaves_no_room_for_whatever_its_threads():
    model = CostModel(A40)
    # an A40 SM holds one 80 KB GEMM CTA; NCCL's CTA needs 80.3 KB of shared memory: the SM is lost
    assert [model.sm_taken(CommConfig(channels=8, threads=t), 8) for t in (128, 256, 512)] == [8.0, 8.0, 8.0]
    small = replace(A40, gpu=replace(A40.gpu, gemm_cta=replace(A40.gpu.gemm_cta, smem_kb=16.0)))
    model = CostModel(small)
    # 16 KB GEMM CTAs of 256 x 168 registers: one per SM (registers); 160 comm threads x 96 registers
    # leave 50176 registers, room for it; 544 threads leave 13312: none
    assert model.sm_taken(CommConfig(channels=8, threads=128), 8) == 0.0
    assert model.sm_taken(CommConfig(channels=8, threads=512), 8) == 8.0


@pytest.mark.parametrize("preset", preset_names())
def test_on_every_preset_a_comm_cta_and_a_gemm_cta_never_share_an_sm(preset):
    # One GEMM CTA per SM on every shipped GPU, and NCCL's CTA (any thread count it launches) leaves no room
    # for it, as NCCL's maintainers say of its kernels (NVIDIA/nccl #689): so no comm CTA shares an SM's issue
    # slots with a GEMM CTA, and the model has no such term. A preset where they fit beside each other fails here.
    model = CostModel(load_hardware(preset))
    assert model.gemm_ctas_per_sm() == 1
    assert {model.footprint_slots_lost(t) for t in (64, 128, 288, 544, 640)} == {1}


def test_a_gemms_pipeline_fills_pay_the_l2_term_of_chunk_staging():
    """A GEMM's fills are HBM reads with no math to hide them, as a memory-bound kernel's bytes are: NCCL's chunks
    staged beside it (CTAs x chunk x buffers, against the L2) slow them by the same L2 term, and nothing else of it."""
    model, seg = CostModel(A100), ComputeSegment("gemm", 1e12, 1e8, 4096)
    fill = 4096 * (4 * 256 * 64 + 128 * 128) * 2 / (2039e9 * 0.85)
    staged = {chunk: model.compute_time(seg, (RunningComm(CommConfig(channels=24, chunk_bytes=chunk), 0.0, 24),))
              for chunk in (1 << 21, 1 << 12)}
    l2 = A100.contention.l2_interference
    small = min(1.0, 24 * (1 << 12) * 2 / (40.0 * 2**20))
    assert l2 > 0
    assert staged[1 << 21] - staged[1 << 12] == pytest.approx(fill * l2 * (1 - small), rel=1e-9)


def test_a_persistent_gemm_beside_24_ctas_takes_two_rounds():
    model = CostModel(H100)
    seg = ComputeSegment("gemm", 1e12, 1e8, 4096)  # 4096 tiles: the persistent grid is 132 CTAs
    assert model.grid(seg) == 132
    slowed = model.compute_time(seg, (RunningComm(CommConfig(channels=24), 0.0, 24),))
    fill = 132 * (6 * 256 * 64 + 128 * 128) * 2 / (3350e9 * 0.85)
    solo = 1e12 / (989e12 * 0.65)
    # 108 SMs left: 2 rounds; the fills pay the L2 term of 24 x 2 x 2 MiB staged (more than the 50 MB L2: x 1.3)
    assert slowed == pytest.approx((solo - fill) * 2 + fill * 1.3, rel=1e-12)
    assert slowed / model.compute_solo(seg) > 1.98
    tiled = CostModel(A100).compute_time(ComputeSegment("gemm", 1e12, 1e8, 4096), (RunningComm(CommConfig(channels=24), 0.0, 24),))
    assert tiled / CostModel(A100).compute_solo(ComputeSegment("gemm", 1e12, 1e8, 4096)) < 1.3  # tiles: 47 vs 38 waves


@pytest.mark.parametrize("tiles, ctas, waves", [(108, 0, (1, 1)), (108, 1, (2, 1)), (216, 8, (3, 2)), (200, 8, (2, 2))])
def test_a_tiled_gemms_last_wave_spills_when_comm_ctas_take_sms(tiles, ctas, waves):
    # A100: one 128x128 GEMM CTA per SM, 108 SMs; a comm CTA leaves no room for one. 108 tiles are one wave
    # alone and two beside a single comm CTA (107 SMs); 216 tiles three beside 8 (100 SMs), 200 tiles two
    # either way. The math stretches by the waves, the tiles' pipeline fills (HBM, no traffic here) do not; they pay
    # only the L2 term of the comm's staged chunks (ctas x 2 x 2 MiB of the 40 MB L2).
    model = CostModel(A100)
    seg = ComputeSegment("gemm", 1e11, 1e7, tiles)
    fill = tiles * (4 * 256 * 64 + 128 * 128) * 2 / (2039e9 * 0.85)
    solo = 1e11 / (312e12 * 0.7)
    l2 = 1 + 0.3 * min(1.0, ctas * 2 * 2**21 / (40.0 * 2**20))
    got = model.compute_time(seg, (RunningComm(CommConfig(channels=max(1, ctas)), 0.0, ctas),))
    assert got == pytest.approx((solo - fill) * waves[0] / waves[1] + fill * l2, rel=1e-12)


def test_hbm_traffic_slows_a_compute_bound_gemm_through_its_pipeline_fills():
    model = CostModel(A100)
    n = 4096
    seg = ComputeSegment("gemm", 2.0 * n**3, 3 * n * n * 2, (n // 128) ** 2)
    solo = model.compute_solo(seg)
    assert solo == pytest.approx(2.0 * n**3 / (312e12 * 0.7))  # compute-bound
    # NCCL issue 1428: 300 GB/s intra-node, at least 3 bytes of HBM per byte: 900 GB/s; copy engines (no SMs)
    rate = 900e9
    hbm = 2039e9 * 0.85
    fill = 1024 * (4 * 256 * 64 + 128 * 128) * 2 / hbm
    expected = (solo - fill) + fill * hbm / (hbm - rate)
    got = model.compute_time(seg, (RunningComm(CommConfig(cta_policy=CTAPolicy.ZERO), rate, 0),))
    assert got == pytest.approx(expected, rel=1e-12)
    # the slowdown is the HBM traffic's alone: copy engines with no traffic leave the GEMM at its solo time,
    # and more traffic slows it more
    zero = CommConfig(cta_policy=CTAPolicy.ZERO)
    assert model.compute_time(seg, (RunningComm(zero, 0.0, 0),)) == pytest.approx(solo, rel=1e-12)
    assert model.compute_time(seg, (RunningComm(zero, 1.2e12, 0),)) > got


def test_memory_bound_kernels_lose_the_hbm_the_comm_takes():
    model = CostModel(A100)
    seg = ComputeSegment("norm", 0.0, 1e9, 10_000)
    hbm = 2039e9 * 0.85
    got = model.compute_time(seg, (RunningComm(CommConfig(cta_policy=CTAPolicy.ZERO), 500e9, 0),))
    assert got == pytest.approx(1e9 / (hbm - 500e9), rel=1e-12)
    assert not math.isclose(got, model.compute_solo(seg))
