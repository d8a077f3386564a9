"""Contention profiling: the fit recovers known constants, `lagom calibrate --contention` runs end to end on 2
gloo ranks (measure, fit, profile, validate --measured), the comm-like kernel is exact under Triton's
interpreter, a CPU profile is never offered for a GPU, and bad flags exit 2 with one line."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from lagom import nccl_tuner
from lagom.cli import main
from lagom.hardware import closest_preset, load_hardware, preset_names
from lagom.model import contention
from lagom.model.contention import ContentionSample, KernelShape, fit, is_held_out, predict, with_constants
from lagom.model.cost_model import CostModel
from lagom.plan.comm_config import CommConfig
from lagom.resources import HARDWARE_PATH_ENV
from lagom.runtime.measure import calibrate
from lagom.runtime.measure.contention_bench import rule_table
from lagom.step.graph import Collective
from lagom.validate import measured_results, summarize

BASE = "a100-8x-100g"
TRUTH = {"gemm_slots_per_comm_cta": 0.5, "hbm_interference": 1.7, "l2_interference": 0.6,
         "comm_slowdown_per_hbm_util": 0.9}


def synthetic(truth: dict[str, float], kernels: list[KernelShape], noise: float, seed: int = 7) -> list[ContentionSample]:
    """Samples as a machine with ``truth`` constants would give them, each time off by ``noise`` (relative)."""
    hw = with_constants(load_hardware(BASE), truth)
    model, rng = CostModel(hw), random.Random(seed)
    out = []
    for kernel in kernels:
        seg = kernel.segment(hw)
        for coll in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
            for channels in (2, 8, 32):
                for chunk in (131072, 2097152):
                    cfg = CommConfig(channels=channels, chunk_bytes=chunk)
                    s = ContentionSample(f"{kernel.label}/{coll}/{channels}/{chunk}", kernel, coll, 64 << 20, 8, 1, cfg,
                                         "synthetic", 1.0, 1.0, 1.0, 1.0)
                    alone = model.comm_time(coll, s.group, s.bytes, cfg)
                    s = replace(s, comm_alone_s=alone,
                                comm_beside_s=model.comm_time(coll, s.group, s.bytes, cfg, model.hbm_util(seg)))
                    kernel_ratio, _ = predict(model, s)
                    solo = model.compute_solo(seg)
                    jitter = [1 + rng.gauss(0, noise) for _ in range(3)]
                    out.append(replace(s, kernel_alone_s=solo * jitter[0], kernel_beside_s=solo * kernel_ratio * jitter[1],
                                       comm_beside_s=s.comm_beside_s * jitter[2]))
    return out


KERNELS = [KernelShape(gemm=(4096, 4096, 4096)), KernelShape(gemm=(1024, 1024, 8192)), KernelShape(elements=1 << 26)]


@pytest.mark.slow  # a fit of every constant to hundreds of samples (10 s): CI's slower tier
def test_the_fit_recovers_known_constants_from_noisy_samples() -> None:
    samples = synthetic(TRUTH, KERNELS, noise=0.005)
    result = fit(samples, load_hardware(BASE))
    for key, value in TRUTH.items():
        assert result.constants[key] == pytest.approx(value, rel=0.15, abs=0.05), key
    assert not result.constants.get("persistent_gemm", 0.0)  # the truth's GEMMs are not persistent
    assert set(result.fit_ids).isdisjoint(result.held_out_ids)
    assert sorted(result.fit_ids + result.held_out_ids) == sorted(s.id for s in samples)
    assert result.held_out_ids == [s.id for s in samples if is_held_out(s.id)]
    fitted, estimate = result.held_out["fitted"], result.held_out["estimate"]
    assert fitted["median"] < 0.02 and fitted["median"] < estimate["median"] / 3
    assert fitted["max"] < estimate["max"]


def test_constants_the_samples_do_not_inform_keep_the_bases() -> None:
    """Only memory-bound kernels: nothing tells residency or the GEMM schedule, so the profile leaves them out."""
    samples = synthetic(TRUTH, [KernelShape(elements=1 << 26), KernelShape(elements=1 << 24)], noise=0.0)
    result = fit(samples, load_hardware(BASE))
    assert {"gemm_slots_per_comm_cta", "persistent_gemm"} <= set(result.uninformed)
    overrides = contention.profile_overrides(result, {"device": "test"})
    assert "gemm_slots_per_comm_cta" not in overrides["contention"] and "gpu" not in overrides
    assert overrides["contention"]["source"] == "measured"
    assert overrides["contention"]["measured"]["points"] == result.fit_ids
    assert overrides["contention"]["hbm_interference"] == pytest.approx(TRUTH["hbm_interference"], rel=0.05)


def test_samples_round_trip_and_bad_ones_are_refused() -> None:
    (s, *_) = synthetic(TRUTH, KERNELS[:1], noise=0.0)
    assert ContentionSample.from_dict(s.to_dict()) == s
    with pytest.raises(Exception, match="not a contention sample"):
        ContentionSample.from_dict({"id": "x"})
    with pytest.raises(Exception, match="not positive"):
        ContentionSample.from_dict({**s.to_dict(), "comm_alone_s": 0.0})


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    calibrate.add_arguments(parser)
    return parser.parse_args(list(argv))


CPU_FLAGS = ("--contention", "--gemms", "96x96x96,192x256x64", "--elements", "32K", "--comm-bytes", "256K",
             "--channels", "1,4", "--chunks", "512K", "--protocols", "Simple", "--repeats", "3", "--budget-s", "120")


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("presets")
    out = folder / "a100-0-cpu-calibrated.yaml"
    assert calibrate.run(args("--base", BASE, "--out", str(out), "--name", out.stem, "--sizes", "16K,16M",
                              "--iters", "3", "--backend", "gloo", *CPU_FLAGS)) == 0
    return out


def test_calibrate_contention_on_two_gloo_ranks_measures_fits_and_writes_a_profile(cpu_profile: Path) -> None:
    hw, base = load_hardware(str(cpu_profile)), load_hardware(BASE)
    section = hw.calibration["contention"]
    samples = [ContentionSample.from_dict(row) for row in section["samples"]]
    # two channel counts, then the one chunk that is not the default: 3 settings x 3 collectives x 3 kernels
    assert len(samples) == 27 and len({s.id for s in samples}) == 27
    assert {s.source for s in samples} == {"gloo"} and {s.ranks for s in samples} == {2}
    assert {s.config.channels for s in samples} == {1, 4, base.nccl.default_channels}
    assert {s.kernel.label for s in samples} == {"gemm-96x96x96", "gemm-192x256x64", "elementwise-32768"}
    assert sorted(section["fit"]["fit_ids"] + section["fit"]["held_out_ids"]) == sorted(s.id for s in samples)
    assert hw.contention.source == "measured"
    assert hw.contention.measured["device_type"] == "cpu" and hw.contention.measured["backend"] == "gloo"
    assert hw.contention.measured["points"] == section["fit"]["fit_ids"] and hw.contention.measured["torch"]
    for key, value in section["fit"]["constants"].items():  # what the fit set is what the planner reads
        target = hw.gpu if key == "persistent_gemm" else hw.contention
        assert getattr(target, key) == pytest.approx(value, rel=1e-3)
    for key in section["fit"]["uninformed"]:
        target, origin = (hw.gpu, base.gpu) if key == "persistent_gemm" else (hw.contention, base.contention)
        assert getattr(target, key) == getattr(origin, key)
    assert hw.cluster.intra.gbps > 0 and hw.gpu.name == base.gpu.name


def test_validate_measured_reads_the_profile(cpu_profile: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = measured_results(cpu_profile)
    section = load_hardware(str(cpu_profile)).calibration["contention"]
    assert len(results) == 2 * len(section["samples"])
    assert {r.role for r in results} == {"fit", "check"}
    assert sum(r.role == "check" for r in results) == 2 * len(section["fit"]["held_out_ids"])
    assert set(summarize(results)) == {"contention-kernel", "contention-comm"}
    assert main(["validate", "--measured", str(cpu_profile.parent)]) == 0  # a folder of profiles too
    assert "contention-kernel: fit median" in capsys.readouterr().out


def test_a_cpu_profile_is_never_offered_for_a_gpu(cpu_profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HARDWARE_PATH_ENV, str(cpu_profile.parent))
    assert cpu_profile.stem in preset_names()
    for layout in ({}, {"gpus_per_node": 8, "nodes": 1}, {"gpus_per_node": 2, "nodes": 1}):
        assert closest_preset("NVIDIA A100-SXM4-80GB", **layout) not in (None, cpu_profile.stem)


COMM_KERNEL_CHECK = textwrap.dedent("""
    import torch
    from lagom.runtime.measure.comm_kernel import stream_chunks
    torch.manual_seed(0)
    for n, ctas, chunk in ((10_000, 3, 4096), (4097, 8, 1024), (300, 1, 4), (2048, 64, 512)):
        src, other = torch.randn(n), torch.randn(n)
        dst = torch.full((n,), float("nan"))
        stream_chunks(src, dst, ctas=ctas, chunk_bytes=chunk)
        assert torch.equal(dst, src), (n, ctas, chunk)
        stream_chunks(src, dst, ctas=ctas, chunk_bytes=chunk, other=other, threads=256)
        assert torch.equal(dst, src + other), (n, ctas, chunk)
    print("exact")
