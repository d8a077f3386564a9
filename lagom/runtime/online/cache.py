"""Plans kept on each node for the next start of the same job: one file per workload, machine, world size and
kind (the online cache of measured plans; the model cache of plans searched beside a job that started without
one). Written atomically by one process per node, so a reader never sees half a file."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan.plan import Plan
from lagom.step.workload import Workload

log = logging.getLogger("lagom.online")


@dataclass(frozen=True)
class PlanCache:
    """One cached plan's file, and the job it must fit."""

    path: Path
    workload: Workload
    hw: Hardware
    world_size: int

    @classmethod
    def for_job(cls, cache_dir: str | Path, workload: Workload, hw: Hardware, world_size: int,
                kind: str = "") -> PlanCache:
        name = f"{workload.fingerprint()}-{hw.fingerprint()}-w{world_size}{'-' + kind if kind else ''}.json"
        return cls(Path(cache_dir) / name, workload, hw, world_size)

    def load(self) -> Plan | None:
        """The cached plan, or None where there is none or it no longer fits the job (said once)."""
        if not self.path.exists():
            return None
        try:
            plan = Plan.load(self.path)
            plan.check_for(self.world_size, self.workload, self.hw)
        except ConfigError as err:
            log.warning("ignoring cached plan %s: %s", self.path, err)
            return None
        log.info("using the plan cached in %s (made %s)", self.path, plan.created)
        return plan

    def save(self, plan: Plan) -> bool:
        """Write the plan on the node's first process (local rank 0); True where this process wrote it."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        if os.environ.get("LOCAL_RANK", str(rank)) != "0":
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        plan.save(tmp)
        os.replace(tmp, self.path)
        return True
