"""Lagom's priority search over the whole step.

Priority of a move for collective j: H_j = (Y' - Y) / (X_j - X_j'), the compute time it adds per
unit of comm time it saves (X: the collective's time, Y: the compute beside it, inflated by the
SMs and HBM the collective takes). Comm-bound collectives (exposed in the last evaluation) are
tuned first, cheapest speed-up (smallest H) first; then compute-bound ones give resources back,
the largest compute saving per unit of comm slowdown first. Each collective is tuned once: the cost
model ranks its candidates on its own windows, the evaluator (simulator or live steps) checks the
best few on the whole step, so the evaluation count grows linearly with the number of collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lagom.comm_config import CommConfig, can_decompose, candidates
from lagom.cost_model import CostModel, RunningComm
from lagom.points import ComputeSegment, OverlapPoint, StepGraph
from lagom.search.base import Evaluator, Problem, SearchResult, nccl_configs

CHECKED_PER_KEY = 4  # candidates per collective confirmed with the evaluator


@dataclass
class Window:
    """The compute one instance of a collective can hide under."""

    point: OverlapPoint
    repeat: int  # occurrences per step
    hide: float  # uncontended seconds of compute between release and need
    segments: list[ComputeSegment]  # that compute, in stream order


def windows(graph: StepGraph, model: CostModel) -> dict[str, list[Window]]:
    """Per key, the distinct windows its instances hide under, each weighted by how often it occurs.

    Identical layers give identical windows, so a 48-layer model has a handful per key, not hundreds.
    """
    out: dict[str, dict[tuple, Window]] = {}
    for phase in graph.phases:
        pos = {s.name: i for segs in phase.segments.values() for i, s in enumerate(segs)}
        for p in phase.points:
            segs = phase.segments[p.device]
            if p.fuse_with is not None and can_decompose(p):
                hide_segs = segs[pos[p.fuse_with]:pos[p.fuse_with] + 1]  # what a decomposition would hide under
            else:
                hide_segs = segs[pos[p.after] + 1 if p.after else 0:pos[p.before] if p.before else len(segs)]
            sig = (p.collective, p.group, p.bytes, p.fuse_with is not None,
                   tuple((s.flops, s.bytes, s.ctas) for s in hide_segs))
            known = out.setdefault(p.key, {})
            if sig in known:
                known[sig].repeat += phase.repeat
            else:
                known[sig] = Window(p, phase.repeat, sum(model.compute_solo(s) for s in hide_segs), hide_segs)
    return {key: list(wins.values()) for key, wins in out.items()}


@dataclass
class Estimate:
    comm: float  # X: seconds of communication per step
    compute: float  # Y: seconds of compute beside it, inflated
    makespan: float  # Z: seconds the windows take


def _inflation(comm_s: float, segments: list[ComputeSegment], running: tuple[RunningComm, ...], model: CostModel) -> float:
    """Extra compute seconds while a collective runs from the window's start for comm_s seconds."""
    extra, left = 0.0, comm_s
    for seg in segments:
        if left <= 0:
            break
        solo, slowed = model.compute_solo(seg), model.compute_time(seg, running)
        if slowed <= left:
            extra, left = extra + slowed - solo, left - slowed
        else:  # the collective ends inside this segment
            extra, left = extra + left * (1 - solo / slowed), 0.0
    return extra


def estimate(cfg: CommConfig, wins: list[Window], model: CostModel) -> Estimate:
    """The windows of one key under one config, each in isolation: Z = max(X, inflated compute)."""
    X = Y = Z = 0.0
    for w in wins:
        p = w.point
        util = max((model.hbm_util(s) for s in w.segments), default=0.0)
        if cfg.decomposition == "p2p" and can_decompose(p):
            n = p.group.size * cfg.num_chunks
            step = model.p2p_step_time(p.group, p.bytes / n, cfg, util)
            x, first = step * (n - cfg.num_chunks), step
        else:
            x, first = model.comm_time(p.collective, p.group, p.bytes, cfg, util), 0.0
        rate = model.comm_hbm_rate(p.collective, p.group, p.bytes, x) if x > 0 else 0.0
        y = w.hide + _inflation(x, w.segments, (RunningComm(cfg, rate),), model)
        X += x * w.repeat
        Y += y * w.repeat
        Z += (first + max(x, y)) * w.repeat
    return Estimate(X, Y, Z)


def priority(cur: Estimate, new: Estimate) -> float:
    """H = (Y' - Y) / (X - X'): compute added per unit of comm time saved."""
    saved = cur.comm - new.comm
    return (new.compute - cur.compute) / saved if saved else math.inf


def _ranked(key: str, cur: Estimate, exposed: float, problem: Problem, wins: list[Window]) -> list[tuple[Estimate, CommConfig]]:
    """Candidates best first. Comm-bound: the exposed comm a move can remove (at most ``exposed``, the
    step's), net of the compute it adds; ties go to the faster comm. Compute-bound: predicted makespan."""
    model = problem.model
    scored = [(estimate(c, wins, model), c) for c in candidates(problem.keys[key][0], problem.hw, problem.space)]
    if exposed > 0:
        def gain(ec: tuple[Estimate, CommConfig]) -> tuple[float, float]:
            est = ec[0]
            return ((est.compute - cur.compute) - min(exposed, cur.comm - est.comm), est.comm)
        return sorted(scored, key=gain)
    return sorted(scored, key=lambda ec: ec[0].makespan)


def search(problem: Problem, evaluator: Evaluator) -> SearchResult:
    model = problem.model
    configs = nccl_configs(problem)
    best = evaluator.evaluate(configs)
    wins = windows(problem.graph, model)
    per_key = best.per_key()
    plans = []
    for key in problem.keys:
        cur = estimate(configs[key], wins[key], model)
        exposed = per_key[key]["exposed"]
        ranked = _ranked(key, cur, best.exposed_comm_s if exposed > 0 else 0.0, problem, wins[key])
        h = priority(cur, ranked[0][0])
        # Comm-bound first, smallest H first; then compute-bound, largest compute saving per comm added.
        plans.append(((0, h) if exposed > 0 else (1, -h if math.isfinite(h) else 0.0), key, cur, ranked, exposed > 0))
    notes: dict[str, str] = {}
    for _, key, cur, ranked, comm_bound in sorted(plans, key=lambda p: p[0]):
        seen = {(round(cur.comm, 12), round(cur.compute, 12))}
        chosen = None
        for est, cfg in ranked:
            if len(seen) > CHECKED_PER_KEY:
                break
            predicted = (round(est.comm, 12), round(est.compute, 12))
            if predicted in seen:  # checks go to distinct predictions, not to knobs the model says are moot
                continue
            seen.add(predicted)
            result = evaluator.evaluate({**configs, key: cfg})
            if result.step_s < best.step_s:
                best, chosen = result, (cfg, est)
        if chosen is None:
            notes[key] = "kept NCCL's choice: no candidate improved the step"
            continue
        cfg, est = chosen
        configs[key] = cfg
        window = "comm-bound" if comm_bound else "compute-bound"
        if est.comm < cur.comm:
            notes[key] = f"{window}: faster comm, H={priority(cur, est):.3g} compute s added per comm s saved"
        else:
            notes[key] = f"{window}: resources given back, {cur.compute - est.compute:.3g} s compute saved per step"
    return SearchResult("lagom", configs, best, evaluator.evaluations, notes)
