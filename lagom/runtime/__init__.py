"""What runs inside a training job: the plan applied to NCCL (``apply``), the collective recorder
(``recorder``), the drift monitor, online tuning, the tuning session both adapters share, its
report, and ``lagom calibrate``. Planning (``lagom.tune`` and what it imports) never imports this
package, so it never pays for torch.
"""

from __future__ import annotations

from lagom.runtime.apply.recorder import Recorder
from lagom.runtime.apply.runtime import Runtime, current, init, nccl_options

__all__ = ["Recorder", "Runtime", "current", "init", "nccl_options"]
