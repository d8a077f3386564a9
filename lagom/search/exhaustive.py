"""Joint brute force over every key's candidates: the yardstick for small problems."""

from __future__ import annotations

import math
from itertools import product

from lagom.comm_config import candidates
from lagom.errors import LagomError
from lagom.search.base import Evaluator, Problem, SearchResult

MAX_EVALUATIONS = 20_000


def size(problem: Problem) -> int:
    """Evaluations a joint brute force needs: the product of every key's candidate count."""
    return math.prod(len(candidates(p[0], problem.hw, problem.space)) for p in problem.keys.values())


def search(problem: Problem, evaluator: Evaluator, limit: int = MAX_EVALUATIONS) -> SearchResult:
    keys = list(problem.keys)
    total = size(problem)
    if total > limit:
        raise LagomError(
            f"exhaustive search needs {total:.3g} evaluations for {len(keys)} tuning keys (limit {limit}); "
            "use --strategy lagom, or a smaller search space"
        )
    choices = [candidates(problem.keys[k][0], problem.hw, problem.space) for k in keys]
    best = None
    for combo in product(*choices):
        configs = dict(zip(keys, combo))
        result = evaluator.evaluate(configs)
        if best is None or result.step_s < best[1].step_s:
            best = (configs, result)
    assert best is not None
    return SearchResult("exhaustive", best[0], best[1], evaluator.evaluations,
                        {k: "best of the joint brute force" for k in keys})


def feasible(problem: Problem, limit: int = MAX_EVALUATIONS) -> bool:
    return size(problem) <= limit
