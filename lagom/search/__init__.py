"""Strategies that choose a CommConfig per tuning key, all behind one evaluator interface.

Every strategy returns settings the target can apply (``Problem.capability``): ``run_strategy`` makes
the per-process knobs one decision for the whole step and settles one value per communicator for the
per-communicator ones (``search.base.settle_communicators``). The exhaustive search enumerates both
itself; NCCL's baseline tunes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from lagom.comm_config import CommConfig, Decomposition, ProcessSettings, planned_chunk, under_process
from lagom.errors import ConfigError
from lagom.points import OverlapPoint
from lagom.search import autoccl, exhaustive, nccl, priority
from lagom.search.base import (
    Evaluator,
    Objective,
    Problem,
    SearchResult,
    SimulatedEvaluator,
    comm_time,
    settle_communicators,
    step_time,
)

Strategy = Callable[[Problem, Evaluator], SearchResult]

STRATEGIES: dict[str, Strategy] = {
    "nccl": nccl.search,
    "autoccl": autoccl.search,
    "lagom": priority.search,
    "exhaustive": exhaustive.search,
}
WHOLE_SPACE = ("nccl", "exhaustive")  # strategies that need no per-process loop around them
# What the per-process and per-communicator decisions minimise: the step, except for AutoCCL, whose
# objective is the collectives' own time.
OBJECTIVES: dict[str, Objective] = {"autoccl": comm_time}


def run_strategy(name: str, problem: Problem, evaluator: Evaluator | None = None) -> SearchResult:
    if name not in STRATEGIES:
        raise ConfigError("strategy", f"unknown '{name}'", f"use one of {', '.join(STRATEGIES)}")
    evaluator = evaluator or SimulatedEvaluator(problem)
    if name in WHOLE_SPACE:
        return replace(STRATEGIES[name](problem, evaluator), process=problem.settings)
    return search_process(STRATEGIES[name], problem, evaluator, OBJECTIVES.get(name, step_time))


def applicable(strategy: Strategy, problem: Problem, evaluator: Evaluator, objective: Objective = step_time) -> SearchResult:
    """One run of a per-key strategy under the problem's per-process values, settled per communicator."""
    found = replace(strategy(problem, evaluator), process=problem.settings)
    return settle_communicators(problem, evaluator, found, objective)


def search_process(strategy: Strategy, problem: Problem, evaluator: Evaluator,
                   objective: Objective = step_time) -> SearchResult:
    """The per-process knobs as one decision for the whole step.

    The strategy runs under NCCL's per-process values; then each per-process knob in turn takes each of
    its values on every collective at once (one evaluation per value, the best kept: one pass of
    coordinate descent), and so does the chunk where it is set per size; if a per-process value moved,
    the strategy runs once more under the new ones (where the chunk is set per size, always, with the
    step-wide chunk). The evaluations stay the strategy's (linear in keys) twice, plus one per value
    tried step-wide. Choices go by ``objective`` (the step; AutoCCL: its
    collectives' time).
    """
    fields = problem.cap.process_fields()
    first = applicable(strategy, problem, evaluator, objective)
    best, process, uniform = first, problem.settings, dict[str, Any]()
    for knob, values in problem.step_wide_choices().items():
        for value in values:
            trial_process = replace(process, **{knob: value}) if knob in fields else process
            trial_uniform = uniform if knob in fields else {**uniform, knob: value}
            if trial_process == process and trial_uniform == uniform:
                continue
            configs = {k: _step_wide(cfg, problem.keys[k][0], problem, trial_process, trial_uniform)
                       for k, cfg in first.configs.items()}
            result = evaluator.evaluate(configs)
            if objective(result) < objective(best.result):
                scope = "per-process" if knob in fields else "step-wide"
                notes = {k: f"{first.notes.get(k, '')}; {scope} {knob}={value} (one value for every collective)"
                         .lstrip("; ") for k in configs}
                best = SearchResult(first.strategy, configs, result, evaluator.evaluations, notes, trial_process)
                process, uniform = trial_process, trial_uniform
    per_size_chunk = "chunk_bytes" not in fields
    if process != problem.settings or per_size_chunk:
        # where the chunk is set per size, the second run searches the step with one chunk (a subset of
        # the per-size space the per-key strategies rank better in)
        chunk = uniform.get("chunk_bytes", process.chunk_bytes)
        narrow = problem.with_process(replace(process, chunk_bytes=chunk), one_chunk=per_size_chunk)
        again = applicable(strategy, narrow, evaluator, objective)
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


__all__ = ["STRATEGIES", "Evaluator", "Problem", "SearchResult", "SimulatedEvaluator", "run_strategy"]
