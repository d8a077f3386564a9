"""One tuned training job, whatever the framework: the plan in force, the per-step loop, the report.

Both adapters run the same session; each subclasses it only for what its framework fixes at start-up
(``apply_at_startup``) and what its report adds (``framework_report``). Data flows one way:

  start plan   online: the plan an earlier run cached; else the plan file (read only); else none.
               offline: the plan file; else the plan a search beside an earlier run cached; else none,
               and rank 0 searches beside the job (``start``). Every rank receives rank 0's (where no
               process group exists yet, at ``agree_start``, before the framework makes its NCCL
               communicators). A plan that needs more than this process can apply (an older NCCL, no
               tuner plugin) is searched again within what it has, beside the job; the report says what
               was missing. No rank waits for a search: each runs in a thread on rank 0, within
               ``search_seconds``, and is adopted at an agreed step.
  calibration  online: the first steps are measured; rank 0 reconciles the model with the calls they
               issued (``lagom.model.reconcile``) and searches the calibrated model in a thread of its own;
               the ranks adopt its plan at the first agreed step after it is ready.
  every step   the recorder's calls of the step go to the online tuner while it measures, then to
               the measured totals and the drift monitor. A tuned plan is adopted on every rank at
               the same step: the Flash-Overlap routing switches now, what is fixed when
               communicators and buffers are made waits for the next start (the plan is cached).
  drift        offline: a warning that the plan may be stale; online: every ``drift_check_steps``
               the ranks agree (one tiny all-reduce) and re-tune together.
  report       one schema for both adapters, written atomically as JSON and Markdown on rank 0.

Lifetime and hangs. Everything a session adds to the process (its runtime: NCCL variables, tuner
rules, the ``new_group`` hook; the adapters' taps and wrappers; its agreement group) is removed by
``close``, which the adapters call when the framework's object goes (DeepSpeed's ``destroy`` or the
engine's garbage collection); Lagom holds the framework's objects only weakly, so a session never
keeps an engine alive. Lagom's own collectives run only through ``control`` (every rank or none,
under a timeout) and only at agreed steps: the steps every rank knows from the agreement before
(``_next_agreement``). The tuner table every rank must share changes only there, in two phases
(``_switch_table``: staged everywhere, then published everywhere, or discarded everywhere). A rank
whose Lagom step logic raised keeps counting steps and, at the next agreed step, says so; every rank
then switches Lagom off together (``switch_off``) and the framework runs on. A collective of Lagom's own that fails or times out switches Lagom off on the rank that saw
it; its peers, waiting in the same collective, time out the same way.
"""

from __future__ import annotations

import atexit
import json
import logging
import time
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan.capability import Capability
from lagom.plan.plan import Plan
from lagom.runtime.apply import nccl_calls
from lagom.runtime.apply.control import Control
from lagom.runtime.apply.runtime import job_world_size, open_runtime, runtime_capability
from lagom.runtime.apply.step_clock import KEEP, StepClock
from lagom.runtime.online import report
from lagom.runtime.online.background import SearchThread
from lagom.runtime.online.live import LiveSearch, Trial
from lagom.runtime.online.live_switch import LiveSwitching
from lagom.runtime.online.monitor import Monitor
from lagom.runtime.online.start import StartPlanning
from lagom.runtime.online.state import (
    FlashRouter,
    KnobChange,
    Measured,
    SessionOptions,
    StartPlan,
    StepStats,
    plugin_counters,
    rank,
)
from lagom.runtime.online.tuner import OnlineTuner, describe_changes
from lagom.runtime.online.tuner import refit as online_refit
from lagom.step.calls import CallRecord, KeyIndex
from lagom.step.workload import Workload
from lagom.tune import running_workload

log = logging.getLogger("lagom.session")
CALIBRATION_STEPS = 5  # online: steps measured under the start plan before the model is fitted to them





