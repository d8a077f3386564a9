"""The live search (lagom.runtime.online.live) driven step by step by a plant: a machine whose step time is a known
function of the settings in force, with noise and drift, as the job's steps would be.

The plant is the simulator (the "true" step under the settings in force) times a drift, plus Gaussian
noise; the search ranks candidates with its own model and accepts only what the plant's steps show.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import pytest

from lagom.model.simulator import Configs, Simulator
from lagom.runtime.online.live import ALPHA, DETECT, GUARD, NOISE_STEPS, POWER, WINDOW, LiveSearch, Noise, Window, judge
from lagom.search import run_strategy
from lagom.search.base import Problem, nccl_configs
from lagom.search.priority import max_checks_per_key
from tests.helpers import two_all_reduces_one_gemm

NOISE = 0.01  # relative standard deviation of one step


def drive(live: LiveSearch, truth: Callable[[Configs], float], seed: int, drift: float = 0.0, noise: float = NOISE,
          called: bool = True) -> list[Configs]:
    """Run the plant until the search ends; every step's settings in force, in order. A step takes a millisecond
    of wall time, as a job's step takes time: the search thinks beside the steps, never holding one up."""
    rng = random.Random(seed)
    in_force = dict(live.reference)
    history = []
    step = 0
    while not live.done:
        step += 1
        history.append(in_force)
        seconds = truth(in_force) * (1 + drift * step) * (1 + rng.gauss(0, noise))
        time.sleep(1e-3)
        keys = {key: 1e-3 for key in in_force} if called else {}  # every key called, or none
        decision = live.after_step(step, seconds, keys)
        if decision.configs is not None:
            in_force = decision.configs
        assert step < 10_000, "the live search did not end"
    return history


def simulated(problem: Problem) -> Callable[[Configs], float]:
    simulator = Simulator(problem.graph)
    return lambda configs: simulator.run(configs, problem.model).step_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_finds_the_plants_optimum_within_the_noise_in_linear_steps(seed: int) -> None:
    problem = two_all_reduces_one_gemm()
    truth = simulated(problem)
    reference = nccl_configs(problem)
    live = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=10_000, budget_s=1e9)
    history = drive(live, truth, seed, drift=0.001)  # +0.1% per step: A/B/A must cancel it
    best = run_strategy("exhaustive", problem).result.step_s
    assert truth(reference) > best * 1.04  # there is something to find
    assert truth(live.final) <= best * (1 + 2 * NOISE)
    bound = 1 + max_checks_per_key(problem) * len(problem.keys)
    assert live.evaluations <= bound
    # each distinct setting costs a candidate window and a reference window; plus the noise steps and the final check
    assert len(history) <= NOISE_STEPS + 2 * live.max_window * (live.evaluations + 1) + live.waited
    assert live.trials and live.trials[-1].decision == "kept"


def test_never_ends_slower_than_the_measured_baseline() -> None:
    """A plant on which every setting but the one in force is 5% slower, whatever the model predicts."""
    problem = two_all_reduces_one_gemm()
    reference = nccl_configs(problem)
    base = simulated(problem)(reference)
    live = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=10_000, budget_s=1e9)
    drive(live, lambda configs: base if configs == reference else base * 1.05, seed=3)
    assert live.final == reference
    assert all(t.decision == "rejected" for t in live.trials)
    # what tuning cost: 5% of a step for every candidate step, against as many steps at the reference
    candidate_steps = sum(len(t.steps) for t in live.trials)
    assert live.cost_s() == pytest.approx(0.05 * base * candidate_steps, rel=0.5)
    assert live.steps_s == pytest.approx(live.steps_used * base + 0.05 * base * candidate_steps, rel=0.02)
    # every trial's window and the reference window judged with it are kept for the refit
    assert len(live.observations) == 2 * len(live.trials)


def test_a_step_over_twice_the_reference_is_switched_back_at_once() -> None:
    problem = two_all_reduces_one_gemm()
    reference = nccl_configs(problem)
    base = simulated(problem)(reference)
    live = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=10_000, budget_s=1e9)
    history = drive(live, lambda configs: base if configs == reference else base * (GUARD + 1), seed=4)
    reverted = [t for t in live.trials if t.decision == "reverted"]
    assert reverted and all(len(t.steps) == 1 for t in reverted)  # one slow step, then the reference again
    slow_in_a_row = max_run([c != reference for c in history])
    assert slow_in_a_row == 1 and live.final == reference


