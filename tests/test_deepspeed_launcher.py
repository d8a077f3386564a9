"""Hugging Face's Trainer builds the DeepSpeed engine itself: a "lagom" section in its DeepSpeed config is read
when the script runs under ``-m lagom_deepspeed.run`` (no change to the script), and the losses are those of
the same job without Lagom. A stock GPT-2 from its config, ZeRO-2 with overlap_comm, 2 gloo ranks on torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "deepspeed" / "hf_trainer.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def run(tmp: Path, *launcher: str) -> tuple[list[dict], str]:
    (tmp / "hw.yaml").write_text("base: a100-8x-100g\ncluster: {gpus_per_node: 2, nodes: 1}\n")
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", *launcher, str(SCRIPT), str(tmp / "out"),
           str(tmp / "hw.yaml")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ranks = [json.loads((tmp / "out" / f"result-{rank}.json").read_text()) for rank in range(2)]
    return ranks, done.stdout + done.stderr


@pytest.mark.slow  # two torchrun jobs of 2 ranks (about 25 s): CI's slower tier
def test_trainers_deepspeed_engine_reads_the_lagom_section_under_the_launcher(tmp_path: Path) -> None:
    (tmp_path / "with").mkdir()
    (tmp_path / "plain").mkdir()
    tuned, _ = run(tmp_path / "with", "-m", "lagom_deepspeed.run")
    plain, _ = run(tmp_path / "plain")
    assert [r["session"] for r in tuned] == [True, True]
    assert [r["session"] for r in plain] == [False, False]  # the section alone does nothing: nothing read it
    assert [r["losses"] for r in tuned] == [r["losses"] for r in plain] and len(tuned[0]["losses"]) == 6
    report = json.loads((tmp_path / "with" / "out" / "report.json").read_text())
    assert report["framework"] == "deepspeed" and report["steps"]
