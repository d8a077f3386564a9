"""Hardware detection: GPU names to presets (torch-free), the job's layout, and a real 2-rank gloo
calibration where no preset fits (CPU), cached and read back, the same on every rank."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from lagom.errors import ConfigError
from lagom.hardware import closest_preset, gpu_family, load_hardware, with_cluster
from lagom.runtime.measure.calibrate import link_override
from lagom.runtime.measure.probe import FALLBACK_PRESET, Facts, from_preset, resolve_hardware
from tests.distributed import run_ranks


@pytest.mark.parametrize("gpu, nvlink, expected", [
    ("NVIDIA A100-SXM4-80GB", None, "a100-8x-100g"),
    ("NVIDIA A100 80GB PCIe", None, "a100-8x-100g"),  # the only A100 presets have NVLink
    ("NVIDIA A40", True, "a40-2x8-nvlink"),
    ("NVIDIA A40", False, "a40-2x8-pcie"),
    ("NVIDIA H100 80GB HBM3", None, "h100-sxm-8x-400g"),
    ("Tesla V100-SXM2-32GB", None, "v100-4x-25g"),
    ("NVIDIA A10", None, None),  # not an A100
    ("NVIDIA H200", None, "h200-sxm-8x-400g"),
    ("NVIDIA B200", None, None),
    ("NVIDIA GeForce RTX 4090", None, None),
    ("AMD Instinct MI300X", None, None),
])
def test_gpu_names_map_to_the_closest_preset(gpu, nvlink, expected):
    assert closest_preset(gpu, nvlink=nvlink, gpus_per_node=8, nodes=1) == expected
    if expected:
        assert gpu_family(load_hardware(expected).gpu.name) == gpu_family(gpu)


def test_among_presets_of_one_gpu_the_layout_decides():
    assert closest_preset("NVIDIA A100-SXM4-80GB", gpus_per_node=8, nodes=2) == "a100-2x8-100g"
    assert closest_preset("NVIDIA A100-SXM4-80GB", gpus_per_node=8, nodes=1) == "a100-8x-100g"


def test_with_cluster_resizes_and_changes_the_fingerprint():
    base = load_hardware("a100-8x-100g")
    assert with_cluster(base, 8, 1) is base
    big = with_cluster(base, 8, 4)
    assert (big.name, big.cluster.world_size) == ("a100-8x-100g-4x8", 32)
    assert (big.cluster.intra, big.gpu) == (base.cluster.intra, base.gpu)
    assert big.fingerprint() not in (base.fingerprint(), with_cluster(base, 4, 8).fingerprint())
    with pytest.raises(ConfigError, match=r"^hardware\.cluster: "):
        with_cluster(base, 0, 1)


def facts(gpu: str | None, world: int = 16, per_node: int = 8, nvlink: bool | None = None) -> Facts:
    return Facts(world_size=world, gpus_per_node=per_node, nodes=world // per_node, gpu_name=gpu, nvlink=nvlink,
                 host="node0", layout_note="LOCAL_WORLD_SIZE")


def test_a_known_gpu_gets_its_preset_sized_to_the_job():
    choice = from_preset(facts("NVIDIA A100-SXM4-80GB", world=32))
    assert choice is not None and choice.source == "preset"
    hw = choice.hardware
    assert (hw.cluster.gpus_per_node, hw.cluster.nodes, hw.gpu.sms) == (8, 4, 108)
    assert "GPU 'NVIDIA A100-SXM4-80GB' matches preset a100-" in choice.reason
    assert "4 node(s) x 8 GPUs (LOCAL_WORLD_SIZE)" in choice.reason and "NVML not available" in choice.reason


def test_nvml_saying_no_nvlink_replaces_the_presets_link():
    choice = from_preset(facts("NVIDIA H100 80GB HBM3", nvlink=False))
    assert choice is not None
    pcie = load_hardware("a40-2x8-pcie").cluster.intra  # the first preset with a PCIe link within a node
    assert choice.hardware.cluster.intra == pcie and choice.hardware.gpu.sms == 132
    assert "NVML reports no NVLink, so the pcie link of a40-2x8-pcie" in choice.reason


def test_an_unknown_gpu_or_a_cpu_matches_no_preset():
    assert from_preset(facts("NVIDIA B200")) is None
    assert from_preset(facts(None)) is None


def test_explicit_hardware_wins_and_its_errors_name_hardware(tmp_path):
    choice = resolve_hardware("v100-4x-25g", 4, cache_dir=tmp_path)
    assert (choice.source, choice.hardware.name) == ("explicit", "v100-4x-25g")
    with pytest.raises(ConfigError, match=r"^hardware: unknown hardware 'nope'"):
        resolve_hardware("nope", 4, cache_dir=tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match=r"^hardware: bad\.yaml: holds a list"):
        resolve_hardware(str(bad), 4, cache_dir=tmp_path)


def test_before_torch_distributed_exists_the_fallback_is_assumed_for_the_jobs_layout(tmp_path):
    choice = resolve_hardware(None, 16, cache_dir=tmp_path, local_world_size=8)  # this machine has no GPU
    hw = choice.hardware
    assert choice.source == "assumed" and hw.name == f"{FALLBACK_PRESET}-2x8"
    assert (hw.cluster.gpus_per_node, hw.cluster.nodes) == (8, 2)
    assert choice.reason == (f"no GPU and torch.distributed is not initialised yet, so nothing could be measured: "
                             f"assumed {FALLBACK_PRESET}'s figures for 2 node(s) x 8 ranks (source: assumed; "
                             "name the hardware for a better plan)")
    assert not any(tmp_path.iterdir())  # nothing measured, nothing cached


def _detect(rank: int, world_size: int, cache_dir: str, empty_dir: str) -> dict:
    import time

    start = time.perf_counter()
    measured = resolve_hardware(None, world_size, cache_dir=Path(cache_dir), budget_s=8.0)
    took = time.perf_counter() - start
    cached = resolve_hardware(None, world_size, cache_dir=Path(cache_dir))
    no_time = resolve_hardware(None, world_size, cache_dir=Path(empty_dir), budget_s=0.0)
    try:
        resolve_hardware("no-such-preset", world_size, cache_dir=Path(cache_dir))
        error = ""
    except ConfigError as err:
        error = str(err)
    return {"took": took, "error": error,
            **{name: (c.source, c.hardware.fingerprint(), c.hardware.cluster.world_size, c.reason)
               for name, c in (("measured", measured), ("cached", cached), ("no_time", no_time))}}


@pytest.mark.slow  # two gloo ranks measuring the machine (8 s): CI's slower tier
def test_two_gloo_ranks_measure_cache_and_agree(tmp_path):
    cache, empty = tmp_path / "cache", tmp_path / "empty"
    ranks = run_ranks(_detect, 2, str(cache), str(empty))
    first, second = ranks
    for key in ("measured", "cached", "no_time", "error"):
        assert first[key] == second[key], key  # rank 0 decided, every rank got the same answer
    source, fingerprint, world, reason = first["measured"]
    assert (source, world) == ("measured", 2) and first["took"] < 10
    assert reason.startswith("no GPU: intra-node link measured by a ") and "gloo calibration of the job's collectives" in reason
    host = re.sub(r"[^A-Za-z0-9.]+", "-", socket.gethostname()).strip("-")
    path = cache / f"hardware-{host}-cpu-1x2.yaml"
    assert f"cached in {path}" in reason and sorted(cache.iterdir()) == [path]
    profile = load_hardware(str(path))
    measured_on = profile.calibration["measured"]
    assert (measured_on["backend"], measured_on["world_size"], measured_on["link"]) == ("gloo", 2, "intra")
    assert set(profile.calibration["fit"]) <= {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    link = link_override(profile.calibration["fit"], load_hardware(FALLBACK_PRESET))
    assert (profile.cluster.intra.gbps, profile.cluster.intra.latency_us) == (link["gbps"], link["latency_us"])
    assert profile.gpu == load_hardware(FALLBACK_PRESET).gpu
    assert first["cached"][:3] == ("cached", fingerprint, 2)
    assert first["no_time"][0] == "assumed" and "no collective was measured at two sizes" in first["no_time"][3]
    assert not any(empty.glob("*.yaml"))
    assert first["error"].startswith("hardware: unknown hardware 'no-such-preset'")
    # A later job on this node, before its process groups exist, reads the same profile.
    later = resolve_hardware(None, 2, cache_dir=cache)
    assert (later.source, later.hardware.fingerprint()) == ("cached", fingerprint)
