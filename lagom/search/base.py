"""What every strategy shares: the problem, the evaluator interface, and the result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Protocol

from lagom.comm_config import SearchSpace, default_config, subspaces
from lagom.cost_model import CostModel
from lagom.hardware import Hardware
from lagom.points import OverlapPoint, StepGraph
from lagom.simulator import Configs, Simulator, StepResult


@dataclass
class Problem:
    graph: StepGraph
    hw: Hardware
    space: SearchSpace = field(default_factory=SearchSpace)

    @cached_property
    def model(self) -> CostModel:
        return CostModel(self.hw)

    @cached_property
    def keys(self) -> dict[str, list[OverlapPoint]]:
        return self.graph.keys()


class Evaluator(Protocol):
    """Runs a step with the given configs and says how it went. ``evaluations`` counts the calls.

    The core's evaluator is the simulator; the adapters' live evaluators measure real steps.
    """

    evaluations: int

    def evaluate(self, configs: Configs) -> StepResult: ...


class SimulatedEvaluator:
    """The simulator as evaluator. Its Simulator keeps the step graph's index and earlier runs, so runs
    resume where the changed keys cannot have mattered yet; searches of one problem may share one
    (``simulator``). ``on_result`` sees every result (progress reports)."""

    def __init__(self, problem: Problem, simulator: Simulator | None = None,
                 on_result: Callable[[StepResult], None] | None = None) -> None:
        self.problem = problem
        self.simulator = simulator or Simulator(problem.graph)
        self.on_result = on_result
        self.evaluations = 0

    def evaluate(self, configs: Configs) -> StepResult:
        self.evaluations += 1
        result = self.simulator.run(configs, self.problem.model)
        if self.on_result is not None:
            self.on_result(result)
        return result


@dataclass
class SearchResult:
    strategy: str
    configs: Configs
    result: StepResult
    evaluations: int
    notes: dict[str, str] = field(default_factory=dict)  # per key: why this config


def nccl_configs(problem: Problem) -> Configs:
    """NCCL's own choice: default channels, threads and buffer; algorithm and protocol by its cost model."""
    base = default_config(problem.hw)
    out: Configs = {}
    for key, points in problem.keys.items():
        p = points[0]
        options = [replace(base, algorithm=a, protocol=pr) for a, pr, tr in subspaces(p, problem.hw) if tr == "p2p"]
        out[key] = min(options, key=lambda c: problem.model.comm_time(p.collective, p.group, p.bytes, c))
    return out
