"""The capability record: scopes from the NCCL version, plugin and topology; a search that only picks
what the target can apply; plans that hold per-process knobs once; a runtime that re-plans or refuses."""

import json
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.model.choices import candidates, nccl_choice
from lagom.plan import emit
from lagom.plan.capability import Capability, Scope, capability_for
from lagom.plan.comm_config import (
    Algorithm,
    CommConfig,
    CTAPolicy,
    SearchSpace,
    communicator_knobs,
    default_config,
    is_consistent,
    with_communicator_value,
    with_process,
)
from lagom.plan.plan import Plan
from lagom.runtime.apply import runtime as apply
from lagom.runtime.online.session import TuningSession
from lagom.runtime.online.state import SessionOptions
from lagom.search import Problem, SearchResult, run_strategy
from lagom.search.base import groups, nccl_configs
from lagom.step.workload import load_workload
from lagom.tune import Tuned, make_plan, plan_from, problem_for, registration
from tests.helpers import gpt_workload, synthetic_problem, write_yaml

# Holds NCCL's defaults (8 and 32 channels, 512 threads, 2 MiB, every protocol), so NCCL's own choice is a candidate.
SPACE = SearchSpace(channels=(2, 8, 32), threads=(256, 512), chunks=(256 * 1024, 2 * 1024 * 1024),
                    protocols=("LL", "LL128", "Simple"), splits=(), priorities=(0, 1), nvls_ctas=(4, 16))


@pytest.mark.parametrize("version, plugin, interface, scopes, policies", [
    ("2.26", True, 4, {"algorithm": "per size", "chunk": "per process", "cta_policy": "not settable"}, ["default"]),
    ("2.26", False, None, {"algorithm": "not settable", "channels": "per communicator", "chunk": "per process"},
     ["default"]),
    ("2.27", True, 4, {"channels": "per size", "cta_policy": "per communicator"}, ["default"]),
    ("2.27", False, None, {"protocol": "not settable", "cta_policy": "per communicator"}, ["default", "efficiency"]),
    ("2.28", True, 5, {"chunk": "per process", "cta_policy": "per communicator"}, ["default", "zero"]),
    ("2.30.7", True, 6, {"chunk": "per size", "algorithm": "per size"}, ["default", "zero"]),
    ("2.30.7", False, None, {"chunk": "per process", "channels": "per communicator"}, ["default", "efficiency", "zero"]),
    ("2.32.6", True, 7, {"chunk": "per size", "algorithm": "per size", "cta_range": "per communicator"},
     ["default", "zero"]),
    ("2.23", True, None, {"algorithm": "not settable"}, ["default"]),  # older than the plugin's v4 interface
])
def test_scopes_follow_the_nccl_version_and_the_plugin(version, plugin, interface, scopes, policies):
    cap = Capability(version, plugin, nvls=False, nvlink_domain=True)
    assert cap.tuner_interface == interface
    for knob, scope in scopes.items():
        assert cap.scope(knob) == scope
    assert cap.scope("threads") == cap.scope("buffsize") == cap.scope("transport") == Scope.PER_PROCESS
    assert cap.scope("priority") == cap.scope("cta_range") == Scope.PER_COMMUNICATOR
    assert cap.scope("decomposition") == Scope.PER_POINT
    assert list(cap.cta_policies()) == policies
    assert ("chunk_bytes" in cap.process_fields()) == (cap.scope("chunk") == Scope.PER_PROCESS)
    assert Capability.from_dict(json.loads(json.dumps(cap.to_dict()))) == cap


def test_a_per_call_config_is_recorded_from_2_31_and_no_knob_takes_it_while_no_framework_passes_one():
    older, newer = Capability("2.30.7"), Capability("2.31.2")
    assert older.per_call() == {} and "per-call" not in older.describe()
    assert set(newer.per_call()) == {"algorithm", "cta_range", "cta_policy", "nvls_ctas"}  # no protocol, no chunk
    assert Scope.PER_CALL not in newer.scopes().values()
    assert newer.to_dict()["per_call_passed_by"] == [] and newer.to_dict()["per_call"] == newer.per_call()
    assert "per-call config (algorithm, cta_range, cta_policy, nvls_ctas) passed by no framework yet" in newer.describe()
    assert Capability.from_dict(json.loads(json.dumps(newer.to_dict()))) == newer


