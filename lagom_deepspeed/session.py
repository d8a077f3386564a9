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

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from lagom import runtime as lagom_runtime
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.monitor import Monitor
from lagom.online import OnlineTuner
from lagom.plan import Plan
from lagom.search import Problem
from lagom.simulator import simulate
from lagom.tune import problem_for
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
    _t0: float = 0.0
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
        derived.workload = wl
        tuner = OnlineTuner(wl, hw, strategy=section.strategy, tune_steps=section.tune_steps,
                            cache_dir=section.cache_dir) if section.mode == "online" else None
        cached = tuner.cached_plan() if tuner is not None else None
        if cached is not None:
            start = planning.StartPlan(planning.check(cached, world, wl, hw, section.cache_dir),
                                       f"cached by an earlier online run in {section.cache_dir}")
        else:
            start = planning.offline_plan(section, wl, hw, world)
        engine_cfg, changes = planning.engine_config(ds_config, start.plan, section.buckets, derived.largest_layer)
        session = cls(section, hw, derived, start.plan, start.source, changes,
                      GroupNames.for_job(model, mpu, world), world, tuner=tuner)
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
        self.runtime = lagom_runtime.init(self.plan, strict_env=self.section.strict_env, hw=self.hw)
        import deepspeed.comm.comm as ds_comm

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

        self.router = FlashRouter(self.section.flash_overlap, self.plan)
        self.backend = WrappedBackend(ds_comm.cdb, self.runtime.recorder, self.names, self.router)
        self.monitor = self._monitor(self.plan)
        boundary = "train_batch" if hasattr(engine, "train_batch") and hasattr(engine, "is_pipe_parallel") \
            and engine.is_pipe_parallel else "step"
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

    def _monitor(self, plan: Plan) -> Monitor:
        problem: Problem = problem_for(self.derived.workload, self.hw)
        result = simulate(problem.graph, plan.configs(), problem.model)
        return Monitor(result.step_s, max(result.compute_s, result.comm_peak_s), threshold=self.section.retune_threshold)

    def step_done(self, step: int) -> None:
        now = time.perf_counter()
        step_s, self._t0 = now - self._t0, now
        recorder = self.runtime.recorder
        records = recorder.end_step()
        self.steps.append(StepStats(step, step_s, sum(r.end_s - r.start_s for r in records), len(records),
                                    f"tuned {len(self.tuned)}" if self.tuned else "start"))
        if self.tuner is not None:
            new = self.tuner.observe(step_s, records)
            if new is not None:
                self.apply(new, step)
        reason = self.monitor.observe(step_s, records) if self.monitor is not None else None
        if reason and self.section.mode == "online":
            self.tuner = OnlineTuner(self.derived.workload, self.hw, strategy=self.section.strategy,
                                     tune_steps=self.section.tune_steps, cache_dir=self.section.cache_dir)
            self.event(f"step {step}: re-tuning over the next {self.section.tune_steps} steps ({reason})")
        if len(self.steps) == self.section.tune_steps:
            self.write_report()
        recorder.begin_step(step)
        self._t0 = time.perf_counter()

    def apply(self, plan: Plan, step: int) -> None:
        """Take a tuned plan: decomposition switches now; buckets and communicators on the next start."""
        old = self.plan
        now, later = [], []
        for e in plan.entries:
            was = old.lookup(e.group, e.collective, e.bytes)
            if was is None or was.config == e.config:
                continue
            if was.config.decomposition != e.config.decomposition:
                now.append(f"{e.key} {was.config.describe()} -> {e.config.describe()}")
            else:
                later.append(f"{e.key} {was.config.describe()} -> {e.config.describe()}")
        knobs = {k: (old.framework["deepspeed"].get(k), v) for k, v in plan.framework.get("deepspeed", {}).items()
                 if old.framework["deepspeed"].get(k) != v}
        later += [f"zero_optimization.{k} {a} -> {b}" for k, (a, b) in knobs.items()]
        self.plan = plan
        self.tuned.append(plan)
        if self.router is not None:
            self.router.plan = plan
        self.monitor = self._monitor(plan)
        self.event(f"step {step}: online plan ({plan.strategy}, {plan.evaluations} evaluations) taken; "
                   f"applied now: {'; '.join(now) or 'nothing that can change in a running engine'}; "
                   f"on the next start (buckets are allocated and communicators built at init; the plan is cached "
                   f"in {self.section.cache_dir}): {'; '.join(later) or 'nothing'}")
        if self.section.plan and dist.get_rank() == 0:
            plan.save(self.section.plan)
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
        self.write_report()
        if self.backend is not None:
            self.backend.close()
        for obj, attr, original in reversed(self._restore):
            if original is None:
                obj.__dict__.pop(attr, None)
            else:
                setattr(obj, attr, original)
        self._restore.clear()
        if self.runtime is not None:
            self.runtime.close()
