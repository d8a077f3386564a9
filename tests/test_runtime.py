"""The runtime: the recorder on real gloo collectives, plan options on group creation, NCCL env handling."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lagom import runtime
from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.plan.comm_config import CommConfig
from lagom.plan.emit import nccl_env
from lagom.plan.plan import Plan, PlanEntry
from lagom.runtime import Recorder, init, nccl_options
from lagom.runtime.apply.recorder import STALE_STEPS
from lagom.step.calls import CallRecord, KeyIndex, TuningKey
from tests.distributed import run_ranks

HW = "a100-8x-100g"
REAL_NEW_GROUP = dist.new_group
BIG = 1 << 22  # floats: 16 MiB, so a gloo all-reduce takes milliseconds


def make_plan(world_size: int = 2) -> Plan:
    """dp: two sizes wanting 2 and 4 CTAs; tp: 8 CTAs on a high-priority stream."""
    hw = load_hardware(HW)

    def entry(group: str, coll: str, nbytes: int, cfg: CommConfig) -> PlanEntry:
        return PlanEntry(key=f"{group}/{coll}/{nbytes}", group=group, group_size=world_size, group_nodes=1,
                         collective=coll, bytes=nbytes, count=1, points=[], config=cfg, predicted_comm_s=1e-3)

    entries = [
        entry("dp", "all_reduce", 1 << 20, CommConfig(channels=4, threads=256, chunk_bytes=512 * 1024)),
        entry("dp", "all_reduce", 4096, CommConfig(channels=2, threads=256, chunk_bytes=512 * 1024)),
        entry("tp", "all_gather", 65536, CommConfig(channels=8, priority=1, threads=256, chunk_bytes=512 * 1024)),
    ]
    return Plan(workload="unit", workload_fingerprint="0" * 16, hardware=hw.name, hardware_fingerprint=hw.fingerprint(),
                world_size=world_size, strategy="lagom", entries=entries, predicted_step_s={"lagom": 0.1})


@pytest.fixture(autouse=True)
def _no_runtime_left(monkeypatch):
    for var in ("NCCL_BUFFSIZE", "NCCL_NTHREADS", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    yield
    if runtime.current() is not None:
        runtime.current().close()


# -- recorder on real collectives


def _record_step(rank: int, world_size: int) -> dict:
    rec = Recorder(cuda=False)
    peer = 1 - rank
    rec.begin_step(7)
    big = torch.ones(BIG)
    work = dist.all_reduce(big, async_op=True)
    t = time.perf_counter()
    handed = rec.track("dp", "all_reduce", big.numel() * 4, work)
    track_s = time.perf_counter() - t
    done_after_track = work.get_future().done()
    gathered = torch.empty(2 * 1024)
    ag = dist.all_gather_into_tensor(gathered, torch.full((1024,), float(rank)), async_op=True)
    rec.track("tp", "all_gather", gathered.numel() * 4, ag)
    rs_in = torch.ones(4096)
    rs = rec.track("dp", "reduce_scatter", rs_in.numel() * 4,
                   dist.reduce_scatter_tensor(torch.empty(2048), rs_in, async_op=True))
    p2p = torch.full((256,), float(rank))
    sent = dist.isend(p2p, peer) if rank == 0 else dist.irecv(p2p, peer)
    p2p_handle = rec.track("pp", "send_recv", p2p.numel() * 4, sent)
    dist.barrier()
    rec.track("dp", "barrier", 0)
    for w in (handed, ag, rs, p2p_handle):
        w.wait()
    first = rec.end_step()
    rec.begin_step(8)
    rec.track("dp", "all_reduce", big.numel() * 4, dist.all_reduce(big, async_op=True)).wait()
    second = rec.end_step()
    return {"track_s": track_s, "done_after_track": done_after_track, "same_work": handed is work,
            "proxy": type(rs).__name__, "first": first, "second": second, "summary": rec.summary(),
            "gathered": gathered.tolist()[::1024], "p2p": p2p[0].item(), "pending": rec.pending}


def test_recorder_times_async_gloo_collectives_without_waiting():
    for out in run_ranks(_record_step, 2):
        assert out["done_after_track"] is False, "track must not wait for the collective"
        assert out["track_s"] < 0.05  # microseconds normally; the 16 MiB all-reduce takes milliseconds
        assert out["same_work"] and out["proxy"] == "_TimedWork"
        assert out["gathered"] == [0.0, 1.0] and out["p2p"] == 0.0  # collectives ran unchanged
        first = out["first"]
        assert [r.key for r in first] == [f"dp/all_reduce/{BIG * 4}", "tp/all_gather/8192", "dp/reduce_scatter/16384",
                                          "pp/send_recv/1024", "dp/barrier/0"]
        assert [r.seq for r in first] == [0, 1, 2, 3, 4] and {r.step for r in first} == {7}
        assert all(0 <= r.start_s <= r.end_s for r in first)
        ar = first[0]
        assert ar.exact and ar.duration_s > 0
        assert [r.exact for r in first] == [True, True, False, False, True]
        assert first[4].duration_s == 0.0  # no work: ends when tracked
        assert [(r.step, r.seq) for r in out["second"]] == [(8, 0)]
        assert out["summary"][f"dp/all_reduce/{BIG * 4}"]["count"] == 2
        assert out["summary"]["pp/send_recv/1024"]["count"] == 1
        assert out["pending"] == 0


def test_a_completed_call_no_longer_holds_its_outputs():
    """The recorder drops a call's future once it completes: the future holds the call's outputs, which the
    framework may free long before the step ends (a gathered parameter)."""
    import gc
    import weakref

    rec = Recorder(cuda=False)
    rec.begin_step(0)
    work = _FutureWork()
    output = torch.ones(1024)
    alive = weakref.ref(output)
    rec.track("dp", "all_gather", 4096, work)
    work.future.set_result([output])
    del work, output
    gc.collect()
    assert alive() is None, "the recorder kept a completed call's output alive"
    [record] = rec.end_step()
    assert record.exact and record.duration_s >= 0


class _FutureWork:
    """A work whose completion the test controls."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def get_future(self) -> torch.futures.Future:
        return self.future


