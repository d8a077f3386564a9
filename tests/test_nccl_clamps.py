"""NCCL's clamps on a tuner's chunk and channels (v2.30.7), and that the search, the cost model and the
emitter plan what NCCL runs.

The facts the tests build on are restated from NCCL's source, not from Lagom's: NCCL_STEPS = 8; a
tuner chunk is cut to buffer / 8 x chunkSteps (4 for ring Simple all-reduce, all-gather,
reduce-scatter, else 1) and rounded down to the grain (LL 16, LL128 1920, Simple 512); LL's buffer is
512 KiB (largest chunk 32 KiB), LL128's 4,915,200 B (576,000 B); the P2P chunk is 512 KiB on NVLink,
128 KiB on PCIe or the network, cut to NCCL_BUFFSIZE / 8; NVLS slots are NCCL_NVLS_CHUNKSIZE (128 KiB).
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import replace

import pytest

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.model.choices import candidates
from lagom.model.cost_model import CostModel
from lagom.nccl_tuner import build
from lagom.plan import emit
from lagom.plan.capability import Capability, channel_cap, chunk_ceiling, nccl_chunk
from lagom.plan.comm_config import (
    Algorithm,
    CommConfig,
    Protocol,
    SearchSpace,
    chunk_choices,
    communicator_knobs,
    run_chunk,
)
from lagom.search import Problem, run_strategy
from lagom.step.graph import Collective, Group
from tests.helpers import synthetic_problem
from tests.test_nccl_tuner import PROTO, Comm, TunerV6, compiler_or_skip, cost_table, entry, make_plan, nccl_choice

KIB, MIB = 1 << 10, 1 << 20
H100 = load_hardware("h100-sxm-8x-400g")
NVLS_ALGO = 4  # NCCL_ALGO_NVLS


# -- the one function: what NCCL runs


@pytest.mark.parametrize(("algorithm", "protocol", "collective", "buffsize", "ceiling"), [
    ("ring", "Simple", "all_reduce", 4 * MIB, 2 * MIB),  # 4 steps of 512 KiB
    ("ring", "Simple", "all_gather", 8 * MIB, 4 * MIB),
    ("ring", "Simple", "broadcast", 4 * MIB, 512 * KIB),  # broadcast and reduce: one step
    ("tree", "Simple", "all_reduce", 4 * MIB, 512 * KIB),
    ("nvls", "Simple", "all_reduce", 16 * MIB, 128 * KIB),  # Lagom's cap: one NVLS slot
    ("ring", "LL", "all_reduce", 64 * MIB, 32 * KIB),  # NCCL_BUFFSIZE does not size LL's buffer
    ("tree", "LL128", "all_reduce", 64 * MIB, 576_000),
])
def test_a_chunk_is_cut_to_its_protocols_buffer_and_grain(algorithm, protocol, collective, buffsize, ceiling):
    assert chunk_ceiling(algorithm, protocol, collective, buffsize) == ceiling
    assert nccl_chunk(algorithm, protocol, collective, 64 * MIB, buffsize) == ceiling
    assert nccl_chunk(algorithm, protocol, collective, None, buffsize) == ceiling  # no tuner: NCCL's own


def test_a_chunk_is_rounded_down_to_the_grain_and_never_below_it():
    assert nccl_chunk("ring", "LL128", "all_reduce", 256 * KIB, 4 * MIB) == 136 * 1920  # 262,144 -> 261,120
    assert nccl_chunk("ring", "Simple", "all_reduce", 1000, 4 * MIB) == 512
    assert nccl_chunk("ring", "LL", "all_reduce", 1, 4 * MIB) == 16


def test_a_smaller_buffer_shrinks_the_p2p_chunk_whatever_is_asked():
    assert nccl_chunk("ring", "Simple", "send_recv", 4 * MIB, 4 * MIB, link="nvlink") == 512 * KIB
    assert nccl_chunk("ring", "Simple", "all_to_all", 64 * KIB, 4 * MIB, link="net") == 128 * KIB
    assert nccl_chunk("ring", "Simple", "send_recv", 4 * MIB, 1 * MIB, link="nvlink") == 128 * KIB  # 1 MiB / 8


@pytest.mark.parametrize(("call", "key"), [
    (lambda: nccl_chunk("ring", "LL64", "all_reduce", 1, 4 * MIB), "protocol"),
    (lambda: nccl_chunk("collnet", "Simple", "all_reduce", 1, 4 * MIB), "algorithm"),
    (lambda: chunk_ceiling("ring", "Simple", "all_reduce", 0), "NCCL_BUFFSIZE"),
    (lambda: Capability(buffsize=1024), "capability.buffsize"),
    (lambda: Capability(nvls_chunk=100), "capability.nvls_chunk"),
    (lambda: channel_cap("ring", 1, 0), "max_channels"),
])
def test_bad_inputs_name_the_key(call, key):
    with pytest.raises(ConfigError) as err:
        call()
    assert err.value.key == key


def test_without_get_chunk_size_the_chunk_is_the_buffers_for_every_algorithm():
    """NCCL 2.28 (no getChunkSize): a config's chunk sizes NCCL_BUFFSIZE (two ring chunks) and NCCL runs
    that buffer's chunk; the plugin's v6 asks for the chunk itself, in a buffer sized for it."""
    per_process, per_size = Capability("2.28"), Capability()
    assert per_process.run_chunk("tree", "Simple", "all_reduce", 2 * MIB) == 512 * KIB
    assert per_process.run_chunk("ring", "Simple", "send_recv", 64 * KIB) == 16 * KIB  # 128 KiB buffer / 8
    assert per_size.run_chunk("tree", "Simple", "all_reduce", 2 * MIB) == 2 * MIB
    assert per_size.run_chunk("ring", "Simple", "send_recv", 64 * KIB) == 512 * KIB  # the buffer never shrinks
    live = replace(per_size, buffsize=4 * MIB)  # NCCL read the start plan's buffer once: a live chunk is cut to it
    assert live.run_chunk("ring", "Simple", "all_reduce", 4 * MIB) == 2 * MIB
    assert live.run_chunk("tree", "Simple", "all_reduce", 2 * MIB, asked=False) == 512 * KIB


# -- the search offers only chunks that run, each once


def _point(collective: str = "all_reduce", group: str = "tp"):
    problem = synthetic_problem([(1.0, 100.0, 300)] * 3, [{"collective": collective, "mb": 8.0, "after": 0,
                                                            "before": 2, "group": group}], hardware="h100-sxm-8x-400g")
    return problem.keys[next(iter(problem.keys))][0]


def test_each_protocol_is_offered_the_distinct_chunks_it_runs():
    point, space = _point(), SearchSpace().under(Capability(nvls=True))
    offered = {(a, p): chunk_choices(point, a, p, H100, space)
               for a, p in ((Algorithm.RING, Protocol.LL), (Algorithm.RING, Protocol.LL128),
                            (Algorithm.RING, Protocol.SIMPLE), (Algorithm.NVLS, Protocol.SIMPLE))}
    assert offered[Algorithm.RING, Protocol.LL] == [8 * KIB, 16 * KIB, 32 * KIB]  # below 64 KiB: LL needs them
    assert offered[Algorithm.RING, Protocol.LL128] == [34 * 1920, 68 * 1920, 136 * 1920, 273 * 1920, 576_000]
    assert offered[Algorithm.RING, Protocol.SIMPLE] == [64 * KIB * 2**i for i in range(7)]
    assert offered[Algorithm.NVLS, Protocol.SIMPLE] == [64 * KIB, 128 * KIB]
    # a live search under the start plan's 1 MiB buffer: nothing above its ring chunk
    live = SearchSpace().under(replace(Capability(), buffsize=1 * MIB))
    assert chunk_choices(point, Algorithm.RING, Protocol.SIMPLE, H100, live) == [64 * KIB, 128 * KIB, 256 * KIB, 512 * KIB]
    assert chunk_choices(_point("all_to_all", "ep"), Algorithm.RING, Protocol.SIMPLE, H100, space) == [512 * KIB]


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "all_to_all"])
def test_every_candidate_keeps_the_chunk_nccl_runs_and_none_collapse(collective):
    point = _point(collective, "tp" if collective != "all_to_all" else "ep")
    space = SearchSpace(splits=()).under(Capability(nvls=True, nvlink_domain=True))
    offered = candidates(point, H100, space)
    model = CostModel(H100, space.capability)
    for cfg in offered:
        if model.uses_copy_engines(point.collective, cfg):
            continue  # copy engines ask NCCL for no chunk
        assert model.run_chunk(point.collective, point.group, cfg) == cfg.chunk_bytes, cfg.describe()
    assert len(offered) == len(set(offered))


def test_a_tuned_plan_emits_the_chunks_and_channels_it_planned():
    problem = synthetic_problem([(0.5, 50.0, 300)] * 5, [
        {"collective": "all_reduce", "mb": mb, "after": j, "before": j + 2, "group": "tp"}
        for j, mb in enumerate((0.02, 0.5, 64.0))], hardware="h100-sxm-8x-400g")
    problem = Problem(problem.graph, problem.hw, SearchSpace(threads=(512,), priorities=(0,), splits=()),
                      capability=Capability(nvls=True))
    found = run_strategy("lagom", problem)
    plan = make_plan([entry("tp", 8, 1, "all_reduce", problem.keys[k][0].bytes, str(c.algorithm), str(c.protocol),
                            channels=c.channels, chunk=c.chunk_bytes) for k, c in found.configs.items()], world_size=8)
    rules = {line.split("#")[1].strip(): line.split("#")[0].split() for line in emit.tuner_rules(plan).splitlines()
             if line.startswith("allreduce")}
    tuned = {k: c for k, c in found.configs.items() if c.by_tuner}
    assert tuned and all(c.chunk_bytes in (8 * KIB, 16 * KIB, 32 * KIB) for c in tuned.values() if c.protocol == "LL")
    for key, cfg in tuned.items():  # what the search planned is what the rule asks for, and NCCL runs it
        assert (int(rules[key][7]), int(rules[key][8])) == (cfg.channels, cfg.chunk_bytes), key


# -- the cost model prices the chunk and channels that run


def test_ll_chunks_the_buffer_cuts_cost_the_same_and_a_small_buffer_slows_p2p():
    model, group = CostModel(H100), Group("tp", 8, 8, 1)
    ll = CommConfig(protocol=Protocol.LL, channels=8, by_tuner=True)
    assert model.comm_time(Collective.ALL_REDUCE, group, 64 * MIB, replace(ll, chunk_bytes=4 * MIB)) == \
        model.comm_time(Collective.ALL_REDUCE, group, 64 * MIB, replace(ll, chunk_bytes=32 * KIB))
    per_process = CostModel(H100, Capability("2.28"))  # the chunk sizes NCCL_BUFFSIZE, and so the P2P chunk
    pair = Group("pp", 2, 1, 2)
    small = per_process.comm_time(Collective.SEND_RECV, pair, 64 * MIB, CommConfig(chunk_bytes=64 * KIB))
    large = per_process.comm_time(Collective.SEND_RECV, pair, 64 * MIB, CommConfig(chunk_bytes=2 * MIB))
    assert small > large
    assert run_chunk(CommConfig(chunk_bytes=64 * KIB), "send_recv", pair, H100, Capability("2.28")) == 16 * KIB


def test_the_plugins_channels_are_not_trimmed_for_small_messages():
    """NCCL trims its own channel count for a small message; a tuner's count replaces it as it is."""
    model, group = CostModel(H100), Group("tp", 8, 8, 1)
    nccls = CommConfig(channels=32, threads=512)
    assert model.launch_shape(Collective.ALL_GATHER, group, 64 * KIB, nccls)[0] < 32
    assert model.launch_shape(Collective.ALL_GATHER, group, 64 * KIB, replace(nccls, by_tuner=True))[0] == 32


