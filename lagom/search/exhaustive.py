"""Joint brute force over every applicable setting: the yardstick for small problems.

It enumerates every combination of the per-process values and, under each, every key's candidates,
skipping combinations that give one communicator two values of a per-communicator knob.
"""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import product

from lagom.errors import LagomError
from lagom.model.choices import candidates
from lagom.plan.comm_config import ProcessSettings, communicator_knobs, is_consistent
from lagom.search.base import Evaluator, Problem, SearchResult, groups

MAX_EVALUATIONS = 20_000


def processes(problem: Problem) -> list[ProcessSettings]:
    """Every combination of the per-process values the search may choose."""
    choices = problem.process_choices()
    return [replace(problem.settings, **dict(zip(choices, values))) for values in product(*choices.values())]


def size(problem: Problem) -> int:
    """Evaluations a joint brute force needs at most: per process combination, the product of every key's
    candidate count (combinations a communicator cannot apply are skipped without an evaluation)."""
    return sum(math.prod(len(candidates(p[0], problem.hw, under.space)) for p in under.keys.values())
               for under in map(problem.with_process, processes(problem)))


def search(problem: Problem, evaluator: Evaluator, limit: int = MAX_EVALUATIONS) -> SearchResult:
    keys = list(problem.keys)
    total = size(problem)
    if total > limit:
        raise LagomError(
            f"exhaustive search needs {total:.3g} evaluations for {len(keys)} tuning keys (limit {limit}); "
            "use --strategy lagom, or a smaller search space"
        )
    knobs = communicator_knobs(problem.cap)
    by_group = list(groups(problem).values())
    best = None
    for process in processes(problem):
        under = problem.with_process(process)
        choices = [candidates(problem.keys[k][0], problem.hw, under.space) for k in keys]
        for combo in product(*choices):
            configs = dict(zip(keys, combo))
            if not all(is_consistent(knob, [(problem.keys[k][0], configs[k]) for k in members], problem.cap)
                       for members in by_group for knob in knobs):
                continue
            result = evaluator.evaluate(configs)
            if best is None or result.step_s < best[1].step_s:
                best = (configs, result, process)
    if best is None:
        raise LagomError("exhaustive search found no setting every communicator can apply")
    return SearchResult("exhaustive", best[0], best[1], evaluator.evaluations,
                        {k: "best of the joint brute force over applicable settings" for k in keys}, best[2])


def feasible(problem: Problem, limit: int = MAX_EVALUATIONS) -> bool:
    return size(problem) <= limit
