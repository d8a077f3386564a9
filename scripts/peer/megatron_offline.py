"""pytest plugin for Megatron-LM's unit tests: the suite runs offline, fetching nothing.

Megatron's ``tests/unit_tests/conftest.py`` imports ``download_and_extract_asset`` and calls it at
session start when ``/opt/data`` is empty. That module needs click and requests and downloads test
assets from the internet. This plugin (loaded with ``-p`` before any conftest) puts in its place a
module whose function refuses to download, so the conftest's own fallback ("Failed to download
test data") runs and tests that need the assets fail or skip as they would on an offline machine.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

ASSET_MODULE = "tests.test_utils.python_scripts.download_unit_tests_dataset"


def _refuse_download(assets_dir: Path | str | None = None, **_: object) -> None:
    raise RuntimeError(f"peer test runs fetch nothing; put the test assets in {assets_dir} beforehand")


def _offline_module() -> types.ModuleType:
    module = types.ModuleType(ASSET_MODULE, "Offline replacement: refuses to download test assets.")
    module.download_and_extract_asset = _refuse_download  # type: ignore[attr-defined]
    return module


sys.modules.setdefault(ASSET_MODULE, _offline_module())
for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(variable, "1")