def choose_hardware(explicit: str | None, world_size: int, cache_dir: Path, control: Control) -> tuple[Hardware, str]:
    """The hardware to plan for and why (named, detected, or measured now; see lagom.runtime.measure.probe),
    agreed through ``control``.

    A named profile must describe this job's world size: a plan for another cluster is refused.
    """
    from lagom.runtime.measure.probe import resolve_hardware

    choice = resolve_hardware(explicit, world_size, cache_dir=cache_dir, control=control)
    hw = choice.hardware
    if hw.cluster.world_size != world_size:
        raise ConfigError("hardware", f"'{hw.name}' describes {hw.cluster.world_size} GPUs ({hw.cluster.nodes} x "
                          f"{hw.cluster.gpus_per_node}) but this job runs {world_size} ranks",
                          "use a hardware file with `base: <preset>` and a cluster of this size, or leave it out "
                          "to detect it")
    return hw, choice.reason



class TuningSession(StartPlanning, LiveSwitching):
    """The state of one tuned job; the adapter calls ``begin_step``/``end_step`` around each step."""

    framework = "torch"

    def __init__(self, workload: Workload | None, hw: Hardware | None, options: SessionOptions, *,
                 world_size: int, hardware_reason: str = "", why_untuned: str = "",
                 control: Control | None = None) -> None:
        self.workload, self.hw, self.options, self.world_size = workload, hw, options, world_size
        self.control = control or Control(options.collective_timeout_s)  # Lagom's own collectives, nothing else
        self.failure: str | None = None  # what raised inside Lagom's step logic on this rank, told at the next agreement
        self.off: str | None = None  # why Lagom switched itself off (the framework runs on its own settings)
        self.off_at: int | None = None  # the step (``steps_seen``) it did
        self._next_agreement: int | None = None  # the step (``steps_seen``) at which every rank agrees next
        # the live loop judges steps by the clock (device time on a GPU, read ``clock.lag`` steps later) and only
        # steps that ran the settings in force: each step's settings epoch, and its records, by step
        self.clock: StepClock | None = None
        self._epoch = 0  # bumped at every agreed change of live settings
        self._step_epoch: dict[int, int] = {}
        self._step_records: dict[int, list[CallRecord]] = {}
        # live tuning: every rank knows the keys and the settings in force when it began; rank 0 searches
        self.live: LiveSearch | None = None
        self.live_on = False
        self.live_keys: list[str] = []
        self.live_reference: Plan | None = None
        self.live_table: Any = None  # lagom.nccl_tuner.live.LiveTable, where the plugin is built
        # whether NCCL consulted the tuner plugin on every rank while calibrating (None: the backend is not NCCL)
        self.nccl_listens: bool | None = None
        self._counters_at: Any = None  # the plugin's counters when calibration began (PluginCounters)
        self._counters_start: Any = None  # ... when this session's plan was put in force
        self._algorithms_run: set[tuple[str, str]] = set()  # (algorithm, protocol) put in force so far in the job
        self._first_steps: set[int] = set()  # steps that pay one-time costs of a new algorithm: never judged
        self._unagreed: StartPlan | None = None  # this rank's own start plan, before rank 0's is agreed
        self.searching = False  # online: rank 0 searches the calibrated model beside the job's steps
        self.reconciled: dict[str, Any] = {}  # the model's keys against the measured calls (``lagom.model.reconcile``)
        self._search: SearchThread | None = None  # rank 0's
        self._search_kind = "online"  # what the search beside the job makes: "start" (offline start-up) or "online"
        self.search_at_start = False  # offline, no plan at start-up: rank 0 searches one beside the job
        self.search_cuts: list[str | None] = []  # per search adopted, why it stopped before its end (None: it did not)
        self.trials: list[Trial] = []
        self.live_summary: dict[str, Any] = {}
        self.hardware_reason = hardware_reason
        self.why_untuned = why_untuned  # set when Lagom cannot describe the job: it then only records
        self.plan: Plan | None = None
        self.plan_source = "none"
        self.capability: Capability | None = options.capability  # what this process can apply, once known
        self.tuner: OnlineTuner | None = None
        self.tuning = False
        self.monitor: Monitor | None = None
        self.router = FlashRouter(options.flash_overlap, None, options.flash_num_chunks, options.flash_stream_priority)
        self.runtime: Any = None
        self.applied_at_start: list[KnobChange] = []
        self.applied_now: list[str] = []
        self.next_start: list[str] = []
        self.env_conflicts: list[str] = []
        self.events: list[str] = []
        self.tuned: list[Plan] = []
        self.steps: list[StepStats] = []
        self.baseline: Measured | None = None  # online: steps measured before the tuned plan
        self.measured = Measured()  # steps under the plan in force
        self.steps_seen = 0
        self.iteration = 0
        self._t0 = 0.0
        self._drift: str | None = None
        self._drift_keys: set[str] | None = set()  # plan keys the drifts since the last agreement are put down to; None: all

    def start(self) -> None:
        """Choose the start plan and put it in force (NCCL env, group options, routing, monitor).

        Ranks must start on one plan, or their first collectives disagree. Where process groups exist, rank 0
        reads the files and every rank receives its choice (a search, where one is needed, runs beside the
        job). Where they do not yet (Megatron starts Lagom right after parsing its arguments), each rank
        chooses a plan of its own, nothing NCCL reads is set, and ``agree_start`` puts rank 0's in force on
        every rank once a group exists.
        """
        _open_sessions.add(self)
        if self.workload is None or self.hw is None:
            self.runtime = open_runtime(None)
            self.event(f"Lagom only records this job: {self.why_untuned}", level=logging.WARNING)
            return
        if self.capability is None:
            self.capability = self._with_registration(runtime_capability(self.hw))
        if (job_world_size() or 1) > 1 and not self.control.distributed:
            self.runtime = open_runtime(None)  # records only: NCCL's own settings until the plan is agreed
            self._unagreed = self.start_plan()
            return
        self._begin(self.within_capability(self.start_plan()))

    # -- start-up ---------------------------------------------------------------------------------

    def symmetric_groups(self) -> tuple[str, ...]:
        """Plan groups whose collective buffers the framework registers symmetrically (the adapters know): the
        ZERO CTA policy is planned there only. None by default."""
        return ()

    def _with_registration(self, capability: Capability | None) -> Capability | None:
        groups = self.symmetric_groups()
        return replace(capability, symmetric_groups=groups) if capability is not None and groups else capability

    def _explore_channels(self) -> int | None:
        """Online mode with the tuner plugin: the most channels the live search may give a call (communicators
        are made with room for it). Without the plugin, channels cannot change live: the plan's range stays."""
        from lagom import nccl_tuner
        from lagom.plan.comm_config import channel_choices

        if self.options.mode != "online" or nccl_tuner.path() is None or self.hw is None:
            return None
        return max(channel_choices(self.hw))

    def communicator_configs(self) -> dict[str, dict[str, Any]]:
        """Per plan group, the settings its communicator is made with (online: with room to explore)."""
        return self.runtime.comm_configs() if self.runtime is not None else {}


    def _new_tuner(self) -> OnlineTuner:
        assert self.workload is not None and self.hw is not None
        return OnlineTuner(self.workload, self.hw, strategy=self.options.strategy, tune_steps=self.calibration_steps,
                           cache_dir=self.options.cache_dir, capability=self.capability)


    def _measuring(self, plan: Plan | None) -> None:
        """Online: the tuner measures the job as it runs under ``plan`` (its bucket sizes included; None: the
        framework's own settings)."""
        if self.tuner is None:
            return
        self.tuner.running_plan = plan
        self.tuner.model_workload = running_workload(self.tuner.workload, plan)
        self.tuning = True
        self._counters_at = plugin_counters()
        # the steps measured are those after the warm-up: every rank agrees on the plan after the last of them
        self._next_agreement = max(self.steps_seen, self.options.warmup_steps) + self.calibration_steps

    @property
    def tuning_underway(self) -> bool:
        """Online tuning is under way: calibration steps, rank 0's search beside the job, or live trials."""
        return self.tuning or self.searching or self.live_on

    @property
    def calibration_steps(self) -> int:
        return min(self.options.tune_steps, CALIBRATION_STEPS)


    # -- per step ---------------------------------------------------------------------------------
    def begin_step(self, step: int | None = None) -> None:
        if self._unagreed is not None and self.control.distributed:
            self.agree_start()  # the adapter found no earlier point: every rank reaches its first step
        self.iteration = self.iteration + 1 if step is None else step
        self.runtime.recorder.begin_step(self.iteration)
        if self.clock is None:
            self.clock = StepClock(bool(self.runtime.recorder.cuda))
        self.clock.begin(self.iteration)
        self._step_epoch[self.iteration] = self._epoch
        for old in [s for s in self._step_epoch if s < self.iteration - KEEP]:
            self._step_epoch.pop(old)
            self._step_records.pop(old, None)
        self._t0 = time.perf_counter()

    def end_step(self) -> Plan | None:
        """Close the step; returns a plan the online tuner adopted at this step, else None.

        Nothing here raises into the framework: a failure inside Lagom is kept for the next agreed
        step (or, where no agreement is due, switches Lagom off on this rank at once).
        """
        step_s = time.perf_counter() - self._t0
        records = self.runtime.recorder.end_step()
        if self.clock is not None:
            self.clock.end(self.iteration)
        if self.live_on:
            for r in records:
                self._step_records.setdefault(r.step, []).append(r)
        self.steps_seen += 1
        self.steps.append(StepStats(self.iteration, step_s, sum(r.duration_s for r in records), len(records),
                                    f"tuned {len(self.tuned)}" if self.tuned else "start"))
        if self.workload is None or self.off is not None:
            self.measured.add(step_s, records)
            return None
        if self.failure is None:
            try:
                self._observe(step_s, records)
            except Exception as err:  # noqa: BLE001 - Lagom must never fail the framework's step
                self._failed(err)
        if self.steps_seen != self._next_agreement:
            return None
        return self._agree()

    def _observe(self, step_s: float, records: list[CallRecord]) -> None:
        """This rank's own bookkeeping of a step; no collective."""
        if self.steps_seen <= self.options.warmup_steps:
            return
        if self.tuning and self.tuner is not None:
            self.baseline = self.baseline or Measured()
            self.baseline.add(step_s, records)
            self.tuner.add(step_s, records)
            return
        if self.live_on:  # the live search's steps: judged at the agreement, not measured as the tuned plan's
            return
        self.measured.add(step_s, records)
        if self.searching:  # the start plan runs on while rank 0 searches: measured, but no drift is watched
            return
        if self.measured.steps == self.options.tune_steps:
            self.write_report()
        self._watch(step_s, records)

    def _failed(self, err: Exception) -> None:
        self.failure = f"{type(err).__name__}: {err}"
        log.error("Lagom failed on rank %d at step %d (%s)", rank(), self.iteration, self.failure, exc_info=err)
        if self._next_agreement is None:  # nothing to agree on: no rank waits for this one inside Lagom
            self.switch_off(f"rank {rank()}: {self.failure}", agreed=False)

    def _agree(self) -> Plan | None:
        """The agreed step: whether any rank failed, saw drift, has no live table, or saw NCCL never consult
        the plugin while calibrating; whether rank 0's search is ready (and, while tuning live, the slowest
        rank's step and collective times); then the tuner's decision, on every rank.

        Settings that every rank must share (the tuner table, Flash-Overlap routing) change only here, after
        an agreement every rank took part in, and the table in two phases (``_switch_table``); when the
        agreement itself fails, they stay as they are.
        """
        try:
            order = self._drift_order()
            calibrated = rank() == 0 and self.tuner is not None and self.tuner.calibration is not None
            header = [float(self.failure is not None), self._drift_level(), float(calibrated),
                      # a rank without a live table while others may switch theirs: none switches NCCL's settings live
                      float((self.options.mode == "online" or self.search_at_start) and self.live_table is None),
                      float(self.tuning and not self._nccl_consulted()),
                      float(self._search is not None and self._search.done)]
            values = self.control.max([*header, *(float(self._drift_keys is None or k in self._drift_keys) for k in order),
                                       *self._live_values()], f"the agreement of step {self.iteration}")
        except Exception as err:  # noqa: BLE001 - a peer missing: nothing more can be agreed
            self.switch_off(str(err), agreed=False)
            return None
        if values[0] > 0:
            self.switch_off(self.failure and f"rank {rank()}: {self.failure}" or "a failure inside Lagom on "
                            "another rank (its log says what)", agreed=True)
            return None
        try:
            if values[3] > 0 and self.live_table is not None:
                self._drop_live_table("a rank has no live tuner table (its log says why), so no rank switches NCCL's "
                                      "settings live: algorithm, protocol, channels and chunk are tried on the model only")
            flags, live = values[len(header):len(header) + len(order)], values[len(header) + len(order):]
            if self.live_on:
                return self._live_step(live)
            if self.tuning and self.tuner is not None:
                self._calibrated(silent=values[4] > 0)
                return None
            if self.searching:
                return self._searched(ready=values[5] > 0)
            self._next_agreement = self.steps_seen + self.options.drift_check_steps
            drifted = {k for k, flag in zip(order, flags) if flag > 0}
            why = self._drift or "drift seen on another rank"
            # the drifted keys alone, live, where rank 0 has a calibrated model to rank their candidates
            if values[1] == 1 and drifted and values[2] > 0 and self.options.tune_steps > self.calibration_steps:
                self.event(f"step {self.iteration}: {why}; re-tuning {', '.join(sorted(drifted))} on live steps")
                self._start_live(only=drifted)
            elif values[1] > 0 and self.tuner is not None:
                self.tuner.reset()
                self._measuring(self.plan)  # type: ignore[arg-type]
                self.baseline = None
                self.event(f"step {self.iteration}: {why}; re-tuning from the next {self.calibration_steps} steps")
            self._drift, self._drift_keys = None, set()
        except Exception as err:  # noqa: BLE001 - rank 0's error reaches every rank; a local one must not fail the job
            self.switch_off(f"{type(err).__name__}: {err}", agreed=False)
        return None

    def _calibrated(self, silent: bool) -> None:
        """The calibration steps are over: rank 0 searches the calibrated model in a thread of its own while the
        job runs on; every rank asks at each step whether the plan is ready (``_searched``)."""
        assert self.tuner is not None
        self.tuning = False
        self.nccl_listens = not silent if self._nccl_backend() else None
        if self.nccl_listens is False:
            self.event("NCCL did not consult Lagom's tuner plugin on every rank during the calibration steps (another "
                       "NCCL_TUNER_PLUGIN, NCCL_ALGO or NCCL_PROTO, or a communicator made before Lagom set its "
                       "environment: NCCL keeps a failed plugin load for the whole process), so live trials change "
                       "only what Lagom routes itself (Flash-Overlap)", level=logging.WARNING)
        self.searching, self._search_kind = True, "online"
        self._next_agreement = self.steps_seen + 1
        if rank() == 0:
            self._search = self.tuner.search_in_background(self.options.search_seconds)

    def _searched(self, ready: bool) -> Plan | None:
        """Rank 0's search is over on every rank's word: its plan, adopted on every rank at this step; else the job
        runs one more step on the plan in force (no rank ever waits for the search)."""
        if not ready:
            self._next_agreement = self.steps_seen + 1
            return None
        payload = self._search.payload if self._search is not None else None
        start = self._search_kind == "start"
        payload = self.control.broadcast(payload, "the start-up plan" if start else "the online plan")
        self.searching, self._search = False, None
        if start:
            return self._start_searched(payload)
        assert self.tuner is not None
        plan = self.tuner.take(payload)
        self.reconciled = self.tuner.reconciled
        self.search_cuts.append(self.tuner.cut)
        self._next_agreement = self.steps_seen + self.options.drift_check_steps
        what = "online plan" + (f" ({self.tuner.cut}: the best found so far)" if self.tuner.cut else "")
        self.adopt(plan, self.iteration, (self.tuner.applies_now, self.tuner.next_start), what=what)
        if self.options.tune_steps > self.calibration_steps:
            self._start_live()
        return plan


    def _drift_order(self) -> list[str]:
        """The plan keys whose drift flags the agreement carries (none while tuning: no drift is watched)."""
        if self.plan is None or self.live_on or self.tuning or self.searching:
            return []
        return sorted(e.key for e in self.plan.entries)

    def _drift_level(self) -> float:
        """0: no drift on this rank; 1: drifts put down to plan keys (re-tune those live); 2: re-tune all."""
        if self._drift is None:
            return 0.0
        return 2.0 if self._drift_keys is None or not self._drift_keys else 1.0

    # -- live tuning ------------------------------------------------------------------------------

    def _refit(self) -> dict[str, Any]:
        """Rank 0: the model refitted to every setting tried live, for the report (``refit`` in its ``live``);
        a failure is reported, never raised, since every rank waits for this summary."""
        cal = self.tuner.calibration if self.tuner is not None else None
        if self.live is None or cal is None or not self.live.observations:
            return {}
        try:
            refit = online_refit(cal, self.live.observations)
        except Exception as err:  # noqa: BLE001 - the summary must reach every rank
            log.warning("lagom: refitting the model to the live trials failed: %s", err)
            return {"error": f"{type(err).__name__}: {err}"}
        if refit.kept:
            self.event(f"model not refitted to {refit.observations} measured windows: the refit fitted their steps "
                       f"worse than the calibration ({refit.step_error_before:.1%} median step error), kept")
        else:
            self.event(f"model refitted to {refit.observations} measured windows: step error "
                       f"{refit.step_error_before:.1%} -> {refit.step_error_after:.1%}" + (
                           "" if refit.slots_per_comm_cta is None else
                           f", GEMM slots per comm CTA {refit.slots_per_comm_cta:g}"))
        return refit.summary()

    def switch_off(self, why: str, agreed: bool) -> None:
        """Stop every decision Lagom makes in this job, on this rank. Said once, at ERROR, and kept for the report.

        ``agreed``: every rank switches off at this step, so the settings ranks must share go back to those of
        the start (Flash-Overlap calls to the framework's collectives, the tuner plugin's start rules in place of
        any live table), in two phases; otherwise they stay as they are, the same on every rank, since changing
        them on one rank alone could hang the framework. What was fixed at start-up stays as it was made.
        """
        if self.off is not None:
            return
        self.off, self.off_at = why, self.steps_seen
        if self.live is not None:
            self.live.stop()
        self.tuning = self.live_on = self.searching = False
        if self._search is not None:
            self._search.stop(wait=False)  # at its next evaluation; the step hook does not wait for it
        self._search = None
        self.tuner = self.live = None
        self.monitor = None
        self._next_agreement = None
        if agreed:
            self.router.plan = None
            self._switch_table(None, "the start rules")  # the live table out of force on every rank
        self.control.close()
        self.events.append(f"Lagom switched itself off: {why}")
        log.error("Lagom switched itself off on rank %d: %s. The job runs on with the framework's own settings.",
                  rank(), why)

    def adopt(self, plan: Plan, step: int, changes: tuple[list[str], list[str]] | None = None,
              what: str = "online plan") -> None:
        """Take a plan found while running: the routing applies now, the rest on the next start.

        ``changes``: (applies now, applies on the next start) as the tuner described them; by default
        they are worked out from the plan in force. ``what``: the plan's name in the log.
        """
        old = self.plan.configs() if self.plan is not None else {}
        now, later = changes if changes is not None else describe_changes(old, plan.configs())
        later = list(later)
        if self.plan is not None:
            later += self.framework_changes(self.plan, plan)
        self._put_in_force(plan)
        self.tuned.append(plan)
        self.measured = Measured()
        self.applied_now, self.next_start = now, later
        self._save(plan)
        self.event(f"step {step}: {what} taken ({plan.strategy}, {plan.evaluations} evaluations, cached in "
                   f"{self.options.cache_dir}). Applied now: {'; '.join(now) or 'nothing'}. On the next start "
                   f"(fixed when communicators and buffers are made): {'; '.join(later) or 'nothing'}")
        self.write_report()

    def framework_changes(self, old: Plan, new: Plan) -> list[str]:
        """Framework knobs (bucket sizes) that differ between two plans; they apply on the next start."""
        out = []
        for name, knobs in new.framework.items():
            was = old.framework.get(name, {})
            out += [f"{name}.{k} {was.get(k)} -> {v}" for k, v in knobs.items() if was.get(k) != v]
        return out

    def _watch(self, step_s: float, records: list[CallRecord]) -> None:
        if self.monitor is None:
            return
        reason = self.monitor.observe(step_s, records)
        if self.tuner is None:
            if reason:
                self.event(f"step {self.iteration}: {reason}; the offline plan may be stale (re-run `lagom tune`, "
                           "or use online mode)", level=logging.WARNING)
            return
        if reason is None:
            return
        self._drift = reason  # every rank hears of it at the next agreed step
        drifted = self.monitor.drifted
        plan_keys = KeyIndex(self._drift_order())
        matched = None if drifted is None else {plan_keys.match(k) for k in drifted}
        if matched is None or None in matched or self._drift_keys is None:
            self._drift_keys = None  # a drift no plan key accounts for: re-tune everything
        else:
            self._drift_keys |= matched  # type: ignore[arg-type]

    def event(self, text: str, level: int = logging.INFO) -> None:
        """Something the user should know: logged once (rank 0) and kept for the report."""
        self.events.append(text)
        if rank() == 0:
            log.log(level, "%s", text)

    # -- report -----------------------------------------------------------------------------------
    def framework_report(self) -> dict[str, Any]:
        """What only this framework's report has (the adapters add it)."""
        return {}

    def report(self) -> dict[str, Any]:
        return report.build(self)

    def write_report(self) -> None:
        """JSON + Markdown on rank 0, where the options ask for them."""
        if self.options.report_files is None or rank() != 0:
            return
        report.write(self.report(), self.options.report_files)

    def _cache_unadopted(self) -> None:
        """Rank 0, at close: a search the job ended before adopting (stopped at its next evaluation, so its payload
        is the best found so far, and the plan's notes say the search was cut) is cached for the next start, which
        runs it from its first step, as an adopted plan is; without it a job shorter than its search would search
        again at every start. A start-up search's plan is also written to ``plan_out``, as an adopted one is.
        Nothing changes in this job: its ranks close at different moments, so no collective runs here."""
        search = self._search
        if search is None or search.payload is None or self.off is not None or "error" in search.payload:
            return
        start = self._search_kind == "start"
        if not start and self.tuner is None:
            return
        try:
            if start:
                plan = Plan.from_dict(json.loads(search.payload["plan"]), "rank 0's start-up plan")
                self._model_cache().save(plan)
            else:
                assert self.tuner is not None
                plan = self.tuner.take(search.payload)  # cached per node, and logged
            self._save(plan)
        except Exception as err:  # noqa: BLE001 - closing must not fail the job
            log.warning("lagom: the plan found as the job ended could not be cached: %s", err)
            return
        what = "start-up" if start else "online"
        self.events.append(f"the job ended before every rank adopted the {what} plan ({search.budget.cut}: the best "
                           f"found so far); cached in {self.options.cache_dir} for the next start")

    def close(self) -> None:
        """Remove what this session added to the process (idempotent); adapters extend it with their own.

        A live table in force stays in the plugin: ranks close at different moments (an engine collected by
        one rank's garbage collector before another's), and a table changed by one rank alone could hang the
        next collective. It is the same on every rank, and the next session of the process puts the start
        rules back at its own agreed start (``_restore_start_rules``)."""
        _open_sessions.discard(self)
        if self._search is not None:
            self._search.stop()
            self._cache_unadopted()
            self._search = None
        if self.live is not None:
            self.live.stop()
            self.live = None
        self.control.close()
        if self.live_table is not None:
            self.live_table.close()
            self.live_table = None
        if self.runtime is not None:
            self.runtime.close()
            nccl_calls.detach(self.runtime.recorder)  # another session of the process may read NCCL's records


_open_sessions: weakref.WeakSet[TuningSession] = weakref.WeakSet()


@atexit.register
def _final_reports() -> None:
    """The final report of every session still open when the process ends (held weakly: an engine the
    program dropped takes its session with it)."""
    for session in list(_open_sessions):
        try:
            session.write_report()
        except Exception as err:  # noqa: BLE001 - one session's report must not stop the others'
            log.warning("Lagom's final report could not be written: %s", err)
        try:
            session.close()  # hooks, taps and threads out before the interpreter finalises
        except Exception as err:  # noqa: BLE001 - the process is ending: nothing may stop its exit
            log.warning("Lagom's session could not be closed at exit: %s", err)



