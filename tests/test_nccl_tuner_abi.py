"""The tuner plugin built and called against NCCL's own tuner headers (tests/nccl_tuner_abi.c).

NCCL's pip wheels ship no plugin headers, so the test runs where an NCCL source checkout is named by
``LAGOM_NCCL_SOURCE`` (its ``plugins/tuner/example/nccl/tuner.h`` and ``src/include/plugin/tuner/tuner_v4.h``),
and is skipped elsewhere; the ctypes tests (test_nccl_tuner.py) check the same calls through Lagom's own
restatement of the ABI everywhere.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from lagom.nccl_tuner import build
from tests.test_nccl_tuner import compiler_or_skip

HARNESS = Path(__file__).with_name("nccl_tuner_abi.c")
RULES = "lagom-nccl-tuner 1\nworld 4\nallreduce 1 1048576 4 1 ring simple 2 131072\n"


def test_the_plugin_has_nccls_abi_and_answers_nccls_calls(tmp_path: Path) -> None:
    source = Path(os.environ.get("LAGOM_NCCL_SOURCE", "/nonexistent"))
    headers = (source / "plugins" / "tuner" / "example", source / "src" / "include")
    if not all((h / name).is_file() for h, name in zip(headers, ("nccl/tuner.h", "plugin/tuner/tuner_v4.h"))):
        pytest.skip("LAGOM_NCCL_SOURCE does not name an NCCL checkout with its tuner headers")
    compiler_or_skip()
    plugin = build.compile_plugin(tmp_path / "plugin.so")
    # v7 (NCCL >= 2.32) is checked against NCCL's own type where the checkout's header declares it
    v7 = ["-DLAGOM_NCCL_HAS_TUNER_V7"] if "ncclTuner_v7_t" in (headers[0] / "nccl" / "tuner.h").read_text() else []
    harness = build.compile_driver(HARNESS, tmp_path / "abi", [*headers, build.SOURCE_DIR], ["-Werror", *v7])
    rules = tmp_path / "rules.lagom"
    rules.write_text(RULES)
    done = subprocess.run([str(harness), str(plugin)], env={**os.environ, "LAGOM_NCCL_TUNER_FILE": str(rules),
                                                            "WORLD_SIZE": "4"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "abi ok" in done.stdout
