"""One tuned DeepSpeed job: what is decided before the engine is built, and what happens per step.

Start-up (before the engine exists, so nothing here can fail after a training step):
  section -> hardware -> workload (derived from the model) -> plan (loaded, cached or searched)
  -> the plan's ZeRO bucket knobs written into the config the engine sees
  -> lagom.runtime.init: NCCL variables exported, group creation wrapped so DeepSpeed's groups are
     created with ``group_desc`` = their lagom name and the plan's NCCL options.
Run time (after the engine exists):
  every backend collective recorded (lagom_deepspeed.comm); ZeRO-3 bucket collectives decomposed
  where the plan says so (lagom_deepspeed.flash); at each optimizer-step boundary the step's records
  feed the online tuner and the drift monitor.
"""

from __future__ import annotations

import atexit
import logging
import time
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from lagom import runtime as lagom_runtime
from lagom.comm_config import CommConfig
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.runtime.monitor import Monitor
from lagom.runtime.online import OnlineTuner
from lagom.plan import Plan
from lagom.tune import running_workload
from lagom_deepspeed import planning
from lagom_deepspeed.comm import WrappedBackend
from lagom_deepspeed.config import LagomConfig
from lagom_deepspeed.flash import FlashRouter
from lagom_deepspeed.groups import GroupNames
from lagom_deepspeed.workload import Derived, apply_overrides, derive

log = logging.getLogger("lagom.deepspeed")


def hardware_for(section: LagomConfig, world_size: int) -> Hardware:
    try:
        hw = load_hardware(section.hardware or "")
    except ConfigError as err:
        raise ConfigError(f"lagom.{err.key}", err.problem, err.fix) from None
    if hw.cluster.world_size != world_size:
        raise ConfigError("lagom.hardware", f"'{hw.name}' describes {hw.cluster.world_size} GPUs "
                          f"({hw.cluster.nodes} x {hw.cluster.gpus_per_node}) but this job runs {world_size} ranks",
                          "use a hardware file with `base: <preset>` and a cluster of this size")
    return hw


RUNTIME_FIELDS = ("decomposition", "num_chunks")  # what the Flash router reads at every call


def plan_changes(old: Plan, new: Plan) -> tuple[list[str], list[str]]:
    """(applies now, applies on the next start) between two plans, one line per changed knob.

    Only the Flash-Overlap choice of data-parallel all-gathers and reduce-scatters can change in a
    running DeepSpeed engine; channels, chunk, threads, algorithm, protocol and priority are fixed
    in communicators and NCCL's environment, bucket sizes in the engine's buffers.
    """
    now, later = [], []
    for e in new.entries:
        was = old.entry(e.key) or old.lookup(e.group, e.collective, e.bytes)
        if was is None:
            continue
        for f in fields(CommConfig):
            a, b = getattr(was.config, f.name), getattr(e.config, f.name)
            if a != b:
                live = f.name in RUNTIME_FIELDS and e.collective in ("all_gather", "reduce_scatter")
                (now if live else later).append(f"{e.key} {f.name} {a} -> {b}")
    knobs_old, knobs_new = old.framework["deepspeed"], new.framework["deepspeed"]
    later += [f"zero_optimization.{k} {knobs_old.get(k)} -> {v}" for k, v in knobs_new.items() if knobs_old.get(k) != v]
    return now, later


@dataclass
class StepStats:
    step: int
    step_s: float
    comm_s: float
    calls: int
    plan: str  # which plan ran the step: "start" or "tuned <n>"


