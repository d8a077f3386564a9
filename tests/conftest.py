"""Test-session settings shared by every test file.

One OpenMP thread per process. Each multi-rank test runs one process per pretend GPU, and
``make test`` runs two xdist workers, so on a 2-core machine several processes already share each
core; with torch's default of one OpenMP thread per core on top, the threads spin-wait on each
other and the tiny models train about twice as slowly. Set before any test imports torch (OpenMP
reads it once, at load), and inherited by the ranks and example subprocesses the tests start.
A value the caller sets explicitly wins.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# The slowest files (seconds on 2 cores) start first. ``make test`` hands whole files to two xdist
# workers in collection order; a long file collected last would run alone at the end while the other
# worker idles. Files not named keep their order after these.
SLOWEST_FIRST = (
    "test_simulator_equivalence.py",  # ~150 s: the reference simulator on every shipped workload
    "test_flash_overlap.py",
    "test_reproduce.py",
    "test_deepspeed.py",
    "test_megatron_groups.py",
    "test_megatron_buckets.py",
    "test_torch_tap.py",
    "test_deepspeed_example.py",
    "test_runtime.py",
    "test_hardware_detect.py",
    "test_megatron_example.py",
    "test_megatron_ddp.py",
    "test_simulator_scale.py",
    "test_megatron_tp_pp.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files slowest first (a stable sort: tests inside a file keep their order)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FIRST)))
