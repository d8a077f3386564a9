"""Overlap points derived from workloads: which collectives, on which groups, with how many bytes."""

import gc
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lagom.hardware import load_hardware
from lagom.step.buckets import deepspeed_buckets
from lagom.step.graph import Collective, make_groups
from lagom.step.points import points_for, rank_params
from lagom.step.workload import load_workload
from tests.helpers import gpt_workload, random_workload, write_yaml

WORKLOADS = Path(__file__).resolve().parent.parent / "configs" / "workloads"


def load(tmp_path, hardware="a100-8x-100g", **override):
    return load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload(**override))), load_hardware(hardware)


def test_tensor_parallel_sequence_parallel_points_per_layer(tmp_path):
    wl, hw = load(tmp_path, parallel={"tp": 2, "dp": 4, "sequence_parallel": True})
    graph = points_for(wl, hw)
    last = next(ph for ph in graph.phases if ph.name == "last")
    act = 2 * 512 * 256 * 2  # micro_batch x seq x hidden x bf16: the gathered activation
    layer0 = [p for p in last.points if ".L0." in p.name]
    kinds = Counter((p.collective, ".bwd." in p.name) for p in layer0)
    # forward: AG before qkv and fc1, RS after proj and fc2; backward: AG x4 (2 re-gathers for wgrad), RS x2
    assert kinds == {(Collective.ALL_GATHER, False): 2, (Collective.REDUCE_SCATTER, False): 2,
                     (Collective.ALL_GATHER, True): 4, (Collective.REDUCE_SCATTER, True): 2}
    assert {p.bytes for p in layer0} == {act} and {p.group.name for p in layer0} == {"tp"}
    fwd_ag = next(p for p in layer0 if p.name.endswith("attn.qkv.ag"))
    assert fwd_ag.before == fwd_ag.fuse_with == "last.L0.attn.qkv"  # blocking, and fusable with its GEMM
    wgrad_ag = next(p for p in layer0 if p.name.endswith("attn.qkv.bwd.ag"))
    assert wgrad_ag.before == "last.L0.attn.qkv.wgrad"  # hidden under the input-gradient GEMM


def test_data_parallel_buckets_cover_every_parameter_once(tmp_path):
    wl, hw = load(tmp_path, parallel={"tp": 2, "dp": 4, "sequence_parallel": True}, framework={"bucket_size": 300_000})
    graph = points_for(wl, hw)
    buckets = [p for p in graph.points if "grad.bucket" in p.name]
    assert all(p.phase == "last" and p.collective == Collective.ALL_REDUCE and p.group.name == "dp" for p in buckets)
    h, ffn, vocab = 256, 1024, 1024
    per_layer = (h * 3 * h + h * h + 2 * h * ffn) / 2 + 4 * h  # tp=2 shards the linears; norms replicated
    expected = (2 * per_layer + vocab * h / 2 + 2 * h) * 4  # the final norm; fp32 gradients
    assert sum(p.bytes for p in buckets) == expected  # no distributed optimizer: no padding
    assert len(buckets) >= 2 and all(p.after is not None and p.before is None for p in buckets)


def test_zero3_gathers_each_layer_in_forward_and_backward_with_prefetch(tmp_path):
    wl, hw = load(tmp_path, parallel={"tp": 1, "dp": 8, "sequence_parallel": False, "zero_stage": 3},
                  framework={"name": "deepspeed"})
    graph = points_for(wl, hw)
    ags = [p for p in graph.phases[-1].points if p.name.endswith("param_ag")]
    assert len(ags) == 2 * wl.model.layers
    second = next(p for p in ags if p.name == "last.L1.param_ag")
    assert second.after == "last.embed"  # released when layer 0 starts: one layer of prefetch
    rs = [p for p in graph.phases[-1].points if p.collective == Collective.REDUCE_SCATTER]
    # one bucket of DeepSpeed's default 500M elements holds every gradient: reduced once backward is done
    assert [p.name for p in rs] == ["last.grad.bucket0"] and rs[0].after == "last.embed.bwd"
    assert rs[0].bytes == (rank_params(wl) + 2 * wl.model.hidden) * 4  # fp32 gradients, the final LayerNorm too


