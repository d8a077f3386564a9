"""Lagom's priority search: the launch wait in its estimate, and the joint revisit of keys that block the
same compute."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lagom.comm_config import CommConfig
from lagom.search import run_strategy
from lagom.search.priority import estimate, windows
from tests.helpers import SMALL_SPACE, synthetic_problem

US = 1e-6


def test_estimate_charges_the_launch_wait_only_on_the_normal_stream_and_only_beside_compute():
    """A kernel launched while a GEMM holds the SMs waits ``cta_wait_us`` (at its solo rate, as the simulator
    charges it); on the high-priority stream, or with no compute in the window, it does not."""
    problem = synthetic_problem([(1.0, 50.0, 840)] * 3,
                                [{"collective": "all_gather", "mb": 64.0, "after": 0, "before": 2, "group": "dp"},
                                 {"collective": "all_gather", "mb": 32.0, "after": 0, "before": 1, "group": "tp"}])
    model, wins = problem.model, windows(problem.graph)
    hidden, bare = (next(k for k in problem.keys if k.startswith(g)) for g in ("dp/", "tp/"))
    normal = CommConfig(channels=4)
    high = replace(normal, priority=1)
    wait = problem.hw.contention.cta_wait_us * US
    assert wait > 0 and model.launch_wait(normal) == pytest.approx(wait) and model.launch_wait(high) == 0.0

    point = problem.keys[hidden][0]
    segment = problem.graph.phases[0].segments[0][1]
    beside = model.comm_time(point.collective, point.group, point.bytes, normal, model.hbm_util(segment))
    alone = model.comm_time(point.collective, point.group, point.bytes, normal)
    assert estimate(high, wins[hidden], model).comm == pytest.approx(beside, rel=1e-12)
    assert estimate(normal, wins[hidden], model).comm == pytest.approx(beside * (1 + wait / alone), rel=1e-12)
    # released right before the segment that needs it: the compute stream is idle, nothing holds the SMs
    assert estimate(normal, wins[bare], model).comm == estimate(high, wins[bare], model).comm


def test_lagom_takes_the_high_priority_stream_where_the_wait_is_exposed():
    """A comm-bound all-gather under a short GEMM: its launch wait is exposed, so the high-priority stream
    saves it on the step. The search must find that (before the estimate saw the wait, priority 1 and 0
    estimated alike and only priority 0 was ever checked)."""
    segments = [(0.02, 2.0, 840)] * 4
    points = [{"collective": "all_gather", "mb": 8.0, "after": i, "before": i + 1, "group": "dp"} for i in (0, 2)]
    points[0]["before"] = 2
    space = replace(SMALL_SPACE, priorities=(0, 1))
    problem = synthetic_problem(segments, points, space=space)
    with_priority = run_strategy("lagom", problem)
    without = run_strategy("lagom", replace(problem, space=replace(space, priorities=(0,))))
    key = next(iter(problem.keys))
    assert with_priority.configs[key].priority == 1
    assert with_priority.result.step_s < without.result.step_s
