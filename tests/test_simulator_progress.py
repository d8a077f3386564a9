"""Progress of a planning call: every simulated step is reported, and the line shows only after a second."""

import io

from rich.console import Console

from lagom.hardware import load_hardware
from lagom.progress import PlanningProgress
from lagom.step.workload import load_workload
from lagom.tune import make_plan
from tests.helpers import gpt_workload, write_yaml


def _job(tmp_path):
    wl = load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload(parallel={"tp": 2, "dp": 2, "pp": 2}, model={"layers": 4})))
    return wl, load_hardware("a100-8x-100g")


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=120), out


def test_every_step_is_reported_and_the_line_shows_after_the_delay(tmp_path):
    wl, hw = _job(tmp_path)
    console, out = _console()
    seen = []
    with PlanningProgress("tuning", console=console, show_after_s=0.0) as progress:
        plan = make_plan(wl, hw, "lagom", progress=lambda p: (seen.append(p), progress(p)))
    assert [p.evaluations for p in seen] == list(range(1, plan.evaluations + 2))  # the search's, then NCCL's baseline
    assert [p.best_step_s for p in seen if p.strategy == "lagom"][-1] == plan.predicted_step_s["lagom"]
    assert seen[-1] == progress.last and seen[-1].strategy == "nccl"
    assert "steps simulated" in out.getvalue() and "tuning" in out.getvalue()


def test_a_quick_call_prints_nothing(tmp_path):
    wl, hw = _job(tmp_path)
    console, out = _console()
    with PlanningProgress("tuning", console=console, show_after_s=3600.0) as progress:
        make_plan(wl, hw, "lagom", progress=progress)
    assert progress.last is not None and out.getvalue() == ""