def test_deepspeed_buckets_follow_deepspeeds_flush_rule():
    # a bucket is reduced when the next gradient would not fit; a gradient larger than a bucket goes alone;
    # empty tensors are skipped and an empty bucket is never reduced
    assert deepspeed_buckets([3, 3, 3, 0, 10, 2, 2], 7) == [6, 3, 10, 4]
    assert deepspeed_buckets([8], 7) == [8]
    assert deepspeed_buckets([], 7) == []


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_buckets_are_cut_from_the_jobs_own_tensors(tmp_path, stage):
    """With the job's gradient sizes in the workload, the plan's gradient buckets are exactly the ones DeepSpeed's
    rule cuts from them, in backward order, each after the backward block whose share of elements it closes at."""
    wl, hw = load(tmp_path, parallel={"tp": 1, "dp": 8, "sequence_parallel": False, "zero_stage": stage},
                  framework={"name": "deepspeed", "reduce_bucket_size": 300_000})
    tensors = [70_000, 250_000, 120_000, 90_000, 400_000, 60_000]
    wl = replace(wl, framework=replace(wl.framework, grad_tensors=tensors))
    coll = Collective.REDUCE_SCATTER if stage == 3 else Collective.ALL_REDUCE
    phase = points_for(wl, hw).phases[-1]
    graph_points = phase.points
    buckets = [p for p in graph_points if p.collective == coll and ".grad.bucket" in p.name]
    assert [p.bytes for p in buckets] == [n * 4 for n in deepspeed_buckets(tensors, 300_000)] == [
        70_000 * 4, 250_000 * 4, 210_000 * 4, 400_000 * 4, 60_000 * 4]
    assert [p.name for p in buckets] == [f"last.grad.bucket{n}" for n in range(5)]
    order = [seg.name for seg in phase.segments[0]]
    placed = [order.index(p.after) for p in buckets]
    assert placed == sorted(placed) and buckets[0].after == "last.L1.ln1.bwd"  # the 2nd layer's backward (7% in)
    assert buckets[-1].after == "last.embed.bwd"  # the last bucket closes with the embedding's backward


def test_pipeline_1f1b_sends_activations_and_gradients(tmp_path):
    wl, hw = load(tmp_path, "v100-4x-25g", model={"layers": 4}, parallel={"tp": 1, "dp": 1, "pp": 4, "sequence_parallel": False},
                  training={"micro_batch": 2, "global_batch": 8})
    graph = points_for(wl, hw)
    sends = [p for p in graph.points if p.collective == Collective.SEND_RECV]
    m = wl.microbatches
    assert m == 4 and len(sends) == 2 * m * (wl.parallel.pp - 1)
    assert {p.group.nodes for p in sends} == {2}  # one GPU per host: every hop crosses the network
    assert graph.devices == 4 and len(graph.phases) == 1


def test_moe_all_to_all_and_groups(tmp_path):
    wl, hw = load(tmp_path, "a40-2x8-nvlink",
                  model={"architecture": "moe", "experts": 8, "top_k": 2, "moe_ffn": 512, "shared_experts": 1},
                  parallel={"tp": 1, "dp": 16, "ep": 8, "sequence_parallel": False}, training={"global_batch": 32})
    graph = points_for(wl, hw)
    a2a = [p for p in graph.phases[-1].points if p.collective == Collective.ALL_TO_ALL]
    assert len(a2a) == 4 * wl.model.layers  # dispatch + combine, forward and backward
    assert {p.group.name for p in a2a} == {"ep"} and a2a[0].bytes == 2 * 512 * 2 * 256 * 2
    groups = make_groups(wl, hw)
    assert (groups["ep"].size, groups["ep"].nodes) == (8, 1) and (groups["dp"].size, groups["dp"].nodes) == (16, 2)


def test_t5_decoder_has_cross_attention(tmp_path):
    wl, hw = load(tmp_path, model={"architecture": "t5", "decoder_layers": 2})
    names = [s.name for ph in points_for(wl, hw).phases for segs in ph.segments.values() for s in segs]
    assert any(".L3.xattn.kv" in n for n in names) and not any(".L0.xattn" in n for n in names)


