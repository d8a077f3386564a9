"""Online tuning: measure the first steps, calibrate the model to them, search, share the plan.

The measured steps say how long each tuning key's collectives and the whole step really take with
the settings in force. The cost model is scaled to agree (comm time per key, compute overall), and
the search runs on that calibrated simulator: one search on rank 0, instead of trying settings on
live steps. Every rank gets the same plan by broadcast, and it is cached per workload, machine and
world size, so the next start needs no tuning steps.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lagom.errors import ConfigError, LagomError
from lagom.hardware import Hardware, load_hardware
from lagom.model.calibrated import CalibratedModel
from lagom.model.reconcile import reconcile
from lagom.model.simulator import Configs, Simulator, StepResult
from lagom.plan.capability import Capability, capability_for
from lagom.plan.comm_config import PROCESS_FIELDS, CommConfig, Transport
from lagom.plan.plan import Plan
from lagom.runtime.apply import runtime
from lagom.runtime.apply.control import Control
from lagom.runtime.online.background import SearchThread
from lagom.runtime.online.cache import PlanCache
from lagom.search import STRATEGIES, Problem, SearchResult, run_strategy
from lagom.search.base import SimulatedEvaluator, nccl_configs
from lagom.search.driver import Budget
from lagom.step.calls import SIZE_TOLERANCE, CallRecord, KeyIndex
from lagom.step.workload import Workload, load_workload, validate
from lagom.tune import Tuned, plan_from, problem_for

log = logging.getLogger("lagom.online")

SCALE_LIMITS = (1e-3, 1e3)  # a calibration factor outside this is a measurement problem, not the model
STEP_TOLERANCE = 2e-3  # the calibrated step matches the measured one to 0.2%
# Comm and compute scales interact (contention, and what hides under what): fit them in turn until
# no scale moves by more than CALIBRATION_TOLERANCE, at most CALIBRATION_ROUNDS times.
CALIBRATION_ROUNDS = 10
CALIBRATION_TOLERANCE = 2e-3
# What an adapter can switch between steps, and what is fixed when communicators and buffers are made.
APPLIES_NOW = {"decomposition": "Flash-Overlap decomposition", "num_chunks": "chunks per peer step"}
# a collective's priority is its communicator's stream, chosen when the process group is created
NEXT_START = {"priority": "priority (communicator high-priority stream)",
              "channels": "CTAs (communicator max_ctas/min_ctas)", "chunk_bytes": "chunk bytes (NCCL_BUFFSIZE)",
              "threads": "threads (NCCL_NTHREADS)", "algorithm": "algorithm (NCCL tuner)",
              "protocol": "protocol (NCCL tuner)", "transport": "transport"}


@dataclass
class Calibration:
    """The calibrated problem (its ``model`` is a CalibratedModel) and how it was fitted.

    ``problem`` keeps the input problem's open space, capability and per-process values, so a search
    of it may choose other per-process values; ``simulator`` ran the fit and is the one to search with
    (it has the step graph's indexes built).
    """

    problem: Problem
    measured_step_s: float
    calibrated_step_s: float  # the simulated step with the settings in force, after fitting
    measured: dict[str, float]  # model key -> measured mean seconds per call
    simulator: Simulator
    unmatched: list[str] = field(default_factory=list)  # keys seen at run time that the model lacks
    unmeasured: list[str] = field(default_factory=list)  # model keys no timed call matched (scale 1)
    bounded_calls: int = 0  # calls timed only up to their wait (no completion callback)

    @property
    def model(self) -> CalibratedModel:
        model = self.problem.model
        assert isinstance(model, CalibratedModel), "a calibration's problem is priced by its calibrated model"
        return model

    def under_buffsize(self, buffsize: int) -> Problem:
        """The calibrated problem under the NCCL_BUFFSIZE the running processes read once (a live trial cannot
        change it): its search never offers a chunk NCCL would cut, and its model prices the chunks NCCL runs."""
        capability = replace(self.problem.cap, buffsize=buffsize)
        return Problem(self.problem.graph, self.problem.hw, self.problem.open_space, capability, self.problem.process,
                       _rescaled(self.model, self.model.hw, capability))


def service_times(records: Iterable[CallRecord]) -> list[tuple[CallRecord, float]]:
    """Each timed call's own run time: calls on one communicator run one after another, so a
    call issued while an earlier one still runs starts when that one ends. Untimed calls (tracked
    without a work, zero length) are left out."""
    by_stream: dict[tuple[int, str], list[CallRecord]] = {}
    for r in records:
        if r.end_s > r.start_s:
            by_stream.setdefault((r.step, r.group), []).append(r)
    out = []
    for calls in by_stream.values():
        busy_until = -math.inf
        for r in sorted(calls, key=lambda c: (c.start_s, c.seq)):
            out.append((r, r.end_s - max(r.start_s, busy_until)))
            busy_until = max(busy_until, r.end_s)
    return out


def _fit_compute(simulator: Simulator, configs: Configs, model: CalibratedModel, target: float) -> float:
    """The compute scale that makes the simulated step last ``target`` (the step grows with it)."""
    seen: dict[float, float] = {}

    def step(scale: float) -> float:
        if scale not in seen:
            model.compute_scale = scale
            seen[scale] = simulator.run(configs, model).step_s
        return seen[scale]

    lo_limit, hi_limit = SCALE_LIMITS
    start = model.compute_scale
    guess = min(hi_limit, max(lo_limit, start * target / step(start)))
    lo, hi = max(lo_limit, guess / 2), min(hi_limit, guess * 2)
    while lo > lo_limit and step(lo) > target:
        lo = max(lo_limit, lo / 4)
    while hi < hi_limit and step(hi) < target:
        hi = min(hi_limit, hi * 4)
    if step(lo) >= target or step(hi) <= target:
        edge = lo if step(lo) >= target else hi
        log.warning("compute scale pinned at %.3g: the measured step (%.4g s) is outside what scaling compute can "
                    "reach with the measured comm times", edge, target)
        model.compute_scale = edge
        return edge
    mid = math.sqrt(lo * hi)
    while hi / lo > 1 + STEP_TOLERANCE and abs(step(mid) - target) > STEP_TOLERANCE * target:
        lo, hi = (mid, hi) if step(mid) < target else (lo, mid)
        mid = math.sqrt(lo * hi)
    model.compute_scale = mid
    return mid


def calibrate(problem: Problem, configs: Configs, records: list[CallRecord], step_s: float,
              size_tolerance: float = SIZE_TOLERANCE, simulator: Simulator | None = None) -> Calibration:
    """Scale the model so that, with ``configs`` (the settings in force), it reproduces the measurements.

    ``problem`` is the planning problem under the per-process values in force; the calibrated one
    searches the same open space within the same capability. ``simulator``: one of ``problem``'s graph
    to reuse (default: a new one); every run of the fit goes through it.
    """
    index = KeyIndex(problem.keys, size_tolerance)
    total: dict[str, float] = {}
    calls: dict[str, int] = {}
    unmatched: set[str] = set()
    bounded = 0
    for r, seconds in service_times(records):
        key = index.match(r.key)
        if key is None:
            unmatched.add(r.key)
            continue
        total[key] = total.get(key, 0.0) + seconds
        calls[key] = calls.get(key, 0) + 1
        bounded += not r.exact
    measured = {k: total[k] / calls[k] for k in total}
    model = CalibratedModel(problem.hw, problem.capability)
    simulator = simulator or Simulator(problem.graph)
    cal = problem.with_model(model)
    lo, hi = SCALE_LIMITS
    for _ in range(CALIBRATION_ROUNDS):
        per_key = simulator.run(configs, model).per_key()
        before = {**model.comm_scale, "compute": model.compute_scale}
        scales = dict(model.comm_scale)
        for key, seconds in measured.items():
            row = per_key.get(key)
            if row and row["count"] and row["time"] > 0:
                scales[key] = min(hi, max(lo, scales.get(key, 1.0) * seconds / (row["time"] / row["count"])))
        model.set_comm_scale(scales)
        _fit_compute(simulator, configs, model, step_s)
        after = {**model.comm_scale, "compute": model.compute_scale}
        if all(abs(after[k] / before.get(k, 1.0) - 1) <= CALIBRATION_TOLERANCE for k in after):
            break
    return Calibration(cal, step_s, simulator.run(configs, model).step_s, measured, simulator, sorted(unmatched),
                       sorted(set(problem.keys) - set(measured)), bounded)


@dataclass(frozen=True)
class Observation:
    """Steps measured under one setting while tuning live: the settings, the mean step, each key's mean call."""

    configs: Configs
    step_s: float
    keys: dict[str, float]


REFIT_SLOTS = (0.0, 0.5, 1.0, 1.5, 2.0)  # GEMM CTA slots per comm CTA tried by the refit
REFIT_ROUNDS = 2
REFIT_TOLERANCE = 1e-2  # the compute scale's bisection stops within 1%
REFIT_SETTINGS = 16  # at most this many distinct settings (the latest) are refitted to: it runs between two steps


@dataclass
class Refit:
    """The calibration refitted to every setting tried live (``refit``), and how well each fits the steps."""

    calibration: Calibration
    observations: int
    step_error_before: float  # median |simulated - measured| / measured over the observations
    step_error_after: float
    slots_per_comm_cta: float | None  # fitted where the observations ran more than one channel count of a key
    kept: bool = False  # the refit fitted the steps worse than the calibration did, which is kept as it was

    def summary(self) -> dict[str, Any]:
        model = self.calibration.model
        return {"observations": self.observations, "step_error_before": self.step_error_before,
                "step_error_after": self.step_error_after, "compute_scale": model.compute_scale,
                "gemm_slots_per_comm_cta": self.slots_per_comm_cta, "comm_scale": dict(model.comm_scale),
                "kept_calibration": self.kept}


def _step_errors(cal: Calibration, model: CalibratedModel, observations: list[Observation]) -> list[float]:
    """log(simulated / measured) of each observation's step."""
    return [math.log(cal.simulator.run(o.configs, model).step_s / o.step_s) for o in observations]


def _refit_compute(cal: Calibration, model: CalibratedModel, observations: list[Observation]) -> float:
    """The compute scale at which the simulated steps are as often long as short (mean log error zero); the
    simulated step grows with it, so a bisection in log space finds it. Returns the mean squared log error."""
    lo, hi = SCALE_LIMITS

    def mean_error(scale: float) -> float:
        model.compute_scale = scale
        return statistics.fmean(_step_errors(cal, model, observations))

    low, high = max(lo, model.compute_scale / 4), min(hi, model.compute_scale * 4)
    at_low, at_high = mean_error(low), mean_error(high)
    if at_low > 0 or at_high < 0:  # outside what scaling compute reaches: keep the nearer edge
        model.compute_scale = low if at_low > 0 else high
    else:
        while high / low > 1 + REFIT_TOLERANCE:
            mid = math.sqrt(low * high)
            low, high = (mid, high) if mean_error(mid) < 0 else (low, mid)
        model.compute_scale = math.sqrt(low * high)
    return statistics.fmean(e * e for e in _step_errors(cal, model, observations))


def _refit_comm(cal: Calibration, model: CalibratedModel, observations: list[Observation]) -> None:
    """Each key's comm scale: the geometric mean of measured over simulated per call, over every observation
    that timed it."""
    lo, hi = SCALE_LIMITS
    logs: dict[str, list[float]] = {}
    for o in observations:
        per_key = cal.simulator.run(o.configs, model).per_key()
        for key, seconds in o.keys.items():
            row = per_key.get(key)
            if row and row["count"] and row["time"] > 0 and seconds > 0:
                logs.setdefault(key, []).append(math.log(seconds / (row["time"] / row["count"])))
    scales = dict(model.comm_scale)
    for key, values in logs.items():
        scales[key] = min(hi, max(lo, scales.get(key, 1.0) * math.exp(statistics.fmean(values))))
    model.set_comm_scale(scales)


def _with_slots(cal: Calibration, slots: float | None) -> CalibratedModel:
    """The calibration's model on hardware whose residency is ``slots`` (None: the profile's), scales kept."""
    old = cal.model
    hw = old.hw if slots is None else replace(old.hw, contention=replace(old.hw.contention, gemm_slots_per_comm_cta=slots))
    return _rescaled(old, hw, old.capability)


def _rescaled(old: CalibratedModel, hw: Hardware, capability: Capability) -> CalibratedModel:
    """A calibrated model on ``hw`` under ``capability`` with ``old``'s scales."""
    model = CalibratedModel(hw, capability)
    model.set_comm_scale(old.comm_scale)
    model.compute_scale = old.compute_scale
    return model


def _merged(observations: list[Observation]) -> list[Observation]:
    """One observation per distinct setting (the reference is measured between every two candidates): the mean
    of its steps and of each key's calls, in the order the settings were first seen."""
    groups: dict[tuple, list[Observation]] = {}
    for o in observations:
        groups.setdefault(tuple(sorted(o.configs.items())), []).append(o)
    out = []
    for same in groups.values():
        keys: dict[str, list[float]] = {}
        for o in same:
            for k, v in o.keys.items():
                keys.setdefault(k, []).append(v)
        out.append(Observation(same[0].configs, statistics.fmean(o.step_s for o in same),
                               {k: statistics.fmean(v) for k, v in keys.items()}))
    return out


def refit(cal: Calibration, observations: list[Observation]) -> Refit:
    """Fit the calibration's scales to every setting tried, not only the one in force at the start: comm per
    key and compute overall, and, where the observations ran some key at more than one channel count, the
    contention slope (GEMM CTA slots one comm CTA takes) too. ``cal`` is left as it was."""
    observations = _merged([o for o in observations if o.step_s > 0])[-REFIT_SETTINGS:]
    before = [abs(math.expm1(e)) for e in _step_errors(cal, cal.model, observations)] if observations else []
    if not observations:
        return Refit(cal, 0, 0.0, 0.0, None)
    channel_counts: dict[str, set[int]] = {}
    for o in observations:
        for key, c in o.configs.items():
            channel_counts.setdefault(key, set()).add(c.channels)
    varied = any(len(v) > 1 for v in channel_counts.values())
    best: tuple[float, float | None, CalibratedModel] | None = None
    for slots in (REFIT_SLOTS if varied else (None,)):
        model = _with_slots(cal, slots)
        loss = 0.0
        for _ in range(REFIT_ROUNDS):
            _refit_comm(cal, model, observations)
            loss = _refit_compute(cal, model, observations)
        if best is None or loss < best[0]:
            best = (loss, slots, model)
    assert best is not None
    _, slots, model = best
    problem = Problem(cal.problem.graph, model.hw, cal.problem.open_space, cal.problem.capability, cal.problem.process,
                      model)
    refitted = replace(cal, problem=problem, calibrated_step_s=cal.simulator.run(observations[0].configs, model).step_s)
    after = [abs(math.expm1(e)) for e in _step_errors(cal, model, observations)]
    if statistics.median(after) > statistics.median(before):  # the scales' fit is not the step's: keep the calibration
        return Refit(cal, len(observations), statistics.median(before), statistics.median(before), None, kept=True)
    return Refit(refitted, len(observations), statistics.median(before), statistics.median(after), slots)


def describe_changes(old: Configs, new: Configs) -> tuple[list[str], list[str]]:
    """(what applies now, what applies on the next start), one line per changed tuning key."""
    now: list[str] = []
    later: list[str] = []
    for key, cfg in new.items():
        before = old.get(key)
        if before is None or before == cfg:
            continue
        diffs = {f.name: (getattr(before, f.name), getattr(cfg, f.name)) for f in fields(CommConfig)
                 if getattr(before, f.name) != getattr(cfg, f.name)}
        for table, out in ((APPLIES_NOW, now), (NEXT_START, later)):
            parts = [f"{label} {diffs[name][0]} -> {diffs[name][1]}" for name, label in table.items() if name in diffs]
            if parts:
                out.append(f"{key}: {', '.join(parts)}")
    return now, later


def _as_workload(workload: Workload | str | Path) -> Workload:
    return workload if isinstance(workload, Workload) else load_workload(workload)


def _as_hardware(hw: Hardware | str) -> Hardware:
    return hw if isinstance(hw, Hardware) else load_hardware(str(hw))


class OnlineTuner:
    """Tunes a running job from its first ``tune_steps`` steps; see the module docstring.

    ``running_plan``: the plan in force while measuring (default: the active runtime's plan when it
    was made for this workload; else NCCL's defaults are what runs). ``capability``: what this
    process can apply, the search's limits (default: ``capability_for(hw)``, this install's plugin
    and the profile's NCCL).
    """

    def __init__(self, workload: Workload | str | Path, hw: Hardware | str, *, strategy: str = "lagom",
                 tune_steps: int = 5, cache_dir: str | Path = ".lagom-cache", group: Any = None,
                 running_plan: Plan | None = None, size_tolerance: float = SIZE_TOLERANCE,
                 model_workload: Workload | None = None, capability: Capability | None = None) -> None:
        self.workload, self.hw = _as_workload(workload), _as_hardware(hw)
        self.capability = capability or capability_for(self.hw)
        # what is modelled: the job as it runs (e.g. with a plan's bucket sizes); ``workload`` keys caches and plans
        self.model_workload = model_workload or self.workload
        if strategy not in STRATEGIES:
            raise ConfigError("strategy", f"unknown '{strategy}'", f"use one of {', '.join(STRATEGIES)}")
        if tune_steps < 1:
            raise ConfigError("tune_steps", f"must be at least 1, got {tune_steps}")
        validate(self.workload, self.hw.cluster.world_size)
        self.world_size = dist.get_world_size() if dist.is_initialized() else self.workload.world_size
        if self.world_size != self.workload.world_size:
            raise ConfigError("parallel", f"the workload has {self.workload.world_size} ranks, this job has {self.world_size}",
                              "tune with the workload of this job")
        self.strategy, self.tune_steps, self.group = strategy, tune_steps, group
        self.running_plan, self.size_tolerance = running_plan, size_tolerance
        self.cache = PlanCache.for_job(cache_dir, self.workload, self.hw, self.world_size)
        self.cache_path = self.cache.path
        self.plan: Plan | None = None
        self.calibration: Calibration | None = None  # rank 0 only
        self.applies_now: list[str] = []
        self.next_start: list[str] = []
        self.cut: str | None = None  # why the last search stopped before its end (its budget), else None
        self._steps: list[float] = []
        self._step_ids: list[int | None] = []  # each measured step's number (None: it issued no call)
        self._records: list[CallRecord] = []
        self.reconciled: dict[str, Any] = {}  # what reconciling the model with the measured steps did (rank 0's)
        self._built: tuple[str, Problem, Simulator] | None = None  # see _problem

    # -- cache
    def cached_plan(self) -> Plan | None:
        """The plan an earlier run tuned and cached for this workload, machine and world size, if any."""
        return self.cache.load()

    def _save(self, plan: Plan) -> None:
        """Cached by one process per node (``PlanCache``)."""
        if self.cache.save(plan):
            log.info("online plan cached in %s: the next start of this job uses it without tuning steps", self.cache_path)

    # -- measuring and tuning
    def reset(self) -> None:
        """Measure again from the next step (after the monitor asks for a re-tune)."""
        self._steps.clear()
        self._step_ids.clear()
        self._records.clear()
        self.plan = None

    @property
    def ready(self) -> bool:
        """Enough steps measured to tune (and not tuned yet)."""
        return self.plan is None and len(self._steps) >= self.tune_steps

    def add(self, step_s: float, records: Iterable[CallRecord]) -> None:
        """Take one measured step (this rank's own; no collective)."""
        if self.plan is not None:
            return
        if not step_s > 0:
            raise ConfigError("OnlineTuner.observe step_s", f"must be positive, got {step_s}")
        records = list(records)
        self._steps.append(step_s)
        self._step_ids.append(records[0].step if records else None)
        self._records.extend(records)

    def observe(self, step_s: float, records: Iterable[CallRecord], control: Control | None = None) -> Plan | None:
        """Take one measured step; after ``tune_steps`` of them, tune and return the plan (on every rank)."""
        self.add(step_s, records)
        return self.decide(control) if self.ready else None

    def decide(self, control: Control | None = None) -> Plan:
        """Search on rank 0 with what was measured, and the plan on every rank through ``control`` (Lagom's
        agreement channel; a temporary one when None). Every rank must call it at the same step."""
        own = control is None
        channel = control or Control()
        try:
            self.plan = self._tune(channel)
        finally:
            if own:
                channel.close()
        return self.plan

    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _plan_in_force(self) -> Plan | None:
        plan = self.running_plan
        active = runtime.current()
        if plan is None and active is not None and active.plan is not None \
                and active.plan.workload_fingerprint == self.workload.fingerprint():
            plan = active.plan
        return plan

    def _running_configs(self, problem: Problem) -> tuple[Problem, Configs]:
        """``problem`` under the per-process values in force (the running plan's, else NCCL's), and each
        key's config in force: the plan's entry, or NCCL's choice under those values where it has none."""
        plan = self._plan_in_force()
        if plan is None:
            return problem, nccl_configs(problem)
        values = {name: plan.process[name] for name in PROCESS_FIELDS if name in plan.process}
        if "transport" in values:
            values["transport"] = Transport(values["transport"])
        running = problem.with_process(replace(problem.settings, **values))
        configs = nccl_configs(running)
        configs.update({k: c for k, c in plan.configs().items() if k in configs})
        return running, configs

    def _tune(self, control: Control) -> Plan:
        payload = self.search_payload() if self._rank() == 0 else {}
        return self.take(control.broadcast(payload, "the online plan"))

    def search_payload(self, budget: Budget | None = None) -> dict[str, Any]:
        """Rank 0's search on what was measured, within ``budget``, as the payload every rank takes (``take``);
        an error is carried in it, never raised, since every rank waits for it."""
        try:
            return self._search(budget)
        except Exception as err:  # noqa: BLE001 - must reach every rank, or they wait in the broadcast
            return {"error": f"{type(err).__name__}: {err}"}

    def search_in_background(self, seconds: float | None) -> SearchThread:
        """Rank 0: ``search_payload`` in a thread of its own (``lagom.runtime.online.background``) within
        ``seconds``, so that no step hook waits for it."""
        return SearchThread(self.search_payload, seconds, name="lagom-online-search")

    def take(self, payload: dict[str, Any]) -> Plan:
        """The plan of rank 0's search payload (``search_payload``), on this rank; cached per node."""
        if "error" in payload:
            raise LagomError(f"online tuning failed on rank 0: {payload['error']}")
        plan = Plan.from_dict(json.loads(payload["plan"]), "online plan")
        self.applies_now, self.next_start = payload["now"], payload["next"]
        self.reconciled = payload.get("reconciled", {})
        self.cut = payload.get("cut")
        self._save(plan)
        self.plan = plan
        return plan

    def _problem(self) -> tuple[Problem, Simulator]:
        """The planning problem of the job as it runs, and one Simulator of its graph for every calibration and
        search of this tuner (re-tunes after drift reuse both while the modelled workload is the same)."""
        fingerprint = self.model_workload.fingerprint()
        if self._built is None or self._built[0] != fingerprint:
            problem = problem_for(self.model_workload, self.hw, self.capability)
            self._built = (fingerprint, problem, Simulator(problem.graph))
        return self._built[1], self._built[2]

    def _reconciled(self) -> tuple[Problem, Simulator]:
        """The modelled problem made to match the measured steps (``lagom.model.reconcile``): calls no key matched become
        keys, keys nothing called are dropped; the modelled one, unchanged, where it matches already."""
        problem, simulator = self._problem()
        measured = [(t, step) for t, step in zip(self._steps, self._step_ids) if step is not None]
        if not measured:
            return problem, simulator
        median = sorted(measured)[len(measured) // 2]  # its calls are placed first; other steps' only add keys
        steps = {median[1]: median[0], **{step: t for t, step in measured}}
        done = reconcile(problem.graph, self.hw, self._records, steps, self.size_tolerance)
        self.reconciled = done.summary()
        log.info("keys reconciled with the measured steps: coverage %s -> %s; %d keys from measured calls, %d "
                 "modelled keys never called dropped%s", done.before.describe(), done.after.describe(),
                 len(done.added), len(done.dropped),
                 f"; still unplanned: {', '.join(done.unplanned)}" if done.unplanned else "")
        if not done.added and not done.dropped:
            return problem, simulator
        reconciled = Problem(done.graph, problem.hw, problem.open_space, problem.capability, problem.process)
        return reconciled, Simulator(reconciled.graph)

    def _search(self, budget: Budget | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        problem, simulator = self._reconciled()
        in_force, running = self._running_configs(problem)
        step_s = sum(self._steps) / len(self._steps)
        cal = calibrate(in_force, running, self._records, step_s, self.size_tolerance, simulator)
        self.calibration = cal
        self._log_calibration(cal)
        result = run_strategy(self.strategy, cal.problem, SimulatedEvaluator(cal.problem, cal.simulator), budget)
        cut = budget.cut if budget is not None else None
        kept = cal.simulator.run(running, cal.model)
        if kept.step_s < result.result.step_s:
            result = SearchResult(self.strategy, running, kept, result.evaluations,
                                  {k: "kept the settings in force: the calibrated search found nothing faster" for k in running},
                                  cal.problem.settings)
        # the baseline is NCCL with its own per-process values, under the calibrated model
        baseline = cal.problem.with_process(problem.settings)
        nccl = run_strategy("nccl", baseline, SimulatedEvaluator(baseline, cal.simulator)).result.step_s
        plan = plan_from(Tuned(self.model_workload, cal.problem, result), self.workload, self.hw,
                         {"nccl": nccl, self.strategy: result.result.step_s})
        now, later = describe_changes(running, plan.configs())
        self._log_plan(result.result, step_s, now, later, time.perf_counter() - started, result.evaluations, cut)
        return {"plan": plan.to_json(), "now": now, "next": later, "reconciled": self.reconciled, "cut": cut}

    def _log_calibration(self, cal: Calibration) -> None:
        scales = cal.model.comm_scale
        log.info("calibrated to %d measured steps (%.4g s/step): compute x%.3g, comm per key %s",
                 len(self._steps), cal.measured_step_s, cal.model.compute_scale,
                 ", ".join(f"{k} x{s:.3g}" for k, s in sorted(scales.items())) or "none measured")
        if cal.unmatched:
            log.warning("collectives seen that the workload model does not have (not calibrated): %s",
                        ", ".join(cal.unmatched))
        if cal.unmeasured:
            log.info("model keys without timed calls keep the uncalibrated comm model: %s", ", ".join(cal.unmeasured))
        if cal.bounded_calls:
            log.info("%d calls had no completion callback: timed up to their wait (an upper bound)", cal.bounded_calls)

    def _log_plan(self, result: StepResult, step_s: float, now: list[str], later: list[str], took: float,
                  evaluations: int, cut: str | None) -> None:
        log.info("online search (%s, %d evaluations, %.2f s%s): %.4g s/step measured -> %.4g s/step predicted",
                 self.strategy, evaluations, took, f", {cut}: the best found so far" if cut else "", step_s,
                 result.step_s)
        for line in now:
            log.info("applies now: %s", line)
        for line in later:
            log.info("applies on the next start (fixed when communicators and buffers are created): %s", line)
        if not now and not later:
            log.info("the settings in force are already the best the calibrated model finds")
