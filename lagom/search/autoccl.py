"""AutoCCL (NSDI'25), re-implemented over the evaluator interface.

Per collective: split the space into (algorithm, protocol, transport) subspaces, sample each
subspace's starting point, prune subspaces much slower than the best, then coordinate descent over
(channels, threads, chunk) in each remaining one. The objective is the collective's own time as
measured under real interference, which is why it buys comm speed even where compute pays for it.
All collectives are tuned at once: every evaluation tries the next candidate of each of them.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

from lagom.model.choices import settable_subspaces
from lagom.plan.comm_config import CommConfig, channels_for, chunk_choices, default_config, tuner_sets_channels
from lagom.search.base import Evaluator, Problem, SearchResult
from lagom.step.graph import OverlapPoint

PRUNE_MARGIN = 0.2  # drop subspaces whose starting point is >20% slower than the best start

Tuner = Generator[CommConfig, float, CommConfig]


def _descend(start: CommConfig, start_t: float, dims: dict[str, list[int]]) -> Generator[CommConfig, float, tuple[CommConfig, float]]:
    """Coordinate descent: along each knob, keep stepping while the collective gets faster."""
    cur, cur_t = start, start_t
    improved = True
    while improved:
        improved = False
        for knob, values in dims.items():
            for step in (1, -1):
                while True:
                    i = values.index(getattr(cur, knob)) + step
                    if not 0 <= i < len(values):
                        break
                    cand = replace(cur, **{knob: values[i]})  # type: ignore[arg-type]  # an int knob
                    t = yield cand
                    if t >= cur_t:
                        break
                    cur, cur_t, improved = cand, t, True
    return cur, cur_t


def _on_grid(cfg: CommConfig, dims: dict[str, list[int]]) -> CommConfig:
    """``cfg`` with each descended knob at the nearest value the space has."""
    for knob, values in dims.items():
        cfg = replace(cfg, **{knob: min(values, key=lambda v: abs(v - getattr(cfg, knob)))})  # type: ignore[arg-type]
    return cfg


def _tune(point: OverlapPoint, problem: Problem) -> Tuner:
    hw, space = problem.hw, problem.space
    base = default_config(hw)
    starts = []
    for algo, proto, transport in settable_subspaces(point, hw, space):
        dims = {"channels": channels_for(algo, hw, space), "threads": list(space.threads),
                "chunk_bytes": chunk_choices(point, algo, proto, hw, space)}
        cfg = replace(base, algorithm=algo, protocol=proto, transport=transport)
        cfg = _on_grid(replace(cfg, by_tuner=tuner_sets_channels(point, cfg, problem.cap)), dims)
        starts.append(((yield cfg), cfg, dims))
    best_start = min(t for t, _, _ in starts)
    best, best_t = None, float("inf")
    for t, cfg, dims in sorted(starts, key=lambda s: s[0]):
        if t > best_start * (1 + PRUNE_MARGIN):
            continue  # pruned subspace
        cfg, t = yield from _descend(cfg, t, dims)
        if t < best_t:
            best, best_t = cfg, t
    return best  # type: ignore[return-value]


def search(problem: Problem, evaluator: Evaluator) -> SearchResult:
    tuners = {key: _tune(points[0], problem) for key, points in problem.keys.items()}
    trying = {key: next(gen) for key, gen in tuners.items()}
    final: dict[str, CommConfig] = {}
    while trying:
        per_key = evaluator.evaluate({**final, **trying}).per_key()
        for key in list(trying):
            row = per_key[key]
            try:
                trying[key] = tuners[key].send(row["time"] / row["count"])
            except StopIteration as stop:
                final[key] = stop.value
                del trying[key]
    result = evaluator.evaluate(final)
    notes = {k: "fastest collective under interference (subspace pruning + coordinate descent)" for k in final}
    return SearchResult("autoccl", final, result, evaluator.evaluations, notes)
