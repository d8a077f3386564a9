"""The online calibration refitted to every setting tried live: comm per key, compute, and the contention slope
where channel counts differed, recovered from steps a known model produced."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lagom.hardware import load_hardware
from lagom.model.calibrated import CalibratedModel
from lagom.model.simulator import Configs, Simulator
from lagom.runtime.online.tuner import Calibration, Observation, refit
from lagom.search.base import Problem, nccl_configs
from lagom.step.workload import load_workload
from lagom.tune import problem_for


@pytest.fixture(scope="module")
def setup() -> tuple[Problem, Simulator, Configs]:
    problem = problem_for(load_workload("phi2-fsdp"), load_hardware("a40-2x8-nvlink"))
    return problem, Simulator(problem.graph), nccl_configs(problem)


def observe(sim: Simulator, truth: CalibratedModel, configs: Configs) -> Observation:
    r = sim.run(configs, truth)
    return Observation(configs, r.step_s, {k: v["time"] / v["count"] for k, v in r.per_key().items() if v["count"]})


def start(problem: Problem, sim: Simulator) -> Calibration:
    """A calibration as the start plan's steps leave it: the profile's model, unscaled."""
    return Calibration(problem.with_model(CalibratedModel(problem.hw)), 1.0, 1.0, {}, sim)


def truth_model(problem: Problem, slots: float) -> CalibratedModel:
    hw = replace(problem.hw, contention=replace(problem.hw.contention, gemm_slots_per_comm_cta=slots))
    truth = CalibratedModel(hw)
    truth.compute_scale = 1.3
    return truth


def test_refit_recovers_scales_and_the_contention_slope_from_the_settings_tried(setup) -> None:
    problem, sim, reference = setup
    truth = truth_model(problem, 0.5)
    truth.set_comm_scale({k: 1.2 for k in reference})
    tried = [{k: replace(c, channels=ch) for k, c in reference.items()} for ch in (1, 2, 4, 16)]
    # the reference between every two candidates, as the live search measures it
    observations = [o for cfgs in tried for o in (observe(sim, truth, cfgs), observe(sim, truth, reference))]
    cal = start(problem, sim)
    result = refit(cal, observations)
    assert result.observations == 5  # the reference's repeats are one setting
    assert result.slots_per_comm_cta == 0.5
    assert result.calibration.model.compute_scale == pytest.approx(1.3, rel=0.02)
    assert all(s == pytest.approx(1.2, rel=1e-3) for s in result.calibration.model.comm_scale.values())
    assert result.step_error_after < 0.01 < result.step_error_before
    assert cal.model.compute_scale == 1.0 and cal.model.hw.contention.gemm_slots_per_comm_cta is None  # untouched


def test_one_channel_count_fits_no_slope(setup) -> None:
    problem, sim, reference = setup
    truth = truth_model(problem, 1.0)
    observations = [observe(sim, truth, reference),
                    observe(sim, truth, {k: replace(c, chunk_bytes=c.chunk_bytes // 4) for k, c in reference.items()})]
    result = refit(start(problem, sim), observations)
    assert result.slots_per_comm_cta is None
    assert result.calibration.model.hw.contention.gemm_slots_per_comm_cta is None
    assert result.step_error_after < result.step_error_before
    assert refit(start(problem, sim), []).observations == 0


def test_a_refit_that_fits_the_steps_worse_keeps_the_calibration(setup) -> None:
    """Collective times ten times what the steps allow (a recorder counting a wait as the call, say): scaling
    comm to them makes every simulated step longer than measured, so the refit is refused, not reported."""
    problem, sim, reference = setup
    truth = truth_model(problem, 0.5)
    tried = [{k: replace(c, channels=ch) for k, c in reference.items()} for ch in (1, 16)]
    observations = []
    for cfgs in tried:
        o = observe(sim, truth, cfgs)
        observations.append(Observation(o.configs, o.step_s, {k: 10 * v for k, v in o.keys.items()}))
    cal = start(problem, sim)
    result = refit(cal, observations)
    assert result.kept and result.calibration is cal and result.slots_per_comm_cta is None
    assert result.step_error_after == result.step_error_before > 0
    assert result.summary()["kept_calibration"] is True
    consistent = refit(cal, [observe(sim, truth, cfgs) for cfgs in tried])
    assert not consistent.kept and consistent.step_error_after < consistent.step_error_before
