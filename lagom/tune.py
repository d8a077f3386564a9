"""The planning API, the one-way flow end to end: workload -> step (``lagom.step.points``) -> search over every
dimension of the plan (``lagom.search.driver``, pricing with ``lagom.model``) -> ``Plan`` (``plan_from``).

``make_plan`` is what ``lagom tune`` and the sessions' start-up search run; ``compare_strategies`` is
``lagom compare``. The planner here only supplies the driver with the problem at each bucket scale (one problem,
simulator and set of results per graph, shared by every strategy of one call).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from lagom.hardware import Hardware
from lagom.model.choices import under_process
from lagom.model.phase_index import drop_index
from lagom.model.simulator import Simulator, StepResult
from lagom.plan.capability import Capability, capability_for
from lagom.plan.comm_config import CTAPolicy, ProcessSettings
from lagom.plan.plan import Plan, PlanEntry
from lagom.search import Problem, SearchResult, exhaustive
from lagom.search.base import Seen, SimulatedEvaluator
from lagom.search.driver import Budget, drive
from lagom.search.exhaustive import MAX_EVALUATIONS
from lagom.step.points import collector_paused_for_search, points_for
from lagom.step.workload import Workload, validate

MAX_POINT_NAMES = 12
BUCKET_SCALES = (0.5, 1.0, 2.0)  # bucket sizes the lagom strategy tries around the workload's own


def problem_for(wl: Workload, hw: Hardware, capability: Capability | None = None) -> Problem:
    """The workload's step graph, to be searched within ``capability`` (default: ``capability_for(hw)``)."""
    validate(wl, hw.cluster.world_size)
    return Problem(points_for(wl, hw), hw, capability=capability or capability_for(hw))


def framework_knobs(wl: Workload) -> dict:
    f = wl.framework
    if f.name == "megatron":
        return {"megatron": {"bucket_size": wl.ddp_bucket_elems,
                             "overlap_grad_reduce": f.overlap_grad_reduce, "overlap_param_gather": f.overlap_param_gather}}
    return {"deepspeed": {"reduce_bucket_size": f.reduce_bucket_size, "allgather_bucket_size": f.allgather_bucket_size,
                          "stage3_prefetch_bucket_size": f.prefetch_bucket_size, "overlap_comm": f.overlap_comm}}


def running_workload(wl: Workload, plan: Plan | None) -> Workload:
    """The workload as the framework runs it under a plan: with the plan's bucket knobs, so the modelled
    collectives have the sizes the job's will have. Plans are still checked against the job's own."""
    f = wl.framework
    if plan is None:
        return wl
    if "megatron" in plan.framework:
        return replace(wl, framework=replace(f, bucket_size=plan.framework["megatron"]["bucket_size"]))
    if "deepspeed" in plan.framework:
        k = plan.framework["deepspeed"]
        return replace(wl, framework=replace(
            f, reduce_bucket_size=k["reduce_bucket_size"], allgather_bucket_size=k["allgather_bucket_size"],
            prefetch_bucket_size=k["stage3_prefetch_bucket_size"], overlap_comm=k["overlap_comm"]))
    return wl


def _with_buckets(wl: Workload, scale: float) -> Workload:
    f = wl.framework
    if f.name == "megatron":
        return replace(wl, framework=replace(f, bucket_size=int(wl.ddp_bucket_elems * scale)))
    return replace(wl, framework=replace(f, reduce_bucket_size=int(f.reduce_bucket_size * scale),
                                         allgather_bucket_size=int(f.allgather_bucket_size * scale)))


@dataclass
class Tuned:
    workload: Workload  # with the bucket sizes the search chose
    problem: Problem
    result: SearchResult


@dataclass
class Progress:
    """Where a planning call stands, after every simulated step."""

    strategy: str  # the strategy being searched
    evaluations: int  # steps simulated so far, all strategies of the call together
    best_step_s: float  # the best step this strategy has found so far


ProgressCallback = Callable[[Progress], None]


