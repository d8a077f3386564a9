"""No rank waits on a search: a job without a plan starts at once, rank 0 searches beside it, every rank adopts the
plan at one agreed step, and a search past its budget hands over its best so far.

Real sessions on 2 gloo ranks train a small model (gradients all-reduced by hand). Rank 0's search is made slow
on purpose: each evaluation waits for a gate the training loop opens at step ``GATE``, so the search cannot end
before it; steps that go on meanwhile prove that no rank waits. Nothing is asserted on seconds: the checks are
on step indices, the plan every rank took and the events.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lagom.runtime.online.session import TuningSession
from lagom.runtime.online.state import SessionOptions, plan_fingerprint
from lagom.search.base import SimulatedEvaluator
from lagom.search.driver import Budget
from lagom.tune import make_plan
from tests.distributed import run_ranks
from tests.test_live_safety import job

GATE = 6  # the step at which rank 0's slowed search may start evaluating
AFTER = 3  # steps run after the plan is adopted
MOST = 3000  # steps at most (a search that never ends fails the test here, not by a hang)
STEP_S = 0.005


def train(session: TuningSession | None, on_step: Any = None) -> tuple[list[float], int | None]:
    """Steps of a small model, with the session's hooks around each when given, until ``AFTER`` steps after
    the session adopted a plan (without a session: as many steps as ``on_step`` lets run). Returns the losses
    and the step at which the plan was adopted."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    world = dist.get_world_size()
    losses: list[float] = []
    adopted: int | None = None
    for step in range(MOST):
        if session is not None:
            session.begin_step(step)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * dist.get_rank() + step))
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        time.sleep(STEP_S)
        if session is not None and session.end_step() is not None:
            adopted = step
        if on_step is not None and not on_step(step):
            break
        if adopted is not None and step >= adopted + AFTER:
            break
    return losses, adopted


def slowed(gate: threading.Event, sleep_at: int, sleep_s: float) -> Any:
    """``SimulatedEvaluator.evaluate`` made slow: every evaluation waits for ``gate``; evaluation ``sleep_at``
    also sleeps ``sleep_s`` (so that a budget of that many seconds is spent after it). Returns the undo."""
    original = SimulatedEvaluator.evaluate
    count = [0]

    def evaluate(self: SimulatedEvaluator, configs: Any) -> Any:
        gate.wait(timeout=300)
        count[0] += 1
        if count[0] == sleep_at:
            time.sleep(sleep_s)
        return original(self, configs)

    SimulatedEvaluator.evaluate = evaluate  # type: ignore[method-assign]
    return lambda: setattr(SimulatedEvaluator, "evaluate", original)


def beside(rank: int, world: int, tmp: str, budget_s: float, sleep_at: int) -> dict[str, Any]:
    wl, hw = job(tmp)
    cache = Path(tmp) / "cache"
    gate = threading.Event()
    undo = slowed(gate, sleep_at, budget_s) if rank == 0 else (lambda: None)
    options = SessionOptions(mode="offline", cache_dir=cache, collective_timeout_s=60, search_seconds=budget_s,
                             report_files=(Path(tmp) / f"report-{rank}.json", Path(tmp) / f"report-{rank}.md"))
    session = TuningSession(wl, hw, options, world_size=world)
    seen: dict[str, Any] = {}

    def at(step: int) -> bool:
        if step == GATE:  # the job got here while the search could not evaluate anything yet
            seen.update(searching=session.searching, plan=session.plan is not None,
                        done=session._search is not None and session._search.done)  # noqa: SLF001
            gate.set()
        return True

    try:
        started = time.perf_counter()
        session.start()
        seen["start_s"] = time.perf_counter() - started
        seen["source"] = session.plan_source
        losses, adopted = train(session, at)
        plain, _ = train(None, on_step=lambda step: step < len(losses) - 1)  # as many steps without Lagom
        seen |= {"losses": losses, "plain": plain, "adopted": adopted, "events": list(session.events),
                 "fingerprint": plan_fingerprint(session.plan) if session.plan is not None else None,
                 "notes": [e.note for e in session.plan.entries] if session.plan is not None else [],
                 "evaluations": session.plan.evaluations if session.plan is not None else None,
                 "cuts": list(session.search_cuts), "off": session.off, "next_start": list(session.next_start)}
        session.write_report()
    finally:
        session.close()
        undo()
    again = TuningSession(wl, hw, options, world_size=world)  # the next start: the cached plan, no search
    try:
        again.start()
        seen |= {"restart_source": again.plan_source, "restart_searching": again.searching,
                 "restart_fingerprint": plan_fingerprint(again.plan) if again.plan is not None else None}
    finally:
        again.close()
    return seen


