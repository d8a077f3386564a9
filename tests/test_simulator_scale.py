"""Cluster scale: one device per pipeline stage stands for every data-parallel replica, so the cost of a
simulation depends on the pipeline, not on dp or the node count; and a 1,024-GPU job is compared end
to end (with fewer layers and micro-batches than configs/workloads/llama3-70b-1024.yaml)."""

import json
from dataclasses import replace

import pytest

from lagom.hardware import load_hardware
from lagom.model.simulator import Simulator
from lagom.report import compare_json
from lagom.search.base import nccl_configs
from lagom.step.workload import load_workload
from lagom.tune import Progress, compare_strategies, problem_for
from tests.helpers import write_yaml

LLAMA = "llama3-70b-1024"


def _on(hw_name: str, nodes: int):
    hw = load_hardware(hw_name)
    return replace(hw, cluster=replace(hw.cluster, nodes=nodes))


def test_cost_grows_with_neither_dp_nor_nodes():
    wl = load_workload("gpt3-13b-pp4")
    wl = replace(wl, framework=replace(wl.framework, bucket_size=40_000_000))  # megatron's default grows with dp
    runs = {}
    for dp in (2, 16, 128):
        job = replace(wl, parallel=replace(wl.parallel, dp=dp), training=replace(wl.training, global_batch=24 * dp))
        problem = problem_for(job, _on("h100-sxm-8x-400g", 2 * dp))
        runs[dp] = (problem, Simulator(problem.graph).run(nccl_configs(problem), problem.model))
    sizes = {dp: (p.graph.devices, sum(map(len, p.graph.phases[0].segments.values())), len(p.graph.points))
             for dp, (p, _) in runs.items()}
    assert len(set(sizes.values())) == 1 and sizes[2][0] == wl.parallel.pp  # one device per stage
    assert len({r.tasks_simulated for _, r in runs.values()}) == 1
    # the data-parallel collectives slow down as they span more nodes
    dp_time = {dp: sum(row["time"] for key, row in r.per_key().items() if key.startswith("dp/")) for dp, (_, r) in runs.items()}
    assert dp_time[2] < dp_time[16] < dp_time[128]


def test_the_shipped_1024_gpu_job_and_its_cluster_load():
    wl = load_workload(LLAMA)
    hw = load_hardware(wl.hardware)
    assert wl.world_size == hw.cluster.world_size == 1024 and wl.microbatches == 256
    assert hw.cluster.nodes == 128 and hw.gpu == load_hardware("h100-sxm-8x-400g").gpu  # inherits the node preset


@pytest.mark.slow  # about 20 s: CI's slower tier (make test-slow)
def test_compare_completes_on_a_1024_gpu_job(tmp_path):
    """`lagom compare` on 1,024 GPUs (8 layers, 16 micro-batches instead of 80 and 256), with progress: the
    comparison the command runs, then the JSON it prints (the command's own wiring is tests/test_cli.py's)."""
    data = load_workload(LLAMA)
    small = {"name": "llama3-70b-1024-small", "hardware": data.hardware,
             "model": {**vars(data.model), "layers": 8}, "training": {**vars(data.training), "global_batch": 16 * 16},
             "parallel": vars(data.parallel), "framework": vars(data.framework)}
    path = write_yaml(tmp_path / "small.yaml", small)
    wl, hw = load_workload(path), load_hardware(data.hardware)
    seen: list[Progress] = []
    tuned = compare_strategies(wl, hw, progress=seen.append)
    steps = {name: t.result.result.step_s for name, t in tuned.items() if t is not None}
    assert tuned["exhaustive"] is None  # far too many joint settings
    assert steps["lagom"] <= steps["nccl"] and steps["lagom"] <= steps["autoccl"] * (1 + 1e-9)
    assert [p.evaluations for p in seen] == list(range(1, len(seen) + 1))
    assert len(seen) == sum(t.result.evaluations for t in tuned.values() if t is not None)
    for strategy in ("autoccl", "lagom"):
        best = [p.best_step_s for p in seen if p.strategy == strategy]
        assert best == sorted(best, reverse=True)
    assert best[-1] == pytest.approx(steps["lagom"], rel=1e-12)  # lagom keeps the best step it simulated
    printed = json.loads(json.dumps(compare_json(wl.name, hw.name, {k: (t.result.result, t.result.evaluations) if t else None
                                                                    for k, t in tuned.items()})))
    assert printed["strategies"]["exhaustive"] is None
    assert printed["speedup"]["lagom"] == pytest.approx(steps["nccl"] / steps["lagom"], rel=1e-12)