class _Planner:
    """What the searches of one call share: per workload one problem, one simulator and the results it
    gave (so a step simulated once is not simulated again, whichever strategy asks), and the progress
    report."""

    def __init__(self, hw: Hardware, progress: ProgressCallback | None, capability: Capability | None = None) -> None:
        self.hw, self.progress = hw, progress
        self.capability = capability or capability_for(hw)
        self.evaluations = 0
        self.best: dict[str, float] = {}
        self._problems: dict[str, tuple[Problem, Simulator, Seen]] = {}

    def problem(self, wl: Workload) -> Problem:
        return self._shared(wl)[0]

    def _shared(self, wl: Workload) -> tuple[Problem, Simulator, Seen]:
        key = _with_buckets(wl, 1.0).fingerprint()  # a default bucket size and the same one set explicitly
        if key not in self._problems:
            problem = problem_for(wl, self.hw, self.capability)
            self._problems[key] = (problem, Simulator(problem.graph), {})
        return self._problems[key]

    def forget(self, wl: Workload) -> None:
        """Drop a workload's problem (a step graph can take gigabytes at cluster scale)."""
        self._problems.pop(_with_buckets(wl, 1.0).fingerprint(), None)

    def rest(self, wl: Workload) -> None:
        """Drop what a workload's simulator keeps for runs to come (its phases' index, prepared phases, earlier runs: hundreds
        of MB at cluster scale) while other graphs are searched; its problem and results stay, and a run
        not among them prepares the graph again."""
        key = _with_buckets(wl, 1.0).fingerprint()
        if key in self._problems:
            problem, _, seen = self._problems[key]
            for phase in problem.graph.phases:
                drop_index(phase)
            self._problems[key] = (problem, Simulator(problem.graph), seen)

    def evaluator(self, wl: Workload, strategy: str) -> SimulatedEvaluator:
        problem, simulator, seen = self._shared(wl)

        def report(result: StepResult) -> None:
            self.evaluations += 1
            self.best[strategy] = min(self.best.get(strategy, result.step_s), result.step_s)
            if self.progress is not None:
                self.progress(Progress(strategy, self.evaluations, self.best[strategy]))

        return SimulatedEvaluator(problem, simulator, report, seen)

    def search(self, wl: Workload, strategy: str, search_buckets: bool = True, budget: Budget | None = None) -> Tuned:
        """Strategy ``strategy`` over every dimension of the plan (``lagom.search.driver``); the bucket sizes
        around the workload's own unless ``search_buckets`` is off (the user pinned them); within ``budget``."""
        space = _BucketSpace(self, wl, strategy, BUCKET_SCALES if search_buckets else (1.0,))
        with collector_paused_for_search():
            found = drive(strategy, space, budget)
        return Tuned(space.at(found.scale), found.problem, found.result)


@dataclass
class _BucketSpace:
    """The driver's bucket dimension over one workload: the workload at each scale of its bucket size, with the
    planner's shared problems and evaluators."""

    planner: _Planner
    wl: Workload
    strategy: str
    scales: tuple[float, ...]

    def at(self, scale: float) -> Workload:
        return self.wl if scale == 1.0 else _with_buckets(self.wl, scale)

    def problem(self, scale: float) -> Problem:
        return self.planner.problem(self.at(scale))

    def evaluator(self, scale: float) -> SimulatedEvaluator:
        return self.planner.evaluator(self.at(scale), self.strategy)

    def rest(self, scale: float) -> None:
        self.planner.rest(self.at(scale))

    def forget(self, scale: float) -> None:
        self.planner.forget(self.at(scale))


def search_with_buckets(wl: Workload, hw: Hardware, strategy: str, search_buckets: bool = True,
                        progress: ProgressCallback | None = None, capability: Capability | None = None) -> Tuned:
    """Run a strategy; lagom also tries bucket sizes around the workload's unless ``search_buckets`` is
    off (the user pinned them). ``progress`` hears after every simulated step."""
    return _Planner(hw, progress, capability).search(wl, strategy, search_buckets)


def make_plan(wl: Workload, hw: Hardware, strategy: str = "lagom", search_buckets: bool = True,
              progress: ProgressCallback | None = None, capability: Capability | None = None,
              budget: Budget | None = None) -> Plan:
    """The plan of one strategy, within ``capability`` (default: what ``hw``'s profile and this install have).

    ``budget`` (``lagom.search.driver.Budget``): the search stops between two evaluations once it is spent, and the
    plan holds the best settings found so far; each entry's note says so, and so does ``budget.cut`` afterwards.
    NCCL's baseline, one evaluation, is priced whatever the budget."""
    planner = _Planner(hw, progress, capability)
    tuned = planner.search(wl, strategy, search_buckets, budget)
    baseline = planner.search(wl, "nccl").result.result.step_s
    return plan_from(tuned, wl, hw, {"nccl": baseline, strategy: tuned.result.result.step_s})


