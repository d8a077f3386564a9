"""`lagom.published_fit`: NCCL constants of a preset set from the fidelity suite's fit points, on the path
`lagom validate` computes them, and kept in the shipped presets with the points behind them."""

import pytest

from lagom.errors import ConfigError
from lagom.fidelity import Comm, load_suite
from lagom.hardware import load_hardware
from lagom.published_fit import fit_points, fit_preset, get_constant, set_constant
from lagom.validate import comm_figure
from tests.helpers import write_yaml

SOURCE = {"ref": "hand-made", "url": "https://example.org/none", "where": "this test"}
NVLS = Comm(collective="all_reduce", ranks=8, bytes=1 << 33, algorithm="nvls")
RING = Comm(collective="all_gather", ranks=8, bytes=1 << 33, algorithm="ring")


def _fit_point(pid: str, comm: Comm, measured: float, constants: list[str]) -> dict:
    fields = {k: v for k, v in vars(comm).items() if v is not None}
    return {"id": pid, "role": "fit", "constants": constants, "what": "hand-made", "unit": "GB/s", "measured": measured,
            "source": dict(SOURCE), "setup": {"kind": "busbw", "hardware": ["h100-sxm-8x-400g"], "comm": fields}}


def test_constants_are_read_and_replaced_by_dotted_path_without_touching_the_profile():
    hw = load_hardware("h100-sxm-8x-400g")
    before = (hw.nccl.channel_gbps["nvlink"], hw.nccl.nvls_efficiency)
    assert (get_constant(hw, "nccl.channel_gbps.nvlink"), get_constant(hw, "nccl.nvls_efficiency")) == before
    changed = set_constant(set_constant(hw, "nccl.channel_gbps.nvlink", 20.0), "nccl.nvls_efficiency", 0.5)
    assert (changed.nccl.channel_gbps["nvlink"], changed.nccl.nvls_efficiency) == (20.0, 0.5)
    assert (hw.nccl.channel_gbps["nvlink"], hw.nccl.nvls_efficiency) == before != (20.0, 0.5)
    with pytest.raises(ConfigError, match="nccl.nvls_eff"):
        set_constant(hw, "nccl.nvls_eff", 1.0)


def test_the_fit_recovers_a_known_constant_and_keeps_one_its_points_do_not_move(tmp_path):
    hw = load_hardware("h100-sxm-8x-400g")
    truth = set_constant(hw, "nccl.nvls_efficiency", 0.55)
    folder = tmp_path / "suite"
    folder.mkdir()
    # a ring all-gather at 8 GiB is bound by the NVLink, not the channels: it cannot move their rate
    write_yaml(folder / "hand.yaml", {"group": "hand", "points": [
        _fit_point("nvls", NVLS, comm_figure(truth, "busbw", NVLS), ["nccl.nvls_efficiency"]),
        _fit_point("ring", RING, comm_figure(hw, "busbw", RING), ["nccl.channel_gbps.nvlink"])]})
    points = load_suite(folder)
    assert [p.spec.id for p in fit_points(points, "h100-sxm-8x-400g")] == ["nvls", "ring"]
    result = fit_preset(points, "h100-sxm-8x-400g")
    assert result.constants["nccl.nvls_efficiency"] == pytest.approx(0.55, abs=1e-3)
    assert result.uninformed == ["nccl.channel_gbps.nvlink"]
    assert result.start["nccl.nvls_efficiency"] == hw.nccl.nvls_efficiency != pytest.approx(0.55, abs=1e-2)
    assert result.median_after < 1e-3 < result.median_before
    assert result.record() == {"source": "published-fit", "points": ["nvls", "ring"],
                               "constants": {"nccl.nvls_efficiency": pytest.approx(0.55, abs=1e-3)}}
    with pytest.raises(ConfigError, match="no fit point"):
        fit_preset(points, "a100-8x-100g")


@pytest.mark.parametrize("preset", ["a100-8x-100g", "h100-sxm-8x-400g", "h200-sxm-8x-400g"])
def test_shipped_presets_keep_what_the_published_fit_gives_with_its_points(preset):
    """A preset marked published-fit holds the fit of the shipped suite's fit points, rounded as its record."""
    result = fit_preset(load_suite(), preset)
    hw = load_hardware(preset)
    record = hw.calibration["published_fit"]
    assert record == result.record()
    for constant, value in record["constants"].items():
        assert get_constant(hw, constant) == value