def test_the_step_budget_ends_the_search_with_what_it_measured() -> None:
    problem = two_all_reduces_one_gemm()
    reference = nccl_configs(problem)
    live = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=12, budget_s=1e9)
    history = drive(live, simulated(problem), seed=5)
    # once spent, the window under way ends and the final check runs: at most two more windows each
    assert len(history) <= 12 + 4 * live.max_window
    assert len(live.trials) <= 3


def max_run(flags: list[bool]) -> int:
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def test_stopping_ends_the_search_thread_mid_search() -> None:
    """A session closed while it tunes live must not leave the search thread waiting for an answer."""
    import threading

    problem = two_all_reduces_one_gemm()
    reference = nccl_configs(problem)
    live = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=10_000, budget_s=1e9)
    before = threading.active_count()
    step = 0
    while live._thread is None:  # noqa: SLF001 - through the noise steps to the first candidate
        step += 1
        live.after_step(step, 1.0, {})
    assert threading.active_count() == before + 1
    live.stop()
    assert threading.active_count() == before and not live.done


def test_a_drift_re_tune_moves_only_the_keys_that_drifted() -> None:
    """``only``: the keys the monitor put a drift down to are searched; every other key keeps what is in force."""
    problem = two_all_reduces_one_gemm()
    truth = simulated(problem)
    reference = nccl_configs(problem)
    moved, *others = sorted(problem.keys)
    live = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=10_000, budget_s=1e9,
                      only={moved}, first_trial=7)
    history = drive(live, truth, seed=0)
    assert live.trials and live.trials[0].id == "t7"  # numbered on from the job's earlier round
    assert all(set(t.changed) <= {moved} for t in live.trials)
    assert all(configs[k] == reference[k] for configs in history for k in others)
    assert all(live.final[k] == reference[k] for k in others)
    assert live.evaluations <= 1 + max_checks_per_key(problem)  # one key's worth of checks
    everything = LiveSearch(problem, Simulator(problem.graph), reference, budget_steps=10_000, budget_s=1e9)
    drive(everything, truth, seed=0)
    assert any(set(t.changed) - {moved} for t in everything.trials), "the full search does try the other keys"


@pytest.mark.parametrize("seed", [0, 1])
def test_each_trials_note_states_the_figures_its_row_prints(seed: int) -> None:
    """The report's row prints a trial's measured step and its reference; the note's figures and percentage are
    those two numbers, whatever the decision (kept, rejected within or beyond the noise, reverted, final)."""
    import re

    problem = two_all_reduces_one_gemm()
    truth = simulated(problem)
    live = LiveSearch(problem, Simulator(problem.graph), nccl_configs(problem), budget_steps=10_000, budget_s=1e9)
    drive(live, truth, seed, drift=0.002)
    assert len(live.trials) >= 3
    for t in live.trials:
        found = re.search(r"([\d.]+) ms against ([\d.]+) ms, ([\d.]+)% (faster|slower)", t.note)
        assert found, t.note
        step_ms, reference_ms = t.measured["step_s"] * 1e3, t.measured["reference_step_s"] * 1e3
        assert found[1] == f"{step_ms:.2f}" and found[2] == f"{reference_ms:.2f}", t.note
        change = step_ms / reference_ms - 1
        assert found[4] == ("faster" if change < 0 else "slower") and found[3] == f"{abs(change) * 100:.1f}", t.note