def test_unfinished_call_is_kept_and_reported_in_a_later_step():
    rec = Recorder(cuda=False)
    rec.begin_step(0)
    late = _FutureWork()
    rec.track("dp", "all_gather", 100, late)
    rec.track("dp", "all_reduce", 200)
    assert [r.key for r in rec.end_step()] == ["dp/all_reduce/200"]
    assert rec.pending == 1
    rec.begin_step(1)
    late.future.set_result(None)
    out = rec.end_step()
    assert [(r.key, r.step, r.seq) for r in out] == [("dp/all_gather/100", 0, 0)]
    assert out[0].end_s > out[0].start_s >= 0 and rec.pending == 0
    assert [r.key for r in rec.records] == ["dp/all_reduce/200", "dp/all_gather/100"]


def test_a_call_that_never_completes_is_dropped_after_stale_steps(caplog):
    rec = Recorder(cuda=False)
    rec.begin_step(0)
    rec.track("dp", "all_gather", 100, _FutureWork())
    rec.begin_step(STALE_STEPS)
    assert rec.end_step() == [] and rec.pending == 1
    rec.begin_step(STALE_STEPS + 1)
    with caplog.at_level(logging.WARNING, logger="lagom.runtime"):
        assert rec.end_step() == []
    assert rec.pending == 0 and "dropping 1 calls that never completed" in caplog.text


