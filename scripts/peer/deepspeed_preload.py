"""pytest plugin for DeepSpeed's unit tests: ranks fork from a forkserver that has already imported deepspeed.

DeepSpeed's DistributedTest starts a fresh pool of forkserver workers for most tests, and each
worker imports torch and deepspeed again when it unpickles the test: tens of seconds per test on
a loaded two-core machine. Preloading them in the forkserver makes each worker a fork of an
interpreter that has them. The same plugin is loaded in both runs (with and without Lagom); with
Lagom, the forkserver's import of deepspeed goes through ``sitecustomize`` like any other, so the
workers inherit the injected ``deepspeed.initialize``.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

PRELOAD = ["torch", "deepspeed", "deepspeed.comm"]


def pytest_configure(config: Any) -> None:
    multiprocessing.set_forkserver_preload(PRELOAD)
