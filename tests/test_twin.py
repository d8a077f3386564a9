"""A pipeline's twin (the same phase built for fewer micro-batches, ``lagom.step.points.points_for``) stands for
the phase in the simulator's runs that jump: its jumps pass over the periods it lacks, so its runs are the
phase's own. Checked against the phase run by itself: step, exposed comm, the compute and comm bounds, every
key's sums, the periods skipped and every collective's timing, on both loops, fresh and resumed; a twin too
short for the jump the phase makes leaves the phase to run itself, with the same result."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from lagom.hardware import load_hardware
from lagom.model import compiled
from lagom.model.simulator import Simulator, StepResult
from lagom.search.base import Problem, nccl_configs
from lagom.step.graph import StepGraph
from lagom.step.points import points_for, twin_micro_batches
from lagom.step.workload import Workload, load_workload
from lagom.tune import problem_for
from tests.helpers import random_workload

LOOPS = [pytest.param(True, id="compiled", marks=pytest.mark.skipif(not compiled.enabled(), reason="no compiled loop")),
         pytest.param(False, id="python")]


def shipped(name: str, m: int) -> tuple[Workload, StepGraph, dict, object]:
    wl = load_workload(name).with_microbatches(m)
    problem = problem_for(wl, load_hardware(wl.hardware))
    return wl, problem.graph, nccl_configs(problem), problem.model


def without_twins(graph: StepGraph) -> StepGraph:
    for phase in graph.phases:
        phase.derived.pop("twin", None)
    return graph


def assert_same(a: StepResult, b: StepResult) -> None:
    close = pytest.approx
    assert (a.step_s, a.exposed_comm_s, a.compute_s, a.comm_peak_s) == close(
        (b.step_s, b.exposed_comm_s, b.compute_s, b.comm_peak_s), rel=1e-9, abs=1e-15)
    mine, theirs = a.per_key(), b.per_key()
    assert mine.keys() == theirs.keys()
    for key, row in theirs.items():
        assert mine[key] == close(row, rel=1e-9, abs=1e-15), key
    assert [p.periods_skipped for p in a.phases] == [p.periods_skipped for p in b.phases]


@pytest.mark.parametrize("compiled_loop", LOOPS)
@pytest.mark.parametrize(("name", "m"), [("gpt3-13b-pp4", 128), ("bert-pp4", 160)])
def test_shipped_pipelines_run_as_their_twins(name: str, m: int, compiled_loop: bool) -> None:
    wl, graph, configs, model = shipped(name, m)
    assert twin_micro_batches(wl) == 16
    sim = Simulator(graph, compiled_loop=compiled_loop)
    twin = sim.run(configs, model)
    assert sim.virtual(0) > 0, "the twin did not stand for the phase"
    assert twin.tasks_simulated < sum(len(s) for s in graph.phases[0].segments.values()) + len(graph.phases[0].points)
    points = twin.phases[0].points  # from a run of the phase itself: the twin's collectives are not the phase's
    own = Simulator(without_twins(graph), compiled_loop=compiled_loop).run(configs, model, timings=True)
    assert_same(twin, own)
    assert [(p.name, p.key, p.device) for p in points] == [(p.name, p.key, p.device) for p in own.phases[0].points]
    assert [x for p in points for x in (p.start, p.end, p.solo, p.exposed)] == pytest.approx(
        [x for p in own.phases[0].points for x in (p.start, p.end, p.solo, p.exposed)], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("compiled_loop", LOOPS)
def test_a_twin_resumes_where_the_changed_key_starts(compiled_loop: bool) -> None:
    _, graph, configs, model = shipped("gpt3-13b-pp4", 128)
    sim = Simulator(graph, compiled_loop=compiled_loop)
    first = sim.run(configs, model, timings=False)
    starts: dict[str, float] = {}
    for p in first.phases[0].points:
        starts[p.key] = min(starts.get(p.key, p.start), p.start)
    late = max(starts, key=starts.__getitem__)  # a gradient bucket's key, late in the step
    changed = {**configs, late: replace(configs[late], channels=max(1, configs[late].channels // 2))}
    resumed = sim.run(changed, model)
    assert resumed.phases[0].resumed_at is not None and sim.virtual(0) > 0
    assert_same(resumed, Simulator(without_twins(graph), compiled_loop=compiled_loop).run(changed, model))


@pytest.mark.parametrize("compiled_loop", LOOPS)
def test_a_twin_too_short_for_the_jump_leaves_the_phase_to_run_itself(compiled_loop: bool) -> None:
    wl, graph, configs, model = shipped("gpt3-13b-pp4", 64)
    hw = load_hardware(wl.hardware)
    graph.phases[0].derived["twin"] = points_for(wl.with_microbatches(9), hw).phases[0]  # settles after 10
    sim = Simulator(graph, compiled_loop=compiled_loop)
    assert sim.virtual(0) == 55  # its shape is the phase's: it is tried
    tried = sim.run(configs, model)
    assert sim.virtual(0) == 0  # it could not jump where the phase does: the phase ran itself, and runs so from now
    assert Simulator(graph, compiled_loop=compiled_loop).virtual(0) == 0  # in every Simulator of the graph
    assert_same(tried, Simulator(without_twins(graph), compiled_loop=compiled_loop).run(configs, model))


def test_a_twin_of_another_shape_is_not_used() -> None:
    wl, graph, configs, model = shipped("gpt3-13b-pp4", 64)
    other = replace(wl, model=replace(wl.model, layers=wl.model.layers + 4))
    graph.phases[0].derived["twin"] = points_for(other.with_microbatches(16), load_hardware(wl.hardware)).phases[0]
    sim = Simulator(graph)
    assert sim.virtual(0) == 0
    assert_same(sim.run(configs, model), Simulator(without_twins(graph)).run(configs, model))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_pipelines_run_as_their_twins(data: st.DataObject) -> None:
    """Any pipeline the schema accepts with enough micro-batches for a twin: its twin's runs are its own."""
    wl = random_workload(data, [2, 4], lambda pp: st.integers(128, 128 + 2 * pp))
    problem = Problem(points_for(wl, load_hardware("h100-sxm-4x8-400g")), load_hardware("h100-sxm-4x8-400g"))
    configs = nccl_configs(problem)
    runs = {}
    for compiled_loop in {compiled.enabled(), False}:
        sim = Simulator(problem.graph, compiled_loop=compiled_loop)
        runs[compiled_loop] = sim.run(configs, problem.model)
        event("the twin ran" if sim.virtual(0) else "the phase ran itself")  # --hypothesis-show-statistics
    for compiled_loop, twin in runs.items():
        assert_same(twin, Simulator(without_twins(problem.graph), compiled_loop=compiled_loop).run(configs, problem.model))


def test_a_resting_graph_lets_its_twins_index_go_too() -> None:
    from lagom.model.phase_index import drop_index

    _, graph, configs, model = shipped("gpt3-13b-pp4", 128)
    Simulator(graph).run(configs, model)
    phase, twin = graph.phases[0], graph.phases[0].derived["twin"]
    assert "index" in twin.derived
    drop_index(phase)
    assert "index" not in phase.derived and "index" not in twin.derived


def test_a_run_that_keeps_timings_does_not_reuse_a_twins_result() -> None:
    """A twin's result has no timings of the phase's; a run asking for them simulates the phase, and keeps them
    however the model changes afterwards (the Python loop's results keep theirs)."""
    _, graph, configs, model = shipped("gpt3-13b-pp4", 128)
    sim = Simulator(graph, compiled_loop=False)
    twin = sim.run(configs, model)
    kept = sim.run(configs, model, timings=True)
    assert kept.phases[0] is not twin.phases[0]
    model.compute_scale = 1.5  # a calibrated model's settings change after the run
    assert len(kept.phases[0].points) == len(graph.phases[0].points)