def test_context_parallel_ring_exchange_runs_through_the_search(tmp_path):
    from lagom.search import run_strategy
    from lagom.tune import problem_for

    wl, hw = load(tmp_path, "h100-sxm-8x-400g", parallel={"tp": 2, "cp": 2, "dp": 2})
    problem = problem_for(wl, hw)
    cp_keys = [k for k in problem.keys if k.startswith("cp/send_recv")]
    assert len(cp_keys) == 2  # forward K/V blocks and backward (twice the bytes)
    result = run_strategy("lagom", problem)
    assert set(cp_keys) <= set(result.result.per_key()) and result.result.step_s > 0


def test_sharded_parameters_with_a_pipeline_reduce_per_layer_only(tmp_path):
    wl, hw = load(tmp_path, model={"layers": 4}, parallel={"tp": 1, "dp": 4, "pp": 2, "fsdp": True,
                                                           "sequence_parallel": False})
    points = points_for(wl, hw).points
    assert not [p for p in points if "grad.bucket" in p.name]
    assert len([p for p in points if p.name.endswith("grad_rs")]) == wl.model.layers * wl.microbatches


def test_moe_gradients_split_dense_over_dp_and_experts_over_expt_dp(tmp_path):
    moe = {"architecture": "moe", "experts": 8, "top_k": 2, "moe_ffn": 512}
    wl, hw = load(tmp_path, "a40-2x8-nvlink", model=moe, parallel={"tp": 1, "dp": 16, "ep": 8, "sequence_parallel": False},
                  training={"global_batch": 32})
    buckets = [p for p in points_for(wl, hw).points if "grad.bucket" in p.name]
    expert = [p for p in buckets if p.name.endswith(".expert")]
    assert {p.group.name for p in expert} == {"expt_dp"} and {p.group.size for p in expert} == {2}
    per_layer_experts = 8 / 8 * 256 * 512 * 2  # one expert per rank, fc1 + fc2
    assert sum(p.bytes for p in expert) == int(wl.model.layers * per_layer_experts * 4)
    wl1, hw1 = load(tmp_path, "a100-8x-100g", model=moe, parallel={"tp": 1, "dp": 8, "ep": 1, "sequence_parallel": False})
    graph = points_for(wl1, hw1)  # ep = 1: experts replicated, no all-to-all, expert grads with the dense ones
    assert not [p for p in graph.points if p.collective == Collective.ALL_TO_ALL]
    assert {p.group.name for p in graph.points if "grad.bucket" in p.name} == {"dp"}


def test_megatron_bucket_layout_rules_by_hand():
    """megatron-core 0.19's layout on four tensors (registration order), computed by hand."""
    from lagom.step.buckets import Bucket, ParamTensor, megatron_buckets

    tensors = [ParamTensor(100, 0, "embed"), ParamTensor(30, 1, 0), ParamTensor(70, 2, 1), ParamTensor(50, 3, 1)]

    def sizes(buckets: list[Bucket]) -> list[int]:
        return [bucket.numel for bucket in buckets]

    # reverse order, a bucket closes at >= 100 elements: 50+70, then 30+100; no padding without the optimizer
    assert megatron_buckets(tensors, 100, 4, False) == [Bucket(120, 1, 2), Bucket(130, "embed", 0)]
    assert sizes(megatron_buckets(tensors, None, 4, False)) == [250]  # no overlap / later pipeline stage
    # distributed optimizer: tensors start on 64-element boundaries, buckets end on multiples of lcm(dp, 128)
    assert sizes(megatron_buckets(tensors, 100, 4, True)) == [256, 256]  # 50 @0, 70 @64 -> 134 -> 256; 30, 100 @320 -> 420 -> 512
    assert sizes(megatron_buckets(tensors, 100, 3, True)) == [384, 384]  # lcm(3, 128) = 384
    assert sizes(megatron_buckets(tensors, 100, 4, True, pad_for_busbw=True)) == [2**16, 2**16]
    # a shared (tied, pipelined) embedding closes the open bucket and gets one of its own
    shared = [ParamTensor(100, 0, "embed", shared_embedding=True), *tensors[1:]]
    assert sizes(megatron_buckets(shared, 100, 4, True)) == [256, 128, 128]  # 30 @256 closes at 320 -> 384
    assert sizes(megatron_buckets(shared, None, 4, True)) == [256, 128]
    assert sizes(megatron_buckets(shared, 100, 4, False)) == [120, 130]  # only the optimizer's layout splits it


