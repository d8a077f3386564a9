"""Strategies that choose a CommConfig per tuning key, all behind one evaluator interface, and the one loop
that searches every dimension of a plan around them (``driver``).

Every strategy returns settings the target can apply (``Problem.capability``): the driver makes the per-process
knobs one decision for the whole step and settles one value per communicator for the per-communicator ones
(``search.base.settle_communicators``). The exhaustive search enumerates both itself; NCCL's baseline tunes
nothing.

May import: ``lagom.model``, ``lagom.plan``, ``lagom.step`` and the base modules. The planning API (``lagom.tune``)
and the runtime build on it.
"""

from __future__ import annotations

from lagom.search.base import Evaluator, Problem, SearchResult, SimulatedEvaluator
from lagom.search.driver import STRATEGIES, drive, run_strategy, strategy

__all__ = ["STRATEGIES", "Evaluator", "Problem", "SearchResult", "SimulatedEvaluator", "drive", "run_strategy",
           "strategy"]