# -- channels: the topology, NVLS CTAs


def test_channel_cap_follows_the_communicator_and_nvls_ctas():
    assert channel_cap("ring", 1, 32) == 32
    assert channel_cap("ring", 2, 64, max_ctas=8) == 8
    assert channel_cap("nvls", 1, 32) == 16  # NCCL's own NVLS CTAs where the communicator sets none
    assert channel_cap("nvls", 1, 32, nvls_ctas=24) == 24
    assert channel_cap("nvls", 1, 32, nvls_ctas=24, max_ctas=8) == 8  # NCCL clamps NVLS CTAs into the CTA range
    assert channel_cap("nvls", 2, 8, nvls_ctas=24) == 8  # NCCL does not clamp across nodes: Lagom does


def test_the_search_offers_no_channels_the_topology_lacks():
    hw = replace(H100, nccl=replace(H100.nccl, max_channels=16))
    point = _point()
    for cfg in candidates(point, hw, SearchSpace(splits=()).under(Capability(nvls=True))):
        assert cfg.channels <= 16, cfg.describe()
    assert "nvls_ctas" in communicator_knobs(Capability(nvls=True))


def test_a_communicators_cta_range_admits_its_nvls_ctas():
    plan = make_plan([entry("tp", 8, 1, "all_reduce", 8 * MIB, "nvls", "Simple", channels=32, chunk=128 * KIB),
                      entry("tp", 8, 1, "all_reduce", 64 * KIB, "ring", "LL", channels=4, chunk=32 * KIB)], world_size=8)
    cfg = emit.communicator_configs(plan)["tp"]
    assert (cfg["nvls_ctas"], cfg["max_ctas"], cfg["min_ctas"]) == (32, 32, 4)


