"""Online mode's drift re-tune through a real session: after live tuning, one key's collectives get slower
per call and the step with them; the agreed drift re-runs the live search on that key alone.

The test plays the framework: each step it reports one call per plan key through the recorder's host-timed
entry (as the torch tap does for a blocking call), with a duration it chooses, and sleeps the step's time.
The drift tests also set the step's time the session measures (``StepTimer``): a loaded machine's sleeps
overshoot, which the monitor rightly reads as a drift of the whole step.
"""

from __future__ import annotations

import math
import time

import pytest

import lagom.runtime.online.session as session_module
from lagom.plan.plan import PlanEntry
from lagom.runtime.online.session import TuningSession
from lagom.runtime.online.state import SessionOptions
from lagom.tune import make_plan
from tests.test_capability import tiny_job

STEP_S = 0.04
SLOW = 3.0  # the drifted key's calls, this many times their time before


_untuned: dict[int, list[PlanEntry]] = {}


def called(session: TuningSession) -> list[PlanEntry]:
    """The collectives a step calls: the plan's keys; before the first plan (an online job starts on the
    framework's own settings), the modelled keys at NCCL's own settings."""
    if session.plan is not None:
        return session.plan.entries
    if id(session) not in _untuned:
        _untuned[id(session)] = make_plan(session.workload, session.hw, "nccl").entries  # type: ignore[arg-type]
    return _untuned[id(session)]


class StepTimer:
    """The session's step timer (its ``time.perf_counter``), advanced by the test by each step's time."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def timer(monkeypatch: pytest.MonkeyPatch) -> StepTimer:
    step_timer = StepTimer()
    monkeypatch.setattr(session_module, "time", step_timer)
    return step_timer


def run_steps(session: TuningSession, steps: int, timer: StepTimer, slow_key: str | None = None) -> None:
    entries = called(session)
    for _ in range(steps):
        session.begin_step()
        start = time.perf_counter()
        for e in entries:
            seconds = STEP_S / len(entries) * (SLOW if e.key == slow_key else 1.0) / 4
            session.runtime.recorder.ended(e.group, e.collective, e.bytes, start, start + seconds)
        step_s = STEP_S * (2.0 if slow_key else 1.0)
        timer.now += step_s
        time.sleep(step_s)  # the live loop's own clock (``StepClock``) still reads the host's
        session.end_step()


def drift_on(session: TuningSession, key: str, timer: StepTimer) -> None:
    """Steady steps (the monitor's baseline), then ``key`` slower until the agreed drift starts a re-tune."""
    run_steps(session, 10, timer)
    assert not session.tuning_underway
    for _ in range(60):
        run_steps(session, 1, timer, slow_key=key)
        if session.tuning_underway:
            return
    raise AssertionError(f"no re-tune started: {session.events[-3:]}")


def test_a_drift_on_one_key_re_tunes_that_key_alone_on_live_steps(tmp_path, timer) -> None:
    wl, hw = tiny_job(tmp_path)
    options = SessionOptions(mode="online", tune_steps=12, cache_dir=tmp_path / "cache", drift_check_steps=5)
    session = TuningSession(wl, hw, options, world_size=8)
    session.start()
    try:
        run_steps(session, 4, timer)
        while session.tuning_underway:  # calibration, then the live search (budget: 7 steps)
            run_steps(session, 1, timer)
            assert session.steps_seen < 200, "online tuning did not end"
        assert session.off is None, session.off
        first_round = len(session.trials)
        slow = sorted(e.key for e in session.plan.entries)[0]  # type: ignore[union-attr]
        drift_on(session, slow, timer)
        assert session.live_on and not session.tuning, session.events[-3:]
        assert any(f"re-tuning {slow} on live steps" in e for e in session.events), session.events[-3:]
        assert session.live is not None and session.live.only == {slow}
        while session.live_on:
            run_steps(session, 1, timer, slow_key=slow)
            assert session.steps_seen < 400, "the drift's live search did not end"
        assert session.off is None, session.off
        assert session.live_summary["keys"] == [slow]
        second = session.trials[first_round:]
        assert all(set(t.changed) <= {slow} for t in second)
        assert [t.id for t in session.trials] == [f"t{n}" for n in range(1, len(session.trials) + 1)]
    finally:
        session.close()


def test_without_a_calibrated_model_a_drift_on_one_key_re_tunes_the_whole_loop(tmp_path, timer) -> None:
    """A plan from the cache was never calibrated in this process: there is no model to rank the drifted key's
    candidates, so the drift re-runs the calibration steps and then the search, as for any other drift."""
    wl, hw = tiny_job(tmp_path)
    options = SessionOptions(mode="online", tune_steps=12, cache_dir=tmp_path / "cache", drift_check_steps=5)
    first = TuningSession(wl, hw, options, world_size=8)
    first.start()
    try:
        while first.steps_seen < 4 or first.tuning_underway:
            run_steps(first, 1, timer)
    finally:
        first.close()
    session = TuningSession(wl, hw, options, world_size=8)
    session.start()
    try:
        assert session.plan_source.startswith("tuned by an earlier online run") and not session.tuning
        drift_on(session, sorted(e.key for e in session.plan.entries)[0], timer)  # type: ignore[union-attr]
        assert session.tuning and not session.live_on
        assert "re-tuning from the next 5 steps" in session.events[-1]
        assert session.off is None, session.off
    finally:
        session.close()


def test_a_device_clock_that_reads_steps_late_judges_each_setting_by_its_own_steps(tmp_path) -> None:
    """On a GPU a step's time is known a few steps after it ends (``StepClock.lag``). The live loop then judges
    the step that many back, and skips steps that ran the settings before a switch: each trial's steps ran
    that trial's settings. Here the host clock is read with the GPU's lag, and the step's time is a known
    function of the channels in force (a plant)."""
    from lagom.runtime.apply.step_clock import DEVICE_LAG, StepClock

    wl, hw = tiny_job(tmp_path)
    options = SessionOptions(mode="online", tune_steps=30, cache_dir=tmp_path / "cache")
    session = TuningSession(wl, hw, options, world_size=8)
    session.start()
    session.clock = StepClock(cuda=False, lag=DEVICE_LAG)
    in_force: dict[int, dict[str, int]] = {}
    try:
        while session.steps_seen < 5 or session.tuning_underway:
            session.begin_step()
            in_force_now = session.router.plan.entries if session.router.plan is not None else called(session)
            channels = {e.key: e.config.channels for e in in_force_now}
            in_force[session.iteration] = channels
            time.sleep(0.01 + 0.01 * sum(abs(math.log2(c) - 2) for c in channels.values()))
            session.end_step()
            assert session.steps_seen < 400, "online tuning did not end"
        assert session.off is None, session.off
        assert session.trials, "the live search tried nothing"
        for t in session.trials:
            for step in t.steps:
                for key, config in t.changed.items():
                    assert in_force[step][key] == config["channels"], (t.id, step, key)
    finally:
        session.close()