def test_copy_engines_and_nvls_depend_on_the_topology():
    one_domain = Capability("2.28", nvlink_domain=True, symmetric_groups=("dp",))
    assert one_domain.zero_applies("all_gather", 1, "dp") and one_domain.zero_applies("all_to_all", 1, "dp")
    assert not one_domain.zero_applies("reduce_scatter", 1, "dp") and not one_domain.zero_applies("all_reduce", 1, "dp")
    assert not one_domain.zero_applies("all_gather", 2, "dp")  # hierarchical across nodes only from 2.30.7
    assert not one_domain.zero_applies("all_gather", 1, "tp")  # nobody registers tp's buffers: they run on SMs
    assert not Capability("2.28", nvlink_domain=True).zero_applies("all_gather", 1, "dp")  # none registered
    assert Capability("2.30.7", nvlink_domain=True, symmetric_groups=("dp",)).zero_applies("all_gather", 2, "dp")
    assert not Capability("2.30.7", nvlink_domain=False,  # PCIe: no copy-engine path
                          symmetric_groups=("dp",)).zero_applies("all_gather", 1, "dp")
    assert Capability(nvls=True).scope("nvls_ctas") == Scope.PER_COMMUNICATOR
    assert Capability(nvls=False).scope("nvls_ctas") == Capability("2.26", nvls=True).scope("nvls_ctas") == Scope.NOT_SETTABLE
    assert Capability(nvls=True).nvls_applies("all_reduce", 1) and not Capability(nvls=True).nvls_applies("all_reduce", 2)
    h100, a40 = load_hardware("h100-sxm-8x-400g"), load_hardware("a40-2x8-pcie")
    assert capability_for(h100, tuner_plugin=True) == Capability("2.30.7", True, nvls=True, nvlink_domain=True)
    assert capability_for(a40, "2.27", tuner_plugin=False) == Capability("2.27", False, nvls=False, nvlink_domain=False)
    # A40 NVLink bridges join pairs: the node is not one NVLink domain, so no copy-engine all-gather
    bridged = capability_for(load_hardware("a40-2x8-nvlink"), tuner_plugin=True)
    assert not bridged.nvlink_domain and not bridged.zero_applies("all_gather", 2, "dp")
    with pytest.raises(ConfigError, match="--nccl-version: 'x' is not an NCCL version"):
        capability_for(h100, "x")


def _segments(point_count: int) -> list[tuple[float, float, int]]:
    return [(0.5, 50.0, 300)] * (point_count + 2)


def test_candidates_offer_cta_policies_and_nvls_only_where_allowed():
    problem = synthetic_problem(_segments(2), [{"collective": "all_gather", "mb": 64.0, "after": 0, "before": 2},
                                               {"collective": "reduce_scatter", "mb": 64.0, "after": 1, "before": 3}],
                                hardware="h100-sxm-8x-400g")
    ag, rs = (problem.keys[k][0] for k in problem.keys)
    hw = problem.hw

    def offered(point, cap):
        return candidates(point, hw, SPACE.under(cap))

    registered = (ag.group.name, rs.group.name)
    new = Capability("2.30.7", nvls=True, nvlink_domain=True, symmetric_groups=registered)
    old = Capability("2.27", nvls=True, nvlink_domain=True, symmetric_groups=registered)
    assert {c.cta_policy for c in offered(ag, new)} == {CTAPolicy.DEFAULT, CTAPolicy.ZERO}
    # ZERO only where the job registers the buffers symmetrically: elsewhere it is never offered
    assert {c.cta_policy for c in offered(ag, replace(new, symmetric_groups=()))} == {CTAPolicy.DEFAULT}
    assert {c.cta_policy for c in offered(rs, new)} == {CTAPolicy.DEFAULT}  # no copy-engine reduce-scatter
    assert {c.cta_policy for c in offered(ag, old)} == {CTAPolicy.DEFAULT}  # ZERO needs 2.28; EFFICIENCY no plugin
    assert CTAPolicy.EFFICIENCY in {c.cta_policy for c in offered(rs, replace(old, tuner_plugin=False))}
    nvls = [c for c in offered(rs, new) if c.algorithm == Algorithm.NVLS]
    # NCCL runs its own NVLS CTAs (16 on Hopper) where the communicator sets none, not its ring channels
    assert {c.channels for c in nvls} == {4, hw.nccl.nvls_channels} == {4, 16} and {c.protocol for c in nvls} == {"Simple"}
    assert not any(c.algorithm == Algorithm.NVLS for c in offered(rs, replace(new, nvls=False)))
    no_plugin = replace(SPACE, transports=("p2p",)).under(replace(new, tuner_plugin=False))
    own = nccl_choice(rs, hw, default_config(hw))  # without the plugin NCCL picks algorithm and protocol itself
    assert {(c.algorithm, c.protocol) for c in candidates(rs, hw, no_plugin)} == {(own.algorithm, own.protocol)}