PIPELINES = [  # (hardware, overrides): pipelines whose blocks differ in kind (t5, moe, cp, fsdp, zero-2 style grads)
    ("a100-8x-100g", {"model": {"layers": 4}, "parallel": {"tp": 2, "dp": 1, "pp": 4}}),
    ("a100-8x-100g", {"model": {"architecture": "t5", "layers": 2, "decoder_layers": 2},
                      "parallel": {"tp": 2, "dp": 1, "pp": 4}}),
    ("a40-2x8-nvlink", {"model": {"architecture": "moe", "layers": 4, "experts": 4, "top_k": 2, "moe_ffn": 512,
                                  "shared_experts": 1},
                        "parallel": {"tp": 1, "dp": 4, "ep": 2, "pp": 2, "sequence_parallel": False}}),
    ("h100-sxm-8x-400g", {"model": {"layers": 4}, "parallel": {"tp": 2, "cp": 2, "dp": 1, "pp": 2}}),
    ("a100-8x-100g", {"model": {"layers": 4}, "parallel": {"tp": 1, "dp": 4, "pp": 2, "fsdp": True,
                                                            "sequence_parallel": False}}),
]


def test_stamped_pipeline_graph_is_the_graph_built_block_by_block(tmp_path):
    """Stamping each stage's forward and backward for every micro-batch gives the graph the model's
    arithmetic gives block by block: every segment, collective and wiring equal, with odd micro-batch
    counts, fewer micro-batches than stages (all warm-up and cool-down) and many."""
    from lagom.model.cost_model import CostModel
    from lagom.model.simulator import simulate

    for hardware, overrides in PIPELINES:
        pp, dp = overrides["parallel"]["pp"], overrides["parallel"]["dp"]
        for m in (1, 3, 2 * pp + 3):
            wl, hw = load(tmp_path, hardware, training={"micro_batch": 1, "global_batch": m * dp}, **overrides)
            stamped, built = points_for(wl, hw), points_for(wl, hw, stamped=False)
            assert stamped == built, (overrides, m)
            assert len(stamped.points) == len({p.name for p in stamped.points})
            if m == 2 * pp + 3 and overrides is PIPELINES[0][1]:
                model = CostModel(hw)
                assert simulate(stamped, {}, model).step_s == simulate(built, {}, model).step_s


COLUMN_CASES = [  # (hardware, overrides) beside PIPELINES: DeepSpeed's ZeRO stages (ZeRO-3's prefetched gathers
    # released by name, buckets after backward without overlap_comm), megatron without overlap, pipelines with ZeRO-1
    ("a100-8x-100g", {"parallel": {"tp": 1, "dp": 8, "sequence_parallel": False, "zero_stage": 3},
                      "framework": {"name": "deepspeed"}}),
    ("a100-8x-100g", {"parallel": {"tp": 2, "dp": 4, "zero_stage": 1},
                      "framework": {"name": "deepspeed", "overlap_comm": False}}),
    ("a100-8x-100g", {"parallel": {"tp": 2, "dp": 4, "zero_stage": 2}, "framework": {"name": "deepspeed"}}),
    ("a100-8x-100g", {"model": {"layers": 4}, "parallel": {"tp": 2, "dp": 1, "pp": 4},
                      "framework": {"overlap_grad_reduce": False}}),
    ("a100-8x-100g", {"model": {"layers": 4}, "parallel": {"tp": 1, "dp": 2, "pp": 4, "zero_stage": 1,
                                                            "sequence_parallel": False},
                      "framework": {"name": "deepspeed"}}),
]


