"""What runs inside a training job, by job: a plan in force in one process (``apply``: NCCL's environment, group
options and tuner rules, the collective recorder and its ``torch.distributed`` tap, Lagom's own collectives under a
timeout), measuring a machine (``measure``: ``lagom calibrate``, the hardware probe) and the online loop of one job
(``online``: the session both adapters subclass, the calibrated search, live trials, the drift monitor, the
report). Planning (``lagom.tune`` and what it imports) never imports this package, so it never pays for torch.
"""

from __future__ import annotations

from lagom.runtime.apply.recorder import Recorder
from lagom.runtime.apply.runtime import Runtime, current, init, nccl_options

__all__ = ["Recorder", "Runtime", "current", "init", "nccl_options"]
