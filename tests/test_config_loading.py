"""Hardware presets and workload YAMLs: strict schemas and layout checks with clear errors."""

import pytest

from lagom.errors import ConfigError
from lagom.hardware import load_hardware, preset_names
from lagom.step.workload import load_workload, validate
from tests.helpers import gpt_workload, write_yaml

REQUIRED_PRESETS = {"a100-8x-100g", "v100-4x-25g", "a40-2x8-nvlink", "a40-2x8-pcie", "h100-sxm-8x-400g"}


def test_required_presets_load_with_datasheet_figures():
    assert REQUIRED_PRESETS <= set(preset_names())
    a100 = load_hardware("a100-8x-100g")
    assert (a100.gpu.sms, a100.gpu.peak_tflops, a100.cluster.world_size) == (108, 312.0, 8)
    assert a100.cluster.inter.gbps == 12.5  # 100 Gbps
    pcie = load_hardware("a40-2x8-pcie")  # inherits the A40 GPU from its base, overrides the links
    assert pcie.gpu.sms == 84 and pcie.cluster.intra.kind == "pcie" and pcie.cluster.world_size == 16
    assert all(load_hardware(n).contention.source in ("estimate", "measured") for n in preset_names())


def test_hardware_file_with_base_overrides_only_what_it_names(tmp_path):
    f = write_yaml(tmp_path / "two.yaml", {"base": "a100-8x-100g", "name": "two", "cluster": {"gpus_per_node": 2}})
    hw = load_hardware(str(f))
    assert hw.cluster.world_size == 2 and hw.gpu.sms == 108 and hw.name == "two"
    assert hw.fingerprint() != load_hardware("a100-8x-100g").fingerprint()


@pytest.mark.parametrize("data, key", [
    ({"base": "a100-8x-100g", "gpu": {"smz": 3}}, "gpu.smz"),
    ({"base": "a100-8x-100g", "gpu": {"sms": -1}}, "gpu.sms"),
])
def test_bad_hardware_files_name_the_key(tmp_path, data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_hardware(str(write_yaml(tmp_path / "hw.yaml", data)))


def test_unknown_hardware_lists_the_presets():
    with pytest.raises(ConfigError, match="unknown hardware 'nope'.*a100-8x-100g"):
        load_hardware("nope")


def test_workload_loads_and_counts_microbatches(tmp_path):
    wl = load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload()))
    assert wl.world_size == 8 and wl.microbatches == 2
    validate(wl, 8)


@pytest.mark.parametrize("override, key", [
    ({"model": {"layerz": 3}}, "model.layerz"),
    ({"model": {"heads": 6}}, "parallel.tp"),  # tp=4 does not divide 6 heads
    ({"model": {"hidden": -256}}, "model.hidden"),
    ({"parallel": {"pp": 3}}, "parallel.pp"),
    ({"parallel": {"zero_stage": 3}}, "parallel.zero_stage"),
    ({"training": {"dtype": "fp8"}}, "training.dtype"),
    ({"parallel": {"ep": 2}}, "parallel.ep"),
])
def test_bad_workloads_name_the_key(tmp_path, override, key):
    data = gpt_workload(**override)
    data["parallel"]["tp"] = 4
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_workload(write_yaml(tmp_path / "w.yaml", data))


def test_layout_must_match_the_cluster(tmp_path):
    wl = load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload()))
    with pytest.raises(ConfigError, match=r"dp\*tp\*pp\*cp=8 but the cluster has 16 GPUs"):
        validate(wl, 16)


def test_every_bucket_size_deepspeed_accepts_is_accepted(tmp_path):
    """stage3_prefetch_bucket_size 0 turns ZeRO-3 prefetching off in DeepSpeed; a negative one is a typo."""
    data = gpt_workload(parallel={"zero_stage": 3, "dp": 8, "tp": 1, "sequence_parallel": False},
                        framework={"name": "deepspeed", "prefetch_bucket_size": 0})
    assert load_workload(write_yaml(tmp_path / "w.yaml", data)).framework.prefetch_bucket_size == 0
    data["framework"]["prefetch_bucket_size"] = -1
    with pytest.raises(ConfigError, match=r"^framework\.prefetch_bucket_size: must be 0 \(no prefetch\) to "):
        load_workload(write_yaml(tmp_path / "w.yaml", data))


def test_a_hardware_file_rewritten_at_once_is_read_again_and_each_load_is_the_callers_own(tmp_path) -> None:
    f = tmp_path / "hw.yaml"
    f.write_text("base: a100-8x-100g\ncluster: {nodes: 2}\n")
    first = load_hardware(str(f))
    f.write_text("base: a100-8x-100g\ncluster: {nodes: 3}\n")  # the same size, within the clock's tick
    assert first.cluster.nodes == 2 and load_hardware(str(f)).cluster.nodes == 3
    first.cluster.nodes = 99  # a caller's change stays in its copy
    f.write_text("base: a100-8x-100g\ncluster: {nodes: 2}\n")
    assert load_hardware(str(f)).cluster.nodes == 2
