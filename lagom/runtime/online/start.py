"""The start plan of a session: where it comes from (cache or file, both fast), its agreement across ranks before
the framework makes its communicators, what puts it in force, and the search that runs beside a job that
starts without one.

No rank waits for a search at start-up. A job with no plan file and no cached plan starts on the framework's
own settings at once. Offline, rank 0 then searches the cost model in a thread beside the job (within
``search_seconds``, see ``lagom.runtime.online.background``); at each step the ranks agree whether it is
ready, and at the step where it is every rank adopts the part of the plan that can change while the job runs
(the tuner plugin's rules through the live table, two phases, and the Flash-Overlap routing). What NCCL or the
framework fixes when a communicator or a buffer is made (the NCCL variables, each communicator's options,
bucket sizes) waits for the next start: the plan is cached for it, and the log and the report name each such
setting. Online, no uncalibrated search runs at all: the first steps are measured on the framework's settings
and the search on the calibrated model, beside the job in the same way, makes the first plan.
"""

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
from lagom.runtime.online.background import SHARE, SearchThread
from lagom.runtime.online.cache import PlanCache
from lagom.runtime.online.monitor import Monitor
from lagom.runtime.online.state import StartPlan, plan_fingerprint, plugin_counters, rank
from lagom.search.driver import Budget
from lagom.tune import framework_knobs, make_plan

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
            self.search_at_start = rank0["search"]
            if rank0["tuning"]:
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
                "hardware": self.hw, "hardware_reason": self.hardware_reason, "tuning": self.tuning,
                "search": self.search_at_start}

    def _begin(self, start: StartPlan) -> None:
        """Put an agreed start plan in force on this rank (every rank does it at the same point)."""
        self.plan_source = start.source
        recorder = self.runtime.recorder if self.runtime is not None else None
        if self.runtime is not None:
            self.runtime.close()
        self.runtime = open_runtime(start.plan, strict_env=self.options.strict_env, hw=self.hw,
                                    capability=self.capability, explore_channels=self._explore_channels(),
                                    recorder=recorder)
        if self.options.mode == "online" or self.search_at_start:  # settings that may change while the job runs
            if start.plan is None:
                self.runtime.plugin_without_rules()  # NCCL loads the plugin now, to take a live table later
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
        if self.search_at_start:
            self._search_beside()

    def start_plan(self) -> StartPlan:
        """Online: the cached plan, else the plan file, else none (the calibrated search makes the first); offline:
        the plan file, else the plan a search beside an earlier run cached, else none while rank 0 searches beside
        the job (``search_at_start``). Nothing here searches: every rank leaves at once."""
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
                if file_plan is None:  # the plan path holds the plan the job runs (a plan file there stays)
                    self._save(cached)
                return StartPlan(cached, f"tuned by an earlier online run, cached in {options.cache_dir}")
        if file_plan is not None:
            self._measuring(file_plan)
            return StartPlan(file_plan, f"loaded from {options.plan_in}")
        return self._without_plan("no plan file or cached plan")

    def _without_plan(self, why: str) -> StartPlan:
        """The framework's own settings at start-up (``why``: what there was not); online, the first steps are
        measured on them; offline, rank 0 searches beside the job from the first step."""
        if self.options.mode == "online":
            self._measuring(None)
            return StartPlan(None, f"none at start-up ({why}): the framework's own settings until the search on the "
                                   "model calibrated to the first steps, beside the job, makes one")
        cache = self._model_cache()
        cached = self.control.on_rank0(cache.load, "the cached start-up plan")
        if cached is not None:
            self.check_plan(cached, f"cache {self.options.cache_dir}")
            self._save(cached)  # the plan path holds the plan the job runs, as after a search
            return StartPlan(cached, f"searched beside an earlier run of this job, cached in {self.options.cache_dir}")
        self.search_at_start = True
        return StartPlan(None, f"none at start-up ({why}): the framework's own settings while rank 0 searches one "
                               "beside the job")

    def _model_cache(self) -> PlanCache:
        """Where a plan searched beside the job is kept for its next start (the online cache's folder)."""
        assert self.workload is not None and self.hw is not None
        return PlanCache.for_job(self.options.cache_dir, self.workload, self.hw, self.world_size, "start")

    def within_capability(self, start: StartPlan) -> StartPlan:
        """The start plan, or, where it needs what this process lacks, none: a plan within what this process has
        is then searched beside the job (offline), or by the calibrated search (online)."""
        plan, available = start.plan, self.capability
        if plan is None or available is None or self.workload is None or self.hw is None:
            return start
        missing = plan.needs(available)
        if not missing:
            return start
        why = f"the plan {start.source} needs {'; '.join(missing)}, which this process lacks ({available.describe()})"
        self.event(f"{why}: the job starts on the framework's own settings and a plan within what it has is searched "
                   "beside it", level=logging.WARNING)
        self.search_at_start = False
        return self._without_plan(why)

    # -- the search beside the job ----------------------------------------------------------------

    def _search_beside(self) -> None:
        """Rank 0 searches the start plan in a thread beside the job; every rank asks at each step whether it is
        ready (``_searched``), and no rank waits for it."""
        self.searching, self._search_kind = True, "start"
        self._next_agreement = self.steps_seen + 1
        if rank() == 0:
            self._search = SearchThread(self._start_payload, self.options.search_seconds, name="lagom-start-search")
        self.event(f"rank 0 searches a plan beside the job (at most {self.options.search_seconds:g} s and "
                   f"{SHARE:.0%} of one core); the ranks adopt it together at the first step after it is ready")

    def _start_payload(self, budget: Budget) -> dict[str, Any]:
        """Rank 0's start-up search, in its thread: the payload every rank receives (an error is carried in it,
        never raised, since every rank takes it at the agreed step)."""
        workload, hw, options = self.workload, self.hw, self.options
        assert workload is not None and hw is not None
        try:
            plan = make_plan(workload, hw, options.strategy, search_buckets=options.search_buckets,
                             capability=self.capability, budget=budget)
            notes = self.start_search_notes(plan, budget)
        except Exception as err:  # noqa: BLE001 - must reach every rank at the agreed step
            return {"error": f"{type(err).__name__}: {err}"}
        return {"plan": plan.to_json(), "cut": budget.cut, "seconds": time.perf_counter() - budget.started,
                "notes": notes}

    def start_search_notes(self, plan: Plan, budget: Budget) -> list[str]:
        """What the adapter adds to the start-up search, in its thread (e.g. the cost of a pinned knob): lines for
        the log and the report. None by default."""
        return []

    def _start_searched(self, payload: dict[str, Any]) -> Plan | None:
        """Every rank, at the agreed step: rank 0's start-up plan adopted. What can change while the job runs is put
        in force now (the tuner table, in two phases, and the routing); the rest waits for the next start, which
        reads the plan from the cache (and from ``plan_out``)."""
        if "error" in payload:
            raise LagomError(f"the start-up search failed on rank 0: {payload['error']}")
        plan = Plan.from_dict(json.loads(payload["plan"]), "rank 0's start-up plan")
        self.search_at_start = False
        self._next_agreement = None  # offline: nothing more to agree on
        cut = payload.get("cut")
        searched = (f"searched beside the job in {payload.get('seconds', 0.0):.1f} s, {plan.evaluations} evaluations" +
                    (f"; {cut}: the best found so far" if cut else ""))
        self.search_cuts.append(cut)
        for note in payload.get("notes", []):
            self.event(note, level=logging.WARNING)
        now, later = self._late_changes(plan)
        self.adopt(plan, self.iteration, (now, later), what=f"start-up plan ({searched})")
        self._model_cache().save(plan)
        if not self._put_live(plan.configs()):
            return None  # the table could not be switched on every rank: Lagom is off (``_switch_table`` said why)
        return plan

    def _late_changes(self, plan: Plan) -> tuple[list[str], list[str]]:
        """(what of a plan adopted while the job runs applies now, what waits for the next start), one line each."""
        now: list[str] = []
        later: list[str] = []
        rules = emit.tuner_entries(plan)
        if rules and self.live_table is not None:
            now.append(f"NCCL tuner rules for {len(rules)} collective sizes, through the live table (channels within "
                       "the CTA range each communicator was made with, chunks within the NCCL_BUFFSIZE in force)")
        elif rules:
            later.append(f"NCCL tuner rules for {len(rules)} collective sizes (no live table in this process: the "
                         "plugin reads them when a communicator is made)")
        decomposed = [e.key for e in plan.entries if e.config.decomposition == "p2p"]
        if decomposed and self.router.enabled:
            now.append(f"Flash-Overlap decomposition of {', '.join(decomposed)}")
        later += [f"{var}={value} (NCCL reads it once per process)" for var, value in
                  emit.nccl_env(plan, self.hw).items()]  # type: ignore[arg-type]
        later += [f"group {group}: communicator options {cfg} (fixed at ncclCommInitRank)"
                  for group, cfg in sorted(emit.communicator_configs(plan).items())]
        running = framework_knobs(self.workload)  # type: ignore[arg-type]
        for name, knobs in plan.framework.items():
            was = running.get(name, {})
            later += [f"{name}.{k} {was.get(k)} -> {v} (fixed when the framework makes its buffers)"
                      for k, v in knobs.items() if was.get(k) != v]
        return now, later

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