def registration(problem: Problem, result: SearchResult) -> list[dict]:
    """The buffers the framework must register symmetrically for the ZERO CTA policy to run on copy
    engines: per communicator, its copy-engine collectives and their largest message."""
    by_group: dict[str, dict] = {}
    for key, points in problem.keys.items():
        p = points[0]
        if result.configs[key].cta_policy == CTAPolicy.ZERO and problem.cap.zero_applies(p.collective, p.group.nodes, p.group.name):
            row = by_group.setdefault(p.group.name, {"group": p.group.name, "collectives": [], "max_bytes": 0})
            row["collectives"] = sorted({*row["collectives"], p.collective.value})
            row["max_bytes"] = max(row["max_bytes"], p.bytes)
    return [{**row, "how": "symmetric memory: torch.distributed._symmetric_memory, or ncclCommWindowRegister "
                           "with NCCL_WIN_COLL_SYMMETRIC on the collective's send and receive buffers"}
            for _, row in sorted(by_group.items())]


def _process_of(problem: Problem, res: SearchResult) -> ProcessSettings:
    """The per-process values a result was searched under; for a result built without them (configs kept
    from a running plan), the values most of its keys have."""
    if res.process is not None:
        return res.process
    values: dict[str, Any] = {}
    for name in problem.cap.process_fields():
        counts = Counter(getattr(c, name) for c in res.configs.values())
        if counts:
            values[name] = counts.most_common(1)[0][0]
    return replace(problem.settings, **values)


def plan_from(tuned: Tuned, wl: Workload, hw: Hardware, predicted: dict[str, float]) -> Plan:
    """The plan of a search result. Every entry runs the per-process values (NCCL reads them once per
    process), so the plan holds them once."""
    res = tuned.result
    problem = tuned.problem
    process = _process_of(problem, res)
    per_key = res.result.per_key()
    entries = []
    for key, points in problem.keys.items():
        p = points[0]
        row = per_key.get(key, {})
        config = under_process(res.configs[key], p, hw, process, problem.cap)
        entries.append(PlanEntry(
            key=key, group=p.group.name, group_size=p.group.size, group_nodes=p.group.nodes,
            collective=p.collective.value, bytes=p.bytes, count=int(row.get("count", len(points))),
            points=[q.name for q in points[:MAX_POINT_NAMES]], config=config, note=res.notes.get(key, ""),
            predicted_comm_s=row.get("time", 0.0), predicted_exposed_s=row.get("exposed", 0.0)))
    return Plan(workload=wl.name, workload_fingerprint=wl.fingerprint(), hardware=hw.name,
                hardware_fingerprint=hw.fingerprint(), world_size=wl.world_size, strategy=res.strategy,
                entries=entries, predicted_step_s=predicted, evaluations=res.evaluations,
                framework=framework_knobs(tuned.workload),
                process=process.to_dict(problem.cap.process_fields()) | {"transport": str(process.transport)},
                capability=problem.cap.to_dict(), registration=registration(problem, res))


def compare_strategies(wl: Workload, hw: Hardware, exhaustive_limit: int = MAX_EVALUATIONS,
                       progress: ProgressCallback | None = None,
                       capability: Capability | None = None) -> dict[str, Tuned | None]:
    """Every strategy on the simulator, within ``capability``; exhaustive is None where it needs more than
    the limit's evaluations."""
    planner = _Planner(hw, progress, capability)
    out: dict[str, Tuned | None] = {s: planner.search(wl, s) for s in ("nccl", "autoccl", "lagom")}
    problem = planner.problem(wl)
    with collector_paused_for_search():
        out["exhaustive"] = (Tuned(wl, problem, exhaustive.search(problem, planner.evaluator(wl, "exhaustive"), exhaustive_limit))
                             if exhaustive.feasible(problem, exhaustive_limit) else None)
    return out
