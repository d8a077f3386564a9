"""The profiler plugin built and called against NCCL's own profiler headers (tests/nccl_profiler_abi.c), plain
and under AddressSanitizer/UndefinedBehaviorSanitizer.

NCCL's pip wheels ship no plugin headers, so the test runs where an NCCL source checkout is named by
``LAGOM_NCCL_SOURCE`` (its ``plugins/profiler/example/nccl/`` headers), and is skipped elsewhere; the ctypes
tests and the threaded stress driver (test_nccl_profiler.py, tests/nccl_profiler_stress.c) make the same calls
through Lagom's own restatement of the ABI everywhere.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lagom.nccl_tuner import build
from tests.test_nccl_profiler import built_under

HARNESS = Path(__file__).with_name("nccl_profiler_abi.c")


@pytest.mark.parametrize("sanitizer", ["plain", "address"])
def test_the_profiler_has_nccls_abi_and_answers_nccls_calls(tmp_path: Path, sanitizer: str) -> None:
    headers = Path(os.environ.get("LAGOM_NCCL_SOURCE", "/nonexistent")) / "plugins" / "profiler" / "example"
    if not (headers / "nccl" / "profiler.h").is_file():
        pytest.skip("LAGOM_NCCL_SOURCE does not name an NCCL checkout with its profiler headers")
    plugin, harness = built_under(sanitizer, tmp_path, HARNESS, [headers, build.PROFILER.source_dir])
    done = subprocess.run([str(harness), str(plugin)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.endswith("abi ok\n")
