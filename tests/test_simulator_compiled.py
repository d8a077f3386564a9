"""The compiled event loop (lagom/model/event_loop.c) against the Python loop it was written from.

The two loops run the same floating-point operations in the same order, both with their steady-state jumps
switched off (every task simulated) and with them on (the compiled loop pauses at the band's period
boundaries, and the Python steady-state logic compares, probes and jumps its state): each way they must
agree to 1e-9 (they agree to the bit today) on the step, the exposed time, every per-key figure and every
collective's start and end, and with jumps on they must skip the same periods, on every shipped workload and
on random multi-stage steps. The 1,024- and 2,048-GPU jobs take the Python loop tens of seconds: CI's slower
tier runs them.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lagom.errors import LagomError
from lagom.hardware import load_hardware
from lagom.model import compiled, phase_arrays, simulator
from lagom.model.calibrated import CalibratedModel
from lagom.model.cost_model import CostModel
from lagom.model.lowering import Lowering, split_of
from lagom.model.phase_index import index_of
from lagom.model.simulator import Simulator, StepResult
from lagom.plan.comm_config import CommConfig, Decomposition, default_config
from lagom.search import run_strategy
from lagom.search.base import nccl_configs
from lagom.step.graph import Collective, ComputeSegment, Group, OverlapPoint, Phase, StepGraph
from lagom.step.workload import load_workload, workload_names
from lagom.tune import problem_for

REL = 1e-9
SLOW = {"llama3-70b-1024", "llama3-405b-2048", "gpt3-13b-pp4"}

pytestmark = pytest.mark.skipif(not compiled.library_path().is_file(),
                                reason="the compiled simulator is not built (no C compiler at install)")


def _agree(fast: StepResult, ref: StepResult) -> None:
    assert fast.step_s == pytest.approx(ref.step_s, rel=REL, abs=1e-15)
    assert fast.exposed_comm_s == pytest.approx(ref.exposed_comm_s, rel=REL, abs=1e-15)
    assert [ph.time for ph in fast.phases] == pytest.approx([ph.time for ph in ref.phases], rel=REL)
    ours, theirs = fast.per_key(), ref.per_key()
    assert list(ours) == list(theirs)  # the same keys, first touched in the same order
    for key, row in theirs.items():
        for field, value in row.items():
            assert ours[key][field] == pytest.approx(value, rel=REL, abs=1e-15), (key, field)
    for mine, other in zip(fast.phases, ref.phases, strict=True):
        assert [(p.name, p.key, p.device) for p in mine.points] == [(p.name, p.key, p.device) for p in other.points]
        for a, b in zip(mine.points, other.points):
            for field in ("start", "end", "solo", "exposed"):
                assert getattr(a, field) == pytest.approx(getattr(b, field), rel=REL, abs=1e-15 + REL * ref.step_s), \
                    (a.name, field)


def _both_ways(graph: StepGraph, configs: dict[str, CommConfig], model: CostModel) -> None:
    """Every task (extrapolate=False), then with the steady-state jumps: the loops agree, and jump alike."""
    for extrapolate in (False, True):
        fast = Simulator(graph, compiled_loop=True).run(configs, model, extrapolate=extrapolate, timings=True)
        ref = Simulator(graph, compiled_loop=False).run(configs, model, extrapolate=extrapolate)
        assert fast.tasks_simulated == ref.tasks_simulated
        assert [ph.periods_skipped for ph in fast.phases] == [ph.periods_skipped for ph in ref.phases]
        _agree(fast, ref)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in workload_names()])
def test_every_shipped_workload_agrees_with_the_python_loop(name):
    """NCCL's configs and Lagom's (which split collectives into P2P steps on several jobs)."""
    wl = load_workload(name)
    problem = problem_for(wl, load_hardware(wl.hardware))
    for configs in (nccl_configs(problem), *([] if name in SLOW else [run_strategy("lagom", problem).configs])):
        _both_ways(problem.graph, configs, problem.model)


def test_the_compiled_loop_jumps_the_steady_state():
    """A pipeline of many micro-batches: the compiled loop skips most periods, and lands where every task does."""
    wl = load_workload("bert-pp4")
    wl = wl.with_microbatches(64)
    problem = problem_for(wl, load_hardware(wl.hardware))
    configs = nccl_configs(problem)
    jumped = Simulator(problem.graph, compiled_loop=True).run(configs, problem.model)
    full = Simulator(problem.graph, compiled_loop=True).run(configs, problem.model, extrapolate=False)
    assert sum(ph.periods_skipped for ph in jumped.phases) > 0
    assert jumped.tasks_simulated < full.tasks_simulated / 3
    assert jumped.step_s == pytest.approx(full.step_s, rel=1e-6)
    assert jumped.exposed_comm_s == pytest.approx(full.exposed_comm_s, rel=1e-6, abs=1e-12)


def test_a_search_on_the_compiled_loop_reuses_its_arrays_and_agrees_run_after_run():
    """One Simulator, many configs (what a search does): each run equals a fresh Python one."""
    wl = load_workload("bert-pp4")
    problem = problem_for(wl, load_hardware(wl.hardware))
    sim = Simulator(problem.graph, compiled_loop=True)
    base = nccl_configs(problem)
    for key in list(base)[:3]:
        for channels in (1, 4):
            configs = {**base, key: replace(base[key], channels=channels)}
            _agree(sim.run(configs, problem.model),
                   Simulator(problem.graph, compiled_loop=False).run(configs, problem.model))
    assert len(sim.lowered()) == 1  # one decomposition choice: lowered once


def test_a_search_run_pins_neither_arrays_nor_records_and_its_timings_come_back_the_same():
    """A search's results outlive the arrays its Simulator keeps (its trails, a strategy's best): they hold on to
    neither those arrays nor per-collective records; asked for its timings, a result simulates the phase again
    and gets what a run that kept them has, unless the model has changed since."""
    wl = load_workload("bert-pp4")
    problem = problem_for(wl, load_hardware(wl.hardware))
    configs = nccl_configs(problem)
    model = CalibratedModel(problem.hw)
    sim = Simulator(problem.graph, compiled_loop=True)
    result = sim.run(configs, model)
    arrays = weakref.ref(next(iter(sim.lowered().values())))
    del sim  # its kept arrays go with it
    gc.collect()
    assert arrays() is None
    kept = Simulator(problem.graph, compiled_loop=True).run(configs, model, timings=True)
    assert [ph.points for ph in result.phases] == [ph.points for ph in kept.phases]
    key = next(iter(configs))
    other = Simulator(problem.graph, compiled_loop=True).run({**configs, key: replace(configs[key], channels=2)}, model)
    model.compute_scale = 1.5
    with pytest.raises(LagomError, match="model has changed"):
        _ = other.phases[0].points


def test_simulators_share_one_budget_of_kept_arrays_and_make_room_before_lowering(monkeypatch):
    """Two Simulators alive (a tune's bucket scales) keep their arrays within one budget, the other's (used as
    often, less recently) dropped first; a lowering first makes room for the largest arrays lowered so far."""
    import lagom.model.simulator as simulator

    wl = load_workload("bert-pp4")
    problem = problem_for(wl, load_hardware(wl.hardware))
    configs = nccl_configs(problem)
    key = next(iter(configs))
    split = {**configs, key: replace(configs[key], decomposition=Decomposition.P2P, num_chunks=1)}
    first, second = Simulator(problem.graph, compiled_loop=True), Simulator(problem.graph, compiled_loop=True)
    first.run(configs, problem.model)
    budget = next(iter(first.lowered().values())).nbytes
    monkeypatch.setattr(simulator, "ARRAYS_KEPT", budget + 1)
    expected = second.run(configs, problem.model)
    assert not first.lowered() and len(second.lowered()) == 1  # the least recently used went
    held: list[int] = []
    lower = phase_arrays.lower
    monkeypatch.setattr(phase_arrays, "lower", lambda lw: held.append(sum(a.nbytes for a in second.lowered().values())) or lower(lw))
    second.run(split, problem.model)  # another split: room made first
    assert held == [0]
    _agree(second.run(configs, problem.model, timings=True), expected)


HW = load_hardware("h100-sxm-4x8-400g")
segment = st.tuples(st.floats(0.01, 2.0), st.floats(1.0, 400.0), st.sampled_from([66, 132, 4000]))


@st.composite
def pipelines(draw):
    """One to three stages, each a random compute stream; collectives on random windows of a stage (some on
    groups that cross nodes and share the NIC, some that Flash-Overlap may split) and sends from a stage's
    segment to the next stage's, repeated over random micro-batch phases."""
    stages = draw(st.integers(1, 3))
    segments = {d: [ComputeSegment(f"d{d}s{i}", f * 1e12, b * 1e6, c, d)
                    for i, (f, b, c) in enumerate(draw(st.lists(segment, min_size=2, max_size=5)))]
                for d in range(stages)}
    points = []
    for j in range(draw(st.integers(0, 4))):  # none: a stage of compute alone
        d = draw(st.integers(0, stages - 1))
        segs = segments[d]
        coll = draw(st.sampled_from([Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE]))
        after = draw(st.sampled_from([None, *range(len(segs) - 1)]))
        lo = 0 if after is None else after + 1
        before = draw(st.sampled_from([None, *range(lo, len(segs))]))
        fuse = None
        if draw(st.booleans()):
            fuse = before if coll == Collective.ALL_GATHER else after if coll == Collective.REDUCE_SCATTER else None
        nodes = draw(st.sampled_from([1, 2, 4]))
        group = Group(draw(st.sampled_from(["dp", "tp", f"g{j}"])) + f"@{nodes}", 8 * nodes if nodes > 1 else 8, 8, nodes)
        points.append(OverlapPoint(f"p{j}", coll, group, int(draw(st.floats(1.0, 300.0)) * 1e6),
                                   None if after is None else segs[after].name,
                                   None if before is None else segs[before].name, device=d,
                                   fuse_with=None if fuse is None else segs[fuse].name))
    for d in range(stages - 1):
        src, dst = segments[d], segments[d + 1]
        i, k = draw(st.integers(0, len(src) - 1)), draw(st.integers(0, len(dst) - 1))
        points.append(OverlapPoint(f"send{d}", Collective.SEND_RECV, Group(f"pp{d}", 2, 1, 2), 64 * 1024 * 1024,
                                   src[i].name, dst[k].name, device=d, peer_device=d + 1))
    phases = [Phase("step", draw(st.integers(1, 3)), segments, points)]
    graph = StepGraph("random", HW.name, stages, phases)
    configs = {}
    for p in points:
        cfg = default_config(HW)
        if p.fuse_with is not None and draw(st.booleans()):
            cfg = replace(cfg, decomposition=Decomposition.P2P, num_chunks=draw(st.sampled_from([1, 2])))
        configs[p.key] = replace(cfg, channels=draw(st.sampled_from([1, 4, 16, 32])))
    return graph, configs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_random_steps_agree_with_the_python_loop(case):
    graph, configs = case
    model = CostModel(HW)
    try:
        Simulator(graph, compiled_loop=False).run(configs, model, extrapolate=False)
    except LagomError as err:  # a drawn graph the lowering refuses (a wait on the phase end's own send...)
        with pytest.raises(LagomError, match=str(err).split(":")[0]):
            Simulator(graph, compiled_loop=True).run(configs, model)
        return
    _both_ways(graph, configs, model)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pipelines(), st.data())
