"""The CPU example end to end: 2 gloo ranks under torchrun, the launcher on the installed (unpatched)
megatron, online tuning, the report, and the cached plan reused by the next start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).parent / "torchrun"
MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8",
    "--lr", "0.05", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "5000",
]


def run_example(cwd: Path, iters: int) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "lagom_megatron.run",
           str(ROOT / "examples/megatron/train_tiny.py"), *MEGATRON_ARGS, "--train-iters", str(iters),
           "--lagom", "--lagom-mode", "online", "--lagom-tune-iters", "2",
           "--lagom-hardware", str(ROOT / "examples/megatron/cpu-2ranks.yaml"), "--lagom-report", "report",
           "--lagom-out", "out"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow  # the example under its launcher, end to end: CI's slower tier
def test_cpu_example_tunes_online_then_reuses_the_cached_plan(tmp_path: Path) -> None:
    # no plan at start: 2 steps calibrate the model, then rank 0 searches it beside the steps; the plan is adopted at
    # an agreed step, or, where the job ends first (a short job, a loaded machine), its best so far is cached at close
    first = run_example(tmp_path, iters=12)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    losses = [line for line in first.stdout.splitlines() if line.startswith("iteration ")]
    assert len(losses) == 12
    log = first.stdout + first.stderr  # megatron's logging setup decides the stream
    assert "online mode: plan none at start-up" in log
    assert "online plan cached in" in log
    report = json.loads((tmp_path / "report" / "lagom-report.json").read_text())
    assert report["mode"] == "online"
    assert report["measured"]["baseline_steps"] == 2 and report["measured"]["tuned_steps"] >= 2
    assert (tmp_path / "report" / "lagom-report.md").read_text().startswith("# Lagom report")
    cached = list((tmp_path / ".lagom-cache").glob("*.json"))
    assert len(cached) == 1 and (tmp_path / "out" / "lagom-plan.json").read_text() == cached[0].read_text()

    second = run_example(tmp_path, iters=3)
    assert second.returncode == 0, second.stderr[-4000:]
    log = second.stdout + second.stderr
    assert "plan tuned by an earlier online run, cached in .lagom-cache" in log
    assert "online search" not in log
    # the second start runs the cached plan from its first step: the report's points are its keys, the DDP buckets
    report = json.loads((tmp_path / "report" / "lagom-report.json").read_text())
    assert report["points"] and {p["group"] for p in report["points"]} == {"dp"}
    assert report["measured"]["tuned_steps"] >= 2