def applicable(problem: Problem, found: SearchResult) -> list[str]:
    """Every way ``found`` breaks what ``problem.capability`` can apply (empty: none)."""
    cap, hw, process = problem.cap, problem.hw, found.process
    under = problem.with_process(process)
    nccls_own = nccl_configs(under)
    wrong = []
    for key, cfg in found.configs.items():
        point = problem.keys[key][0]
        if cfg != with_process(cfg, point, hw, process, cap.process_fields()):
            wrong.append(f"{key}: per-process knob differs from {process}")
        if str(cfg.cta_policy) not in cap.cta_policies():
            wrong.append(f"{key}: CTA policy {cfg.cta_policy}")
        if cfg.algorithm == Algorithm.NVLS and not cap.nvls_applies(point.collective, point.group.nodes):
            wrong.append(f"{key}: NVLS")
        # a candidate of the space, or NCCL's own choice kept for a key no candidate beat (with its
        # communicator's values of the knobs set per communicator, which the search settles for every key)
        kept = nccls_own[key]
        for knob in communicator_knobs(cap):
            kept = with_communicator_value(knob, _value(cfg, knob), point, kept, cap)
        if found.strategy != "nccl" and cfg not in candidates(point, hw, under.space) and cfg != kept:
            wrong.append(f"{key}: {cfg.describe()} is not a candidate")
    for members in groups(problem).values():
        for knob in communicator_knobs(cap):
            if not is_consistent(knob, [(problem.keys[k][0], found.configs[k]) for k in members], cap):
                wrong.append(f"{knob}: two values on one communicator")
    return wrong


def _value(cfg: CommConfig, knob: str):
    """The value a config holds for a communicator knob (NVLS CTAs are an NVLS config's channels)."""
    return cfg.cta_policy if knob == "cta_policy" else cfg.priority if knob == "priority" else cfg.channels


@st.composite
def small_problems(draw):
    hardware = draw(st.sampled_from(["a40-2x8-nvlink", "h100-sxm-8x-400g"]))
    points = [{"collective": draw(st.sampled_from(["all_gather", "reduce_scatter", "all_reduce"])),
               "mb": draw(st.floats(1.0, 200.0)), "after": j, "before": j + 2,
               "group": draw(st.sampled_from(["dp", "tp"]))} for j in range(3)]
    segments = [(draw(st.floats(0.05, 2.0)), draw(st.floats(1.0, 300.0)), 300) for _ in range(5)]
    base = synthetic_problem(segments, points, hardware=hardware)
    cap = Capability(draw(st.sampled_from(["2.26", "2.27", "2.28", "2.30.7"])), draw(st.booleans()),
                     nvls=base.hw.cluster.nvls, nvlink_domain=draw(st.booleans()))
    return Problem(base.graph, base.hw, SPACE, capability=cap)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_problems())
