"""Every workload config loads strictly and fits the clusters `lagom reproduce` runs it on."""

from __future__ import annotations

from pathlib import Path

import pytest

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.step.graph import Collective
from lagom.step.workload import load_workload, workload_names
from lagom.tune import problem_for
from lagom_experiments.reproduce import load_published

PUBLISHED = load_published()
RUNS = [(w, h) for s in PUBLISHED.settings for w in s.workloads for h in s.hardware]


# Cluster-scale planning jobs (issue 11: benchmarks/planning_scale.py); nothing published to reproduce.
SCALE_ONLY = {"gpt3-13b-pp4", "llama3-70b-1024", "llama3-405b-2048"}


def test_every_config_is_used_by_a_published_setting_or_the_scale_benchmark():
    assert sorted({w for w, _ in RUNS} | SCALE_ONLY) == workload_names()
    bench = (Path(__file__).resolve().parent.parent / "benchmarks" / "planning_scale.py").read_text()
    assert all(name in bench for name in SCALE_ONLY)


@pytest.mark.parametrize("name", workload_names())
def test_config_loads_on_its_default_hardware(name):
    wl = load_workload(name)
    assert wl.name == name
    hw = load_hardware(wl.hardware)
    problem = problem_for(wl, hw)  # validates the layout against the cluster's world size
    assert problem.keys, f"{name} has no overlap point to tune"


@pytest.mark.parametrize(("name", "hardware"), RUNS)
def test_config_validates_on_every_cluster_it_is_reproduced_on(name, hardware):
    wl, hw = load_workload(name), load_hardware(hardware)
    assert wl.world_size == hw.cluster.world_size
    problem_for(wl, hw)


@pytest.mark.parametrize(("name", "arch"), [
    ("phi2-fsdp", (32, 2560, 10240, 32, 32, 51200)),
    ("llama3-8b-fsdp", (32, 4096, 14336, 32, 8, 128256)),
    ("mpt-7b-fsdp", (32, 4096, 16384, 32, 32, 50432)),
    ("deepseek-moe-16b-ep8", (28, 2048, 10944, 16, 16, 102400)),
    ("olmoe-1b-7b-ep8", (16, 2048, 1024, 16, 16, 50304)),
])
def test_paper_models_have_their_published_architecture(name, arch):
    m = load_workload(name).model
    assert (m.layers, m.hidden, m.ffn, m.heads, m.kv_heads or m.heads, m.vocab) == arch


@pytest.mark.parametrize(("model", "micro", "global_"), [("phi2", 8, 512), ("llama3-8b", 4, 256), ("mpt-7b", 2, 256)])
def test_paper_tensor_parallel_batches(model, micro, global_):
    wl = load_workload(f"{model}-tp8")
    assert (wl.parallel.tp, wl.training.micro_batch, wl.training.global_batch) == (8, micro, global_)
    fsdp = load_workload(f"{model}-fsdp")
    assert fsdp.parallel.fsdp and fsdp.parallel.dp == 16
    assert fsdp.training.micro_batch == {"phi2": 2}.get(model, 1)


def test_moe_runs_use_expert_parallel_8_with_micro_batch_2_global_16():
    for name in ("deepseek-moe-16b-ep8", "olmoe-1b-7b-ep8"):
        wl = load_workload(name)
        assert (wl.parallel.ep, wl.training.micro_batch, wl.training.global_batch) == (8, 2, 16)
    ds = load_workload("deepseek-moe-16b-ep8").model
    assert (ds.experts, ds.top_k, ds.shared_experts, ds.moe_ffn) == (64, 6, 2, 1408)


def test_fsdp_step_has_the_two_collectives_the_paper_tunes():
    wl = load_workload("phi2-fsdp")
    keys = problem_for(wl, load_hardware("a40-2x8-nvlink")).keys
    assert {points[0].collective for points in keys.values()} == {Collective.ALL_GATHER, Collective.REDUCE_SCATTER}


def test_user_runs_have_the_requested_layouts():
    gpt, bert, t5 = (load_workload(n) for n in ("gpt2-tp8", "bert-pp4", "t5-dp-tp"))
    assert (gpt.parallel.tp, gpt.hardware) == (8, "a100-8x-100g")
    assert (bert.parallel.pp, bert.model.architecture, bert.hardware) == (4, "bert", "v100-4x-25g")
    assert t5.model.architecture == "t5" and t5.parallel.dp > 1 and t5.parallel.tp > 1 and t5.world_size == 16


def test_a_config_on_the_wrong_cluster_names_the_mismatch():
    with pytest.raises(ConfigError, match="parallel.*8 GPUs"):
        problem_for(load_workload("phi2-fsdp"), load_hardware("a100-8x-100g"))

