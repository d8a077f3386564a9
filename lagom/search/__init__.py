"""Strategies that choose a CommConfig per tuning key, all behind one evaluator interface."""

from __future__ import annotations

from collections.abc import Callable

from lagom.errors import ConfigError
from lagom.search import autoccl, exhaustive, nccl, priority
from lagom.search.base import Evaluator, Problem, SearchResult, SimulatedEvaluator

STRATEGIES: dict[str, Callable[[Problem, Evaluator], SearchResult]] = {
    "nccl": nccl.search,
    "autoccl": autoccl.search,
    "lagom": priority.search,
    "exhaustive": exhaustive.search,
}


def run_strategy(name: str, problem: Problem, evaluator: Evaluator | None = None) -> SearchResult:
    if name not in STRATEGIES:
        raise ConfigError("strategy", f"unknown '{name}'", f"use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name](problem, evaluator or SimulatedEvaluator(problem))


__all__ = ["STRATEGIES", "Evaluator", "Problem", "SearchResult", "SimulatedEvaluator", "run_strategy"]
