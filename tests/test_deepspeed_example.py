"""The DeepSpeed example as a user runs it: `deepspeed --num_gpus 2` on CPU, with the lagom section."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lagom.hardware import load_hardware
from lagom_deepspeed.config import parse_section
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "deepspeed"


@pytest.mark.slow  # the example under its launcher, end to end: CI's slower tier
def test_tiny_gpt_trains_with_deepspeed_launcher(tmp_path: Path) -> None:
    cfg = json.loads((EXAMPLE / "ds_config_cpu.json").read_text())
    cfg["lagom"] |= {"plan": str(tmp_path / "plan.json"), "report": str(tmp_path / "report")}
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    launcher = Path(sys.executable).parent / "deepspeed"
    run = subprocess.run([str(launcher), "--master_port", str(free_port()), "--num_gpus", "2",
                          str(EXAMPLE / "tiny_gpt.py"), "--deepspeed_config", str(tmp_path / "ds.json"), "--steps", "6"],
                         cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = [line for line in run.stdout.splitlines() if line.startswith("losses:")]
    assert len(losses) == 1 and len(losses[0].split()) == 1 + 6
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["steps"]) == 6 and report["workload"]["parallel"]["zero_stage"] == 3
    assert report["hardware"] == "a100-2gpu-example"
    assert (tmp_path / "plan.json").exists()


def test_shipped_configs_are_valid() -> None:
    for name in ("ds_config_cpu.json", "ds_config_cpu_pipeline.json", "ds_config_gpu.json"):
        section = parse_section(json.loads((EXAMPLE / name).read_text()))
        assert section is not None and section.enabled
        hw = load_hardware(str(ROOT / section.hardware) if section.hardware.endswith(".yaml") else section.hardware)
        assert hw.cluster.world_size == (16 if "gpu" in name else 2)