def test_every_strategy_picks_only_what_the_target_can_apply(problem):
    for strategy in ("nccl", "autoccl", "lagom"):
        found = run_strategy(strategy, problem)
        assert applicable(problem, found) == [], strategy


def test_a_per_process_knob_is_one_decision_for_the_step():
    """With the chunk per process (NCCL 2.28: no getChunkSize), every key runs the one chunk chosen; the
    same problem with per-size chunks may give keys different ones."""
    points = [{"collective": "all_gather", "mb": mb, "after": j, "before": j + 2, "group": "dp"}
              for j, mb in enumerate((2.0, 150.0, 40.0))]
    base = synthetic_problem(_segments(3), points)
    per_process = Problem(base.graph, base.hw, SPACE, capability=Capability("2.28", True, False, True))
    found = run_strategy("lagom", per_process)
    assert len({c.chunk_bytes for c in found.configs.values()}) == 1
    assert {c.chunk_bytes for c in found.configs.values()} == {found.process.chunk_bytes}
    assert len({c.threads for c in found.configs.values()}) == 1


def tiny_job(tmp_path):
    wl = load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload(parallel={"tp": 2, "dp": 4})))
    return wl, load_hardware("a100-8x-100g")


@pytest.mark.parametrize("cap", [Capability("2.30.7", True, False, True), Capability("2.26", False, False, True)])
def test_plans_hold_per_process_knobs_once(tmp_path, cap):
    wl, hw = tiny_job(tmp_path)
    plan = make_plan(wl, hw, "lagom", capability=cap)
    data = json.loads(plan.to_json())
    assert set(data["process"]) == set(cap.process_fields())
    assert Capability.from_dict(data["capability"]) == cap
    for entry in data["entries"]:
        assert not set(entry["config"]) & set(cap.process_fields())
    assert Plan.from_dict(data) == plan
    if not cap.per_size:
        assert emit.tuner_entries(plan) == [] and emit.tuner_csv(plan) == emit.TUNER_COLUMNS + "\n"
    data["entries"][0]["config"]["threads"] = 128
    with pytest.raises(ConfigError, match=r"entries\[0\]\.config\.threads: a per-process knob inside an entry"):
        Plan.from_dict(data)


def test_entries_that_disagree_on_a_per_process_knob_are_refused(tmp_path):
    wl, hw = tiny_job(tmp_path)
    plan = make_plan(wl, hw, "nccl", capability=Capability("2.30.7", True, False, True))
    entries = [replace(e, config=replace(e.config, threads=128 if i == 0 else 512)) for i, e in enumerate(plan.entries)]
    with pytest.raises(ConfigError, match="config.threads: a per-process knob with 2 values"):
        replace(plan, entries=entries, process={})
    with pytest.raises(ConfigError, match=r"entries\[0\]\.config\.threads: 128 differs from the plan's per-process"):
        replace(plan, entries=entries)


def test_a_result_without_its_process_values_runs_the_ones_most_keys_have(tmp_path):
    """E.g. configs kept from a running plan beside NCCL's for new keys: the plan holds one value."""
    wl, hw = tiny_job(tmp_path)
    problem = problem_for(wl, hw, Capability("2.30.7", True, False, True))
    found = run_strategy("nccl", problem)
    keys = list(found.configs)
    mixed = {k: replace(c, threads=256 if i else 128) for i, (k, c) in enumerate(found.configs.items())}
    plan = plan_from(Tuned(wl, problem, replace(found, configs=mixed, process=None)), wl, hw, {"nccl": 1.0})
    assert len(keys) > 2 and plan.process["threads"] == 256 and {e.config.threads for e in plan.entries} == {256}