def test_random_runs_resumed_from_a_checkpoint_agree_with_fresh_ones(monkeypatch, case, data):
    """With a checkpoint after every task, a run that changes one key resumes from the last state before that
    key's first collective, on either loop, and gives what a fresh run gives."""
    monkeypatch.setattr(compiled, "CHECKPOINT_EVERY", 1)
    monkeypatch.setattr(simulator, "CHECKPOINT_EVERY", 1)
    graph, configs = case
    assume(configs)  # a key to change
    model = CostModel(HW)
    key = data.draw(st.sampled_from(sorted(configs)))
    changed = {**configs, key: replace(configs[key], channels=data.draw(st.sampled_from([2, 8, 64])))}
    try:
        fresh = Simulator(graph, compiled_loop=False).run(changed, model)
    except LagomError:  # a drawn graph the lowering refuses
        return
    for loop in (True, False):
        sim = Simulator(graph, compiled_loop=loop)
        sim.run(configs, model)
        again = sim.run(changed, model)
        assert again.step_s == pytest.approx(fresh.step_s, rel=REL, abs=1e-15), loop
        assert again.exposed_comm_s == pytest.approx(fresh.exposed_comm_s, rel=REL, abs=1e-15), loop
        ours, theirs = again.per_key(), fresh.per_key()
        assert list(ours) == list(theirs), loop
        for k, row in theirs.items():
            for field, value in row.items():
                assert ours[k][field] == pytest.approx(value, rel=REL, abs=1e-15), (loop, k, field)


