"""Incremental runs, on both loops: a Simulator resumes a run from an earlier one's checkpoint when the configs differ
only in keys whose first collective started later, and reuses a phase none of the changed keys is in.
Both must give exactly what a fresh simulator gives."""

from dataclasses import replace

import pytest

from lagom.hardware import load_hardware
from lagom.model import compiled
from lagom.model.cost_model import CostModel
from lagom.model.simulator import Simulator
from lagom.search.base import nccl_configs
from lagom.step.workload import load_workload
from lagom.tune import problem_for


def job(name: str, micro_batches: int | None = None):
    wl = load_workload(name)
    if micro_batches:
        wl = wl.with_microbatches(micro_batches)
    return problem_for(wl, load_hardware(wl.hardware))


@pytest.fixture(autouse=True, params=["python", "compiled"])
def loop(request, monkeypatch):
    """Both loops keep checkpoints and resume from them (the compiled one in C, at its own interval)."""
    monkeypatch.setenv("LAGOM_SIMULATOR", request.param)
    if request.param == "compiled" and not compiled.enabled():
        pytest.skip("the compiled simulator is not built")
    return request.param


def same(a, b) -> None:
    assert a.step_s == pytest.approx(b.step_s, rel=1e-12)
    assert a.exposed_comm_s == pytest.approx(b.exposed_comm_s, rel=1e-12, abs=1e-15)
    pa, pb = a.per_key(), b.per_key()
    for key, row in pb.items():
        for field, value in row.items():
            assert pa[key][field] == pytest.approx(value, rel=1e-12, abs=1e-15), (key, field)


def test_changing_a_late_key_resumes_from_a_checkpoint():
    """Gradient reduce-scatters start in the cool-down of a pipeline: the run resumes there."""
    problem = job("gpt3-13b-pp4", 32)
    base = nccl_configs(problem)
    sim = Simulator(problem.graph)
    first = sim.run(base, problem.model)
    late = [k for k in base if k.startswith("dp/reduce_scatter/")]
    assert late
    for key, channels in zip(late, (2, 4, 16)):
        configs = {**base, key: replace(base[key], channels=channels)}
        resumed = sim.run(configs, problem.model)
        fresh = Simulator(problem.graph).run(configs, problem.model)
        assert resumed.phases[0].resumed_at is not None and resumed.phases[0].resumed_at > 0.8 * first.step_s
        assert fresh.phases[0].resumed_at is None
        same(resumed, fresh)


def test_changing_an_early_key_simulates_from_the_start():
    problem = job("gpt3-13b-pp4", 24)
    base = nccl_configs(problem)
    sim = Simulator(problem.graph)
    sim.run(base, problem.model)
    key = next(k for k in base if k.startswith("tp/"))
    configs = {**base, key: replace(base[key], channels=4)}
    again = sim.run(configs, problem.model)
    assert again.phases[0].resumed_at is None
    same(again, Simulator(problem.graph).run(configs, problem.model))


def test_a_phase_without_changed_keys_is_reused_and_identical_configs_cost_nothing():
    """Data-parallel jobs: gradient buckets only in the last micro-batch's phase."""
    problem = job("llama3-8b-tp8")
    base = nccl_configs(problem)
    sim = Simulator(problem.graph)
    first = sim.run(base, problem.model)
    assert [ph.name for ph in first.phases] == ["micro", "last"]
    assert sim.run(dict(base), problem.model).phases == first.phases  # same configs: the same results
    last_only = [k for k in base if not any(p.key == k for p in problem.graph.phases[0].points)]
    assert last_only
    configs = {**base, last_only[0]: replace(base[last_only[0]], channels=2)}
    second = sim.run(configs, problem.model)
    assert second.phases[0] is first.phases[0] and second.phases[1] is not first.phases[1]
    same(second, Simulator(problem.graph).run(configs, problem.model))


def test_a_changed_model_is_not_resumed():
    """Checkpoints belong to the model they were simulated with."""
    problem = job("gpt3-13b-pp4", 24)
    base = nccl_configs(problem)
    sim = Simulator(problem.graph)
    sim.run(base, problem.model)
    other = type(problem.model)(replace(problem.hw, gpu=replace(problem.hw.gpu, gemm_efficiency=0.5)))
    slower = sim.run(base, other)
    assert slower.phases[0].resumed_at is None
    same(slower, Simulator(problem.graph).run(base, other))


class _Scaled(CostModel):
    """Compute scaled by a factor set between runs, as the online tuner's calibrated model is."""

    def __init__(self, hw) -> None:
        super().__init__(hw)
        self.scale = 1.0

    def compute_solo(self, seg):
        return super().compute_solo(seg) * self.scale

    def compute_time(self, seg, running=()):
        return self.compute_solo(seg) if not running else super().compute_time(seg, running) * self.scale


def test_a_model_whose_settings_changed_is_not_reused():
    """The same model object with another scale: nothing of the earlier run is reused."""
    problem = job("llama3-8b-tp8")
    base = nccl_configs(problem)
    model = _Scaled(problem.hw)
    sim = Simulator(problem.graph)
    first = sim.run(base, model)
    model.scale = 1.3
    second = sim.run(base, model)
    assert second.step_s > 1.1 * first.step_s
    assert all(a is not b for a, b in zip(second.phases, first.phases))
    same(second, Simulator(problem.graph).run(base, model))


@pytest.mark.parametrize("loop", ["python"], indirect=True)  # the compiled loop runs on arrays, not shapes
def test_memoised_shapes_stay_bounded_and_change_nothing(monkeypatch):
    """Each run lands its steady-state jumps elsewhere, so a long search would memoise ever more task
    shapes; past SHAPES_KEPT a Simulator drops them all and works them out again, with the same steps."""
    import lagom.model.simulator

    problem = job("gpt3-13b-pp4", 16)
    base = nccl_configs(problem)
    tp = [k for k in base if k.startswith("tp/")]
    sim = Simulator(problem.graph)
    sim.run(base, problem.model)
    one_run = sum(lw.kept() for lw in sim._lowerings.values())
    monkeypatch.setattr(lagom.model.simulator, "SHAPES_KEPT", one_run + 1)
    forgot = False
    for channels in (2, 4):
        configs = {**base, tp[0]: replace(base[tp[0]], channels=channels)}
        before = sum(lw.kept() for lw in sim._lowerings.values())
        same(sim.run(configs, problem.model), Simulator(problem.graph).run(configs, problem.model))
        after = sum(lw.kept() for lw in sim._lowerings.values())
        forgot |= after < before
        assert after <= one_run + 1
    assert forgot