@pytest.mark.parametrize("case", range(len(PIPELINES) + len(COLUMN_CASES)))
def test_the_builders_columns_are_the_columns_of_its_objects(tmp_path, case):
    """The columns the builder writes as it stamps and wires blocks (what the model's index reads) equal the
    columns read off the phase's objects, segment names looked up: every array and group, stamped or built block
    by block, with one micro-batch, fewer than stages and many."""
    from lagom.step.graph import columns_of

    hardware, overrides = (PIPELINES + COLUMN_CASES)[case]
    parallel = overrides["parallel"]
    for m in (1, 3, 2 * parallel.get("pp", 1) + 3):
        wl, hw = load(tmp_path, hardware, training={"micro_batch": 1, "global_batch": m * parallel["dp"]}, **overrides)
        for stamped in (True, False):
            for phase in points_for(wl, hw, stamped=stamped).phases:
                built = phase.derived.get("columns")
                assert built is not None, (overrides, m, stamped, phase.name)
                assert built == columns_of(phase), (overrides, m, stamped, phase.name)


def test_shipped_workloads_columns_are_the_columns_of_their_objects():
    from lagom.step.graph import columns_of

    for path in sorted(WORKLOADS.glob("*.yaml")):
        if path.stem in ("llama3-70b-1024", "llama3-405b-2048"):  # cluster scale: the pipelines above have their shape
            continue
        wl = load_workload(path)
        for phase in points_for(wl, load_hardware(wl.hardware)).phases:
            assert phase.derived["columns"] == columns_of(phase), (path.stem, phase.name)


def test_a_phase_rebuilt_from_its_objects_reads_its_columns_off_them():
    """A phase made from another one's objects (a reconciled graph drops and adds points) carries no builder columns:
    the index reads the new phase's own objects, not the columns of the phase it came from."""
    from lagom.step.graph import phase_columns

    wl = load_workload("gpt2-tp8")
    phase = points_for(wl, load_hardware(wl.hardware)).phases[0]
    fewer = replace(phase, points=phase.points[1:])
    assert "columns" not in fewer.derived
    assert len(phase_columns(fewer).after) == len(phase.points) - 1
    assert phase_columns(fewer).after.tolist() == phase_columns(phase).after.tolist()[1:]


def test_a_search_pauses_the_collector_on_the_main_thread_only(monkeypatch):
    """A search on the main thread (``lagom tune``, ``compare``) runs with the cyclic collector paused and gives it
    back; one on another thread (a search beside a training job) leaves the process's collector alone."""
    from lagom.step.points import collector_paused_for_search
    from lagom.tune import make_plan

    seen: dict[str, bool] = {}

    def during(where: str) -> None:
        with collector_paused_for_search():
            seen[where] = gc.isenabled()

    assert gc.isenabled()
    during("main")
    thread = threading.Thread(target=during, args=("thread",))
    thread.start()
    thread.join()
    assert seen == {"main": False, "thread": True} and gc.isenabled()

    import lagom.search.driver as driver
    drive = driver.drive
    monkeypatch.setattr("lagom.tune.drive", lambda *a, **k: (seen.setdefault("tune", gc.isenabled()), drive(*a, **k))[1])
    wl = load_workload("gpt2-tp8")
    make_plan(wl, load_hardware(wl.hardware), "nccl")
    assert seen["tune"] is False and gc.isenabled()


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_random_workloads_columns_are_the_columns_of_their_objects(data):
    """Any layout the workload schema accepts (architecture, every parallel size, ZeRO stage or FSDP, overlap on or
    off, bucket sizes, micro-batches): the builder's columns equal the ones read off the objects, stamped or not."""
    from lagom.step.graph import columns_of

    wl = random_workload(data, [1, 2, 4], lambda pp: st.integers(1, 3 * pp + 2))
    hw = load_hardware("h100-sxm-4x8-400g")
    for stamped in (True, False):
        for phase in points_for(wl, hw, stamped=stamped).phases:
            assert phase.derived["columns"] == columns_of(phase), (wl, stamped, phase.name)
