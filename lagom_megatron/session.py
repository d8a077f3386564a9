"""One Lagom-tuned Megatron run: the plan in force, what it changed, the per-step loop, the report.

Start-up (``Session.start``, from the parsed arguments, before any process group exists):
- offline: the plan file (checked against this job's world size, workload and hardware), or a plan
  made now by the cost model and saved there;
- online: the plan cached by an earlier run of the same job, else the plan file, else Megatron's
  defaults while ``--lagom-tune-iters`` steps (after one warm-up step) are measured.
A plan in force at start-up sets the DDP bucket size, the NCCL options of each process group
(through megatron's ``get_nccl_options``), the process-wide NCCL variables and, with Transformer
Engine, the userbuffers config. Each step then records every intercepted collective. In online
mode the tuner searches on rank 0 after the measured steps and every rank gets its plan: the
Flash-Overlap routing applies at once, everything fixed at start-up applies on the next start (the
plan is cached), and both are logged. A monitor watches the overlap efficiency and re-tunes
(online) or warns (offline) on drift.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from lagom import emit
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.plan import Plan
from lagom.tune import make_plan, running_workload
from lagom.workload import Workload
from lagom_megatron import report
from lagom_megatron.arguments import LagomOptions
from lagom_megatron.groups import megatron_pg_names
from lagom_megatron.intercept import Interceptor, Router
from lagom_megatron.workload import workload_from_args

log = logging.getLogger("lagom.megatron")
CACHE_DIR = Path(".lagom-cache")
DRIFT_CHECK_STEPS = 20  # online: ranks agree on a drift re-tune this often (one tiny all-reduce)


def _rank(args: argparse.Namespace) -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else getattr(args, "rank", 0)


def _hardware(options: LagomOptions, plan: Plan | None) -> Hardware:
    name = options.hardware or (plan.hardware if plan else None)
    try:
        return load_hardware(name)  # type: ignore[arg-type]
    except ConfigError as err:
        raise ConfigError("--lagom-hardware", str(err), "pass a preset name from configs/hardware or a YAML file") from None


def _load_plan(path: Path, world_size: int, wl: Workload, hw: Hardware | None) -> Plan:
    """A saved plan, refused (naming the plan's key) when it was made for another job or machine."""
    try:
        plan = Plan.load(path)
        plan.check_for(world_size, wl, hw)
    except ConfigError as err:
        raise ConfigError(f"--lagom-plan {path}: {err.key}", err.problem, err.fix) from None
    return plan


def _plan_offline(workload: Workload, hw: Hardware, options: LagomOptions, args: argparse.Namespace) -> Plan:
    t0 = time.perf_counter()
    plan = make_plan(workload, hw, options.strategy)
    log.info("offline: planned %d points with strategy %s in %.1f s", len(plan.entries), plan.strategy,
             time.perf_counter() - t0)
    if options.plan is not None and _rank(args) == 0:
        plan.save(options.plan)
        log.info("offline: plan written to %s (used as is on the next start)", options.plan)
    return plan


class Session:
    """The state of one tuned run; hooks call ``step_begin``/``step_end`` around each training step."""

    def __init__(self, args: argparse.Namespace, options: LagomOptions, workload: Workload, hw: Hardware,
                 plan: Plan | None) -> None:
        from lagom.runtime import init as init_runtime

        self.args, self.options, self.workload, self.hw = args, options, workload, hw
        self.cp = workload.parallel.cp
        self.plan: Plan | None = None
        self.tuner: Any = None  # online mode: the OnlineTuner
        self.tuning = False  # online: the steps now are measured for the tuner
        self.monitor: Any = None
        self.applied_now: list[str] = []
        self.next_start: list[str] = []
        self.env_conflicts: list[str] = []
        self.group_options: dict[str, Any] = {}  # megatron pg_name -> options this adapter gave its group
        self.baseline: report.Measured | None = None  # steps measured before an online plan
        self.measured = report.Measured()  # steps under the plan in force
        self.iteration = 0
        self.steps_seen = 0
        self._t0 = 0.0
        self._drift = False  # some step since the last agreement check saw drift
        self._restore: list[tuple[Any, str, Any]] = []
        # NCCL env checks and export, per-group options by group_desc, the recorder
        self.runtime = init_runtime(plan, strict_env=False, hw=hw)
        self.router = Router(flash_overlap=options.flash_overlap)
        self.interceptor = Interceptor(self.runtime.recorder, self.router)
        if plan is not None:
            self._apply_at_startup(plan)

    # -- start-up
    @classmethod
    def start(cls, args: argparse.Namespace, options: LagomOptions) -> "Session":
        workload = workload_from_args(args)
        hw = _hardware(options, None) if options.hardware else None
        file_plan = None
        if options.plan is not None and options.plan.exists():
            file_plan = _load_plan(options.plan, workload.world_size, workload, hw)
        if hw is None and file_plan is None:
            raise ConfigError("--lagom-hardware", f"is needed: the plan {options.plan} does not exist yet, so one is made",
                              "pass a preset name from configs/hardware or a hardware YAML file")
        hw = hw or _hardware(options, file_plan)
        tuner, cached = None, None
        if options.mode == "online":
            from lagom.runtime.online import OnlineTuner

            tuner = OnlineTuner(workload, hw, strategy=options.strategy, tune_steps=options.tune_iters,
                                cache_dir=str(CACHE_DIR), model_workload=running_workload(workload, file_plan))
            cached = tuner.cached_plan()
            if cached is not None:
                log.info("online: reusing the plan cached for this job and machine; no tuning steps needed")
            else:
                log.info("online: measuring the first %d steps with %s, then tuning", options.tune_iters,
                         f"the plan {options.plan}" if file_plan else "Megatron's defaults")
            startup = cached or file_plan
            tuner.running_plan = startup  # what the measured steps run with
        else:
            startup = file_plan or _plan_offline(workload, hw, options, args)
        session = cls(args, options, workload, hw, startup)
        session.tuner, session.tuning = tuner, tuner is not None and cached is None
        session._install()
        return session

    def _apply_at_startup(self, plan: Plan) -> None:
        """Everything Megatron fixes at start-up: buckets, communicator options, NCCL env, TE userbuffers."""
        self.plan = plan
        self.router.plan = plan
        self.env_conflicts = emit.env_conflicts(plan, self.hw, os.environ)  # the runtime has logged them
        if self.runtime.env_set:
            self.applied_now.append(f"NCCL variables exported: {self.runtime.env_set}")
        self._apply_buckets(plan)
        self._apply_te(plan)
        comm = emit.communicator_configs(plan)
        self.applied_now.append("communicator options per group: " +
                                ", ".join(f"{g} {c}" for g, c in sorted(comm.items())))
        decomposed = [e.key for e in plan.entries if e.config.decomposition == "p2p"]
        if decomposed and not self.options.flash_overlap:
            log.warning("the plan decomposes %d TP points (%s); pass --lagom-flash-overlap to run them with "
                        "Flash-Overlap, they run as collectives now", len(decomposed), ", ".join(decomposed[:3]))
        elif decomposed:
            self.applied_now.append(f"Flash-Overlap for {len(decomposed)} TP points: {', '.join(decomposed)}")
        self.monitor = self._monitor(plan)

    def _apply_buckets(self, plan: Plan) -> None:
        bucket = plan.framework.get("megatron", {}).get("bucket_size")
        if not bucket or not getattr(self.args, "overlap_grad_reduce", False):
            return
        if getattr(self.args, "ddp_num_buckets", None) is not None:
            log.warning("--ddp-num-buckets is set, so megatron ignores the plan's bucket size %d", bucket)
            return
        current = self.workload.ddp_bucket_elems  # the job's own, or megatron's default
        if current != bucket:
            log.info("DDP bucket size: %d -> %d elements (plan)", current, bucket)
            self.args.ddp_bucket_size = bucket
        self.applied_now.append(f"DDP bucket size {bucket} elements")

    def _apply_te(self, plan: Plan) -> None:
        if not getattr(self.args, "tp_comm_overlap", False):
            return
        cfgs = emit.te_ub_cfgs(plan)
        if importlib.util.find_spec("transformer_engine") is None:
            log.info("Transformer Engine is not importable: the plan's userbuffers config is not used")
            return
        if not cfgs:
            return
        path = self.out_dir / "te_ub_cfgs.yaml"
        if self.args.tp_comm_overlap_cfg:
            log.warning("--tp-comm-overlap-cfg %s is kept; the plan's userbuffers config is in %s",
                        self.args.tp_comm_overlap_cfg, path)
        else:
            self.args.tp_comm_overlap_cfg = str(path)
            self.applied_now.append(f"Transformer Engine userbuffers config {path}")
        report.write_atomic(path, emit.te_ub_yaml(plan))

    def _monitor(self, plan: Plan) -> Any:
        """Drift watch: efficiency against the simulated bound, collective keys against the first steps'
        (megatron pads buckets, so the plan's modelled sizes are not the reference)."""
        from lagom.runtime.monitor import Monitor

        return Monitor.for_plan(self.workload, self.hw, plan)

    @property
    def out_dir(self) -> Path:
        files = self.options.report_files
        return files[0].parent if files else CACHE_DIR

    # -- hooks into megatron
    def _swap(self, owner: Any, attr: str, value: Any) -> None:
        self._restore.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def nccl_options(self, original: Any) -> Any:
        """megatron's get_nccl_options, with the plan's settings for every group the plan covers.

        Megatron then creates each group with these options; the runtime's new_group wrapper sees
        they are the plan's and records them.
        """
        def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict) -> Any:
            planned = self.communicator_configs().get(pg_name)
            if planned is None:
                return original(pg_name, nccl_comm_cfgs)
            user = dict(nccl_comm_cfgs.get(pg_name) or {})
            for key, value in planned.items():
                if key in user and user[key] != value:
                    log.warning("process group %s: %s=%s from the megatron config is replaced by the plan's %s",
                                pg_name, key, user[key], value)
            options = original(pg_name, {pg_name: {**user, **planned}})
            self.group_options[pg_name] = options
            return options
        return get_nccl_options

    def communicator_configs(self) -> dict[str, dict[str, Any]]:
        """The plan's communicator settings under every megatron pg_name they apply to."""
        if self.plan is None:
            return {}
        return {pg: cfg for group, cfg in emit.communicator_configs(self.plan).items()
                for pg in megatron_pg_names(group, self.cp)}

    def _install(self) -> None:
        from megatron.core import parallel_state

        self.interceptor.install()
        self._swap(parallel_state, "get_nccl_options", self.nccl_options(parallel_state.get_nccl_options))

    def close(self) -> None:
        self.interceptor.uninstall()
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()
        self.runtime.close()

    # -- per step
    def step_begin(self, iteration: int | None = None) -> None:
        self.iteration = self.iteration + 1 if iteration is None else iteration
        self.runtime.recorder.begin_step(self.iteration)
        self._t0 = time.perf_counter()

    def step_end(self) -> None:
        step_s = time.perf_counter() - self._t0
        records = self.runtime.recorder.end_step()
        self.steps_seen += 1
        if self.steps_seen == 1:  # warm-up: allocations and megatron's first-batch path; not representative
            return
        if self.tuning:
            self._observe_tuning(step_s, records)
        else:
            self.measured.add(step_s, records, self.plan)
            if self.measured.steps == self.options.tune_iters:
                self.write_report()
            self._watch(step_s, records)

    def _observe_tuning(self, step_s: float, records: list[Any]) -> None:
        if self.baseline is None:
            self.baseline = report.Measured()
        self.baseline.add(step_s, records, self.plan)
        plan = self.tuner.observe(step_s, records)
        if plan is None:
            return
        self.tuning = False
        self._adopt_online(plan)

    def _adopt_online(self, plan: Plan) -> None:
        """A plan found while running: the routing applies now; what Megatron fixes at start-up (CTAs,
        NCCL variables, buffers) applies on the next start, which finds the plan in the cache."""
        self.plan = plan
        self.router.plan = plan
        self.measured = report.Measured()
        self.applied_now = list(self.tuner.applies_now)
        self.next_start = list(self.tuner.next_start)
        if self.options.plan is not None and _rank(self.args) == 0:
            plan.save(self.options.plan)
            log.info("online plan also written to %s", self.options.plan)
        decomposed = [e.key for e in plan.entries if e.config.decomposition == "p2p"]
        if decomposed and not self.options.flash_overlap:
            log.warning("the online plan decomposes %d TP points; pass --lagom-flash-overlap to run them with "
                        "Flash-Overlap", len(decomposed))
        self.monitor = self._monitor(plan)

    def _watch(self, step_s: float, records: list[Any]) -> None:
        if self.monitor is None:
            return
        reason = self.monitor.observe(step_s, records)
        if self.options.mode == "offline":
            if reason:
                log.warning("offline plan may be stale (%s); re-run `lagom tune` or use --lagom-mode online", reason)
            return
        self._drift = self._drift or bool(reason)
        if self.measured.steps % DRIFT_CHECK_STEPS == 0 and self._agree(self._drift):
            log.info("online: the plan went stale on some rank; re-tuning over the next %d steps", self.options.tune_iters)
            self.tuner.reset()
            self.tuning, self.baseline, self._drift = True, None, False

    @staticmethod
    def _agree(flag: bool) -> bool:
        """True when any rank says so: every rank must start a re-tune at the same step."""
        if not torch.distributed.is_initialized():
            return flag
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t = torch.tensor([int(flag)], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    # -- report
    def report(self) -> dict[str, Any]:
        return report.build(self.plan, mode=self.options.mode, workload=self.workload.name, hardware=self.hw.name,
                            baseline=self.baseline, tuned=self.measured, applied_now=self.applied_now,
                            next_start=self.next_start, env_conflicts=self.env_conflicts,
                            decomposed=self.router.decomposed)

    def write_report(self) -> None:
        """JSON + Markdown on rank 0 (when asked for) and Megatron's TensorBoard / W&B writers."""
        if _rank(self.args) != 0 or self.plan is None:
            return
        data = self.report()
        files = self.options.report_files
        if files:
            report.write(data, files)
            log.info("Lagom report written to %s and %s", *files)
        try:
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        except ImportError:
            return
        report.to_writers(data, self.iteration, get_tensorboard_writer(), get_wandb_writer())

