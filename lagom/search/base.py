"""What every strategy shares: the problem, the evaluator interface, and the result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from typing import Any, Protocol

from lagom.hardware import Hardware
from lagom.model.choices import nccl_choice
from lagom.model.cost_model import CostModel
from lagom.model.simulator import Configs, PointTiming, Simulator, StepResult, simulate
from lagom.plan.capability import Capability, capability_for
from lagom.plan.comm_config import (
    ProcessSettings,
    SearchSpace,
    Transport,
    channel_choices,
    communicator_knobs,
    communicator_values,
    default_config,
    is_consistent,
    transports_for,
    with_communicator_value,
    with_process,
)
from lagom.step.graph import OverlapPoint, StepGraph


@dataclass
class Problem:
    """A step graph on a machine, searched within what ``capability`` can apply.

    ``space`` becomes the space a strategy searches: limited by the capability and with every
    per-process knob pinned to ``process`` (NCCL's defaults unless the search chose others);
    ``open_space`` keeps the per-process values the search may choose between.
    """

    graph: StepGraph
    hw: Hardware
    space: SearchSpace = field(default_factory=SearchSpace)
    capability: Capability | None = None
    process: ProcessSettings | None = None
    cost_model: CostModel | None = None  # what a step costs; None: the hardware's CostModel (a calibrated one enters here)
    open_space: SearchSpace = field(init=False)
    # what searches work out from the graph and model alone, kept for every search of them (shared by
    # ``with_process``); the model must not change once a search has run
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.capability is None:
            self.capability = self.space.capability or capability_for(self.hw)
        if self.process is None:
            n = self.hw.nccl
            self.process = ProcessSettings(n.default_threads, Transport.P2P, n.default_chunk_bytes)
        if self.cost_model is None:
            self.cost_model = CostModel(self.hw, self.capability)
        self.open_space = self.space.under(self.capability)
        self.space = self.open_space.pinned(self.process)

    @property
    def cap(self) -> Capability:
        """The capability, typed (``__post_init__`` always sets it)."""
        if self.capability is None:
            raise ValueError("Problem.capability is set in __post_init__")
        return self.capability

    @property
    def settings(self) -> ProcessSettings:
        """The per-process values, typed (``__post_init__`` always sets them)."""
        if self.process is None:
            raise ValueError("Problem.process is set in __post_init__")
        return self.process

    def with_process(self, process: ProcessSettings, one_chunk: bool = False) -> Problem:
        """The same problem with other per-process values (graph, model and keys shared); ``one_chunk``
        also narrows the chunk to the process's, where the plugin would let it vary per size."""
        space = replace(self.open_space, chunks=(process.chunk_bytes,)) if one_chunk else self.open_space
        other = Problem(self.graph, self.hw, space, self.capability, process, self.model)  # one model, so what
        if "keys" in self.__dict__:  # ``derived`` holds stays true for both
            other.__dict__["keys"] = self.__dict__["keys"]
        other.derived = self.derived
        return other

    def process_choices(self) -> dict[str, list]:
        """Per per-process knob, the values the search may give the whole step: threads always, the
        transport where some key can use shm, the chunk when NCCL_BUFFSIZE is its only setting."""
        space, fields = self.open_space, self.cap.process_fields()
        choices: dict[str, list] = {"threads": list(dict.fromkeys((self.settings.threads, *space.threads)))}
        usable = {t for points in self.keys.values() for t in transports_for(points[0], self.hw, space)}
        choices["transport"] = [t for t in (Transport.P2P, Transport.SHM) if t in usable or t == self.settings.transport]
        if "chunk_bytes" in fields:
            choices["chunk_bytes"] = list(dict.fromkeys((self.settings.chunk_bytes, *space.chunks)))
        return choices

    def step_wide_choices(self) -> dict[str, list]:
        """The values the search tries on every collective at once: the per-process knobs', and the chunk
        also where the tuner plugin sets it per size (one joint move the per-key strategies do not make)."""
        choices = self.process_choices()
        choices.setdefault("chunk_bytes", list(dict.fromkeys((self.settings.chunk_bytes, *self.open_space.chunks))))
        return choices

    @property
    def model(self) -> CostModel:
        """The cost model, typed (``__post_init__`` always sets it)."""
        if self.cost_model is None:
            raise ValueError("Problem.cost_model is set in __post_init__")
        return self.cost_model

    def with_model(self, model: CostModel) -> Problem:
        """The same step, space, capability and per-process values priced by another model (a calibrated one):
        nothing a search derived from the old model is kept."""
        return Problem(self.graph, self.hw, self.open_space, self.capability, self.process, model)

    @cached_property
    def keys(self) -> dict[str, list[OverlapPoint]]:
        return self.graph.keys()


class Evaluator(Protocol):
    """Runs a step with the given configs and says how it went. ``evaluations`` counts the calls.

    The core's evaluator is the simulator; the adapters' live evaluators measure real steps.
    """

    evaluations: int

    def evaluate(self, configs: Configs) -> StepResult: ...


Seen = dict[frozenset, StepResult]  # step results of one graph under one model, by the configs simulated


class SimulatedEvaluator:
    """The simulator as evaluator. Its Simulator keeps the step graph's index and earlier runs, so runs
    resume where the changed keys cannot have mattered yet; searches of one problem may share one
    (``simulator``). Configs simulated before are not simulated again (``seen``, which evaluators of one
    graph and one model may share: the passes of a search repeat a few). ``evaluations`` counts the
    configs asked for, ``simulated`` those run. ``on_result`` sees every result (progress reports)."""

    def __init__(self, problem: Problem, simulator: Simulator | None = None,
                 on_result: Callable[[StepResult], None] | None = None, seen: Seen | None = None) -> None:
        self.problem = problem
        self.simulator = simulator or Simulator(problem.graph)
        self.on_result = on_result
        self.seen: Seen = {} if seen is None else seen
        self.evaluations = self.simulated = 0

    def evaluate(self, configs: Configs) -> StepResult:
        self.evaluations += 1
        what = frozenset(configs.items())
        result = self.seen.get(what)
        if result is None:
            self.simulated += 1
            result = self.simulator.run(configs, self.problem.model)
            self.seen[what] = _kept(result, self.problem.graph, dict(configs), self.problem.model)
        if self.on_result is not None:
            self.on_result(result)
        return result


def _kept(result: StepResult, graph: StepGraph, configs: Configs, model: CostModel) -> StepResult:
    """A result to keep for repeats, without the run behind it (every task's record and checkpoint: tens of
    MB a run at cluster scale); its collectives' timings, if asked for, come from a fresh simulation."""
    @cache
    def rerun() -> StepResult:  # once for every phase that asks
        return simulate(graph, configs, model)

    def timings(i: int) -> Callable[[], list[PointTiming]]:
        return lambda: rerun().phases[i].points

    return replace(result, phases=[replace(ph, _timings=timings(i)) for i, ph in enumerate(result.phases)])


@dataclass
class SearchResult:
    strategy: str
    configs: Configs
    result: StepResult
    evaluations: int
    notes: dict[str, str] = field(default_factory=dict)  # per key: why this config
    process: ProcessSettings | None = None  # the per-process values every config was searched under


def nccl_configs(problem: Problem) -> Configs:
    """NCCL's own choice under the problem's per-process values: default channels and CTA policy;
    algorithm and protocol by its cost model."""
    out: Configs = {}
    for key, points in problem.keys.items():
        cfg = with_process(default_config(problem.hw), points[0], problem.hw, problem.settings, problem.cap.process_fields())
        out[key] = nccl_choice(points[0], problem.hw, cfg, problem.model)
    return out


def groups(problem: Problem) -> dict[str, list[str]]:
    """Tuning keys per communicator (by group name)."""
    out: dict[str, list[str]] = {}
    for key, points in problem.keys.items():
        out.setdefault(points[0].group.name, []).append(key)
    return out


def settle_bound(problem: Problem) -> int:
    """The most evaluations ``settle_communicators`` can make: per communicator, every value of every
    per-communicator knob."""
    space = problem.open_space
    values = {"cta_policy": space.cta_policies, "channels": channel_choices(problem.hw, space),
              "nvls_ctas": space.nvls_ctas, "priority": space.priorities}
    return len(groups(problem)) * sum(len(values[k]) for k in communicator_knobs(problem.cap))


Objective = Callable[[StepResult], float]


def step_time(result: StepResult) -> float:
    return result.step_s


def comm_time(result: StepResult) -> float:
    """The collectives' own time per step (AutoCCL's objective)."""
    return sum(row["time"] for row in result.per_key().values())


def settle_communicators(problem: Problem, evaluator: Evaluator, found: SearchResult,
                         objective: Objective = step_time) -> SearchResult:
    """One value per communicator for each knob NCCL reads per communicator.

    Where a strategy gave the keys of one communicator different values, each value they asked for is
    tried on all of them and the best by ``objective`` wins: at most (communicators x knobs x values)
    evaluations.
    """
    cap = problem.cap
    configs, best = dict(found.configs), found.result
    notes = dict(found.notes)
    settled = 0
    for group, keys in groups(problem).items():
        for knob in communicator_knobs(cap):
            items = [(problem.keys[k][0], configs[k]) for k in keys]
            if is_consistent(knob, items, cap):
                continue
            trials = []
            for value in communicator_values(knob, items, cap):
                trial = dict(configs)
                trial.update({k: with_communicator_value(knob, value, p, c, cap) for k, (p, c) in zip(keys, items)})
                trials.append((evaluator.evaluate(trial), value, trial))
            best, value, configs = min(trials, key=lambda t: objective(t[0]))
            settled += 1
            for k in keys:
                notes[k] = f"{notes.get(k, '')}; {knob} {value} for all of {group} (one value per communicator)".lstrip("; ")
    if not settled:
        return found
    return SearchResult(found.strategy, configs, best, evaluator.evaluations, notes, found.process)
