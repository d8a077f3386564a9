"""Online tuning: calibration recovers known scales, the calibrated search stays within the process's
capability and may choose per-process values, both ranks get one plan, the cache is per world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.model.calibrated import CalibratedModel
from lagom.model.choices import candidates, nccl_pick
from lagom.model.cost_model import CostModel, RunningComm
from lagom.model.simulator import Configs, simulate
from lagom.plan.capability import capability_for
from lagom.plan.comm_config import CommConfig, ProcessSettings, SearchSpace, Transport
from lagom.plan.plan import Plan
from lagom.runtime.online.tuner import OnlineTuner, calibrate, describe_changes, service_times
from lagom.search.base import nccl_configs
from lagom.step.calls import CallRecord
from lagom.step.graph import Collective, ComputeSegment, Group
from lagom.step.workload import load_workload
from lagom.tune import make_plan, problem_for
from tests.distributed import run_ranks
from tests.helpers import gpt_workload, write_yaml

COMM_SCALE, COMPUTE_SCALE = 1.5, 1.3


def job(tmp: Path, ranks: int = 2, base: str = "a100-8x-100g") -> tuple[Path, Path]:
    """A tiny GPT with tp=2 and sequence parallel, on a 2-GPU node of ``base`` (or dp on top for 4 ranks)."""
    wl = write_yaml(tmp / f"w{ranks}.yaml", gpt_workload(parallel={"tp": 2, "dp": ranks // 2, "sequence_parallel": True},
                                                          training={"global_batch": 4 * ranks // 2}))
    name = f"{base.split('-')[0]}-{ranks}x"
    hw = write_yaml(tmp / f"hw{ranks}-{base}.yaml", {"base": base, "name": name,
                                                      "cluster": {"gpus_per_node": ranks, "nodes": 1}})
    return wl, hw


def measured_steps(wl_path: Path, hw_path: Path, steps: int, comm: float = COMM_SCALE,
                   compute: float = COMPUTE_SCALE, configs: Configs | None = None) -> tuple[float, list[CallRecord]]:
    """What a job running ``configs`` (default: NCCL's) would measure if the truth were the model with
    comm x``comm`` and compute x``compute``."""
    hw = load_hardware(str(hw_path))
    problem = problem_for(load_workload(wl_path), hw)
    truth = CalibratedModel(hw)
    truth.set_comm_scale({k: comm for k in problem.keys})
    truth.compute_scale = compute
    result = simulate(problem.graph, nccl_configs(problem) if configs is None else configs, truth)
    records = []
    for step in range(steps):
        offset, seq = 0.0, 0
        for phase in result.phases:
            for _ in range(phase.repeat):
                for pt in sorted(phase.points, key=lambda p: p.start):
                    group, coll, size = pt.key.rsplit("/", 2)
                    records.append(CallRecord(group, coll, int(size), seq, step, offset + pt.start, offset + pt.end))
                    seq += 1
                offset += phase.time
    return result.step_s, records


def test_calibration_recovers_the_scales_of_consistent_measurements(tmp_path):
    wl, hw = job(tmp_path)
    step_s, records = measured_steps(wl, hw, steps=2)
    problem = problem_for(load_workload(wl), load_hardware(str(hw)))
    stray = CallRecord("dp", "all_reduce", 7, 999, 0, 0.0, 1e-4)
    cal = calibrate(problem, nccl_configs(problem), records + [stray], step_s)
    assert set(cal.model.comm_scale) == set(problem.keys) and cal.unmeasured == []
    for key, scale in cal.model.comm_scale.items():
        assert scale == pytest.approx(COMM_SCALE, rel=0.05), key
    assert cal.model.compute_scale == pytest.approx(COMPUTE_SCALE, rel=0.05)
    assert cal.calibrated_step_s == pytest.approx(step_s, rel=5e-3)
    assert cal.unmatched == ["dp/all_reduce/7"]
    assert cal.problem.model is cal.model and problem.model is not cal.model  # the input problem is untouched


def test_calibrated_model_scales_without_double_counting():
    hw = load_hardware("a100-8x-100g")
    base, cal = CostModel(hw), CalibratedModel(hw)
    cal.compute_scale = 2.0
    seg = ComputeSegment("gemm", 1e12, 1e8, 1000)
    running = (RunningComm(CommConfig(channels=16), 1e11, 16),)
    assert cal.compute_solo(seg) == pytest.approx(2 * base.compute_solo(seg))
    assert cal.compute_time(seg) == pytest.approx(2 * base.compute_solo(seg))
    assert cal.compute_time(seg, running) == pytest.approx(2 * base.compute_time(seg, running))
    tp = Group("tp", 8, 8, 1)
    cal.set_comm_scale({"tp/all_gather/1048576": 3.0, "tp/reduce_scatter/1048576": 1.0})
    cfg = CommConfig()
    ag = Collective.ALL_GATHER
    assert cal.comm_time(ag, tp, 1 << 20, cfg) == pytest.approx(3 * base.comm_time(ag, tp, 1 << 20, cfg))
    assert cal.comm_time(ag, tp, 1 << 21, cfg) == pytest.approx(base.comm_time(ag, tp, 1 << 21, cfg))  # not calibrated
    assert cal.p2p_step_time(tp, 4096, cfg) == pytest.approx(2 * base.p2p_step_time(tp, 4096, cfg))  # group mean
    assert cal.comm_peak_time(Collective.ALL_GATHER, tp, 1 << 20) == base.comm_peak_time(Collective.ALL_GATHER, tp, 1 << 20)


def test_service_times_follow_the_communicator_order():
    recs = [CallRecord("dp", "all_reduce", 8, 0, 0, 0.0, 3.0), CallRecord("dp", "all_reduce", 8, 1, 0, 1.0, 5.0),
            CallRecord("tp", "all_gather", 8, 2, 0, 1.0, 2.0), CallRecord("tp", "barrier", 0, 3, 0, 4.0, 4.0)]
    assert [(r.seq, s) for r, s in service_times(recs)] == [(0, 3.0), (1, 2.0), (2, 1.0)]


def test_changes_are_split_into_now_and_next_start():
    old = {"tp/all_gather/8": CommConfig(), "dp/all_reduce/8": CommConfig(), "pp/send_recv/8": CommConfig()}
    new = {"tp/all_gather/8": CommConfig(decomposition="p2p", num_chunks=2, channels=4),
           "dp/all_reduce/8": CommConfig(chunk_bytes=65536), "pp/send_recv/8": CommConfig()}
    now, later = describe_changes(old, new)
    assert now == ["tp/all_gather/8: Flash-Overlap decomposition collective -> p2p, chunks per peer step 1 -> 2"]
    assert later == ["tp/all_gather/8: CTAs (communicator max_ctas/min_ctas) 8 -> 4",
                     "dp/all_reduce/8: chunk bytes (NCCL_BUFFSIZE) 2097152 -> 65536"]


def test_the_calibrated_search_chooses_per_process_values(tmp_path):
    """A profile whose NCCL runs one warp per channel (32 threads) starves every collective: the job runs
    NCCL's defaults, and the calibrated search gives the whole step more threads (NCCL_NTHREADS, applied
    on the next start). No tuner plugin: the chunk is per process too."""
    wl, _ = job(tmp_path)
    hw = write_yaml(tmp_path / "one-warp.yaml", {"base": "a100-8x-100g", "name": "a100-one-warp",
                                                 "cluster": {"gpus_per_node": 2, "nodes": 1},
                                                 "nccl": {"default_threads": 32}})
    hardware = load_hardware(str(hw))
    no_plugin = capability_for(hardware, tuner_plugin=False)
    step_s, records = measured_steps(wl, hw, steps=1)
    tuner = OnlineTuner(wl, hw, tune_steps=1, cache_dir=tmp_path / "cache", capability=no_plugin)
    plan = tuner.observe(step_s, records)
    assert tuner.calibration.problem.settings.threads == 32  # what ran
    threads = plan.process["threads"]
    assert threads != 32 and threads in SearchSpace().threads
    assert set(plan.process) == {"threads", "transport", "chunk_bytes"}
    assert all(e.config.threads == threads for e in plan.entries)
    assert any(f"threads (NCCL_NTHREADS) 32 -> {threads}" in line for line in tuner.next_start)


def test_running_configs_carry_the_running_plans_process_values(tmp_path):
    """A plan in force with 128 threads and 64 KiB chunks (NCCL_BUFFSIZE): every key runs them, the one
    the plan lacks too (with NCCL's own algorithm and protocol), and the calibration models them."""
    wl, hw = job(tmp_path)
    hardware = load_hardware(str(hw))
    no_plugin = capability_for(hardware, tuner_plugin=False)
    data = make_plan(load_workload(wl), hardware, capability=no_plugin).to_dict()
    data["process"].update(threads=128, chunk_bytes=65536)
    gather = "tp/all_gather/524288"
    data["entries"] = [e for e in data["entries"] if e["key"] != gather]
    running_plan = Plan.from_dict(data)
    tuner = OnlineTuner(wl, hw, tune_steps=1, cache_dir=tmp_path / "cache", capability=no_plugin,
                        running_plan=running_plan)
    problem = problem_for(load_workload(wl), hardware, no_plugin)
    in_force, configs = tuner._running_configs(problem)
    assert in_force.settings == ProcessSettings(128, Transport.P2P, 65536)
    assert set(configs) == set(problem.keys) and gather not in running_plan.configs()
    assert all(c.threads == 128 and c.chunk_bytes == 65536 for c in configs.values())
    assert configs[gather] == nccl_configs(in_force)[gather]
    point = problem.keys[gather][0]
    assert (configs[gather].algorithm, configs[gather].protocol) == nccl_pick(point, hardware, Transport.P2P)
    planned = running_plan.configs()
    assert {k: configs[k] for k in planned} == planned
    # measured under those configs with comm x1.5: the key the plan lacks is calibrated from what it ran
    step_s, records = measured_steps(wl, hw, steps=1, configs=configs)
    tuner.observe(step_s, records)
    assert tuner.calibration.problem.settings == in_force.settings
    assert tuner.calibration.model.comm_scale[gather] == pytest.approx(COMM_SCALE, rel=1e-2)
    assert tuner.calibration.calibrated_step_s == pytest.approx(step_s, rel=5e-3)


def test_a_tuner_without_the_plugin_proposes_only_what_nccl_applies(tmp_path):
    """On two A40s the calibrated search with the plugin may run a collective off NCCL's own algorithm and
    protocol (its space offers them); a tuner told there is no plugin leaves algorithm and protocol to NCCL,
    and its plan needs nothing the process lacks."""
    wl, hw = job(tmp_path, base="a40-2x8-nvlink")
    hardware = load_hardware(str(hw))
    problem = problem_for(load_workload(wl), hardware)
    step_s, records = measured_steps(wl, hw, steps=1)
    plans = {}
    for plugin in (True, False):
        cap = capability_for(hardware, tuner_plugin=plugin)
        tuner = OnlineTuner(wl, hw, tune_steps=1, cache_dir=tmp_path / f"cache-{plugin}", capability=cap)
        plans[plugin] = tuner.observe(step_s, records)
        assert plans[plugin].needs(cap) == [] and plans[plugin].capability == cap.to_dict()

    def off_nccl_pick(plan: Plan) -> list[str]:
        return [e.key for e in plan.entries if e.config.decomposition == "collective" and
                (e.config.algorithm, e.config.protocol) != nccl_pick(problem.keys[e.key][0], hardware, e.config.transport)]

    def offered_off_nccl_pick(plugin: bool) -> bool:
        under = problem_for(load_workload(wl), hardware, capability_for(hardware, tuner_plugin=plugin))
        return any((c.algorithm, c.protocol) != nccl_pick(p, hardware, c.transport)
                   for points in under.keys.values() for p in points[:1] for c in candidates(p, hardware, under.space))

    assert offered_off_nccl_pick(True), "with the plugin the search may leave NCCL's pick: the check below can fail"
    assert not offered_off_nccl_pick(False) and off_nccl_pick(plans[False]) == []
    channels = {e.config.channels for e in plans[False].entries}
    assert len(channels) == 1  # one CTA range per communicator (one communicator here), decomposed or not
    assert plans[False].capability["tuner_plugin"] is False


def _tune_on_ranks(rank: int, world_size: int, tmp: str) -> dict:
    wl, hw = job(Path(tmp))
    cache = Path(tmp) / "cache"
    # Each rank measures a little differently: only rank 0's measurements may shape the plan.
    step_s, records = measured_steps(wl, hw, steps=3, comm=COMM_SCALE + 0.5 * rank)
    tuner = OnlineTuner(wl, hw, tune_steps=3, cache_dir=cache)
    assert tuner.cached_plan() is None
    got = [tuner.observe(step_s, [r for r in records if r.step == s]) for s in range(3)]
    assert got[0] is None and got[1] is None and got[2] is not None
    assert tuner.observe(step_s, records) is None  # tuned once
    dist.barrier()  # rank 0 has written the cache
    again = OnlineTuner(wl, hw, tune_steps=3, cache_dir=cache).cached_plan()
    mine = Path(tmp) / f"r{rank}"
    mine.mkdir()
    wl4, hw4 = job(mine, ranks=4)
    try:
        OnlineTuner(wl4, hw4, cache_dir=cache)
        refused = ""
    except ConfigError as err:
        refused = str(err)
    return {"plan": got[2].to_json(), "cached": again.to_json() if again else None, "cache_file": str(tuner.cache_path),
            "now": tuner.applies_now, "next": tuner.next_start, "refused": refused,
            "scales": tuner.calibration.model.comm_scale if tuner.calibration else None}


def test_online_tuner_on_two_ranks_shares_one_plan_and_caches_it(tmp_path):
    r0, r1 = run_ranks(_tune_on_ranks, 2, str(tmp_path))
    assert r0["plan"] == r1["plan"]
    plan = Plan.from_dict(json.loads(r0["plan"]))
    assert plan.world_size == 2 and plan.workload == "tiny-gpt" and plan.hardware == "a100-2x"
    assert set(plan.predicted_step_s) == {"nccl", "lagom"}
    assert Path(r0["cache_file"]).name.endswith("-w2.json") and Path(r0["cache_file"]).exists()
    assert r0["cached"] == r0["plan"] and r1["cached"] == r0["plan"]
    assert r0["now"] == r1["now"] and r0["next"] == r1["next"]
    assert all(s == pytest.approx(COMM_SCALE, rel=0.05) for s in r0["scales"].values())
    assert r1["scales"] is None  # rank 1 did not search
    assert "the workload has 4 ranks, this job has 2" in r0["refused"]


def test_a_cached_plan_for_another_world_size_is_never_returned(tmp_path, caplog):
    wl2, hw2 = job(tmp_path, ranks=2)
    step_s, records = measured_steps(wl2, hw2, steps=1)
    two = OnlineTuner(wl2, hw2, tune_steps=1, cache_dir=tmp_path / "cache")
    plan = two.observe(step_s, records)
    assert two.cached_plan().to_json() == plan.to_json()
    wl4, hw4 = job(tmp_path, ranks=4)
    four = OnlineTuner(wl4, hw4, cache_dir=tmp_path / "cache")
    assert four.cache_path.name.endswith("-w4.json") and four.cached_plan() is None
    four.cache_path.write_text(two.cache_path.read_text())  # a 2-rank plan where the 4-rank job looks
    assert four.cached_plan() is None
    assert any("plan was made for 2 ranks, this job has 4" in m for m in caplog.messages)


def test_bad_settings_are_config_errors(tmp_path):
    wl, hw = job(tmp_path)
    with pytest.raises(ConfigError, match="strategy"):
        OnlineTuner(wl, hw, strategy="fastest")
    with pytest.raises(ConfigError, match="tune_steps"):
        OnlineTuner(wl, hw, tune_steps=0)