class _FakeEvent:
    """Stands in for torch.cuda.Event: timestamps from a counter, reached once ``clock`` passes them."""

    clock = 0.0
    reached = -1.0
    made = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None
        _FakeEvent.made += 1

    def record(self) -> None:
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def query(self) -> bool:
        return self.t is not None and self.t <= _FakeEvent.reached

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an unfinished event would synchronise"
        return (end.t - self.t) * 1000.0  # 1 s per tick, in ms

    def synchronize(self) -> None:
        raise AssertionError("the recorder must not synchronise")


def test_cuda_path_uses_events_and_never_synchronises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize called"))
    _FakeEvent.clock, _FakeEvent.reached = 0.0, -1.0
    rec = Recorder(cuda=True)
    rec.begin_step(3)  # event t=1
    work = _FutureWork()
    rec.track("tp", "all_gather", 64, work)  # start t=2
    rec.track("tp", "all_reduce", 32)  # start=end t=3
    work.future.set_result(None)  # callback records the end event: t=4
    _FakeEvent.reached = 3.0  # the GPU has passed the sync call, not the all-gather's end
    assert [(r.key, r.start_s, r.end_s) for r in rec.end_step()] == [("tp/all_reduce/32", 2.0, 2.0)]
    assert rec.pending == 1
    _FakeEvent.reached = 10.0
    out = rec.end_step()
    assert [(r.key, r.step, r.start_s, r.end_s) for r in out] == [("tp/all_gather/64", 3, 1.0, 3.0)]


def test_step_clock_reads_device_steps_once_their_events_complete(monkeypatch):
    from lagom.runtime.apply.step_clock import DEVICE_LAG, StepClock

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronize called"))
    _FakeEvent.clock, _FakeEvent.reached = 0.0, -1.0
    clock = StepClock(cuda=True)
    assert clock.lag == DEVICE_LAG and StepClock(cuda=False).lag == 0
    clock.begin(1)  # t=1
    clock.end(1)  # t=2
    clock.begin(2)  # t=3
    _FakeEvent.clock += 2.0  # the step runs two ticks on the device
    clock.end(2)  # t=6
    assert clock.seconds(1) is None and clock.seconds(2) is None  # the device has not got there: never waited for
    _FakeEvent.reached = 2.0
    assert clock.seconds(1) == 1.0 and clock.seconds(2) is None
    _FakeEvent.reached = 6.0
    assert clock.seconds(2) == 3.0
    assert clock.seconds(7) is None  # a step never begun


def test_key_index_matches_padded_sizes_only():
    index = KeyIndex(["dp/all_reduce/1000000", "dp/all_reduce/4096", "tp/all_gather/65536"], tolerance=0.05)
    assert index.match("dp/all_reduce/1024000") == "dp/all_reduce/1000000"
    assert index.match("dp/all_reduce/4096") == "dp/all_reduce/4096"
    assert index.match("dp/all_reduce/2000000") is None
    assert index.match("dp/reduce_scatter/4096") is None
    assert CallRecord("a/b", "all_gather", 5, 0, 0, 0.0, 1.0).key == "a/b/all_gather/5"



