"""Plans: JSON round trip, refusal of other topologies, and what the emitters write."""

import copy
import csv
import io
import json
from dataclasses import replace

import pytest
import yaml

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.plan import emit
from lagom.plan.capability import DEFAULT_BUFFSIZE, buffsize_for
from lagom.plan.comm_config import CommConfig, Decomposition
from lagom.plan.plan import Plan
from lagom.step.workload import load_workload
from lagom.tune import make_plan
from tests.helpers import gpt_workload, write_yaml


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    wl = load_workload(write_yaml(tmp / "w.yaml", gpt_workload(parallel={"tp": 2, "dp": 4})))
    hw = load_hardware("a100-8x-100g")
    return wl, hw, make_plan(wl, hw, "lagom")


def test_plan_round_trips_through_json(job, tmp_path):
    wl, hw, plan = job
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back == plan
    assert {e.group for e in plan.entries} == {"tp", "dp"}
    assert set(plan.predicted_step_s) == {"nccl", "lagom"} and plan.predicted_step_s["lagom"] <= plan.predicted_step_s["nccl"]
    assert plan.framework["megatron"]["bucket_size"] > 0


def test_plan_refuses_another_topology_workload_or_machine(job):
    wl, hw, plan = job
    plan.check_for(8, wl, hw)
    with pytest.raises(ConfigError, match=r"plan\.world_size: plan was made for 8 ranks, this job has 16"):
        plan.check_for(16)
    with pytest.raises(ConfigError, match="plan.workload_fingerprint"):
        plan.check_for(8, replace(wl, model=replace(wl.model, layers=4)))
    with pytest.raises(ConfigError, match="plan.hardware_fingerprint.*not 'h100-sxm-8x-400g'"):
        plan.check_for(8, wl, load_hardware("h100-sxm-8x-400g"))


def test_bad_plan_files_name_the_key(job, tmp_path):
    _, _, plan = job
    data = json.loads(plan.to_json())
    data["entries"][0]["config"]["chanels"] = 4
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"entries\[0\]\.config\.chanels: unknown key"):
        Plan.load(tmp_path / "p.json")
    data = json.loads(plan.to_json())
    data["version"] = 99
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="version"):
        Plan.load(tmp_path / "p.json")


def test_emitters_follow_the_plan(job):
    wl, hw, plan = job
    plan = copy.deepcopy(plan)
    tp = [e for e in plan.entries if e.group == "tp"]
    for e in tp:  # collectives (the search may split them into Flash-Overlap P2P steps, which leave the tuner's
        e.config = replace(e.config, decomposition=Decomposition.COLLECTIVE, num_chunks=1)  # table: tested below)
    tp[0].config = replace(tp[0].config, channels=3, priority=1, cta_policy="default")  # on SMs, inside the CTA range
    cfgs = yaml.safe_load(emit.megatron_nccl_yaml(plan))
    assert cfgs["tp"]["min_ctas"] == min(e.config.channels for e in tp) == 3
    assert cfgs["tp"]["max_ctas"] == max(e.config.channels for e in tp)
    assert cfgs["tp"]["is_high_priority_stream"] is True
    rows = list(csv.DictReader(io.StringIO(emit.tuner_csv(plan))))
    assert list(rows[0]) == emit.TUNER_COLUMNS.split(",")
    row = next(r for r in rows if int(r["min_bytes"]) <= tp[0].bytes <= int(r["max_bytes"])
               and r["coll"] == emit.TUNER_COLL[tp[0].collective])
    assert int(row["min_bytes"]) < tp[0].bytes < int(row["max_bytes"])  # padded buffers still match
    assert (row["channels"], row["nRanks"], row["proto"]) == ("3", "2", tp[0].config.protocol.lower())
    env = emit.nccl_env(plan, hw)  # the per-process values, once; the buffer holds every per-size chunk whole
    assert env["NCCL_NTHREADS"] == str(plan.process["threads"])
    buffsize = int(env["NCCL_BUFFSIZE"])  # never below NCCL's default: that would shrink P2P and NCCL's own chunks
    assert buffsize >= DEFAULT_BUFFSIZE and all(
        buffsize >= buffsize_for(str(e.config.algorithm), str(e.config.protocol), e.collective, e.config.chunk_bytes)
        for e in plan.entries if e.config.decomposition == "collective")
    assert "NCCL_P2P_DISABLE" not in env
    plan.process["transport"] = "shm"
    assert emit.nccl_env(plan, hw)["NCCL_P2P_DISABLE"] == "1"  # host shared memory for intra-node traffic
    ub = emit.te_ub_cfgs(plan)
    assert {"qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop", "qkv_wgrad"} <= set(ub)
    assert ub["qkv_wgrad"]["method"] == "bulk" and ub["fc2_fprop"]["method"] in ("pipeline", "ring_exchange")


def test_environment_that_contradicts_the_plan_is_caught(job):
    _, hw, plan = job
    ok = emit.nccl_env(plan, hw)
    assert emit.env_conflicts(plan, hw, ok) == []
    bad = {**ok, "NCCL_MAX_NCHANNELS": "2"}
    with pytest.raises(ConfigError, match="NCCL_MAX_NCHANNELS: NCCL_MAX_NCHANNELS=2 overrides the plan.*unset NCCL_MAX_NCHANNELS"):
        emit.check_env(plan, hw, bad)


def test_decomposed_points_leave_the_tuner_csv_and_become_ring_exchange(job):
    plan = copy.deepcopy(job[2])
    rs = next(e for e in plan.entries if e.group == "tp" and e.collective == "reduce_scatter")
    rs.config = replace(rs.config, decomposition="collective")
    assert emit.te_ub_cfgs(plan)["proj_fprop"]["method"] == "pipeline"  # a collective: TE's split pipeline
    assert any(line.startswith("reducescatter") for line in emit.tuner_csv(plan).splitlines())
    rs.config = replace(rs.config, decomposition="p2p", num_chunks=2)
    assert emit.te_ub_cfgs(plan)["proj_fprop"]["method"] == "ring_exchange"
    assert not any(line.startswith("reducescatter") for line in emit.tuner_csv(plan).splitlines())
    assert CommConfig.from_dict(rs.config.to_dict()) == rs.config
