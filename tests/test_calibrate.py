"""`lagom calibrate`: real gloo collectives on 2 ranks -> a profile load_hardware accepts; exact fits."""

from __future__ import annotations

import argparse
from dataclasses import asdict

import pytest

from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.model.cost_model import ring_shape
from lagom.runtime.measure import calibrate
from tests.distributed import run_ranks

BASE = "a100-8x-100g"


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return parser.parse_args(list(argv))


def check_profile(path, world: int) -> None:
    hw = load_hardware(str(path))
    base = load_hardware(BASE)
    cal = hw.calibration
    assert hw.name == f"{BASE}-calibrated" and hw.gpu == base.gpu and hw.contention == base.contention
    assert hw.cluster.intra.gbps > 0 and hw.cluster.intra.latency_us >= 0
    assert hw.cluster.intra.gbps == calibrate.link_override(cal["fit"], base)["gbps"]
    assert hw.cluster.inter == base.cluster.inter  # only the measured link changes
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        assert [b for b, _ in cal[coll]] == [16384, 16777216]
        assert all(s > 0 for _, s in cal[coll])
        assert cal["fit"][coll]["latency_us"] > 0 and cal["fit"][coll]["gbps"] > 0
    measured = cal["measured"]
    assert measured["backend"] == "gloo" and measured["world_size"] == world and measured["torch"]
    assert "untouched" in measured["contention"]
    assert "contention" in path.read_text().splitlines()[1].lower()


def test_calibrate_spawns_two_ranks_and_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "prof.yaml"
    assert calibrate.run(args("--base", BASE, "--out", str(out), "--sizes", "16K,16M", "--iters", "5",
                              "--backend", "gloo")) == 0
    check_profile(out, world=2)
    assert f"wrote {out}: intra link" in capsys.readouterr().out


def _calibrate_in_job(rank: int, world_size: int, out: str) -> int:
    return calibrate.run(args("--base", BASE, "--out", out, "--sizes", "16K,16M", "--iters", "5"))


@pytest.mark.slow  # two gloo ranks calibrating inside a running job (9 s): CI's slower tier
def test_calibrate_uses_the_ranks_of_a_running_job(tmp_path):
    out = tmp_path / "job.yaml"
    assert run_ranks(_calibrate_in_job, 2, str(out)) == [0, 0]
    check_profile(out, world=2)


def test_fit_recovers_latency_and_bandwidth_exactly():
    world, latency_s, gbps = 8, 20e-6, 50.0
    samples = {}
    for coll in calibrate.COLLECTIVES:
        steps, factor = ring_shape(coll, world, "ring")
        samples[coll.value] = [[b, steps * latency_s + b * factor / (gbps * 1e9)] for b in (4096, 1 << 20, 64 << 20)]
    fits = calibrate.fit(samples, world)
    for coll, f in fits.items():
        assert f["latency_us"] == pytest.approx(20.0, rel=1e-4) and f["gbps"] == pytest.approx(50.0, rel=1e-4), coll
    base = load_hardware(BASE)
    link = calibrate.link_override(fits, base)
    # all_reduce has 14 steps of 20 us, the others 7, 7 and 1; less NCCL's ring Simple base latency per call
    # spread over them and its per-step latency.
    call_us, step_us = base.nccl.base_latency_us, base.nccl.protocols["Simple"].latency_us
    per_step = sorted((20.0 * s - call_us) / s - step_us for s in (14, 7, 7, 1))
    assert link["gbps"] == pytest.approx(50.0, rel=1e-4)
    assert link["latency_us"] == pytest.approx((per_step[1] + per_step[2]) / 2, rel=1e-4)


def test_fit_refuses_times_that_do_not_grow_with_size():
    with pytest.raises(Exception, match="does not grow with the message size"):
        calibrate.fit({"all_reduce": [[4096, 2e-3], [1 << 20, 1e-3]]}, 2)


def test_bad_flags_are_config_errors():
    with pytest.raises(ConfigError, match="--sizes"):
        calibrate.parse_sizes("4K,lots")
    with pytest.raises(ConfigError, match="--sizes"):
        calibrate.parse_sizes("4K")
    assert calibrate.parse_sizes("64M, 4k,1MiB") == [4096, 1 << 20, 64 << 20]
    with pytest.raises(ConfigError, match="hardware"):
        calibrate.run(args("--base", "no-such-preset"))
    with pytest.raises(ConfigError, match="--backend"):
        calibrate.run(args("--base", BASE, "--backend", "nccl"))
    assert asdict(load_hardware(BASE))  # the base preset itself is untouched by any of this