def test_a_call_record_is_made_read_compared_and_shown_as_the_dataclass_was():
    r = CallRecord("a/b", "all_gather", 5, 2, 7, 0.25, 1.0)
    assert r == CallRecord(group="a/b", collective="all_gather", nbytes=5, seq=2, step=7, start_s=0.25, end_s=1.0,
                           exact=True, tensors=1)  # the defaults
    assert r != CallRecord("a/b", "all_gather", 5, 2, 7, 0.25, 1.0, exact=False)
    assert r != CallRecord("a/b", "all_gather", 5, 2, 7, 0.25, 1.0, tensors=2)
    assert repr(r) == ("CallRecord(group='a/b', collective='all_gather', nbytes=5, seq=2, step=7, start_s=0.25, "
                       "end_s=1.0, exact=True, tensors=1)")
    assert (r.group, r.collective, r.nbytes, r.seq, r.step, r.start_s, r.end_s, r.exact, r.tensors) == (
        "a/b", "all_gather", 5, 2, 7, 0.25, 1.0, True, 1)
    assert (r.duration_s, r.key, r.tuning_key) == (0.75, "a/b/all_gather/5", TuningKey("a/b", "all_gather", 5))
    with pytest.raises(AttributeError):
        r.end_s = 2.0  # type: ignore[misc]  # read-only: nothing may change a record others hold
    rec = Recorder(cuda=False)
    rec.begin_step(3)
    rec.track("dp", "all_reduce", 200)
    rec.ended("dp", "all_gather", 100, 0.5, 0.25, tensors=2)
    got = rec.end_step()
    assert all(type(g) is CallRecord for g in got + rec.records)
    assert [(g.key, g.seq, g.step, g.exact, g.tensors) for g in got] == [("dp/all_reduce/200", 0, 3, True, 1),
                                                                        ("dp/all_gather/100", 1, 3, True, 2)]
    assert got == rec.records and got[1].duration_s == 0.0  # an end before the start: the start


# -- init: options, env, wrapper


def test_options_carry_the_plan_values_and_env_is_exported_then_restored():
    plan = make_plan()
    rt = init(plan)
    assert runtime.current() is rt and rt.hw is not None and rt.hw.name == HW
    dp, tp = rt.options_for("dp"), rt.options_for("tp")
    assert (dp.config.max_ctas, dp.config.min_ctas, dp.is_high_priority_stream) == (4, 2, False)
    assert (tp.config.max_ctas, tp.config.min_ctas, tp.is_high_priority_stream) == (8, 8, True)
    assert rt.options_for("TENSOR_MODEL_PARALLEL_GROUP").config.max_ctas == 8  # megatron's group_desc
    assert rt.options_for("pp") is None
    wanted = nccl_env(plan, rt.hw)
    assert wanted == {"NCCL_BUFFSIZE": str(4 << 20), "NCCL_NTHREADS": "256"}  # never below NCCL's default
    assert {k: os.environ[k] for k in wanted} == wanted == rt.env_set
    rt.close()
    assert runtime.current() is None
    assert not any(k in os.environ for k in wanted)


def test_new_group_gets_pg_options_for_nccl_and_other_arguments_untouched(monkeypatch):
    calls = []
    real = dist.new_group
    signature = inspect.signature(real)

    @functools.wraps(real)
    def spy(*args, **kwargs):
        calls.append(dict(signature.bind(*args, **kwargs).arguments))
        return "group"

    for owner in (dist, dist.distributed_c10d):
        monkeypatch.setattr(owner, "new_group", spy)
    rt = init(make_plan())
    assert dist.new_group is not spy and dist.distributed_c10d.new_group is dist.new_group
    assert dist.new_group([0, 1], timedelta(seconds=7), "nccl", group_desc="tp") == "group"
    options = calls[-1].pop("pg_options")
    assert calls[-1] == {"ranks": [0, 1], "timeout": timedelta(seconds=7), "backend": "nccl", "group_desc": "tp"}
    assert options.config.max_ctas == 8 and options.is_high_priority_stream
    dist.new_group(ranks=[0, 1], backend="nccl", group_desc="EMBEDDING_GROUP", use_local_synchronization=True)
    assert calls[-1] == {"ranks": [0, 1], "backend": "nccl", "group_desc": "EMBEDDING_GROUP",
                         "use_local_synchronization": True}
    dist.new_group(ranks=[0, 1], backend="gloo", group_desc="dp")
    assert "pg_options" not in calls[-1]  # gloo takes no NCCL options ...
    assert rt.group_options["dp"].config.max_ctas == 4  # ... but they are built and recorded
    mine = nccl_options({"max_ctas": 1, "min_ctas": 1})
    dist.new_group(ranks=[0, 1], backend="nccl", group_desc="dp", pg_options=mine)
    assert calls[-1]["pg_options"] is mine  # the caller's own options win
    assert rt.applied_groups == {"tp"}
    rt.close()
    assert dist.new_group is spy and dist.distributed_c10d.new_group is spy


