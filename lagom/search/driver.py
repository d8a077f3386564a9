"""The one search loop: every dimension of a plan searched around one per-key strategy.

A plan has three kinds of decision, and ``drive`` takes them in one pass, in this order:

1. **keys**: the strategy's choice per tuning key under the current per-process values, then one value per
   communicator for what NCCL reads per communicator (``settle_communicators``);
2. **step-wide values**: each per-process knob (threads, transport, the chunk where NCCL_BUFFSIZE is its only
   setting) and the chunk set on every collective at once, one evaluation per value, the best kept (one pass of
   coordinate descent from the strategy's keys and, where the objective is the step, one from NCCL's own
   settings); where a value moved, or the chunk is set per size, the keys once more under them;
3. **bucket sizes** (the lagom strategy, where the step has framework buckets): the framework's bucket size at
   each other scale of ``Space.scales``, with the strategy run again only on the keys that size changes, the
   rest keeping the first choice, under the per-process values step 2 chose.

Evaluations stay linear in the keys: the strategy's own twice, plus one or two per step-wide value, plus the
changed keys' per other bucket scale. NCCL's baseline and the exhaustive search enumerate their whole space themselves
and skip 2 and 3. The objective is the step, except for AutoCCL, whose objective is its collectives' own time.

**A budget** (``Budget``) stops a search between two evaluations: after ``seconds`` of wall clock, or when its
``stop`` event is set (a session closing). ``drive`` then returns the best settings it has evaluated that NCCL can
run as they are (one value per communicator for each per-communicator knob), with a note on every key that says
the search was cut, and ``Budget.cut`` says why. A search cut before it evaluated any such settings returns
NCCL's own choice, evaluated once. ``Budget.pause`` runs before every evaluation: a search beside a running job
yields the CPU there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from lagom.errors import ConfigError
from lagom.model.choices import under_process
from lagom.model.simulator import Configs, StepResult
from lagom.plan.comm_config import (
    CommConfig,
    Decomposition,
    ProcessSettings,
    communicator_knobs,
    is_consistent,
    planned_chunk,
)
from lagom.search import autoccl, exhaustive, nccl, priority
from lagom.search.base import (
    Evaluator,
    Objective,
    Problem,
    SearchResult,
    SimulatedEvaluator,
    comm_time,
    groups,
    nccl_configs,
    settle_communicators,
    step_time,
)
from lagom.step.graph import OverlapPoint

Strategy = Callable[[Problem, Evaluator], SearchResult]

STRATEGIES: dict[str, Strategy] = {
    "nccl": nccl.search,
    "autoccl": autoccl.search,
    "lagom": priority.search,
    "exhaustive": exhaustive.search,
}
WHOLE_SPACE = ("nccl", "exhaustive")  # strategies that search their whole space themselves
OBJECTIVES: dict[str, Objective] = {"autoccl": comm_time}
BUCKET_SCALED = ("lagom",)  # strategies that also search the framework's bucket size


class Space(Protocol):
    """Where the bucket-size dimension lives: the problem and an evaluator at each bucket scale (1.0: the
    framework's own size), and the memory a scale's simulator may give back once it is searched."""

    scales: tuple[float, ...]

    def problem(self, scale: float) -> Problem: ...

    def evaluator(self, scale: float) -> Evaluator: ...

    def rest(self, scale: float) -> None: ...

    def forget(self, scale: float) -> None: ...


@dataclass
class OneProblem:
    """A space with one problem and no bucket dimension (``run_strategy``, the online search)."""

    only: Problem
    evaluating: Evaluator
    scales: tuple[float, ...] = (1.0,)

    def problem(self, scale: float) -> Problem:
        return self.only

    def evaluator(self, scale: float) -> Evaluator:
        return self.evaluating

    def rest(self, scale: float) -> None:
        pass

    def forget(self, scale: float) -> None:
        pass


@dataclass
class Found:
    """What ``drive`` chose: the bucket scale, the problem at that scale, and the settings."""

    scale: float
    problem: Problem
    result: SearchResult


class BudgetSpent(Exception):
    """A search's budget ran out between two evaluations; ``drive`` catches it and returns the best so far."""


@dataclass
class Budget:
    """When a search stops before its end, and what it does before each evaluation (see the module docstring).

    ``seconds``: the wall-clock allowance, counted from the budget's creation (None: none); ``stop``: an event
    another thread may set; ``pause``: called before every evaluation. ``cut``: why the search stopped early,
    None while it has not.
    """

    seconds: float | None = None
    stop: threading.Event | None = None
    pause: Callable[[], None] | None = None
    cut: str | None = None
    started: float = field(default_factory=time.perf_counter)

    def check(self) -> None:
        """Before an evaluation: pause, then raise ``BudgetSpent`` if the budget is spent (and stay spent)."""
        if self.pause is not None:
            self.pause()
        if self.cut is None and self.stop is not None and self.stop.is_set():
            self.cut = "stopped before its end"
        if self.cut is None and self.seconds is not None and time.perf_counter() - self.started >= self.seconds:
            self.cut = f"cut at its budget of {self.seconds:g} s"
        if self.cut is not None:
            raise BudgetSpent(self.cut)


class _BestSoFar:
    """The evaluator a budgeted search runs through: the budget checked before each evaluation, and the best
    settings evaluated so far (by the strategy's objective) that NCCL can run as they are."""

    def __init__(self, inner: Evaluator, problem: Problem, objective: Objective, budget: Budget) -> None:
        self.inner, self.problem, self.objective, self.budget = inner, problem, objective, budget
        self.best: tuple[float, Configs, StepResult] | None = None

    @property
    def evaluations(self) -> int:
        return self.inner.evaluations

    @evaluations.setter
    def evaluations(self, value: int) -> None:
        self.inner.evaluations = value

    def evaluate(self, configs: Configs) -> StepResult:
        self.budget.check()
        result = self.inner.evaluate(configs)
        score = self.objective(result)
        if (self.best is None or score < self.best[0]) and self._runnable(configs):
            self.best = (score, dict(configs), result)
        return result

    def _runnable(self, configs: Configs) -> bool:
        """Every key set, with one value per communicator of each per-communicator knob (a strategy's
        intermediate moves may give a communicator's keys different values until they are settled)."""
        problem = self.problem
        if set(configs) != set(problem.keys):
            return False
        knobs = communicator_knobs(problem.cap)
        return all(is_consistent(knob, [(problem.keys[k][0], configs[k]) for k in keys], problem.cap)
                   for keys in groups(problem).values() for knob in knobs)

    def found(self, name: str) -> SearchResult:
        """The best so far as a result (NCCL's own choice, evaluated once past the budget, where there is none)."""
        if self.best is None:
            configs = nccl_configs(self.problem)
            self.best = (0.0, configs, self.inner.evaluate(configs))
        _, configs, result = self.best
        note = f"the best settings evaluated when the search was {self.budget.cut} ({self.evaluations} evaluations)"
        return SearchResult(name, configs, result, self.evaluations, {k: note for k in configs})


def strategy(name: str) -> Strategy:
    """A registered strategy by name, or a ConfigError naming the choices."""
    if name not in STRATEGIES:
        raise ConfigError("strategy", f"unknown '{name}'", f"use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def drive(name: str, space: Space, budget: Budget | None = None) -> Found:
    """Search every dimension of ``space`` with strategy ``name`` (see the module docstring), within ``budget``
    (default: none): once it is spent, the best found so far."""
    run = strategy(name)
    budget = budget or Budget()
    problem = space.problem(1.0)
    objective = OBJECTIVES.get(name, step_time)
    evaluator = _BestSoFar(space.evaluator(1.0), problem, objective, budget)
    try:
        if name in WHOLE_SPACE:
            return Found(1.0, problem, replace(run(problem, evaluator), process=problem.settings))
        found = Found(1.0, problem, _keys_and_step_wide(run, problem, evaluator, objective))
    except BudgetSpent:
        return Found(1.0, problem, evaluator.found(name))
    if name not in BUCKET_SCALED or not _has_buckets(problem):
        return found
    del evaluator  # its simulator: what ``space.rest`` lets go of while the other bucket sizes are searched
    return _bucket_sizes(space, found, budget)


def run_strategy(name: str, problem: Problem, evaluator: Evaluator | None = None,
                 budget: Budget | None = None) -> SearchResult:
    """One problem searched by strategy ``name`` (no bucket dimension), within ``budget``."""
    return drive(name, OneProblem(problem, evaluator or SimulatedEvaluator(problem)), budget).result


def refine(problem: Problem, evaluator: Evaluator, start: SearchResult | None, only: set[str] | None) -> SearchResult:
    """The keys in ``only`` searched again from ``start``'s settings, the rest kept (the priority search): the
    bucket dimension's step, and the live search's on the job's own steps."""
    return priority.search(problem, evaluator, start, only)


def _has_buckets(problem: Problem) -> bool:
    return any("grad.bucket" in p.name for p in problem.graph.points)


def _settled(run: Strategy, problem: Problem, evaluator: Evaluator, objective: Objective) -> SearchResult:
    """Dimension 1: one run of the per-key strategy under the problem's per-process values, settled per
    communicator."""
    found = replace(run(problem, evaluator), process=problem.settings)
    return settle_communicators(problem, evaluator, found, objective)


def _keys_and_step_wide(run: Strategy, problem: Problem, evaluator: Evaluator, objective: Objective) -> SearchResult:
    """Dimensions 1 and 2: the keys, the step-wide values one at a time, and the keys again where they moved.

    The step-wide values are tried on the strategy's keys and, where the objective is the step, on NCCL's own
    settings as well: a key's choice made under NCCL's per-process values may suit none of the others (a
    pipeline send that runs as well on 2 channels as on 4 under a 2 MiB buffer is slower on 2 at every buffer
    that beats 2 MiB on 4), so one descent from it alone can stop where the other would have gone on. A value is
    kept where it beats every step evaluated so far."""
    fields = problem.cap.process_fields()
    first = _settled(run, problem, evaluator, objective)
    best, process, uniform = first, problem.settings, dict[str, Any]()
    starts = [first]
    nccl_own = nccl_configs(problem)
    if objective is step_time and nccl_own != first.configs:
        starts.append(SearchResult(first.strategy, nccl_own, first.result, first.evaluations,
                                   {k: "NCCL's own settings" for k in nccl_own}))
    for start in starts:
        here, here_uniform = problem.settings, dict[str, Any]()
        for knob, values in problem.step_wide_choices().items():
            for value in values:
                trial_process = replace(here, **{knob: value}) if knob in fields else here
                trial_uniform = here_uniform if knob in fields else {**here_uniform, knob: value}
                if trial_process == here and trial_uniform == here_uniform:
                    continue
                configs = {k: _step_wide(cfg, problem.keys[k][0], problem, trial_process, trial_uniform)
                           for k, cfg in start.configs.items()}
                result = evaluator.evaluate(configs)
                if objective(result) < objective(best.result):
                    scope = "per-process" if knob in fields else "step-wide"
                    notes = {k: f"{start.notes.get(k, '')}; {scope} {knob}={value} (one value for every collective)"
                             .lstrip("; ") for k in configs}
                    best = SearchResult(first.strategy, configs, result, evaluator.evaluations, notes, trial_process)
                    process, uniform = trial_process, trial_uniform
                    here, here_uniform = trial_process, trial_uniform
    per_size_chunk = "chunk_bytes" not in fields
    if process != problem.settings or per_size_chunk:
        # where the chunk is set per size, the second run searches the step with one chunk (a subset of
        # the per-size space the per-key strategies rank better in)
        chunk = uniform.get("chunk_bytes", process.chunk_bytes)
        narrow = problem.with_process(replace(process, chunk_bytes=chunk), one_chunk=per_size_chunk)
        again = _settled(run, narrow, evaluator, objective)
        if objective(again.result) < objective(best.result):
            best = replace(again, process=process)
    return replace(best, evaluations=evaluator.evaluations)


def _step_wide(cfg: CommConfig, point: OverlapPoint, problem: Problem, process: ProcessSettings,
               uniform: dict[str, Any]) -> CommConfig:
    """A key's config with the per-process values and, on the collectives NCCL runs, the step-wide ones
    (a step-wide chunk as NCCL runs it for each: LL's is at most 32 KiB)."""
    out = under_process(cfg, point, problem.hw, process, problem.cap)
    if not uniform or out.decomposition != Decomposition.COLLECTIVE:
        return out
    out = replace(out, **uniform)
    if "chunk_bytes" in uniform:
        out = replace(out, chunk_bytes=planned_chunk(out, point.collective, point.group, problem.hw, problem.open_space))
    return out


def _bucket_sizes(space: Space, central: Found, budget: Budget) -> Found:
    """Dimension 3: the other bucket scales, each searched only on the keys its size changes (their count of
    points differs), the rest keeping the central choice, under the central per-process values. A scale the
    budget cuts offers the best it evaluated; no later scale is searched."""
    best, evaluations = central, central.result.evaluations
    for scale in space.scales:
        if scale == 1.0 or budget.cut is not None:
            continue
        space.rest(best.scale)  # searched: at most its baseline is asked for again, from its results
        trial = _one_scale(space, scale, central, budget)
        if trial is None:  # nothing at this scale NCCL could run: the scales before stand
            space.forget(scale)
            continue
        evaluations += trial.result.evaluations
        if trial.result.result.step_s < best.result.result.step_s:
            if best is not central:
                space.forget(best.scale)
            best = trial
        else:
            space.forget(scale)
        del trial  # a forgotten scale's graph goes before the next one is built
    best.result.evaluations = evaluations
    return best


def _one_scale(space: Space, scale: float, central: Found, budget: Budget) -> Found | None:
    """One bucket scale searched on the keys its size changes; None where the budget ran out before NCCL's own
    settings were evaluated there. Its evaluator (and simulator) go when it returns."""
    problem = space.problem(scale).with_process(central.result.process or central.problem.settings)
    changed = {k for k, pts in problem.keys.items() if len(central.problem.keys.get(k, ())) != len(pts)}
    evaluator = _BestSoFar(space.evaluator(scale), problem, step_time, budget)
    try:
        found = settle_communicators(problem, evaluator, refine(problem, evaluator, central.result, changed))
    except BudgetSpent:
        if evaluator.best is None:
            return None
        found = evaluator.found(central.result.strategy)
    found.process = problem.settings
    return Found(scale, problem, found)