def check_beside(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["off"] is None, out["off"]
        assert out["searching"] and not out["plan"] and not out["done"], "the job reached the gate while searching"
        assert out["source"].startswith("none at start-up")
        assert out["losses"] == out["plain"], "numerics changed"
        assert out["adopted"] is not None and out["adopted"] >= GATE, out["adopted"]
        assert any("start-up plan (searched beside the job" in e for e in out["events"])
        assert out["restart_source"].startswith("searched beside an earlier run") and not out["restart_searching"]
        assert out["restart_fingerprint"] == out["fingerprint"]
    r0, r1 = ranks
    assert r0["adopted"] == r1["adopted"], "the ranks adopted the plan at different steps"
    assert r0["fingerprint"] == r1["fingerprint"] is not None


@pytest.fixture(scope="module")
def full_search(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(beside, 2, str(tmp_path_factory.mktemp("full")), 600.0, 0)


def test_the_job_trains_while_rank_0_searches_and_adopts_at_one_agreed_step(full_search: list) -> None:
    check_beside(full_search)
    assert full_search[0]["cuts"] == [None] and full_search[1]["cuts"] == [None]
    assert not any("cut at" in note for note in full_search[0]["notes"])


def test_what_a_plan_found_while_running_cannot_change_waits_for_the_next_start(full_search: list) -> None:
    for out in full_search:
        taken = next(e for e in out["events"] if "start-up plan (searched beside the job" in e)
        assert "On the next start (fixed when communicators and buffers are made): " in taken
        assert any("communicator options" in line or "(NCCL reads it once per process)" in line
                   or "fixed when the framework makes its buffers" in line for line in out["next_start"]), taken


@pytest.mark.slow  # two gloo ranks training beside a search slowed past its budget (12 s): CI's slower tier
def test_a_search_past_its_budget_hands_over_its_best_so_far(full_search: list, tmp_path: Path) -> None:
    budget = 0.5
    ranks = run_ranks(beside, 2, str(tmp_path), budget, 2)  # the second evaluation spends the whole budget
    check_beside(ranks)
    cut = f"cut at its budget of {budget:g} s"
    for out in ranks:
        assert out["cuts"] == [cut]
        assert all(cut in note for note in out["notes"])
        assert any(f"{cut}: the best found so far" in e for e in out["events"])
    assert ranks[0]["evaluations"] < full_search[0]["evaluations"]
    report = json.loads((tmp_path / "report-0.json").read_text())
    assert report["search"] == {"underway": False, "cut": [cut]}
    assert f"{cut}; the plan adopted is the best it had found" in (tmp_path / "report-0.md").read_text()


def test_a_budget_stops_the_driver_between_evaluations_with_the_best_it_evaluated(tmp_path: Path) -> None:
    """In one process: a stop event set after a few evaluations ends the search there; its plan is the best of
    what was evaluated, and it says so in every entry's note."""
    wl, hw = job(str(tmp_path))
    full = make_plan(wl, hw)
    stop, count = threading.Event(), [0]

    def pause() -> None:
        count[0] += 1
        if count[0] > 5:
            stop.set()

    budget = Budget(stop=stop, pause=pause)
    cut = make_plan(wl, hw, budget=budget)
    assert budget.cut == "stopped before its end"
    assert cut.evaluations == 5 < full.evaluations
    assert cut.predicted_step_s["lagom"] >= full.predicted_step_s["lagom"]
    assert cut.predicted_step_s["lagom"] <= cut.predicted_step_s["nccl"]
    assert all("stopped before its end" in e.note for e in cut.entries)
    never = Budget(seconds=0.0)
    first = make_plan(wl, hw, budget=never)  # spent before any evaluation: NCCL's own choice, evaluated once
    assert never.cut == "cut at its budget of 0 s"
    assert first.predicted_step_s["lagom"] == first.predicted_step_s["nccl"]


def searches_until_closed(session: TuningSession, monkeypatch: pytest.MonkeyPatch) -> None:
    """No evaluation of the session's search ends before the job does: each waits for the stop that close sends,
    and close waits for the stopped search however loaded the machine."""
    from lagom.runtime.online import background

    monkeypatch.setattr(background, "JOIN_S", 120.0)
    original = SimulatedEvaluator.evaluate

    def evaluate(self: SimulatedEvaluator, configs: Any) -> Any:
        search = session._search  # noqa: SLF001
        if search is not None and search.budget.stop is not None:
            search.budget.stop.wait(timeout=120)
        return original(self, configs)

    monkeypatch.setattr(SimulatedEvaluator, "evaluate", evaluate)


def test_an_online_search_the_job_ends_before_is_cached_for_the_next_start(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A job shorter than its online search (one process): at close, rank 0's search stops at its next evaluation
    and its best so far is cached, so the next start runs that plan from its first step instead of searching again
    (nothing is adopted in the ending job)."""
    from lagom.plan.plan import Plan
    from tests.test_live_safety import one_process_session

    session = one_process_session(tmp_path)
    searches_until_closed(session, monkeypatch)

    def step() -> None:
        session.begin_step()
        time.sleep(STEP_S)
        session.end_step()

    try:
        for _ in range(MOST):
            if session.searching or session.off is not None:
                break
            step()
        assert session.off is None and session.searching and session.plan is None
        for _ in range(3):  # the job runs on while the search waits
            step()
        assert session.plan is None and not session.tuned
    finally:
        session.close()
    cached = list((tmp_path / "cache-0").glob("*.json"))
    assert len(cached) == 1, cached
    plan = Plan.load(cached[0])
    assert plan.entries and all("stopped before its end" in e.note for e in plan.entries)
    assert any("the job ended before every rank adopted the online plan" in e for e in session.events)
    again = one_process_session(tmp_path)  # the next start of the same job
    try:
        assert again.plan_source.startswith("tuned by an earlier online run") and not again.tuning
        assert again.plan is not None and plan_fingerprint(again.plan) == plan_fingerprint(plan)
    finally:
        again.close()


def test_a_start_up_search_the_job_ends_before_is_cached_and_written_for_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline job with no plan, shorter than rank 0's start-up search (one process): at close the search stops
    at its next evaluation and its best so far is cached and written to the plan path, so the next start runs it
    from its first step instead of searching again."""
    from lagom.plan.plan import Plan
    from tests.test_capability import tiny_job

    wl, hw = tiny_job(tmp_path)
    options = SessionOptions(cache_dir=tmp_path / "cache", plan_out=tmp_path / "plan.json")
    session = TuningSession(wl, hw, options, world_size=8)
    searches_until_closed(session, monkeypatch)
    try:
        session.start()
        assert session.searching and session.plan is None
        for _ in range(3):  # the job runs on while the search waits
            session.begin_step()
            time.sleep(STEP_S)
            session.end_step()
        assert session.plan is None and session.searching
    finally:
        session.close()
    written = Plan.load(tmp_path / "plan.json")
    assert written.entries and all("stopped before its end" in e.note for e in written.entries)
    assert any("the job ended before every rank adopted the start-up plan" in e for e in session.events)
    again = TuningSession(wl, hw, options, world_size=8)  # the next start of the same job
    try:
        again.start()
        assert again.plan_source.startswith("searched beside an earlier run of this job") and not again.searching
        assert again.plan is not None and plan_fingerprint(again.plan) == plan_fingerprint(written)
    finally:
        again.close()
    (tmp_path / "plan.json").unlink()
    third = TuningSession(wl, hw, options, world_size=8)  # a start from the cache writes the plan path too
    try:
        third.start()
        assert plan_fingerprint(Plan.load(tmp_path / "plan.json")) == plan_fingerprint(written)
    finally:
        third.close()