def _groups_under_plan(rank: int, world_size: int) -> dict:
    rt = init(make_plan(world_size))
    group = dist.new_group([0, 1], group_desc="dp")
    other = dist.new_group([0, 1], group_desc="mine")
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=group)
    dist.all_reduce(t, group=other)
    out = {"sum": t[0].item(), "built": sorted(rt.group_options), "applied": sorted(rt.applied_groups),
           "max_ctas": rt.group_options["dp"].config.max_ctas, "min_ctas": rt.group_options["dp"].config.min_ctas}
    rt.close()
    out["restored"] = dist.new_group is REAL_NEW_GROUP and dist.distributed_c10d.new_group is REAL_NEW_GROUP
    return out


def test_groups_created_on_gloo_record_the_plan_options():
    for out in run_ranks(_groups_under_plan, 2):
        assert out == {"sum": 6.0, "built": ["dp"], "applied": [], "max_ctas": 4, "min_ctas": 2, "restored": True}


def test_env_conflict_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("NCCL_BUFFSIZE", "123")
    with pytest.raises(ConfigError, match="NCCL_BUFFSIZE"):
        init(make_plan())
    assert runtime.current() is None and dist.new_group is REAL_NEW_GROUP


def test_env_conflict_warns_and_continues_when_not_strict(monkeypatch, caplog):
    monkeypatch.setenv("NCCL_BUFFSIZE", "123")
    with caplog.at_level(logging.WARNING, logger="lagom.runtime"):
        rt = init(make_plan(), strict_env=False)
    assert any("NCCL_BUFFSIZE=123 overrides the plan" in m for m in caplog.messages)
    assert os.environ["NCCL_BUFFSIZE"] == "123" and os.environ["NCCL_NTHREADS"] == "256"
    assert rt.env_set == {"NCCL_NTHREADS": "256"}
    rt.close()
    assert os.environ["NCCL_BUFFSIZE"] == "123" and "NCCL_NTHREADS" not in os.environ


def test_plan_for_another_world_size_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="plan.world_size"):
        init(make_plan(world_size=2))


def test_plan_file_is_loaded_and_no_plan_only_records(tmp_path):
    path = tmp_path / "plan.json"
    make_plan().save(path)
    rt = init(str(path))
    assert rt.plan is not None and rt.plan.entries[2].config.priority == 1
    rt.close()
    bare = init(None)
    assert bare.plan is None and bare.options_for("dp") is None and bare.env_set == {}
    assert dist.new_group is REAL_NEW_GROUP and "NCCL_BUFFSIZE" not in os.environ
    assert isinstance(bare.recorder, Recorder)


def test_init_again_closes_the_previous_runtime():
    first = init(make_plan())
    second = init(make_plan())
    assert runtime.current() is second and first._closed  # noqa: SLF001
    assert runtime.apply.runtime.open_runtimes() == [second] and dist.new_group.__wrapped__ is REAL_NEW_GROUP
    second.close()
    assert dist.new_group is REAL_NEW_GROUP


def test_runtimes_open_side_by_side_share_the_environment_until_the_last_closes():
    """Two sessions (engines) alive at once: closing one leaves the other's NCCL variables and group hook."""
    first = runtime.apply.runtime.open_runtime(make_plan())
    second = None
    try:
        exported = dict(first.env_set)
        assert exported and all(os.environ[k] == v for k, v in exported.items())
        second = runtime.apply.runtime.open_runtime(make_plan())
        assert second.env_set == exported and runtime.apply.runtime.open_runtimes() == [first, second]
        first.close()
        assert all(os.environ[k] == v for k, v in exported.items()) and dist.new_group.__wrapped__ is REAL_NEW_GROUP
    finally:
        first.close()
        if second is not None:
            second.close()
    assert not any(k in os.environ for k in exported) and dist.new_group is REAL_NEW_GROUP
    assert runtime.apply.runtime.exported() == {} and runtime.apply.runtime.open_runtimes() == []