# -- the emitter: rules and NCCL_BUFFSIZE


def test_rules_carry_the_chunk_nccl_runs_and_the_buffer_fits_every_rule():
    plan = make_plan([entry("tp", 8, 1, "all_reduce", 1 * MIB, "ring", "LL", chunk=1 * MIB),
                      entry("tp", 8, 1, "all_reduce", 64 * MIB, "nvls", "Simple", channels=16, chunk=4 * MIB),
                      entry("tp", 8, 1, "all_gather", 8 * MIB, "ring", "LL128", chunk=2 * MIB)], world_size=8)
    chunks = {line.split("#")[1].strip(): int(line.split()[8]) for line in emit.tuner_rules(plan).splitlines()
              if "  # " in line}
    assert chunks == {"tp/all_reduce/1048576": 32 * KIB, "tp/all_reduce/67108864": 128 * KIB,
                      "tp/all_gather/8388608": 576_000}
    assert emit.buffsize(plan) == 4 * MIB  # never below NCCL's default: P2P chunks stay whole
    tree = make_plan([entry("dp", 16, 2, "all_reduce", 64 * MIB, "tree", "Simple", chunk=1 * MIB)])
    assert emit.buffsize(tree) == 8 * MIB  # a tree chunk is one step: 8 of them
    per_process = make_plan([entry("dp", 16, 2, "all_to_all", 64 * MIB, chunk=64 * KIB)])
    per_process.capability = Capability("2.28").to_dict()
    per_process.process = {"threads": 512, "transport": "p2p", "chunk_bytes": 64 * KIB}
    assert emit.buffsize(per_process) == 128 * KIB  # NCCL_BUFFSIZE is the chunk's knob: two ring chunks


