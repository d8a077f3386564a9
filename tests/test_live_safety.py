"""Lagom never turns a passing run into a hang: failures injected into the live loop of a real session on 2 gloo
ranks, each with its own copy of the tuner plugin, as on a cluster.

The test plays the framework (as tests/test_drift_retune.py does): each step reports one call per plan key
through the recorder and sleeps. After every step each rank reads, through the plugin's own C reader, the rule
its NCCL would give each planned collective; the ranks' readings must be the same at every step, whatever
fails: a rank that cannot open a live table, a table that cannot be staged on one rank, a receiver that times
out in rank 0's broadcast, a search slower than a step, ranks that start from different cached plans.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lagom import nccl_tuner
from lagom.hardware import load_hardware
from lagom.nccl_tuner.live import LIVE_TABLE_ENV, LiveTable
from lagom.runtime.apply.control import ControlError
from lagom.runtime.online.session import TuningSession
from lagom.runtime.online.state import SessionOptions
from lagom.step.workload import load_workload
from lagom.tune import make_plan
from tests.distributed import free_port, run_ranks
from tests.helpers import gpt_workload, write_yaml
from tests.test_long_lived import HW

pytestmark = pytest.mark.skipif(nccl_tuner.path() is None, reason="needs the tuner plugin built (a C compiler)")
STEP_S = 0.02


def job(tmp: str) -> tuple[Any, Any]:
    """A 2-rank data-parallel job on two A100s; each process writes its own files (ranks start together)."""
    hw_file = Path(tmp) / f"hw-{os.getpid()}.yaml"
    hw_file.write_text(HW)
    wl = load_workload(write_yaml(Path(tmp) / f"w-{os.getpid()}.yaml",
                                  gpt_workload(parallel={"tp": 1, "dp": 2, "sequence_parallel": False})))
    return wl, load_hardware(str(hw_file))


def options(tmp: str, rank: int, **overrides: Any) -> SessionOptions:
    values: dict[str, Any] = dict(mode="online", tune_steps=24, cache_dir=Path(tmp) / f"cache-{rank}",
                                  collective_timeout_s=20, drift_check_steps=1000)
    return SessionOptions(**(values | overrides))


def job_entries(session: TuningSession) -> list[Any]:
    """The collectives the job calls each step: the plan's in force, else (an online job starts with no plan and
    runs on NCCL's own settings until the calibrated search makes one) those of NCCL's own plan of the job."""
    if session.plan is not None:
        return list(session.plan.entries)
    assert session.workload is not None and session.hw is not None
    return list(make_plan(session.workload, session.hw, "nccl").entries)


def rules_now(session: TuningSession, reader: LiveTable) -> tuple:
    """The rule the plugin in this process gives each collective of the job now (None: NCCL's own choice)."""
    return tuple(reader.lookup(e.collective, e.bytes, e.group_size, e.group_nodes) for e in job_entries(session))


def run(session: TuningSession, reader: LiveTable, steps: int) -> tuple[list[tuple], list[float]]:
    """``steps`` steps; the rules in force after each, and how long each step's end hook took."""
    seen, hooks = [], []
    for _ in range(steps):
        session.begin_step()
        start = time.perf_counter()
        for e in job_entries(session):
            session.runtime.recorder.ended(e.group, e.collective, e.bytes, start, start + STEP_S / 10)
        time.sleep(STEP_S)
        began = time.perf_counter()
        session.end_step()
        hooks.append(time.perf_counter() - began)
        seen.append(rules_now(session, reader))
    return seen, hooks


def reader_table(tmp: str) -> LiveTable:
    """A table object of this process's plugin, only to read rules through ``lookup`` (it never stages)."""
    return LiveTable.create(2, Path(tmp))


def one_rank_cannot_open_a_table(rank: int, world: int, tmp: str) -> dict[str, Any]:
    reader = reader_table(tmp)
    if rank == 1:  # e.g. its TMPDIR cannot be written
        LiveTable.create = classmethod(lambda cls, *a, **k: (_ for _ in ()).throw(OSError("TMPDIR not writable")))
    wl, hw = job(tmp)
    session = TuningSession(wl, hw, options(tmp, rank), world_size=world)
    session.start()
    try:
        seen, _ = run(session, reader, 40)
        return {"seen": seen, "off": session.off, "table": session.live_table is not None,
                "events": session.events, "underway": session.tuning_underway, "tuned": len(session.tuned)}
    finally:
        session.close()
        reader.close()


@pytest.mark.slow  # a pair of ranks through the whole live loop (about 18 s): CI's slower tier
def test_a_rank_without_a_live_table_turns_live_switching_off_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = run_ranks(one_rank_cannot_open_a_table, 2, str(tmp_path))
    assert r0["seen"] == r1["seen"], "the ranks' plugins gave different rules at some step"
    assert all(rules == r0["seen"][-1] for rules in r0["seen"]) and set(r0["seen"][-1]) == {None}  # never switched
    assert r0["tuned"] >= 1 and r1["tuned"] >= 1  # ... though the online search made a plan, adopted at one step
    assert r0["off"] is None and r1["off"] is None and not r0["underway"]
    assert not r0["table"] and not r1["table"]
    assert any("a rank has no live tuner table" in e for e in r0["events"])


def staging_fails_on_one_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    reader = reader_table(tmp)
    wl, hw = job(tmp)
    session = TuningSession(wl, hw, options(tmp, rank), world_size=world)
    session.start()
    stage = LiveTable.stage
    staged: list[Any] = []

    def full_disk(table: LiveTable, rules: str | None) -> None:
        staged.append(rules)
        if rank == 1 and rules is not None and len(staged) >= 2:  # the reference stages; the first candidate cannot
            raise OSError(28, "No space left on device")
        stage(table, rules)

    LiveTable.stage = full_disk  # type: ignore[method-assign]
    try:
        seen, _ = run(session, reader, 40)
        return {"seen": seen, "off": session.off, "staged": len(staged)}
    finally:
        LiveTable.stage = stage  # type: ignore[method-assign]
        session.close()
        reader.close()


def test_a_table_one_rank_cannot_stage_is_published_on_no_rank(tmp_path: Path) -> None:
    r0, r1 = run_ranks(staging_fails_on_one_rank, 2, str(tmp_path))
    assert r0["seen"] == r1["seen"], "the ranks' plugins gave different rules at some step"
    assert r0["staged"] >= 2, "no candidate was staged: the test did not reach the failure"
    assert any(any(rule is not None for rule in rules) for rules in r0["seen"])  # the reference was in force ...
    assert set(r0["seen"][-1]) == {None}  # ... and after the refused switch, the start rules on every rank
    assert "could not be staged" in r0["off"] and "could not be staged" in r1["off"]
    assert "No space left on device" in r1["off"]


def a_receiver_times_out(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Rank 1 receives rank 0's first live candidate, then its wait is made to time out, as a gloo broadcast can
    succeed on the root while a receiver gives up; rank 0's search is slowed past several steps too."""
    reader = reader_table(tmp)
    wl, hw = job(tmp)
    session = TuningSession(wl, hw, options(tmp, rank, collective_timeout_s=5), world_size=world)
    if rank == 0:
        search = session._new_tuner().__class__._search

        def slow(tuner: Any, budget: Any = None) -> dict[str, Any]:  # the search beside the job, in its thread
            time.sleep(10 * STEP_S)
            return search(tuner, budget)

        session._new_tuner().__class__._search = slow  # type: ignore[method-assign]
    session.start()
    broadcast = session.control.broadcast

    def times_out(value: Any, what: str) -> Any:
        got = broadcast(value, what)
        if rank == 1 and "live decision" in what and got.configs is not None and session.live_on \
                and session._epoch > 1:
            session.control.broken = "timed out"
            session.control._destroy()
            raise ControlError(f"{what}: timed out (injected)")
        return got

    session.control.broadcast = times_out  # type: ignore[method-assign]
    try:
        seen, hooks = run(session, reader, 45)
        return {"seen": seen, "off": session.off, "hooks": hooks, "tuned": len(session.tuned)}
    finally:
        session.close()
        reader.close()


@pytest.mark.slow  # a pair of ranks through the live loop and a 5 s timeout (about 12 s): CI's slower tier
def test_a_receiver_timeout_switches_no_rank_alone_and_no_hook_waits_for_a_search(tmp_path: Path) -> None:
    r0, r1 = run_ranks(a_receiver_times_out, 2, str(tmp_path))
    assert r0["seen"] == r1["seen"], "a rank switched alone"
    assert r1["off"] and "timed out (injected)" in r1["off"]
    assert r0["off"], "rank 0 did not notice its peer had gone"
    assert r0["tuned"] >= 1  # the slowed search's plan was adopted, at a later step
    # rank 0's search took 10 steps: no step hook waited for it (the agreement's own gloo calls are milliseconds;
    # rank 0's wait for its vanished peer is the one long hook, bounded by the 5 s timeout)
    assert sorted(r1["hooks"])[-1] < 5 * STEP_S
    assert sorted(r0["hooks"])[-2] < 5 * STEP_S


def different_caches(rank: int, world: int, tmp: str, port: int) -> dict[str, Any]:
    """Megatron's start: no process group yet, each rank with its own (different) cached plan; rank 0's is agreed
    once a group exists."""
    wl, hw = job(tmp)
    cache = Path(tmp) / f"cache-{rank}"
    cache.mkdir(exist_ok=True)
    plan = make_plan(wl, hw, "nccl" if rank == 0 else "lagom")
    plan.save(cache / f"{wl.fingerprint()}-{hw.fingerprint()}-w{world}.json")
    dist.destroy_process_group()  # as before megatron's init_process_group
    session = TuningSession(wl, hw, options(tmp, rank), world_size=world)
    session.start()
    before = (session.plan, dict(session.runtime.env_set), os.environ.get(nccl_tuner.RULES_FILE_ENV))
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    session.agree_start()
    rules = Path(os.environ[nccl_tuner.RULES_FILE_ENV]).read_text() if nccl_tuner.RULES_FILE_ENV in os.environ else ""
    env = {k: v for k, v in session.runtime.env_set.items() if k != LIVE_TABLE_ENV}  # each process's own table
    out = {"before": before, "strategy": session.plan.strategy if session.plan else None, "rules": rules,
           "env": env, "source": session.plan_source, "tuning": session.tuning}
    session.close()
    return out


@pytest.mark.slow  # a pair of ranks that re-form their group (about 12 s): CI's slower tier
def test_ranks_with_different_cached_plans_start_on_rank_0s(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    r0, r1 = run_ranks(different_caches, 2, str(tmp_path), free_port())
    for out in (r0, r1):
        assert out["before"] == (None, {}, None), "NCCL's settings were set before the ranks agreed"
    assert r0["strategy"] == r1["strategy"] == "nccl"
    assert r0["rules"] and r0["rules"] == r1["rules"]
    assert r0["env"] and r0["env"] == r1["env"] and r0["tuning"] == r1["tuning"] and r0["source"] == r1["source"]


# -- one process (a world of 8 planned, as tests/test_drift_retune.py): what each rank decides alone ---------------
def one_process_session(tmp_path: Path, **overrides: Any) -> TuningSession:
    from tests.test_capability import tiny_job

    wl, hw = tiny_job(tmp_path)
    session = TuningSession(wl, hw, options(str(tmp_path), 0, **overrides), world_size=8)
    session.start()
    return session


def until_live(session: TuningSession, reader: LiveTable) -> None:
    """Steps until the calibration and rank 0's search are over (the live loop starts next)."""
    while session.steps_seen < 5 or session.tuning or session.searching:
        run(session, reader, 1)


def test_where_nccl_never_consults_the_plugin_only_routing_is_tried_live_and_the_report_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job on NCCL whose NCCL never called the plugin while calibrating (no NCCL here: the counters stay at 0)."""
    from lagom.runtime.online.live import ROUTED_FIELDS

    monkeypatch.setattr(TuningSession, "_nccl_backend", lambda self: True)
    session = one_process_session(tmp_path)
    reader = reader_table(str(tmp_path))
    try:
        until_live(session, reader)
        assert session.nccl_listens is False and session.live_on
        assert session.live is not None and session.live.fields == ROUTED_FIELDS
        assert any("did not consult Lagom's tuner plugin" in e for e in session.events)
        while session.tuning_underway:
            run(session, reader, 1)
        reference = {k: c.to_dict() for k, c in session.live_reference.configs().items()}  # type: ignore[union-attr]
        moved = {f for t in session.trials for k, c in t.changed.items() for f, v in c.items() if reference[k][f] != v}
        assert moved <= set(ROUTED_FIELDS), moved
        calls = session.report()["nccl_plugin"]
        assert calls == {"communicators": 0, "coll_infos_per_step": 0.0, "applied_per_step": 0.0,
                         "consulted_while_calibrating": False}
        from lagom.runtime.online import report
        assert "NCCL never consulted it while calibrating" in report.markdown(session.report())
    finally:
        session.close()
        reader.close()


def test_the_first_step_under_an_algorithm_new_to_the_job_is_not_judged(tmp_path: Path) -> None:
    from dataclasses import replace

    session = one_process_session(tmp_path)
    reader = reader_table(str(tmp_path))
    try:
        until_live(session, reader)
        assert session.live_on
        configs = session.plan.configs()  # type: ignore[union-attr]
        key = next(iter(configs))
        same = dict(configs)
        assert session._put_live(same) and session.iteration + 1 not in session._first_steps  # nothing new
        other = "tree" if configs[key].algorithm != "tree" else "ring"
        assert session._put_live({**configs, key: replace(configs[key], algorithm=other)})
        first = session.iteration + 1
        assert first in session._first_steps
        session.begin_step()
        session.end_step()  # the live loop judges this step at the agreement: not ready
        assert session.live is not None and first not in session.live._window.steps
    finally:
        session.close()
        reader.close()


def test_a_session_closed_mid_tuning_leaves_its_table_until_the_next_session_starts(tmp_path: Path) -> None:
    """Ranks close at different moments, so a closing session changes no table; the next session of the process
    puts the start rules back at its own (agreed) start."""
    first = one_process_session(tmp_path)
    reader = reader_table(str(tmp_path))
    try:
        until_live(first, reader)
        assert first.live_on
        in_force = rules_now(first, reader)
        assert any(rule is not None for rule in in_force)
        first.close()
        assert rules_now(first, reader) == in_force
        (tmp_path / "second").mkdir()
        second = one_process_session(tmp_path / "second", mode="offline")
        second.close()
        assert set(rules_now(first, reader)) == {None}
        assert any("earlier session's live tuner table" in e for e in second.events)
    finally:
        first.close()
        reader.close()
