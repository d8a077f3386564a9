"""One tuned training job, whatever the framework: the plan in force, the per-step loop, the report.

Both adapters run the same session; each subclasses it only for what its framework fixes at start-up
(``apply_at_startup``) and what its report adds (``framework_report``). Data flows one way:

  start plan   online: the plan an earlier run cached; else the plan file (read only); else a search
               with the cost model, on rank 0; every rank receives rank 0's (where no process group
               exists yet, at ``agree_start``, before the framework makes its NCCL communicators).
               A plan that needs more than this process can apply (an older NCCL, no tuner plugin) is
               made again within what it has; the report says what was missing.
  calibration  online: the first steps are measured; rank 0 reconciles the model with the calls they
               issued (``lagom.reconcile``) and searches the calibrated model in a thread of its own;
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
import hashlib
import json
import logging
import os
import time
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lagom import emit
from lagom.calls import CallRecord, KeyIndex, mean_per_call
from lagom.capability import Capability
from lagom.errors import ConfigError, LagomError
from lagom.flash_overlap import FlashOverlapConfig
from lagom.hardware import Hardware
from lagom.plan import Plan, PlanEntry
from lagom.runtime.apply.control import DEFAULT_TIMEOUT_S, Control
from lagom.runtime.apply.runtime import job_world_size, open_runtime, registration_message, runtime_capability
from lagom.runtime.apply.step_clock import KEEP, StepClock
from lagom.runtime.online import report
from lagom.runtime.online.live import DEFAULT_BUDGET_S, ROUTED_FIELDS, LiveSearch, Trial, describe_live
from lagom.runtime.online.monitor import Monitor
from lagom.runtime.online.tuner import OnlineTuner, SearchThread, describe_changes
from lagom.runtime.online.tuner import refit as online_refit
from lagom.tune import make_plan, running_workload
from lagom.workload import Workload

log = logging.getLogger("lagom.session")
CALIBRATION_STEPS = 5  # online: steps measured under the start plan before the model is fitted to them


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _buffsize_in_force() -> int:
    """The NCCL_BUFFSIZE this process's NCCL read (once, at its first communicator): the environment's, else
    NCCL's default."""
    from lagom.capability import DEFAULT_BUFFSIZE

    value = os.environ.get("NCCL_BUFFSIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else DEFAULT_BUFFSIZE


def _fingerprint(plan: Plan) -> str:
    """A plan's identity across ranks: the hash of its JSON."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]


def _plugin_counters() -> Any:
    """The tuner plugin's counters in this process (``PluginCounters``), or None without the plugin."""
    from lagom.nccl_tuner.live import LiveTableError, counters

    try:
        return counters()
    except (LiveTableError, OSError):
        return None


# Whether a live tuner table of a session is in force in this process's plugin (the table is process-wide and
# outlives the session that published it when that session closed mid-tuning).
_live_table_published = False


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


@dataclass(frozen=True)
class SessionOptions:
    """What a user chose, in framework-neutral terms (Megatron's flags and DeepSpeed's section map here)."""

    mode: str = "offline"  # offline | online
    strategy: str = "lagom"
    tune_steps: int = 60  # online: the step budget; the first CALIBRATION_STEPS fit the model, the rest try settings live
    tune_seconds: float = DEFAULT_BUDGET_S  # online: the wall-clock budget of the live search
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


class TuningSession:
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
        self.reconciled: dict[str, Any] = {}  # the model's keys against the measured calls (``lagom.reconcile``)
        self._search: SearchThread | None = None  # rank 0's
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

    # -- start-up ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Choose the start plan and put it in force (NCCL env, group options, routing, monitor).

        Ranks must start on one plan, or their first collectives disagree. Where process groups exist, rank 0
        reads the files and searches and every rank receives its choice. Where they do not yet (Megatron
        starts Lagom right after parsing its arguments), each rank chooses a plan of its own, nothing NCCL
        reads is set, and ``agree_start`` puts rank 0's in force on every rank once a group exists.
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
            if plan is not None and _fingerprint(plan) != rank0["fingerprint"]:
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
                "fingerprint": _fingerprint(start.plan) if start.plan is not None else "", "source": start.source,
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
        self._counters_start = _plugin_counters()
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

    def _restore_start_rules(self) -> None:
        """A live table an earlier session of this process left in force (it closed mid-tuning, or switched
        off without an agreement) would override this session's rules: every rank puts the start rules back,
        agreed, before this session's first step."""
        from lagom.nccl_tuner.live import LiveTable, LiveTableError

        if not self.control.any([_live_table_published], "whether a live tuner table is in force")[0]:
            return
        table = self.live_table
        try:
            table = table or LiveTable.create(self.world_size)
        except (LiveTableError, OSError):
            table = None  # no plugin in this process: no table was ever in force here; the peers stage alone
        try:
            if self._switch_table(None, "the start rules in place of an earlier session's live table", table):
                self.event("an earlier session's live tuner table was still in force: the start rules are back")
        finally:
            if table is not None and table is not self.live_table:
                table.close()

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
        from lagom.comm_config import channel_choices

        if self.options.mode != "online" or nccl_tuner.path() is None or self.hw is None:
            return None
        return max(channel_choices(self.hw))

    def communicator_configs(self) -> dict[str, dict[str, Any]]:
        """Per plan group, the settings its communicator is made with (online: with room to explore)."""
        return self.runtime.comm_configs() if self.runtime is not None else {}

    def _open_live_table(self) -> Any:
        """The tuner plugin's live table for this session (private to this user), or None where it cannot be had."""
        from lagom import nccl_tuner

        try:
            from lagom.nccl_tuner.live import LIVE_TABLE_ENV, LiveTable

            table = LiveTable.create(self.world_size)
        except Exception as err:  # noqa: BLE001 - no plugin, no table: live tuning still switches Flash-Overlap
            self.event(f"no live tuner table ({err if nccl_tuner.path() is not None else nccl_tuner.UNAVAILABLE}): "
                       "algorithm, protocol, channels and chunk are tried on the model only", level=logging.WARNING)
            return None
        if not self.runtime.export(LIVE_TABLE_ENV, str(table.path)):
            self.event(f"{LIVE_TABLE_ENV} is set in the environment: this session's live table is not the one NCCL "
                       "reads, so live tuning does not change NCCL's settings", level=logging.WARNING)
        return table

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

    def _new_tuner(self) -> OnlineTuner:
        assert self.workload is not None and self.hw is not None
        return OnlineTuner(self.workload, self.hw, strategy=self.options.strategy, tune_steps=self.calibration_steps,
                           cache_dir=self.options.cache_dir, capability=self.capability)

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

    def _measuring(self, plan: Plan) -> None:
        """Online: the tuner measures the job as it runs under ``plan`` (its bucket sizes included)."""
        if self.tuner is None:
            return
        self.tuner.running_plan = plan
        self.tuner.model_workload = running_workload(self.tuner.workload, plan)
        self.tuning = True
        self._counters_at = _plugin_counters()
        # the steps measured are those after the warm-up: every rank agrees on the plan after the last of them
        self._next_agreement = max(self.steps_seen, self.options.warmup_steps) + self.calibration_steps

    @property
    def tuning_underway(self) -> bool:
        """Online tuning is under way: calibration steps, rank 0's search beside the job, or live trials."""
        return self.tuning or self.searching or self.live_on

    @property
    def calibration_steps(self) -> int:
        return min(self.options.tune_steps, CALIBRATION_STEPS)

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
                      float(self.options.mode == "online" and self.live_table is None),
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
        self.searching = True
        self._next_agreement = self.steps_seen + 1
        if rank() == 0:
            self._search = self.tuner.search_in_background()

    def _searched(self, ready: bool) -> Plan | None:
        """Rank 0's search is over on every rank's word: its plan, adopted on every rank at this step; else the job
        runs one more step on the plan in force (no rank ever waits for the search)."""
        assert self.tuner is not None
        if not ready:
            self._next_agreement = self.steps_seen + 1
            return None
        payload = self._search.payload if self._search is not None else None
        payload = self.control.broadcast(payload, "the online plan")
        self.searching, self._search = False, None
        plan = self.tuner.take(payload)
        self.reconciled = self.tuner.reconciled
        self._next_agreement = self.steps_seen + self.options.drift_check_steps
        self.adopt(plan, self.iteration, (self.tuner.applies_now, self.tuner.next_start))
        if self.options.tune_steps > self.calibration_steps:
            self._start_live()
        return plan

    def _nccl_backend(self) -> bool:
        """Whether the job's collectives run on NCCL (only there can the tuner plugin change anything)."""
        return dist.is_initialized() and "nccl" in str(dist.get_backend()).lower()

    def _nccl_consulted(self) -> bool:
        """Whether NCCL called the tuner plugin's getCollInfo in this process since calibration began."""
        now = _plugin_counters()
        return now is not None and self._counters_at is not None and now.since(self._counters_at).coll_infos > 0

    def plugin_calls(self) -> dict[str, Any] | None:
        """What NCCL asked the tuner plugin in this process since the plan was put in force, per step, for the
        report (None without the plugin)."""
        now = _plugin_counters()
        if now is None or self._counters_start is None:
            return None
        since, steps = now.since(self._counters_start), max(1, self.steps_seen)
        return {"communicators": since.inits, "coll_infos_per_step": since.coll_infos / steps,
                "applied_per_step": since.applied / steps, "consulted_while_calibrating": self.nccl_listens}

    def _drop_live_table(self, why: str) -> None:
        if self.live_table is not None:
            self.live_table.close()
            self.live_table = None
            self.event(why, level=logging.WARNING)

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
    def _start_live(self, only: set[str] | None = None) -> None:
        """Try settings on the next steps, every step an agreed one; rank 0 runs the search (``lagom.runtime.online.live``)
        over every key, or over ``only`` (keys that drifted) with the others kept as they are."""
        plan = self.plan
        assert plan is not None and self.tuner is not None
        self.live_reference = plan
        self.live_keys = sorted(e.key for e in plan.entries)
        self.live_on = True
        self._next_agreement = self.steps_seen + 1
        if not self._put_live(plan.configs()):  # the reference, on every rank: the noise steps measure what is in force
            return
        budget = self.options.tune_steps - self.calibration_steps
        if rank() == 0 and self.tuner.calibration is not None:
            cal = self.tuner.calibration
            reference = {k: cfg for k, cfg in plan.configs().items() if k in cal.problem.keys}
            # where NCCL never consults the plugin, its settings are not tried: a trial of them would be noise
            fields = ROUTED_FIELDS if self.nccl_listens is False else None
            problem = cal.under_buffsize(_buffsize_in_force())  # chunks NCCL would cut are never tried
            self.live = LiveSearch(problem, cal.simulator, reference, max_channels=self._max_channels(),
                                   budget_steps=budget, budget_s=self.options.tune_seconds, only=only,
                                   first_trial=len(self.trials) + 1, fields=fields)
        self.event(f"step {self.iteration}: trying settings on live steps (at most {budget} steps or "
                   f"{self.options.tune_seconds:g} s){self._live_reach()}")

    def _max_channels(self) -> dict[str, int]:
        """Per group whose NCCL communicator got options, the most channels it was made with (NCCL cannot go
        above it live); groups on other backends have no such limit."""
        return {group: int(cfg["max_ctas"]) for group, cfg in self.communicator_configs().items()
                if group in self.runtime.applied_groups and "max_ctas" in cfg}

    def _live_reach(self) -> str:
        """What the live settings reach in this process, for the log and the report."""
        if self.live_table is None:
            return "; NCCL's settings cannot change live here (no tuner plugin table): only Flash-Overlap routing does"
        if self.nccl_listens is False:
            return "; NCCL does not consult the tuner plugin on every rank: only Flash-Overlap routing is tried"
        if not self._nccl_backend():
            return "; this job's backend is not NCCL, so the tuner table changes nothing it runs (the loop is the same)"
        return ""

    @property
    def _judged_step(self) -> int:
        """The step the live loop judges at this step's end: this one on the host, ``clock.lag`` back on a GPU."""
        return self.iteration - (self.clock.lag if self.clock is not None else 0)

    def _live_values(self) -> list[float]:
        """This rank's judged step for the agreement: whether it is not ready (its device time unknown yet, or
        it ran other settings than those in force now), its time and each key's mean seconds per call (0: none)."""
        if not self.live_on:
            return []
        step = self._judged_step
        step_s = self.clock.seconds(step) if self.clock is not None else None
        if step_s is None or self._step_epoch.get(step) != self._epoch or step in self._first_steps:
            return [1.0, 0.0, *(0.0 for _ in self.live_keys)]
        means = mean_per_call(self._step_records.get(step, []), KeyIndex(self.live_keys).match)
        return [0.0, step_s, *(means.get(k, 0.0) for k in self.live_keys)]

    def _live_step(self, values: list[float]) -> Plan | None:
        from lagom.runtime.online.live import Decision

        if values[0] > 0:  # some rank cannot judge its step yet (or it ran the settings before): the next one
            if self.live is not None:
                self.live.unjudged_step()  # a step the search could not use still spends its budget
            self._next_agreement = self.steps_seen + 1
            return None
        decision: Decision | None = None
        if self.live is not None:
            keys = {k: v for k, v in zip(self.live_keys, values[2:]) if v > 0}
            decision = self.live.after_step(self._judged_step, values[1], keys)
        decision = self.control.broadcast(decision, f"the live decision of step {self.iteration}")
        if decision.configs is not None and not self._put_live(decision.configs):
            return None  # not switched on any rank: Lagom is off (``_switch_table`` said why)
        if not decision.done:
            self._next_agreement = self.steps_seen + 1
            return None
        return self._end_live(decision.configs or {})

    def _with_configs(self, configs: dict[str, Any]) -> Plan:
        plan = self.live_reference or self.plan
        assert plan is not None
        return replace(plan, entries=[replace(e, config=configs[e.key]) if e.key in configs else e for e in plan.entries])

    def _put_live(self, configs: dict[str, Any]) -> bool:
        """Every rank, at the same step: the tuner table and the Flash-Overlap routing for ``configs``; False when
        the table could not be switched on every rank (then none switched, and Lagom is off)."""
        plan = self._with_configs(configs)
        if not self._switch_table(emit.tuner_rules(plan), f"the live settings of step {self.iteration}"):
            return False
        self.router.plan = plan
        self._epoch += 1  # the next step is the first that runs them
        # the first step of an algorithm or protocol new to the job pays its connection setup, buffers and kernel
        # loading once: it is not judged, so trials are not biased against new algorithms
        pairs = {(cfg.algorithm, cfg.protocol) for cfg in configs.values()}
        if self._algorithms_run and pairs - self._algorithms_run:
            self._first_steps.add(self.iteration + 1)
        self._algorithms_run |= pairs
        return True

    def _switch_table(self, rules: str | None, what: str, table: Any = None) -> bool:
        """Put ``rules`` (None: the start rules) in force in the tuner plugin on every rank, or on none.

        Two phases: every rank stages the table (writes it, has the plugin parse and hold it), the ranks agree
        that every one of them staged it, then each publishes it, a pointer swap that cannot fail. A rank that
        cannot stage makes every rank discard and switch Lagom off together (back to the start rules, which
        cannot be refused); an agreement that fails leaves every rank on the table it had, which is the same.
        Every rank calls it at the same point, with or without a table of its own (``table``: another than
        the session's, to put the start rules back with).
        """
        global _live_table_published
        from lagom.nccl_tuner.live import LiveTableError

        table, refusal = table or self.live_table, ""
        if table is not None:
            try:
                table.stage(rules)
            except (LiveTableError, OSError) as err:
                refusal = f"{type(err).__name__}: {err}"
                log.error("Lagom on rank %d could not stage %s: %s", rank(), what, refusal)
        try:
            refused = self.control.any([bool(refusal)], f"{what}: staged on every rank")[0]
        except Exception as err:  # noqa: BLE001 - a peer missing: no rank publishes
            if table is not None:
                table.discard()
            self.switch_off(str(err), agreed=False)
            return False
        if refused:
            if table is not None:
                table.discard()
            self.switch_off(f"{what} could not be staged on " + (f"rank {rank()} ({refusal})" if refusal else
                                                                  "another rank (its log says why)"), agreed=True)
            return False
        if table is not None and table.publish():
            _live_table_published = rules is not None
        return True

    def _end_live(self, configs: dict[str, Any]) -> Plan:
        reference = self.live_reference
        assert reference is not None
        final = self._with_configs(configs)
        summary: dict[str, Any] = {}
        if self.live is not None:
            summary = {"why": getattr(self.live, "why", ""), "evaluations": self.live.evaluations,
                       "keys": sorted(self.live.only) if self.live.only is not None else "all",
                       "noise": self.live.noise, "reference_step_s": self.live.reference_step_s,
                       "steps_s": self.live.steps_s, "cost_s": self.live.cost_s(),
                       "steps": self.live.steps_used, "confidence": self.live.confidence(),
                       "clamped": sorted(self.live.clamped), "accepted": self.live.accepted,
                       "refused": self.live.refused, "window_steps": self.live.window, "alpha": self.live.alpha,
                       "trials": [asdict(t) for t in self.live.trials], "refit": self._refit()}
        summary = self.control.broadcast(summary, "the live tuning summary")
        trials = [Trial(**t) for t in summary.pop("trials", [])]
        self.trials += trials  # a drift's re-tune adds its own to the first round's
        final.measured = {"steps": summary.get("steps", 0), "confidence": summary.get("confidence", 1.0),
                          "trials": len(trials)}
        self.live_summary = summary
        self.live_on, self.live = False, None
        now = describe_live(final.configs(), reference.configs())
        self._next_agreement = self.steps_seen + self.options.drift_check_steps
        self.adopt(final, self.iteration, (now, self.next_start))
        if self.tuner is not None:
            self.tuner.plan = final
            self.tuner._save(final)  # noqa: SLF001 - the cache holds the measured plan
        return final

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

    def adopt(self, plan: Plan, step: int, changes: tuple[list[str], list[str]] | None = None) -> None:
        """Take a plan found while running: the routing applies now, the rest on the next start.

        ``changes``: (applies now, applies on the next start) as the tuner described them; by default
        they are worked out from the plan in force.
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
        self.event(f"step {step}: online plan taken ({plan.strategy}, {plan.evaluations} evaluations, cached in "
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

    def close(self) -> None:
        """Remove what this session added to the process (idempotent); adapters extend it with their own.

        A live table in force stays in the plugin: ranks close at different moments (an engine collected by
        one rank's garbage collector before another's), and a table changed by one rank alone could hang the
        next collective. It is the same on every rank, and the next session of the process puts the start
        rules back at its own agreed start (``_restore_start_rules``)."""
        _open_sessions.discard(self)
        if self.live is not None:
            self.live.stop()
            self.live = None
        self.control.close()
        if self.live_table is not None:
            self.live_table.close()
            self.live_table = None
        if self.runtime is not None:
            self.runtime.close()


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



