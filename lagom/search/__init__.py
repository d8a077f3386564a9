"""Strategies that choose a CommConfig per tuning key, all behind one evaluator interface."""

from __future__ import annotations

from typing import Callable

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


def compare(problem: Problem) -> dict[str, SearchResult | None]:
    """Every strategy on the simulator; exhaustive is None where the problem is too large for it."""
    out: dict[str, SearchResult | None] = {name: run_strategy(name, problem) for name in ("nccl", "autoccl", "lagom")}
    out["exhaustive"] = run_strategy("exhaustive", problem) if exhaustive.feasible(problem) else None
    return out


__all__ = ["STRATEGIES", "Evaluator", "Problem", "SearchResult", "SimulatedEvaluator", "compare", "run_strategy"]