""")


def test_the_comm_like_kernel_copies_and_reduces_exactly_under_tritons_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", COMM_KERNEL_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "exact", done.stderr[-2000:]


@pytest.mark.parametrize(("flag", "value"), [
    ("--repeats", "0"), ("--budget-s", "-1"), ("--budget-s", "nan"), ("--gemms", "12x"), ("--gemms", "0x4x4"),
    ("--channels", "0"), ("--channels", "two"), ("--chunks", "1Q"), ("--protocols", "XYZ"), ("--elements", "abc"),
    ("--comm-bytes", "-5"), ("--workload", "no-such-workload"),
])
def test_bad_contention_flags_exit_2_with_one_line(flag: str, value: str, capsys: pytest.CaptureFixture[str],
                                                  tmp_path: Path) -> None:
    argv = ["calibrate", "--base", BASE, "--out", str(tmp_path / "p.yaml"), "--contention", flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag.lstrip("-") in err.replace("--workload", "workload"), err
    assert not (tmp_path / "p.yaml").exists()


def test_one_rank_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["calibrate", "--base", BASE, "--out", str(tmp_path / "p.yaml"), "--contention", "--ranks", "1"]) == 2
    err = capsys.readouterr().err
    assert "--ranks" in err and "GPU" in err


def test_a_workload_gives_its_layer_gemms_at_its_tp_and_its_activation_size() -> None:
    """gpt2-tp8: 8 x 1024 tokens, hidden 3072, 32 heads, ffn 12288, tp 8 (hand-computed shapes)."""
    settings = calibrate.bench_settings(args("--base", BASE, "--contention", "--workload", "gpt2-tp8"),
                                        load_hardware(BASE))
    assert [k.gemm for k in settings.kernels[:-1]] == [(8192, 1152, 3072), (8192, 3072, 384), (8192, 1536, 3072),
                                                        (8192, 3072, 1536)]
    assert settings.kernels[-1].elements == 128 << 20
    assert set(settings.comm_bytes.values()) == {8192 * 3072 * 2}
    channels = [c.channels for c in settings.configs()]
    assert channels[:7] == [1, 2, 4, 8, 16, 32, 64]  # the channel sweep comes first: a short budget measures it


@pytest.mark.skipif(nccl_tuner.path() is None, reason=nccl_tuner.UNAVAILABLE)
def test_a_samples_setting_reaches_the_tuner_plugins_table(tmp_path: Path) -> None:
    """What a sample runs with is what the plugin gives NCCL for that call (buffers rounded to whole elements)."""
    from lagom.nccl_tuner.live import LiveTable, RuleChoice

    table = LiveTable.create(2, tmp_path)
    try:
        cfg = CommConfig(channels=4, protocol="LL128", chunk_bytes=131072)
        table.put(rule_table(2, Collective.REDUCE_SCATTER, 262144, 1, cfg))
        assert table.lookup("reduce_scatter", 262144 - 8, 2, 1) == RuleChoice("ring", "ll128", 4, 131072)
        assert table.lookup("all_gather", 262144, 2, 1) is None  # other collectives stay NCCL's
    finally:
        table.close()
