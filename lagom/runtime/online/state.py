"""What a tuning session holds, as data (the user's options, the start plan, the knobs set at start-up, the
measured steps, which calls Flash-Overlap routes), and the process facts its parts read (rank, NCCL_BUFFSIZE in
force, a plan's fingerprint, the tuner plugin's counters)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lagom.flash_overlap import FlashOverlapConfig
from lagom.plan.capability import Capability
from lagom.plan.plan import Plan, PlanEntry
from lagom.runtime.apply.control import DEFAULT_TIMEOUT_S
from lagom.runtime.online.background import DEFAULT_SEARCH_S
from lagom.runtime.online.live import DEFAULT_BUDGET_S
from lagom.step.calls import CallRecord


@dataclass(frozen=True)
class SessionOptions:
    """What a user chose, in framework-neutral terms (Megatron's flags and DeepSpeed's section map here)."""

    mode: str = "offline"  # offline | online
    strategy: str = "lagom"
    tune_steps: int = 60  # online: the step budget; the first CALIBRATION_STEPS fit the model, the rest try settings live
    tune_seconds: float = DEFAULT_BUDGET_S  # online: the wall-clock budget of the live search
    # every search beside the job (offline start-up, the calibrated search, drift re-tunes): its wall-clock budget,
    # after which it returns the best found so far
    search_seconds: float = DEFAULT_SEARCH_S
    plan_in: Path | None = None  # a plan to start from; never written
    plan_out: Path | None = None  # where plans Lagom makes are written (rank 0)
    cache_dir: Path = Path(".lagom-cache")
    report_files: tuple[Path, Path] | None = None  # (JSON, Markdown)
    flash_overlap: bool = False
    flash_num_chunks: int | None = None  # overrides the plan's pieces per peer shard
    flash_stream_priority: int | None = None  # overrides the plan's priority for the transfer stream
    strict_env: bool = False  # NCCL variables contradicting the plan: error (True) or warning
    retune_threshold: float = 0.1
    drift_check_steps: int = 20
    warmup_steps: int = 0  # first steps left out of every measurement (allocations, first-batch paths)
    search_buckets: bool = True  # False when the user pinned bucket sizes
    capability: Capability | None = None  # what this process can apply; None: detected (runtime_capability)
    collective_timeout_s: float = DEFAULT_TIMEOUT_S  # Lagom's own collectives: a rank missing this long switches Lagom off

@dataclass
class StartPlan:
    plan: Plan | None
    source: str  # where it came from, for the log and the report

@dataclass
class KnobChange:
    """A framework knob Lagom set at start-up (or would have set, when the user's flag won)."""

    key: str
    before: Any
    after: Any
    why: str

@dataclass
class StepStats:
    step: int
    step_s: float
    comm_s: float
    calls: int
    plan: str  # which plan ran it: "start", "tuned 1", ...

class FlashRouter:
    """Which calls run as Flash-Overlap P2P decompositions: those whose plan entry says ``p2p``.

    Decisions are cached per (group, collective, bytes) until the plan changes; ``calls`` counts the
    decomposed calls per plan key, for the report.
    """

    def __init__(self, enabled: bool, plan: Plan | None = None, num_chunks: int | None = None,
                 stream_priority: int | None = None) -> None:
        self.enabled, self.num_chunks, self.stream_priority = enabled, num_chunks, stream_priority
        self.calls: dict[str, int] = {}
        self._decisions: dict[tuple[str, str, int], tuple[str, FlashOverlapConfig] | None] = {}
        self.plan = plan

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @plan.setter
    def plan(self, plan: Plan | None) -> None:
        self._plan = plan
        self._decisions.clear()
        self.active = self.enabled and plan is not None and any(e.config.decomposition == "p2p" for e in plan.entries)

    def decision(self, group: str, collective: str, nbytes: int, *,
                 unmodelled_sizes: bool = False) -> tuple[str, FlashOverlapConfig] | None:
        """(plan key, operator config) when this call is decomposed, else None.

        ``unmodelled_sizes``: a size the plan does not model (ZeRO-3 gathers per parameter, the plan
        models per layer) follows the plan's choice for its communicator and collective when every
        entry of them agrees on decomposing; it is counted under the nearest entry.
        """
        if not self.active or self._plan is None:
            return None
        cache_key = (group, collective, nbytes)
        if cache_key not in self._decisions:
            entry = self._plan.lookup(group, collective, nbytes)
            if entry is None and unmodelled_sizes:
                same = [e for e in self._plan.entries if e.group == group and e.collective == collective]
                if same and all(e.config.decomposition == "p2p" for e in same):
                    entry = min(same, key=lambda e: abs(e.bytes - nbytes))
            self._decisions[cache_key] = None if entry is None or entry.config.decomposition != "p2p" else (
                entry.key, self._config(entry))
        return self._decisions[cache_key]

    def _config(self, entry: PlanEntry) -> FlashOverlapConfig:
        priority = -1 if entry.config.priority else 0  # CUDA: lower is higher priority
        return FlashOverlapConfig(num_chunks=self.num_chunks or entry.config.num_chunks,
                                  comm_stream_priority=priority if self.stream_priority is None else self.stream_priority)

    def count(self, key: str) -> None:
        self.calls[key] = self.calls.get(key, 0) + 1

class Measured:
    """Steps measured under one plan: wall time, and per observed key its calls and seconds."""

    def __init__(self) -> None:
        self.steps = 0
        self.step_s = 0.0
        self.per_key: dict[str, list[float]] = {}  # observed key -> [calls, seconds]

    @property
    def mean_step_s(self) -> float:
        return self.step_s / self.steps if self.steps else 0.0

    def add(self, step_s: float, records: list[CallRecord]) -> None:
        self.steps += 1
        self.step_s += step_s
        for r in records:
            row = self.per_key.setdefault(r.key, [0, 0.0])
            row[0] += 1
            row[1] += max(0.0, r.duration_s)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def buffsize_in_force() -> int:
    """The NCCL_BUFFSIZE this process's NCCL read (once, at its first communicator): the environment's, else
    NCCL's default."""
    from lagom.plan.capability import DEFAULT_BUFFSIZE

    value = os.environ.get("NCCL_BUFFSIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_BUFFSIZE


def plan_fingerprint(plan: Plan) -> str:
    """A plan's identity across ranks: the hash of its JSON."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def plugin_counters() -> Any:
    """The tuner plugin's counters in this process (``PluginCounters``), or None without the plugin."""
    from lagom.nccl_tuner.live import LiveTableError, counters

    try:
        return counters()
    except (LiveTableError, OSError):
        return None

