"""The one-way flow: workload -> overlap points -> model -> search -> plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lagom.hardware import Hardware
from lagom.plan import Plan, PlanEntry
from lagom.points import points_for
from lagom.search import Problem, SearchResult, run_strategy
from lagom.search.base import SimulatedEvaluator
from lagom.search import exhaustive
from lagom.search.exhaustive import MAX_EVALUATIONS
from lagom.workload import Workload, validate

MAX_POINT_NAMES = 12
BUCKET_SCALES = (0.5, 1.0, 2.0)  # bucket sizes the lagom strategy tries around the workload's own


def problem_for(wl: Workload, hw: Hardware) -> Problem:
    validate(wl, hw.cluster.world_size)
    return Problem(points_for(wl, hw), hw)


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


def _has_buckets(problem: Problem) -> bool:
    return any("grad.bucket" in p.name for p in problem.graph.points)


@dataclass
class Tuned:
    workload: Workload  # with the bucket sizes the search chose
    problem: Problem
    result: SearchResult


def search_with_buckets(wl: Workload, hw: Hardware, strategy: str, search_buckets: bool = True) -> Tuned:
    """Run a strategy; lagom also tries bucket sizes around the workload's (one search per size) unless
    ``search_buckets`` is off (the user pinned them)."""
    problem = problem_for(wl, hw)
    if strategy != "lagom" or not search_buckets or not _has_buckets(problem):
        return Tuned(wl, problem, run_strategy(strategy, problem))
    best: Tuned | None = None
    evaluations = 0
    for scale in BUCKET_SCALES:
        cand = _with_buckets(wl, scale)
        prob = problem_for(cand, hw)
        res = run_strategy(strategy, prob, SimulatedEvaluator(prob))
        evaluations += res.evaluations
        if best is None or res.result.step_s < best.result.result.step_s:
            best = Tuned(cand, prob, res)
    assert best is not None
    best.result.evaluations = evaluations
    return best


def make_plan(wl: Workload, hw: Hardware, strategy: str = "lagom", search_buckets: bool = True) -> Plan:
    tuned = search_with_buckets(wl, hw, strategy, search_buckets)
    baseline = run_strategy("nccl", problem_for(wl, hw)).result.step_s
    return plan_from(tuned, wl, hw, {"nccl": baseline, strategy: tuned.result.result.step_s})


def plan_from(tuned: Tuned, wl: Workload, hw: Hardware, predicted: dict[str, float]) -> Plan:
    res = tuned.result
    per_key = res.result.per_key()
    entries = []
    for key, points in tuned.problem.keys.items():
        p = points[0]
        row = per_key.get(key, {})
        entries.append(PlanEntry(
            key=key, group=p.group.name, group_size=p.group.size, group_nodes=p.group.nodes,
            collective=p.collective.value, bytes=p.bytes, count=int(row.get("count", len(points))),
            points=[q.name for q in points[:MAX_POINT_NAMES]], config=res.configs[key], note=res.notes.get(key, ""),
            predicted_comm_s=row.get("time", 0.0), predicted_exposed_s=row.get("exposed", 0.0)))
    return Plan(workload=wl.name, workload_fingerprint=wl.fingerprint(), hardware=hw.name,
                hardware_fingerprint=hw.fingerprint(), world_size=wl.world_size, strategy=res.strategy,
                entries=entries, predicted_step_s=predicted, evaluations=res.evaluations,
                framework=framework_knobs(tuned.workload))


def compare_strategies(wl: Workload, hw: Hardware, exhaustive_limit: int = MAX_EVALUATIONS) -> dict[str, Tuned | None]:
    """Every strategy on the simulator; exhaustive is None where it needs more than the limit's evaluations."""
    out: dict[str, Tuned | None] = {s: search_with_buckets(wl, hw, s) for s in ("nccl", "autoccl", "lagom")}
    problem = problem_for(wl, hw)
    out["exhaustive"] = (Tuned(wl, problem, exhaustive.search(problem, SimulatedEvaluator(problem), exhaustive_limit))
                         if exhaustive.feasible(problem, exhaustive_limit) else None)
    return out
