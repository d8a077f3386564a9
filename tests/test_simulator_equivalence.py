"""The simulator against the pre-issue-11 one (tests/reference_simulator.py) on every shipped workload.

For NCCL's, AutoCCL's and Lagom's configs of each configs/workloads/*.yaml, the step, the exposed comm
and every per-key figure agree to 1e-9 relative, with and without steady-state extrapolation. The
reference re-rates every running task at every event, so on the larger jobs it would take minutes:
those run with one layer per stage and fewer micro-batches here (same layout and machine);
test_simulator_steady.py checks their full size against the simulator's own full simulation.
"""

from dataclasses import replace
from functools import cache

import pytest

from lagom.hardware import load_hardware
from lagom.model import compiled
from lagom.model.simulator import Simulator
from lagom.search import run_strategy
from lagom.step.workload import load_workload, workload_names
from lagom.tune import problem_for
from tests.reference_simulator import reference_simulate

REL = 1e-9
STRATEGIES = ("nccl", "autoccl", "lagom")
REFERENCE_TASKS = 8_000  # above this many tasks the reference is too slow for the suite: fewer micro-batches


def _tasks(problem) -> int:
    return sum(len(segs) for ph in problem.graph.phases for segs in ph.segments.values()) + len(problem.graph.points)


def _reduced(wl):
    """The job as large as the reference can simulate quickly: over the budget, one layer per pipeline
    stage and 2 x pp + 6 micro-batches, the fewest that leave pipelines a steady state to extrapolate."""
    problem = problem_for(wl, load_hardware(wl.hardware))
    if _tasks(problem) <= REFERENCE_TASKS:
        return wl, problem
    if wl.model.architecture != "t5":  # t5's encoder and decoder layers are split between the stages
        wl = replace(wl, model=replace(wl.model, layers=wl.parallel.pp))
    micro = min(wl.microbatches, 2 * wl.parallel.pp + 6)
    wl = wl.with_microbatches(micro)
    return wl, problem_for(wl, load_hardware(wl.hardware))


@cache
def _job(name: str):
    wl, problem = _reduced(load_workload(name))
    configs = {s: run_strategy(s, problem).configs for s in STRATEGIES}
    return problem, configs


def _close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=REL, abs=1e-15)


# CI's slower tier runs these: the 1,024- and 2,048-GPU jobs' reduced forms still take the reference half a minute, and
# three tensor-parallel jobs shaped as gpt2-tp8 is (which the quick tier keeps) take ten seconds each
SLOW_TIER = {"llama3-70b-1024", "llama3-405b-2048", "llama3-8b-tp8", "mpt-7b-tp8", "phi2-tp8"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TIER else n
                                  for n in workload_names()])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_step_matches_the_reference_simulator(name, strategy):
    """Both loops: the Python one with and without its steady-state jumps, and the compiled one where built."""
    problem, configs = _job(name)
    ref = reference_simulate(problem.graph, configs[strategy], problem.model)
    loops = [False] + ([True] if compiled.library_path().is_file() else [])
    for compiled_loop, extrapolate in [(loop, jumps) for loop in loops for jumps in (False, True)]:
        res = Simulator(problem.graph, compiled_loop=compiled_loop).run(configs[strategy], problem.model,
                                                                        extrapolate=extrapolate)
        why = (compiled_loop, extrapolate)
        assert _close(res.step_s, ref.step_s), (why, res.step_s, ref.step_s)
        assert _close(res.exposed_comm_s, ref.exposed_comm_s), (why, res.exposed_comm_s, ref.exposed_comm_s)
        assert [ph.time for ph in res.phases] == pytest.approx(ref.phase_times, rel=REL)
        per_key = res.per_key()
        assert set(per_key) == set(ref.per_key)
        for key, row in ref.per_key.items():
            for field, value in row.items():
                assert _close(per_key[key][field], value), (why, key, field, per_key[key][field], value)


@pytest.mark.slow  # it needs the largest job's configs (half a minute): CI's slower tier
def test_the_reference_check_covers_decompositions_and_pipelines():
    """The equivalence above is only as strong as the configs it runs: some must split collectives into
    P2P steps (Flash-Overlap) and some jobs must be pipelines with extrapolated steady states."""
    decomposed = pipelines = extrapolated = 0
    for name in workload_names():
        problem, configs = _job(name)
        decomposed += any(c.decomposition == "p2p" for s in STRATEGIES for c in configs[s].values())
        pipelines += problem.graph.devices > 1
        extrapolated += any(ph.periods_skipped for ph in Simulator(problem.graph, compiled_loop=False).run(configs["lagom"], problem.model).phases)
    assert decomposed >= 3 and pipelines >= 3 and extrapolated >= 3