def test_a_run_keeps_a_bounded_number_of_checkpoints_and_resumes_from_them(monkeypatch):
    """Each holds every queue's state: a larger phase spaces them further apart instead of keeping more."""
    monkeypatch.setattr(compiled, "CHECKPOINT_EVERY", 1)
    wl = load_workload("gpt3-13b-pp4")
    wl = wl.with_microbatches(32)
    problem = problem_for(wl, load_hardware(wl.hardware))
    base = nccl_configs(problem)
    counts = []
    for most in (10**9, 64):
        monkeypatch.setattr(compiled, "CHECKPOINTS_PER_RUN", most)
        sim = Simulator(problem.graph, compiled_loop=True)
        sim.run(base, problem.model)
        counts.append(len(sim._trails[0].phases[0][2]))
    assert 64 < counts[0] and 1 <= counts[1] <= 64
    late = next(k for k in base if k.startswith("dp/reduce_scatter/"))
    configs = {**base, late: replace(base[late], channels=2)}
    resumed = sim.run(configs, problem.model)
    assert resumed.phases[0].resumed_at is not None
    fresh = Simulator(problem.graph, compiled_loop=True).run(configs, problem.model)
    assert resumed.step_s == pytest.approx(fresh.step_s, rel=1e-12)
    for key, row in fresh.per_key().items():
        assert resumed.per_key()[key] == pytest.approx(row, rel=1e-12, abs=1e-15), key