def test_on_a_null_effect_the_false_accept_rate_is_the_tests_alpha() -> None:
    """A plant on which no setting changes anything, with 2% noise per step: a trial is accepted only when the test
    rejects "no faster" by chance, at most ALPHA of the time (binomial bound over the trials run)."""
    problem = two_all_reduces_one_gemm()
    base = simulated(problem)(nccl_configs(problem))
    trials = accepted = 0
    for seed in range(12):
        live = LiveSearch(problem, Simulator(problem.graph), nccl_configs(problem), budget_steps=10_000, budget_s=1e9)
        drive(live, lambda configs: base * 1.0, seed=100 + seed, noise=0.02)
        trials += len([t for t in live.trials if not t.note.startswith("final check")])
        accepted += live.accepted
    assert trials >= 60
    # 4 sigma: neighbouring trials share a reference window, so the count spreads a little more than a binomial's;
    # the rate itself is pinned by the next test
    assert accepted <= ALPHA * trials + 4 * math.sqrt(ALPHA * trials), (accepted, trials)


def test_the_trials_test_is_exact_however_short_the_noise_made_its_windows() -> None:
    """The live loop's statistics, as it composes them: windows sized from the noise pooled so far (short where it
    happened to read low), each trial judged by ``judge``, its reference window then pooled. On a setting that
    changes nothing, short windows and long ones are accepted in ALPHA of their trials (4 sigma). Testing with
    the pooled noise instead accepted 7.9% of the short ones."""
    rng = random.Random(5)

    def window(steps: int) -> Window:
        out = Window()
        for step in range(steps):
            out.add(step, 1.0 + rng.gauss(0, 0.02), {})
        return out

    counts = {"short": [0, 0], "long": [0, 0]}  # accepted, trials
    for _ in range(2000):  # a fresh job's search each: the noise starts from the noise steps
        noise = Noise()
        before = window(NOISE_STEPS)
        noise.add(before)
        for _ in range(10):
            steps = max(WINDOW, noise.steps_to_find(DETECT, ALPHA, POWER))
            candidate, after = window(steps), window(steps)
            p = judge(candidate, before, after)[2]
            noise.add(after)
            group = counts["short" if steps <= 4 else "long"]
            group[0] += p < ALPHA
            group[1] += 1
            before = after
    for name, (accepted, trials) in counts.items():
        assert trials >= 1000, name
        assert abs(accepted / trials - ALPHA) <= 4 * math.sqrt(ALPHA * (1 - ALPHA) / trials), (name, accepted, trials)


def test_a_noisy_job_gets_longer_windows_and_a_trial_nobody_called_is_refused() -> None:
    problem = two_all_reduces_one_gemm()
    truth = simulated(problem)
    quiet = LiveSearch(problem, Simulator(problem.graph), nccl_configs(problem), budget_steps=400, budget_s=1e9)
    drive(quiet, truth, seed=7, noise=0.002)
    noisy = LiveSearch(problem, Simulator(problem.graph), nccl_configs(problem), budget_steps=400, budget_s=1e9)
    drive(noisy, truth, seed=7, noise=0.05)
    assert quiet.window < noisy.window <= noisy.max_window
    silent = LiveSearch(problem, Simulator(problem.graph), nccl_configs(problem), budget_steps=400, budget_s=1e9)
    drive(silent, truth, seed=8, called=False)
    assert silent.refused and silent.accepted == 0 and silent.final == silent.reference
    assert all(t.decision == "refused" for t in silent.trials if not t.note.startswith("final check"))
    assert not silent.observations  # nothing measured: nothing for the refit either


def test_live_channels_are_clamped_to_what_nccl_runs_on_the_communicator() -> None:
    """A live rule reaches every communicator of its rank and node counts: its channels are bound by the topology
    (the profile's max_channels), the CTA range the communicator was made with, and for NVLS its NVLS CTAs."""
    from dataclasses import replace

    problem = two_all_reduces_one_gemm()
    reference = nccl_configs(problem)
    key = next(iter(reference))
    group = problem.keys[key][0].group
    topology = problem.hw.nccl.max_channels
    free = LiveSearch(problem, Simulator(problem.graph), reference)
    assert free.live_configs({key: replace(reference[key], channels=64)})[key].channels == min(64, topology)
    bound = LiveSearch(problem, Simulator(problem.graph), reference, max_channels={group.name: 4})
    assert bound.live_configs({key: replace(reference[key], channels=16)})[key].channels == 4
    assert bound.clamped == {key}
    nvls = replace(reference[key], algorithm="nvls", channels=48)
    assert free.live_configs({key: nvls})[key].channels == problem.hw.nccl.nvls_channels