# -- the plugin caps an NVLS rule's chunk at NCCL_NVLS_CHUNKSIZE when it reads the rule


@pytest.fixture
def fresh_v6(tmp_path) -> TunerV6:
    """The plugin built from this checkout's sources (the installed library may predate them)."""
    compiler_or_skip()
    return TunerV6.in_dll(ctypes.CDLL(str(build.compile_plugin(tmp_path / "plugin.so", ["-Werror"]))),
                          "ncclTunerPlugin_v6")


@pytest.mark.parametrize(("env", "nvls_chunk"), [(None, 128 * KIB), ("65536", 64 * KIB), ("junk", 128 * KIB)])
def test_the_plugin_asks_nvls_for_no_more_than_a_slot(fresh_v6, tmp_path, monkeypatch, env, nvls_chunk):
    path = tmp_path / "rules.lagom"
    path.write_text("lagom-nccl-tuner 1\nworld 8\n"
                    f"allreduce 1000 {64 * MIB} 8 1 nvls simple 16 {4 * MIB}\n"
                    f"allgather 1000 {64 * MIB} 8 1 ring simple 16 {4 * MIB}\n")
    monkeypatch.setenv("LAGOM_NCCL_TUNER_FILE", str(path))
    monkeypatch.setenv("WORLD_SIZE", "8")
    if env is None:
        monkeypatch.delenv("NCCL_NVLS_CHUNKSIZE", raising=False)
    else:
        monkeypatch.setenv("NCCL_NVLS_CHUNKSIZE", env)
    comm = Comm(fresh_v6, 8, 1)
    for collective, algo, want in (("all_reduce", NVLS_ALGO, nvls_chunk), ("all_gather", 1, 4 * MIB)):
        after, channels = comm.coll_info(collective, 8 * MIB, cost_table(ignored=()))
        assert nccl_choice(after) == (algo, PROTO["Simple"]) and channels == 16
        assert comm.chunk(collective, MIB, algo, PROTO["Simple"]) == want
    comm.close()


def test_offered_chunks_are_sorted_and_distinct_for_every_subspace():
    point, space = _point(), SearchSpace().under(Capability(nvls=True))
    for algo, proto in itertools.product(Algorithm, Protocol):
        offered = chunk_choices(point, algo, proto, H100, space)
        assert offered == sorted(set(offered)) and offered