def test_a_cost_model_fault_inside_the_compiled_loop_is_raised_as_in_python():
    """The callback's exception crosses the C loop and is raised, naming the task, as the Python loop names it."""
    wl = load_workload("gpt2-tp8")
    problem = problem_for(wl, load_hardware(wl.hardware))

    class Broken(CostModel):
        def compute_time(self, segment, running=()):
            return float("nan") if running else super().compute_time(segment, running)

    model = Broken(problem.model.hw)
    with pytest.raises(LagomError, match="cost model gave duration nan") as fast:
        Simulator(problem.graph, compiled_loop=True).run(nccl_configs(problem), model)
    with pytest.raises(LagomError, match="cost model gave duration nan") as ref:
        Simulator(problem.graph, compiled_loop=False).run(nccl_configs(problem), model)
    assert str(fast.value) == str(ref.value)


def test_the_environment_chooses_the_python_loop_and_a_bad_value_is_named():
    code = ("from lagom.model.simulator import Simulator; from lagom.step.graph import StepGraph; "
            "print(Simulator(StepGraph('w', 'h', 1, [])).compiled_loop)")
    run = [sys.executable, "-c", code]
    assert subprocess.run(run, capture_output=True, text=True, check=True,
                          env={"LAGOM_SIMULATOR": "python", "PATH": ""}).stdout.strip() == "False"
    assert subprocess.run(run, capture_output=True, text=True, check=True, env={"PATH": ""}).stdout.strip() == "True"
    bad = subprocess.run(run, capture_output=True, text=True, env={"LAGOM_SIMULATOR": "fortran", "PATH": ""})
    assert bad.returncode != 0 and "LAGOM_SIMULATOR" in bad.stderr and "'python'" in bad.stderr


@pytest.mark.parametrize("compiled_loop", [True, False])
def test_compute_durations_carry_over_runs_under_one_model_and_its_settings(compiled_loop):
    """A Simulator keeps compute durations across runs, keyed by the configs beside each segment: a run with one
    key's channels changed asks the model for fewer of them than the same run on a fresh Simulator, and gets
    the same step to the bit; a change in the model's settings (a calibrated compute scale) starts them afresh."""
    wl = load_workload("bert-pp4")
    problem = problem_for(wl, load_hardware(wl.hardware))
    model = CalibratedModel(problem.hw)
    asked: list[int] = []
    real = model.compute_time
    model.compute_time = lambda seg, running=(): asked.append(1) or real(seg, running)  # type: ignore[method-assign]
    configs = nccl_configs(problem)
    key = next(iter(configs))
    other = {**configs, key: replace(configs[key], channels=2)}
    sim = Simulator(problem.graph, compiled_loop=compiled_loop)
    sim.run(configs, model)
    asked.clear()
    carried = sim.run(other, model)
    carried_asks = len(asked)
    asked.clear()
    fresh = Simulator(problem.graph, compiled_loop=compiled_loop).run(other, model)
    assert carried_asks < len(asked)
    assert (carried.step_s, carried.exposed_comm_s) == (fresh.step_s, fresh.exposed_comm_s)
    model.compute_scale = 1.5
    scaled = sim.run(other, model)
    assert scaled.step_s == Simulator(problem.graph, compiled_loop=compiled_loop).run(other, model).step_s
    assert scaled.step_s > carried.step_s