def test_nccl_options_rejects_bad_values():
    with pytest.raises(ConfigError, match="min_ctas"):
        nccl_options({"max_ctas": 2, "min_ctas": 4})
    with pytest.raises(ConfigError, match="max_ctas"):
        nccl_options({"max_ctas": 0, "min_ctas": 0})
    with pytest.raises(ConfigError, match="bogus"):
        nccl_options({"bogus": 1})
    opts = nccl_options({"max_ctas": 16, "min_ctas": 2, "cga_cluster_size": 2, "net_name": "IB"})
    assert (opts.config.max_ctas, opts.config.min_ctas, opts.config.cga_cluster_size) == (16, 2, 2)


def _init_records_through_the_tap(rank: int, world: int) -> dict:
    import lagom
    from lagom.runtime.apply import torch_tap as tap
    rt = lagom.init(None)
    group = dist.new_group([0, 1], group_desc="dp")
    rt.recorder.begin_step(1)
    dist.all_reduce(torch.ones(1000), group=group)
    records = rt.recorder.end_step()
    subscribed = tap.current_tap() is not None
    rt.close()
    return {"records": [(r.group, r.collective, r.nbytes) for r in records], "subscribed": subscribed,
            "after_close": tap.current_tap() is not None}


def test_init_alone_records_every_collective_in_a_step():
    """``lagom.init()`` without an adapter: the torch.distributed tap records under the group's group_desc."""
    for out in run_ranks(_init_records_through_the_tap, 2):
        assert out == {"records": [("dp", "all_reduce", 4000)], "subscribed": True, "after_close": False}


def _init_logs_the_plans_coverage(rank: int, world: int) -> dict:
    import logging

    import lagom

    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("lagom").addHandler(Said())
    logging.getLogger("lagom").setLevel(logging.INFO)
    rt = lagom.init(make_plan(world), strict_env=False)
    group = dist.new_group([0, 1], group_desc="dp")
    rt.recorder.begin_step(1)
    dist.all_reduce(torch.ones(1024), group=group)  # 4096 bytes: a key of the plan
    dist.all_reduce(torch.ones(3000), group=group)  # 12000 bytes: no key
    rt.recorder.end_step()
    covered = rt.coverage()
    rt.close()
    return {"coverage": (covered.calls, covered.bytes) if covered else None,
            "said": [s for s in said if s.startswith("the plan's keys were")]}


def test_init_says_how_much_of_what_ran_the_plan_describes():
    """``lagom.init()`` has no session to report for it: at close it logs the share of the recorded calls and bytes
    that were keys of its plan, and what to do when the plan missed them."""
    for out in run_ranks(_init_logs_the_plans_coverage, 2):
        assert out["coverage"] == (0.5, 4096 / (4096 + 12000))
        assert out["said"] == ["the plan's keys were 50% of calls, 25% of bytes recorded in this process; run online "
                               "(or tune on a workload that matches the job) so that the plan's settings reach the "
                               "calls that happen"]


def test_the_recorder_keeps_the_last_records_within_a_quarter_more_and_summarises_every_step() -> None:
    rec = Recorder(cuda=False, max_records=8)
    for step in range(30):
        rec.begin_step(step)
        now = time.perf_counter()
        rec.ended("dp", "all_reduce", 1000 + step, now, now + 1e-4)
        rec.end_step()
        assert len(rec.records) <= 8 + 8 // 4
    assert len(rec.records) >= 8
    assert [r.nbytes for r in rec.records][-8:] == [1000 + s for s in range(22, 30)]  # the latest, in order
    assert sum(row["count"] for row in rec.summary().values()) == 30  # the summary covers every step
