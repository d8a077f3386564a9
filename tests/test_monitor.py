"""The monitor: quiet on steady steps, one reason per drift, new collective sizes reported once."""

from __future__ import annotations

import logging
import random
import re

import pytest

from lagom.errors import ConfigError
from lagom.runtime.online.monitor import Monitor
from lagom.step.calls import CallRecord


def records(*keys: str) -> list[CallRecord]:
    out = []
    for seq, key in enumerate(keys):
        group, coll, size = key.rsplit("/", 2)
        out.append(CallRecord(group, coll, int(size), seq, 0, 0.0, 1e-3))
    return out


def test_steady_noisy_steps_stay_quiet():
    rng = random.Random(0)
    mon = Monitor(expected_step_s=1.0, bound_s=0.86)
    steady = records("dp/all_reduce/1048576", "tp/all_gather/65536")
    reasons = [mon.observe(1.0 + rng.uniform(-0.04, 0.04), steady) for _ in range(200)]
    assert reasons == [None] * 200
    assert mon.baseline == pytest.approx(0.86, abs=0.04)


def test_drift_is_reported_once_then_rebaselined(caplog):
    mon = Monitor(expected_step_s=1.0, bound_s=0.86, threshold=0.1, warmup=3, window=20)
    for _ in range(8):
        assert mon.observe(1.0) is None
    assert mon.baseline == pytest.approx(0.86)
    with caplog.at_level(logging.WARNING, logger="lagom.monitor"):
        slow = [mon.observe(1.3) for _ in range(40)]
    fired = [i for i, r in enumerate(slow) if r]
    # Window mean of 5 fast (0.86) and k slow (0.6615) steps drops below 0.86 * 0.9 = 0.774 at k = 4.
    assert fired == [3]
    assert slow[3] == "overlap efficiency 0.77 < baseline 0.86 - 10%: re-tune (workload or network changed)"
    assert caplog.messages == [slow[3]]
    assert mon.baseline == pytest.approx(0.86 / 1.3)  # the new regime is the new baseline


def test_a_single_slow_step_is_not_a_drift():
    mon = Monitor(expected_step_s=1.0, bound_s=0.9, warmup=3, window=10)
    for _ in range(10):
        mon.observe(1.0)
    assert mon.observe(3.0) is None
    assert [mon.observe(1.0) for _ in range(20)] == [None] * 20


def test_new_sizes_against_the_plan_keys_are_reported_once():
    plan_keys = ["dp/all_reduce/1000000", "tp/all_gather/65536"]
    mon = Monitor(expected_step_s=1.0, bound_s=0.8, keys=plan_keys)
    padded = records("dp/all_reduce/1024000", "tp/all_gather/65536")  # megatron-style padding: same key
    assert mon.observe(1.0, padded) is None
    reason = mon.observe(1.0, padded + records("dp/all_reduce/123"))
    assert reason == "new collective sizes seen: dp/all_reduce/123 (not in the plan)"
    assert mon.observe(1.0, padded + records("dp/all_reduce/123")) is None


def test_without_plan_keys_the_warmup_keys_are_the_reference():
    mon = Monitor(expected_step_s=1.0, bound_s=0.8, warmup=3)
    base = records("dp/reduce_scatter/4096")
    for _ in range(3):
        assert mon.observe(1.0, base) is None
    keys = [f"dp/all_gather/{n}" for n in range(10, 17)]
    reason = mon.observe(1.0, base + records(*keys))
    assert re.fullmatch(r"new collective sizes seen: dp/all_gather/10, dp/all_gather/11, dp/all_gather/12, "
                        r"dp/all_gather/13, dp/all_gather/14 and 2 more \(not seen during warm-up\)", reason)


def test_drift_and_new_keys_in_one_step_give_both_reasons():
    mon = Monitor(expected_step_s=1.0, bound_s=0.9, warmup=1, window=1, keys=["dp/all_reduce/8"])
    assert mon.observe(1.0, records("dp/all_reduce/8")) is None
    reason = mon.observe(2.0, records("dp/all_reduce/8", "ep/all_to_all/64"))
    assert reason.startswith("new collective sizes seen: ep/all_to_all/64 (not in the plan); overlap efficiency 0.45")


@pytest.mark.parametrize("kwargs, key", [
    ({"threshold": 1.5}, "Monitor.threshold"), ({"warmup": 0}, "Monitor.warmup"), ({"bound_s": 0.0}, "Monitor.bound_s"),
])
def test_bad_settings_name_the_key(kwargs, key):
    args = {"expected_step_s": 1.0, "bound_s": 0.5, **kwargs}
    with pytest.raises(ConfigError, match=re.escape(key)):
        Monitor(**args)


def timed(durations: dict[str, float]) -> list[CallRecord]:
    """One call per key, each taking its given seconds."""
    out = []
    for seq, (key, seconds) in enumerate(durations.items()):
        group, coll, size = key.rsplit("/", 2)
        out.append(CallRecord(group, coll, int(size), seq, 0, 0.0, seconds))
    return out


def test_a_drift_is_put_down_to_the_keys_whose_calls_got_slower():
    plan_keys = ["dp/all_reduce/1000000", "tp/all_gather/65536", "pp/send_recv/4096"]
    mon = Monitor(expected_step_s=1.0, bound_s=0.9, threshold=0.1, warmup=3, window=4, keys=plan_keys)
    steady = {"dp/all_reduce/1024000": 0.02, "tp/all_gather/65536": 0.01, "pp/send_recv/4096": 0.005}
    for _ in range(5):
        assert mon.observe(1.0, timed(steady)) is None
    # the data-parallel all-reduce is 3x slower per call (a congested link), the others as before
    slow = dict(steady, **{"dp/all_reduce/1024000": 0.06})
    reasons = [mon.observe(1.3, timed(slow)) for _ in range(6)]
    fired = [r for r in reasons if r]
    assert len(fired) == 1 and fired[0].endswith("slower per call: dp/all_reduce/1000000")
    assert mon.drifted == frozenset({"dp/all_reduce/1000000"})


def test_a_drift_no_key_accounts_for_asks_for_a_whole_re_tune():
    mon = Monitor(expected_step_s=1.0, bound_s=0.9, threshold=0.1, warmup=2, window=2, keys=["dp/all_reduce/8"])
    for _ in range(3):
        mon.observe(1.0, timed({"dp/all_reduce/8": 0.01}))
    reasons = [mon.observe(1.5, timed({"dp/all_reduce/8": 0.0105})) for _ in range(3)]  # compute slowed, not the call
    assert any(reasons) and mon.drifted is None
    assert not any("slower per call" in r for r in reasons if r)


def test_without_plan_keys_a_slower_key_is_named_as_the_job_issues_it():
    mon = Monitor(expected_step_s=1.0, bound_s=0.9, threshold=0.1, warmup=2, window=2)
    for _ in range(3):
        mon.observe(1.0, timed({"dp/all_reduce/4096": 0.01, "tp/all_gather/64": 0.01}))
    for _ in range(3):
        mon.observe(1.4, timed({"dp/all_reduce/4096": 0.01, "tp/all_gather/64": 0.05}))
    assert mon.drifted == frozenset({"tp/all_gather/64"})
