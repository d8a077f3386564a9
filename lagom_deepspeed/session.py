"""A tuned DeepSpeed engine: the core session plus what DeepSpeed fixes when the engine is built.

Start-up (before the engine exists, so nothing here can fail after a training step):
  section -> hardware -> workload (derived from the model) -> plan (core session: loaded, cached or
  searched) -> the plan's ZeRO bucket knobs written into the config the engine sees
  -> lagom.runtime.init: NCCL variables exported, group creation wrapped so DeepSpeed's groups are
     created with ``group_desc`` = their lagom name and the plan's NCCL options.
Run time (after the engine exists): every backend collective recorded (lagom_deepspeed.comm); ZeRO-3
bucket collectives decomposed where the plan says so (lagom_deepspeed.flash); each optimizer-step
boundary closes the core session's step.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan.plan import Plan
from lagom.runtime.apply.control import Control
from lagom.runtime.online.session import TuningSession, choose_hardware
from lagom.runtime.online.state import KnobChange, SessionOptions
from lagom_deepspeed import planning
from lagom_deepspeed.comm import Subscription, subscribe
from lagom_deepspeed.config import LagomConfig
from lagom_deepspeed.flash import ZeroFlash
from lagom_deepspeed.groups import GroupNames
from lagom_deepspeed.workload import Derived, describe

log = logging.getLogger("lagom.deepspeed")


def session_options(section: LagomConfig) -> SessionOptions:
    report = (Path(f"{section.report}.json"), Path(f"{section.report}.md")) if section.report else None
    plan_in = Path(section.plan) if section.plan else None
    # the plan file is read when it exists; a plan searched at start-up is written there when it does not
    plan_out = plan_in if plan_in is not None and not plan_in.exists() else (
        Path(f"{section.report}-plan.json") if section.report else None)
    flash = section.flash_overlap
    return SessionOptions(
        mode=section.mode, strategy=section.strategy, tune_steps=section.tune_steps, tune_seconds=section.tune_seconds,
        search_seconds=section.search_seconds, plan_in=plan_in,
        plan_out=plan_out, cache_dir=Path(section.cache_dir), report_files=report, flash_overlap=flash.enabled,
        flash_num_chunks=flash.num_chunks, flash_stream_priority=flash.comm_stream_priority or None,
        strict_env=section.strict_env, retune_threshold=section.retune_threshold,
        drift_check_steps=section.monitor_interval, collective_timeout_s=section.collective_timeout_s,
        search_buckets=section.buckets.reduce_bucket_size is None and section.buckets.allgather_bucket_size is None)


def hardware_for(section: LagomConfig, world_size: int, control: Control) -> tuple[Hardware, str]:
    try:
        return choose_hardware(section.hardware, world_size, Path(section.cache_dir), control)
    except ConfigError as err:
        raise ConfigError(f"lagom.{err.key}", err.problem, err.fix) from None


class Session(TuningSession):
    """Everything Lagom holds for one engine; reachable as ``engine.lagom``."""

    framework = "deepspeed"

    def __init__(self, section: LagomConfig, hw: Hardware | None, hardware_reason: str, derived: Derived,
                 names: GroupNames, world_size: int, control: Control | None = None) -> None:
        super().__init__(derived.workload, hw, session_options(section), world_size=world_size,
                         hardware_reason=hardware_reason, why_untuned=derived.warning() if derived.workload is None else "",
                         control=control)
        self.section, self.derived, self.names = section, derived, names
        self.tap: Subscription | None = None
        self.flash: ZeroFlash | None = None
        # the engine, weakly: a session must never keep an engine (its model and optimizer state) alive
        self._engine: weakref.ref[Any] | None = None
        self._wrapped: list[str] = []  # engine methods this session wraps (instance attributes)
        self._finalizer: weakref.finalize | None = None

    # -- start-up -------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, section: LagomConfig, model: Any, mpu: Any, ds_config: dict[str, Any]) -> tuple[Session, dict]:
        """Validate and plan; return the session and the config the engine must be built with."""
        world = dist.get_world_size()
        pp = getattr(model, "num_stages", 1) if hasattr(model, "topology") else 1
        tp = mpu.get_model_parallel_world_size() if mpu is not None else 1
        derived = describe(model, ds_config, world, pp=pp, tp=tp, overrides=section.workload)
        hw, reason = None, "not needed: Lagom only records this job"
        control = Control(section.collective_timeout_s)
        try:
            if derived.workload is not None:  # what Lagom cannot describe it leaves to DeepSpeed's own settings
                hw, reason = hardware_for(section, world, control)
                derived.workload = planning.pinned(derived.workload, section.buckets)
        except BaseException:
            control.close()
            raise
        session = cls(section, hw, reason, derived, GroupNames.for_job(model, mpu, world), world, control)
        try:
            session.start()
        except BaseException:
            session.close()
            raise
        engine_cfg = ds_config
        if session.plan is not None:
            engine_cfg, changes = planning.engine_config(ds_config, session.plan, section.buckets, derived.largest_layer)
            session.applied_at_start += [KnobChange(f"zero_optimization.{c.key}", c.before, c.after, c.why) for c in changes]
            for c in changes:
                session.event(f"applied at start-up: zero_optimization.{c.key} {c.before} -> {c.after} ({c.why})")
        return session, engine_cfg

    def check_plan(self, plan: Plan, where: str) -> None:
        super().check_plan(plan, where)
        if "deepspeed" not in plan.framework:
            raise ConfigError(f"lagom.plan ({where})", f"has no DeepSpeed bucket sizes (framework: {list(plan.framework)})",
                              "make the plan from a deepspeed workload")

    def start_runtime(self) -> None:
        """Join the process's backend tap: DeepSpeed's groups, made from now on, get lagom names (and so
        the plan's NCCL options); must run before the engine makes its groups."""
        from deepspeed.utils import groups

        if "nccl" in str(dist.get_backend()) and self.plan is not None:
            if self.names.p2p == "pp":
                self.event("pipeline engine: its groups were made with the PipelineModule and its send/recv use the "
                           "default group, so the plan's per-group NCCL options cannot reach them; the plan's NCCL "
                           "environment applies to communicators created from now on", level=logging.WARNING)
            elif groups._WORLD_GROUP is not None and self.runtime.plan_group("dp"):
                self.event("DeepSpeed's data-parallel group was made by an earlier engine in this process: the "
                           "plan's NCCL options for dp apply from the next start", level=logging.WARNING)
        self.tap = subscribe(self.names)

    # -- run time -------------------------------------------------------------------------------
    def attach(self, engine: Any) -> None:
        """Wrap the backend and the engine's step boundary; the first step starts now.

        The session ends with the engine: ``engine.destroy()`` closes it, and so does the engine's garbage
        collection (the wrappers live on the engine, and the session holds the engine only weakly).
        """
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if self.tap is None:
            raise RuntimeError("Session.attach before start_runtime: the backend tap is not there yet")
        self.flash = ZeroFlash(self.router)
        self.tap.attach(self.runtime.recorder, self.flash)
        pipeline = isinstance(engine, PipelineEngine)
        boundary = "train_batch" if pipeline else "step"  # where global_steps moves
        # calls made inside these go to this engine's session only (several engines may share a process)
        for name in ("train_batch", "eval_batch") if pipeline else ("forward", "backward", "step"):
            self._wrap(engine, name, stepping=name == boundary)
        self._wrap_destroy(engine)
        self._engine = weakref.ref(engine)
        # closes the session when the engine is collected; holds the session, never the engine
        self._finalizer = weakref.finalize(engine, self.close)
        engine.lagom = self
        self.begin_step(engine.global_steps)
        self.write_report()

    def _wrap(self, engine: Any, name: str, stepping: bool) -> None:
        original = getattr(engine, name)
        tap = self.tap

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before = engine.global_steps
            with tap.active():  # type: ignore[union-attr]
                out = original(*args, **kwargs)
            if stepping and engine.global_steps != before:
                self.end_step()
                self.begin_step(engine.global_steps)
            return out

        setattr(engine, name, wrapped)
        self._wrapped.append(name)

    def _wrap_destroy(self, engine: Any) -> None:
        """``engine.destroy()`` (DeepSpeed's own teardown) ends the session too."""
        original = getattr(engine, "destroy", None)
        if original is None:
            return

        def destroy(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                self.close()

        engine.destroy = destroy
        self._wrapped.append("destroy")

    def framework_report(self) -> dict[str, Any]:
        return {"inferred": self.derived.notes,
                "parameters": {"model": self.derived.model_params, "implied_by_workload": self.derived.implied_params},
                "group_options": {k: str(v) for k, v in (getattr(self.runtime, "group_options", None) or {}).items()},
                "section": asdict(self.section) if hasattr(self.section, "__dataclass_fields__")
                else self.section.model_dump()}

    def close(self) -> None:
        """Write the final report and undo everything this session added (idempotent): the engine, if it is
        still alive, keeps running untuned."""
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.flash is not None:  # attached: the report has steps to tell
            self.flash = None
            self.write_report()
        if self.tap is not None:
            self.tap.close()
            self.tap = None
        engine = self._engine() if self._engine is not None else None
        if engine is not None:
            for name in self._wrapped:
                engine.__dict__.pop(name, None)
            if engine.__dict__.get("lagom") is self:
                del engine.__dict__["lagom"]
        self._wrapped.clear()
        super().close()