def test_zero_policy_and_nvls_reach_the_communicator_config_and_the_registration(tmp_path):
    problem = synthetic_problem(_segments(2), [{"collective": "all_gather", "mb": 64.0, "after": 0, "before": 2},
                                               {"collective": "all_reduce", "mb": 8.0, "after": 1, "before": 3}],
                                hardware="h100-sxm-8x-400g")
    problem = Problem(problem.graph, problem.hw, SPACE,
                      capability=Capability("2.30.7", True, True, True, symmetric_groups=("g0",)))
    ag, ar = problem.keys
    configs = {ag: replace(default_config(problem.hw), cta_policy=CTAPolicy.ZERO),
               ar: CommConfig(algorithm=Algorithm.NVLS, channels=16, cta_policy=CTAPolicy.ZERO)}
    found = SearchResult("test", configs, run_strategy("nccl", problem).result, 1, process=problem.settings)
    rows = registration(problem, found)
    assert [(r["group"], r["collectives"], r["max_bytes"]) for r in rows] == [("g0", ["all_gather"], 64_000_000)]
    wl, hw = tiny_job(tmp_path)
    plan = make_plan(wl, hw, "nccl", capability=Capability("2.30.7", True, False, True))
    dp = [e for e in plan.entries if e.group == "dp"]
    dp[0].config = replace(dp[0].config, cta_policy=CTAPolicy.ZERO)
    dp[-1].config = replace(dp[-1].config, algorithm=Algorithm.NVLS, channels=12)
    cfgs = emit.communicator_configs(plan)
    assert cfgs["dp"]["cta_policy"] == "zero" and cfgs["dp"]["nvls_ctas"] == 12
    assert "cta_policy" not in emit.megatron_nccl_yaml(plan)  # megatron's YAML has no such key
    options = apply.nccl_options(cfgs["dp"])
    assert (options.config.cta_policy, options.config.nvls_ctas) == (2, 12)  # NCCL_CTA_POLICY_ZERO
    assert any(line.split()[5] == "nvls" for line in emit.tuner_rules(plan).splitlines() if line.startswith("allreduce"))


def test_init_refuses_a_plan_that_needs_what_the_process_lacks(tmp_path):
    wl, hw = tiny_job(tmp_path)
    plan = make_plan(wl, hw, "lagom", capability=Capability("2.30.7", True, False, True))
    assert plan.needs(Capability("2.30.7", True, False, True)) == []
    needs = plan.needs(Capability("2.30.7", False, False, True))
    assert needs and "tuner plugin" in needs[0] and "not built" in needs[0]
    with pytest.raises(ConfigError, match="plan.capability: plan 'tiny-gpt' needs Lagom's NCCL tuner plugin.*NCCL 2.20"):
        apply.init(plan, hw=hw, capability=Capability("2.20", True, False, True))
    zero = replace(plan, entries=[replace(e, config=replace(e.config, cta_policy=CTAPolicy.ZERO)) for e in plan.entries])
    assert any("CTA policy zero (NCCL >= 2.28; this is NCCL 2.27)" in n for n in zero.needs(Capability("2.27", True)))


def test_a_session_re_plans_within_what_the_process_has(tmp_path):
    wl, hw = tiny_job(tmp_path)
    plan_file = tmp_path / "plan.json"
    make_plan(wl, hw, "lagom", capability=Capability("2.30.7", True, False, True)).save(plan_file)
    older = Capability("2.26", False, False, True)
    session = TuningSession(wl, hw, SessionOptions(plan_in=plan_file, capability=older, cache_dir=tmp_path / "cache"),
                            world_size=8)
    try:
        session.start()  # the job starts on the framework's own settings; the new plan is searched beside it
        assert session.plan is None and session.searching
        assert "needs Lagom's NCCL tuner plugin" in session.plan_source
        assert any("needs Lagom's NCCL tuner plugin" in e for e in session.events)
        deadline = time.monotonic() + 300
        while session.searching:  # steps of a millisecond: an empty loop would hold the GIL from the search
            session.begin_step()
            time.sleep(0.001)
            session.end_step()
            assert time.monotonic() < deadline, "the search beside the job never ended"
        assert session.plan is not None and session.plan.capability_record() == older
        assert session.plan.needs(older) == [] and emit.tuner_entries(session.plan) == []
        report = session.report()
        assert report["capability"]["this_process"].startswith("NCCL 2.26, no tuner plugin")
    finally:
        session.close()