@dataclass
class Session:
    """Everything Lagom holds for one engine; reachable as ``engine.lagom``."""

    section: LagomConfig
    hw: Hardware
    derived: Derived
    plan: Plan
    plan_source: str
    changes: list[planning.KnobChange]
    names: GroupNames
    world_size: int
    runtime: Any = None
    backend: WrappedBackend | None = None
    router: FlashRouter | None = None
    tuner: OnlineTuner | None = None
    monitor: Monitor | None = None
    steps: list[StepStats] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # what was tuned, when, and when it applies
    tuned: list[Plan] = field(default_factory=list)
    tuning: bool = False  # online: measuring steps for the tuner (not when started from a cached plan)
    _t0: float = 0.0
    _drift: str | None = None
    _restore: list[tuple[Any, str, Any]] = field(default_factory=list)

    # -- start-up -------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, section: LagomConfig, model: Any, mpu: Any, ds_config: dict[str, Any]) -> tuple["Session", dict]:
        """Validate and plan; return the session and the config the engine must be built with."""
        world = dist.get_world_size()
        hw = hardware_for(section, world)
        pp = getattr(model, "num_stages", 1) if hasattr(model, "topology") else 1
        tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
        derived = apply_overrides(derive(model, ds_config, world, pp=pp, tp=tp), section.workload, world)
        wl = planning.pinned(derived.workload, section.buckets)
        start = planning.offline_plan(section, wl, hw, world)
        derived.workload = running_workload(wl, start.plan)
        tuner, cached = None, None
        if section.mode == "online":
            tuner = OnlineTuner(derived.workload, hw, strategy=section.strategy, tune_steps=section.tune_steps,
                                cache_dir=section.cache_dir, running_plan=start.plan)
            cached = tuner.cached_plan()
            if cached is not None:
                start = planning.StartPlan(planning.check(cached, world, derived.workload, hw, section.cache_dir),
                                           f"tuned by an earlier online run, cached in {section.cache_dir}")
                tuner.running_plan = cached
        engine_cfg, changes = planning.engine_config(ds_config, start.plan, section.buckets, derived.largest_layer)
        session = cls(section, hw, derived, start.plan, start.source, changes,
                      GroupNames.for_job(model, mpu, world), world, tuner=tuner,
                      tuning=tuner is not None and cached is None)
        session._log_start()
        return session, engine_cfg

    def _log_start(self) -> None:
        if dist.get_rank() != 0:
            return
        wl = self.derived.workload
        log.info("Lagom %s mode: plan %s (%s, %d keys, predicted step %s)", self.section.mode, self.plan_source,
                 self.plan.strategy, len(self.plan.entries),
                 ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.plan.predicted_step_s.items()))
        log.info("workload %s: %d layers, hidden %d, ffn %d, seq %d, vocab %d, dp %d pp %d tp %d, ZeRO %d; "
                 "%d parameters on the model, %d implied", wl.name, wl.model.layers, wl.model.hidden, wl.model.ffn,
                 wl.model.seq_len, wl.model.vocab, wl.parallel.dp, wl.parallel.pp, wl.parallel.tp,
                 wl.parallel.zero_stage, self.derived.model_params, self.derived.implied_params)
        for note in self.derived.notes:
            log.info("  inferred %s", note)
        if wl.parallel.zero_stage == 0:
            log.info("ZeRO stage 0: DeepSpeed's all-reduce buckets are fixed inside the engine; no bucket knob is written")
        for c in self.changes:
            log.info("applied at start-up: zero_optimization.%s %s -> %s (%s)", c.key, c.before, c.after, c.why)

    def start_runtime(self) -> None:
        """NCCL env and per-group options; must run before DeepSpeed creates its groups."""
        import deepspeed.comm.comm as ds_comm
        from deepspeed.utils import groups

        self.runtime = lagom_runtime.init(self.plan, strict_env=self.section.strict_env, hw=self.hw)
        if "nccl" in str(dist.get_backend()):
            if self.names.p2p == "pp":
                log.warning("pipeline engine: its groups were made with the PipelineModule and its send/recv use "
                            "the default group, so the plan's per-group NCCL options cannot reach them; the plan's "
                            "NCCL environment applies to communicators created from now on")
            elif groups._WORLD_GROUP is not None and self.runtime.plan_group("dp"):
                log.warning("DeepSpeed's data-parallel group was made by an earlier engine in this process: "
                            "the plan's NCCL options for dp apply from the next start")
        backend = ds_comm.cdb
        original = backend.new_group
        names = self.names

        def new_group(ranks: Any) -> Any:
            ranks = sorted(int(r) for r in ranks)
            return dist.new_group(ranks, group_desc=names.name_of_ranks(tuple(ranks)))

        backend.new_group = new_group
        self._restore.append((backend, "new_group", original))

    # -- run time -------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Wrap the backend and the engine's step boundary; the first step starts now."""
        import deepspeed.comm.comm as ds_comm
        from deepspeed.runtime.pipe.engine import PipelineEngine

        self.router = FlashRouter(self.section.flash_overlap, self.plan)
        self.backend = WrappedBackend(ds_comm.cdb, self.runtime.recorder, self.names, self.router)
        self.monitor = self._monitor(self.plan)
        boundary = "train_batch" if isinstance(engine, PipelineEngine) else "step"  # where global_steps moves
        original = getattr(engine, boundary)

        def stepped(*args: Any, **kwargs: Any) -> Any:
            before = engine.global_steps
            out = original(*args, **kwargs)
            if engine.global_steps != before:
                self.step_done(engine.global_steps)
            return out

        setattr(engine, boundary, stepped)
        self._restore.append((engine, boundary, None))
        engine.lagom = self
        self.runtime.recorder.begin_step(engine.global_steps)
        self._t0 = time.perf_counter()
        self.write_report()
        atexit.register(self.write_report)  # the final report, also when the script never calls close()

    def _monitor(self, plan: Plan) -> Monitor:
        return Monitor.for_plan(self.derived.workload, self.hw, plan, threshold=self.section.retune_threshold)

    def step_done(self, step: int) -> None:
        now = time.perf_counter()
        step_s, self._t0 = now - self._t0, now
        recorder = self.runtime.recorder
        records = recorder.end_step()
        self.steps.append(StepStats(step, step_s, sum(r.end_s - r.start_s for r in records), len(records),
                                    f"tuned {len(self.tuned)}" if self.tuned else "start"))
        if self.tuning:
            new = self.tuner.observe(step_s, records)  # type: ignore[union-attr]
            if new is not None:
                self.tuning = False
                self.apply(new, step)
        reason = self.monitor.observe(step_s, records) if self.monitor is not None else None
        if self.tuner is None:
            if reason:
                self.event(f"step {step}: {reason}; the offline plan may be stale (re-plan, or use mode online)")
        else:
            self._drift = reason or self._drift
            if len(self.steps) % self.section.monitor_interval == 0:
                if self._agree(self._drift is not None):
                    self.tuner.running_plan = self.plan
                    self.tuner.reset()
                    self.tuning = True
                    self.event(f"step {step}: {self._drift or 'drift seen on another rank'}; "
                               f"re-tuning from the next {self.section.tune_steps} steps")
                self._drift = None
        if len(self.steps) == self.section.tune_steps:
            self.write_report()
        recorder.begin_step(step)
        self._t0 = time.perf_counter()

    @staticmethod
    def _agree(flag: bool) -> bool:
        """Whether any rank saw drift: every rank must re-tune at the same step, or the tuner's
        broadcast would wait forever. One tiny all-reduce (and its host sync) every
        ``monitor_interval`` steps, at the step boundary, in online mode only."""
        from deepspeed.accelerator import get_accelerator

        t = torch.tensor([float(flag)], device=get_accelerator().current_device_name())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def apply(self, plan: Plan, step: int) -> None:
        """Take a tuned plan: Flash-Overlap choices switch now; the rest waits for the next start."""
        now, later = plan_changes(self.plan, plan)
        self.plan = plan
        self.tuned.append(plan)
        if self.router is not None:
            self.router.plan = plan
        self.monitor = self._monitor(plan)
        self.event(f"step {step}: online plan taken ({plan.strategy}, {plan.evaluations} evaluations, cached in "
                   f"{self.section.cache_dir}). Applied now: {'; '.join(now) or 'nothing'}. "
                   f"On the next start (buckets are allocated and communicators built with the engine): "
                   f"{'; '.join(later) or 'nothing'}")
        self.write_report()

    def event(self, text: str) -> None:
        self.events.append(text)
        if dist.get_rank() == 0:
            log.info("%s", text)

    def write_report(self) -> None:
        if self.section.report and dist.get_rank() == 0:
            from lagom_deepspeed.report import write

            write(self, self.section.report)

    def close(self) -> None:
        """Write the final report and undo every wrapper (the engine keeps running untuned)."""
        if self.backend is not None:
            atexit.unregister(self.write_report)
            self.write_report()
            self.backend.close()
        for obj, attr, original in reversed(self._restore):
            if original is None:
                obj.__dict__.pop(attr, None)
            else:
                setattr(obj, attr, original)
        self._restore.clear()
        if self.runtime is not None:
            self.runtime.close()