def test_splits_gone_over_again_in_the_same_order_are_not_all_lowered_again(monkeypatch):
    """A search's stages go over the same choices of decompositions in the same order. Where they do not all fit
    the budget, dropping the least recently used would drop each one just before its next use (three splits, two
    fitting: six lowerings over two passes); dropping the least used, then the newest, keeps one for the second
    pass. Results are the fresh Simulator's."""
    import lagom.model.simulator as simulator

    wl = load_workload("bert-pp4")
    problem = problem_for(wl, load_hardware(wl.hardware))
    configs = nccl_configs(problem)
    key = next(iter(configs))
    passes = [configs] + [{**configs, key: replace(configs[key], decomposition=Decomposition.P2P, num_chunks=k)}
                          for k in (1, 2)]
    sizes = []
    for c in passes:
        one = Simulator(problem.graph, compiled_loop=True)
        one.run(c, problem.model)
        sizes.append(next(iter(one.lowered().values())).nbytes)
    monkeypatch.setattr(simulator, "_KEPT", simulator._KeptArrays())  # no other test's arrays in the budget
    monkeypatch.setattr(simulator, "ARRAYS_KEPT", 2 * max(sizes) + 1)
    lowered: list[int] = []
    lower = phase_arrays.lower
    monkeypatch.setattr(phase_arrays, "lower", lambda lw: lowered.append(1) or lower(lw))
    again = [{**c, key: replace(c[key], channels=1)} for c in passes]  # the same splits, runs not seen before
    sim = Simulator(problem.graph, compiled_loop=True)
    results = [sim.run(c, problem.model) for c in passes + again]
    assert len(lowered) == 5
    for c, result in zip(passes + again, results):
        _agree(result, Simulator(problem.graph, compiled_loop=True).run(c, problem.model))


def _same_arrays(lowering_of) -> None:
    """A phase lowered with every queue's rows at once and by the walk through its shapes: identical arrays."""
    at_once, walked = phase_arrays._lower(lowering_of(), at_once=True), phase_arrays._lower(lowering_of(), at_once=False)
    for name in ("position", "queue_first", "task", "dev_list", "dep_list", "wake_list", "cost_key", "cost_cross",
                 "cost_one_way", "compute_queue", "blame_device"):
        mine, theirs = getattr(at_once, name), getattr(walked, name)
        assert mine.dtype == theirs.dtype and mine.tolist() == theirs.tolist(), name
    assert (at_once.costs, at_once.cost_task, at_once.keys, at_once.records) == \
        (walked.costs, walked.cost_task, walked.keys, walked.records)


@pytest.mark.parametrize("name", [n for n in workload_names() if n not in SLOW] + ["gpt3-13b-pp4"])
def test_phases_lowered_at_once_are_the_walks_rows(name):
    """Nothing split, and every collective a decomposition applies to split into P2P steps of one and of two
    chunks per peer (all-gathers and reduce-scatters both, on the jobs that have them)."""
    wl = load_workload(name)
    if name == "gpt3-13b-pp4":  # 8 micro-batches: warm-up, a band and cool-down on every stage
        wl = wl.with_microbatches(8)
    problem = problem_for(wl, load_hardware(wl.hardware))
    splittable = [key for key, points in problem.keys.items()
                  if points[0].collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER) and any(p.fuse_with for p in points)]
    for phase in problem.graph.phases:
        for split in (frozenset(), *(frozenset((key, chunks) for key in splittable) for chunks in (1, 2))):
            for band in (True, False):
                _same_arrays(lambda: Lowering(index_of(phase), split, band))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines())
def test_random_phases_lowered_at_once_are_the_walks_rows(case):
    graph, configs = case
    try:
        phase_arrays._lower(Lowering(index_of(graph.phases[0]), split_of(configs), True), at_once=False)
    except LagomError:  # a drawn graph the lowering refuses: the simulator tests check it refuses alike
        return
    _same_arrays(lambda: Lowering(index_of(graph.phases[0]), split_of(configs), True))


def test_a_phase_without_collectives_lowers_and_runs_alike():
    """A phase of compute alone (a micro-batch with no collective to overlap) beside one with a split gather."""
    segments = {0: [ComputeSegment(f"s{i}", 2e12, 4e8, 512) for i in range(3)]}
    tp = Group("tp", 8, 8, 1)
    gather = OverlapPoint("ag", Collective.ALL_GATHER, tp, 64 * 2**20, "s0", "s2", fuse_with="s2")
    graph = StepGraph("bare", HW.name, 1, [Phase("alone", 3, segments, []),
                                           Phase("gathered", 1, {0: [replace(s) for s in segments[0]]}, [gather])])
    split = {gather.key: replace(default_config(HW), decomposition=Decomposition.P2P, num_chunks=2)}
    for phase in graph.phases:
        for configs in ({}, split):
            _same_arrays(lambda: Lowering(index_of(phase), split_of(configs), True))
    _both_ways(graph, split, CostModel(HW))
    _both_ways(graph, {gather.key: default_config(HW)}, CostModel(HW))
