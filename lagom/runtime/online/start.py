"""The start plan of a session: where it comes from (cache, file, a search on rank 0), its agreement
across ranks before the framework makes its communicators, and what puts it in force."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from lagom.errors import ConfigError, LagomError
from lagom.plan import emit
from lagom.plan.plan import Plan
from lagom.runtime.apply.runtime import open_runtime, registration_message, runtime_capability
from lagom.runtime.online import report
from lagom.runtime.online.monitor import Monitor
from lagom.runtime.online.state import StartPlan, plan_fingerprint, plugin_counters, rank
from lagom.tune import make_plan

log = logging.getLogger("lagom.session")


class StartPlanning:
    """``TuningSession``'s start-up: the plan every rank starts on, agreed, and put in force."""


    def agree_start(self) -> None:
        """Put rank 0's start plan in force on every rank, once a process group exists (a no-op when it is in
        force already). Called by the adapter before the framework makes its NCCL communicators, else at the
        first step: communicators made before then keep NCCL's own settings, the same on every rank."""
        mine, self._unagreed = self._unagreed, None
        if mine is None:
            return
        try:
            own = self._start_message(mine)
            rank0 = self.control.broadcast(own, "the start plan")
            plan = Plan.from_dict(json.loads(rank0["plan"]), "rank 0's start plan") if rank0["plan"] else None
            if plan is not None and plan_fingerprint(plan) != rank0["fingerprint"]:
                raise LagomError("rank 0's start plan arrived altered (its fingerprint does not match)")
            if own["fingerprint"] != rank0["fingerprint"]:
                log.warning("Lagom on rank %d: this rank's own start plan (%s) differs from rank 0's (%s), e.g. a "
                            "stale node-local cache or a plan file missing here; rank 0's is used", rank(),
                            mine.source, rank0["source"])
            if self.hw is None or self.hw.fingerprint() != rank0["hardware"].fingerprint():
                self.hw, self.hardware_reason = rank0["hardware"], rank0["hardware_reason"]
                self.capability = self._with_registration(runtime_capability(self.hw))
                if self.tuner is not None:
                    self.tuner = self._new_tuner()
            if rank0["tuning"] and plan is not None:
                self._measuring(plan)
            else:
                self.tuning = False
            self._begin(self.within_capability(StartPlan(plan, rank0["source"])))
        except Exception as err:  # noqa: BLE001 - Lagom's own failure must not fail the job: NCCL's defaults stay
            self.switch_off(f"the start plan could not be agreed: {type(err).__name__}: {err}", agreed=False)

    def _start_message(self, start: StartPlan) -> dict[str, Any]:
        """What rank 0 tells every rank of its start: the plan (JSON), its fingerprint, its hardware, whether
        it measures calibration steps next."""
        return {"plan": start.plan.to_json() if start.plan is not None else "",
                "fingerprint": plan_fingerprint(start.plan) if start.plan is not None else "", "source": start.source,
                "hardware": self.hw, "hardware_reason": self.hardware_reason, "tuning": self.tuning}

    def _begin(self, start: StartPlan) -> None:
        """Put an agreed start plan in force on this rank (every rank does it at the same point)."""
        self.plan_source = start.source
        recorder = self.runtime.recorder if self.runtime is not None else None
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = open_runtime(start.plan, strict_env=self.options.strict_env, hw=self.hw,
                                    capability=self.capability, explore_channels=self._explore_channels(),
                                    recorder=recorder)
        if self.options.mode == "online":
            self.live_table = self._open_live_table()
        self._counters_start = plugin_counters()
        self._restore_start_rules()
        if start.plan is not None:
            message = registration_message(start.plan)
            if message is not None:
                self.events.append(message)  # init_runtime has logged it once
            self.env_conflicts = emit.env_conflicts(start.plan, self.hw, os.environ)  # type: ignore[arg-type]
            self._put_in_force(start.plan)
            self.apply_at_startup(start.plan)
        self.event(f"{self.options.mode} mode: plan {self.plan_source}" + (
            f" ({start.plan.strategy}, {len(start.plan.entries)} keys)" if start.plan else ""))

    def start_plan(self) -> StartPlan:
        """Online: the cached plan, else the plan file, else a search; offline: the file, else a search."""
        workload, hw, options = self.workload, self.hw, self.options
        if workload is None or hw is None:
            raise ConfigError("workload", "a start plan needs a workload and hardware")
        # files are read on rank 0 and shared: a node that lacks one must not take another path than its peers
        plan_in = options.plan_in
        file_plan = self.control.on_rank0(lambda: self._load(plan_in) if plan_in and plan_in.exists() else None,
                                          "the plan file")
        if options.mode == "online":
            tuner = self.tuner = self._new_tuner()
            cached = self.control.on_rank0(tuner.cached_plan, "the cached online plan")
            if cached is not None:
                self.check_plan(cached, f"cache {options.cache_dir}")
                self._measuring(cached)
                self.tuning = False
                return StartPlan(cached, f"tuned by an earlier online run, cached in {options.cache_dir}")
        if file_plan is not None:
            self._measuring(file_plan)
            return StartPlan(file_plan, f"loaded from {options.plan_in}")
        started = time.perf_counter()
        plan = self.control.on_rank0(lambda: make_plan(workload, hw, options.strategy, search_buckets=options.search_buckets,
                                                       capability=self.capability), "the start plan")
        source = f"searched with the cost model at start-up ({time.perf_counter() - started:.1f} s)"
        if options.plan_out is not None:
            self._save(plan)
            source += f", saved to {options.plan_out}"
        self._measuring(plan)
        return StartPlan(plan, source)

    def within_capability(self, start: StartPlan) -> StartPlan:
        """The start plan, or, where it needs what this process lacks, a plan made within what it has."""
        plan, available = start.plan, self.capability
        if plan is None or available is None or self.workload is None or self.hw is None:
            return start
        missing = plan.needs(available)
        if not missing:
            return start
        workload, hw, options = self.workload, self.hw, self.options
        replanned = self.control.on_rank0(lambda: make_plan(workload, hw, options.strategy,
                                                            search_buckets=options.search_buckets, capability=available),
                                          "the start plan within this process's capability")
        self.event(f"the plan {start.source} needs {'; '.join(missing)}: re-planned within what this process has "
                   f"({available.describe()})", level=logging.WARNING)
        self._measuring(replanned)
        return StartPlan(replanned, f"re-planned at start-up for NCCL {available.nccl_version} "
                                    f"(the plan {start.source} needs {'; '.join(missing)})")

    def _load(self, path: Path) -> Plan:
        try:
            plan = Plan.load(path)
        except ConfigError as err:
            raise ConfigError(f"plan {path}: {err.key}", err.problem, err.fix) from None
        self.check_plan(plan, str(path))
        return plan

    def check_plan(self, plan: Plan, where: str) -> None:
        """Refuse a plan made for another layout, workload or machine, naming where it came from."""
        try:
            plan.check_for(self.world_size, self.workload, self.hw)
        except ConfigError as err:
            raise ConfigError(f"plan ({where}): {err.key}", err.problem, err.fix) from None

    def _save(self, plan: Plan) -> None:
        """Rank 0 writes plans Lagom made to ``plan_out``; the input plan is never overwritten."""
        out = self.options.plan_out
        if out is None or rank() != 0:
            return
        plan_in = self.options.plan_in
        if plan_in is not None and plan_in.exists() and out.resolve() == plan_in.resolve():
            log.warning("the new plan is not written over the plan this job was started from (%s)", out)
            return
        report.write_atomic(out, plan.to_json() + "\n")

    def _put_in_force(self, plan: Plan) -> None:
        self.plan = plan
        self.router.plan = plan
        self.monitor = Monitor.for_plan(self.workload, self.hw, plan,  # type: ignore[arg-type]
                                        threshold=self.options.retune_threshold)

    def apply_at_startup(self, plan: Plan) -> None:
        """What the framework fixes at start-up (buckets, communicator options): the adapters' job."""
