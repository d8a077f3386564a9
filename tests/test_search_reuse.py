"""What the search reuses instead of repeating: results of configs simulated before, and what the priority
search works out from the step graph alone."""

from dataclasses import replace

import pytest

from lagom.hardware import load_hardware
from lagom.model.simulator import Simulator
from lagom.search import Problem, SimulatedEvaluator, run_strategy
from lagom.search.base import nccl_configs
from lagom.step.workload import load_workload
from lagom.tune import _Planner, _with_buckets, make_plan
from tests.helpers import gpt_workload, two_all_reduces_one_gemm, write_yaml


class CountingSimulator(Simulator):
    """A Simulator that counts its runs."""

    runs = 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return super().run(*args, **kwargs)


def test_a_repeated_config_is_not_simulated_again_and_equals_a_fresh_simulation_exactly():
    problem = two_all_reduces_one_gemm()
    configs = nccl_configs(problem)
    key = next(iter(configs))
    other = {**configs, key: replace(configs[key], channels=2)}
    evaluator = SimulatedEvaluator(problem, CountingSimulator(problem.graph))
    first = evaluator.evaluate(configs)
    evaluator.evaluate(other)
    again = evaluator.evaluate(dict(configs))  # an equal dict, not the same object
    assert (evaluator.evaluations, evaluator.simulated, evaluator.simulator.runs) == (3, 2, 2)
    fresh = Simulator(problem.graph).run(configs, problem.model)
    assert again == fresh and again.step_s == fresh.step_s == first.step_s
    assert again.per_key() == fresh.per_key()
    assert [ph.points for ph in again.phases] == [ph.points for ph in fresh.phases]  # timings simulated anew
    assert again.phases[0].points  # the collectives are there


def test_a_kept_results_timings_of_every_phase_come_from_one_simulation(monkeypatch):
    import lagom.search.base as base

    wl = load_workload("t5-dp-tp")  # a gradient-accumulation micro-batch phase and the last one
    problem = _Planner(load_hardware(wl.hardware), None).problem(wl)
    configs = nccl_configs(problem)
    evaluator = SimulatedEvaluator(problem)
    evaluator.evaluate(configs)
    kept = evaluator.evaluate(configs)  # from the cache: no run behind it
    calls = []
    monkeypatch.setattr(base, "simulate", lambda *args: calls.append(args) or Simulator(args[0]).run(args[1], args[2]))
    assert len(kept.phases) > 1
    timings = [ph.points for ph in kept.phases]
    assert len(calls) == 1
    fresh = Simulator(problem.graph).run(configs, problem.model)
    assert timings == [ph.points for ph in fresh.phases]


def test_the_strategies_of_one_call_share_results_per_graph_and_a_bucket_size_is_another_graph(tmp_path):
    wl = load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload(framework={
        "name": "megatron", "overlap_grad_reduce": True})))
    planner = _Planner(load_hardware("a100-8x-100g"), None)
    configs = nccl_configs(planner.problem(wl))
    nccl, lagom = planner.evaluator(wl, "nccl"), planner.evaluator(wl, "lagom")
    assert nccl.evaluate(configs) == lagom.evaluate(configs)
    assert (nccl.simulated, lagom.simulated, lagom.evaluations) == (1, 0, 1)
    assert planner.evaluations == 2  # progress counts both
    planner.rest(wl)  # the simulator's runs dropped, the results kept
    rested = planner.evaluator(wl, "lagom")
    assert rested.simulator is not lagom.simulator and rested.evaluate(configs) == lagom.evaluate(configs)
    assert rested.simulated == 0
    doubled = _with_buckets(wl, 2.0)
    bigger = planner.evaluator(doubled, "lagom")
    bigger.evaluate(nccl_configs(planner.problem(doubled)))
    assert bigger.simulated == 1 and bigger.seen is not lagom.seen


def test_a_plan_from_reused_results_equals_one_simulated_in_full(monkeypatch):
    """`lagom tune` with every repeat simulated again (no results kept, nothing the search derives from the
    graph kept between its passes) gives the same plan, with fewer simulations."""
    wl = load_workload("bert-pp4")
    hw = load_hardware(wl.hardware)
    runs = {"count": 0}
    real_run = Simulator.run

    def counted(self, *args, **kwargs):
        runs["count"] += 1
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(Simulator, "run", counted)
    kept = make_plan(wl, hw)
    reused = runs["count"]
    monkeypatch.setattr(SimulatedEvaluator, "evaluate", lambda self, configs: (
        setattr(self, "evaluations", self.evaluations + 1), self.simulator.run(configs, self.problem.model))[1])
    monkeypatch.setattr(Problem, "with_process", _unshared(Problem.with_process))
    runs["count"] = 0
    full = make_plan(wl, hw)
    assert kept.configs() == full.configs() and kept.evaluations == full.evaluations
    assert [e.note for e in kept.entries] == [e.note for e in full.entries]
    assert kept.predicted_step_s == pytest.approx(full.predicted_step_s, rel=1e-12)  # runs resume differently
    assert reused < runs["count"]


def _unshared(with_process):
    def fresh(self, *args, **kwargs):
        other = with_process(self, *args, **kwargs)
        other.derived = {}
        return other
    return fresh


def test_searching_a_problem_again_gives_what_a_fresh_problem_gives():
    problem = two_all_reduces_one_gemm()
    first = run_strategy("lagom", problem)
    assert "priority" in problem.derived
    again = run_strategy("lagom", problem)
    fresh = run_strategy("lagom", two_all_reduces_one_gemm())
    for found in (again, fresh):
        assert found.configs == first.configs
        assert found.result.step_s == pytest.approx(first.result.step_s, rel=1e-12)
