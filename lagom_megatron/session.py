"""A Lagom-tuned Megatron run: the core session plus what Megatron fixes at start-up.

``Session.start_for(args, options)`` runs from the parsed arguments, before any process group exists:
each rank then chooses a start plan of its own and sets nothing NCCL reads; at megatron's
``initialize_model_parallel`` (the default group exists, the groups the plan configures do not yet)
every rank puts rank 0's plan in force (``TuningSession.agree_start``). A plan in force at start-up
sets the DDP bucket size, the NCCL options of each process group (through megatron's
``get_nccl_options``), the process-wide NCCL variables and, with Transformer Engine, the userbuffers
config. Explicit user flags win over the plan: the plan is made around them, and Lagom
says once, at WARNING, what it would have changed and what not changing it is predicted to cost.
Everything else (start plan, online tuning, drift, report) is ``lagom.runtime.online.session``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.model.simulator import simulate
from lagom.plan import emit
from lagom.plan.plan import Plan
from lagom.runtime.apply.control import Control
from lagom.runtime.apply.runtime import option_value
from lagom.runtime.online import report
from lagom.runtime.online.session import TuningSession, choose_hardware
from lagom.runtime.online.state import KnobChange, SessionOptions
from lagom.search.driver import Budget
from lagom.step.workload import Workload
from lagom.tune import make_plan, problem_for
from lagom_megatron.arguments import LagomOptions, flash_overlap_blockers
from lagom_megatron.groups import megatron_pg_names
from lagom_megatron.intercept import Interceptor
from lagom_megatron.workload import workload_from_args

log = logging.getLogger("lagom.megatron")
USER_COMM_FLAGS = "--nccl-communicator-config-path / --high-priority-stream-groups"


def session_options(options: LagomOptions, args: argparse.Namespace) -> SessionOptions:
    return SessionOptions(
        mode=options.mode, strategy=options.strategy, tune_steps=options.tune_iters, tune_seconds=options.tune_seconds,
        search_seconds=options.search_seconds, plan_in=options.plan,
        plan_out=options.plan_out, cache_dir=options.cache_dir, report_files=options.report_files,
        flash_overlap=options.flash_overlap, warmup_steps=1,
        search_buckets=getattr(args, "ddp_bucket_size", None) is None)


def _hardware(options: LagomOptions, workload: Workload, control: Control) -> tuple[Hardware, str]:
    """The hardware the plan is made for: the flag, else the plan file's, else detected."""
    explicit = options.hardware
    if explicit is None and options.plan is not None and options.plan.exists():
        explicit = Plan.load(options.plan).hardware
    try:
        return choose_hardware(explicit, workload.world_size, options.cache_dir, control)
    except ConfigError as err:
        raise ConfigError("--lagom-hardware", f"{err.key}: {err.problem}", err.fix or
                          "pass a preset name (shipped, or in a LAGOM_HARDWARE_PATH folder) or a hardware YAML file") from None


class Session(TuningSession):
    """The core session with Megatron's start-up knobs and hooks; see the module docstring."""

    framework = "megatron"

    def __init__(self, args: argparse.Namespace, options: LagomOptions, workload: Workload | None,
                 hw: Hardware | None, hardware_reason: str = "", why_untuned: str = "",
                 control: Control | None = None) -> None:
        world_size = workload.world_size if workload is not None else int(getattr(args, "world_size", 1) or 1)
        super().__init__(workload, hw, session_options(options, args), world_size=world_size,
                         hardware_reason=hardware_reason, why_untuned=why_untuned, control=control)
        self.args, self.lagom_options = args, options
        self.cp = int(getattr(args, "context_parallel_size", 1) or 1)
        self.group_options: dict[str, Any] = {}  # megatron pg_name -> options this adapter gave its group
        self._restore: list[tuple[Any, str, Any]] = []
        self._user_comm_warned: set[str] = set()
        self.interceptor: Interceptor | None = None

    @classmethod
    def start_for(cls, args: argparse.Namespace, options: LagomOptions) -> Session:
        """The session for these arguments; a job Lagom cannot describe runs on Megatron's settings, recorded."""
        control = Control()
        try:
            workload = workload_from_args(args)
        except ConfigError as err:  # Megatron accepted the job: Lagom must not fail it
            session = cls(args, options, None, None, why_untuned=f"{err}. Megatron keeps its own settings", control=control)
        else:
            try:
                hw, reason = _hardware(options, workload, control)
            except BaseException:
                control.close()
                raise
            session = cls(args, options, workload, hw, reason, control=control)
        try:
            session.start()
        except BaseException:
            session.close()
            raise
        session.interceptor = Interceptor(session.runtime.recorder, session.router)
        session._install()
        return session

    def symmetric_groups(self) -> tuple[str, ...]:
        """--use-nccl-ub registers the data-parallel parameter and gradient buffers in symmetric NCCL windows
        (unless --disable-symmetric-registration): the parameter all-gather may run on copy engines."""
        if getattr(self.args, "nccl_ub", False) and not getattr(self.args, "disable_symmetric_registration", False):
            return ("dp", "dp_cp")
        return ()

    # -- start-up knobs
    def apply_at_startup(self, plan: Plan) -> None:
        """Everything Megatron fixes at start-up: buckets, communicator options, TE userbuffers."""
        if self.runtime.env_set:
            self.applied_at_start.append(KnobChange("NCCL environment", None, self.runtime.env_set, "plan"))
        self._apply_buckets(plan)
        self._apply_te(plan)
        for group, cfg in sorted(emit.communicator_configs(plan).items()):
            self.applied_at_start.append(KnobChange(f"nccl_comm_cfgs.{group}", None, cfg, f"plan ({plan.strategy})"))
        self._flash_hint(plan)

    def _apply_buckets(self, plan: Plan) -> None:
        bucket = plan.framework.get("megatron", {}).get("bucket_size")
        if not bucket or not getattr(self.args, "overlap_grad_reduce", False):
            return
        if getattr(self.args, "ddp_num_buckets", None) is not None:
            self.event(f"--ddp-num-buckets is set, so megatron ignores the plan's bucket size {bucket}",
                       level=logging.WARNING)
            return
        user = getattr(self.args, "ddp_bucket_size", None)
        if user is not None:
            if user != bucket:
                self.event(f"--ddp-bucket-size {user} is kept (explicit flags win); the plan was made around it",
                           level=logging.WARNING)
            return
        self.args.ddp_bucket_size = bucket
        self.applied_at_start.append(KnobChange("ddp_bucket_size", self.workload.ddp_bucket_elems, bucket,  # type: ignore[union-attr]
                                                f"plan ({plan.strategy})"))

    def start_search_notes(self, plan: Plan, budget: Budget) -> list[str]:
        """In the start-up search's thread, where the user pinned --ddp-bucket-size: what keeping it costs against
        the bucket size Lagom would pick (a second search, within what is left of the same budget)."""
        user = getattr(self.args, "ddp_bucket_size", None)
        if user is None or not getattr(self.args, "overlap_grad_reduce", False) or budget.cut is not None:
            return []
        free = make_plan(self.workload, self.hw, self.options.strategy,  # type: ignore[arg-type]
                         capability=self.capability, budget=budget)
        mine, theirs = free.predicted_step_s[free.strategy], plan.predicted_step_s[plan.strategy]
        wanted = free.framework["megatron"]["bucket_size"]
        if wanted == user:
            return []
        return [f"Lagom would set --ddp-bucket-size {wanted} (kept: {user}); predicted cost of keeping it: "
                f"{(theirs - mine) * 1e3:+.3f} ms per step"]

    def _apply_te(self, plan: Plan) -> None:
        if not getattr(self.args, "tp_comm_overlap", False):
            return
        cfgs = emit.te_ub_cfgs(plan)
        if importlib.util.find_spec("transformer_engine") is None:
            self.event("Transformer Engine is not importable: the plan's userbuffers config is not used")
            return
        if not cfgs:
            return
        path = self.out_dir / "te_ub_cfgs.yaml"
        report.write_atomic(path, emit.te_ub_yaml(plan))
        if self.args.tp_comm_overlap_cfg:
            self.event(f"--tp-comm-overlap-cfg {self.args.tp_comm_overlap_cfg} is kept (explicit flags win); the "
                       f"plan's userbuffers config is in {path}", level=logging.WARNING)
        else:
            self.args.tp_comm_overlap_cfg = str(path)
            self.applied_at_start.append(KnobChange("tp_comm_overlap_cfg", None, str(path), f"plan ({plan.strategy})"))

    @property
    def out_dir(self) -> Path:
        return self.lagom_options.out_dir

    # -- hooks into megatron
    def _swap(self, owner: Any, attr: str, value: Any) -> None:
        self._restore.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def nccl_options(self, original: Any) -> Any:
        """megatron's get_nccl_options, with the plan's settings for every group the plan covers.

        Values the user gave for a group (``--nccl-communicator-config-path``, ``--high-priority-stream-groups``)
        win; Lagom says once per group what it would have set and the predicted cost.
        """
        def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict) -> Any:
            planned = self.communicator_configs().get(pg_name)
            if planned is None:
                return original(pg_name, nccl_comm_cfgs)
            user = dict(nccl_comm_cfgs.get(pg_name) or {})
            overridden = {k: (user[k], v) for k, v in planned.items() if k in user and user[k] != v}
            if overridden:
                self._warn_user_comm(pg_name, overridden)
            merged = {**planned, **user}
            if merged.get("min_ctas", 1) > merged.get("max_ctas", merged.get("min_ctas", 1)):
                # the user's bound wins; the plan's other bound moves to meet it
                bound = "max_ctas" if "max_ctas" in user else "min_ctas"
                merged["min_ctas" if bound == "max_ctas" else "max_ctas"] = merged[bound]
            options = original(pg_name, {pg_name: merged})
            # megatron's YAML has no CTA policy or NVLS CTAs: set them on the options it built
            for key in ("cta_policy", "nvls_ctas"):
                if key in planned and key not in user:
                    setattr(options.config, key, option_value(key, planned[key]))
            self.group_options[pg_name] = options
            return options
        return get_nccl_options

    def _warn_user_comm(self, pg_name: str, overridden: dict[str, tuple[Any, Any]]) -> None:
        if pg_name in self._user_comm_warned:
            return
        self._user_comm_warned.add(pg_name)
        kept = ", ".join(f"{k}={user} (plan: {plan})" for k, (user, plan) in overridden.items())
        self.event(f"process group {pg_name}: {kept} from {USER_COMM_FLAGS} kept (explicit flags win); predicted "
                   f"cost of not applying the plan's: {self._comm_cost(pg_name, overridden) * 1e3:+.3f} ms per step",
                   level=logging.WARNING)

    def _comm_cost(self, pg_name: str, overridden: dict[str, tuple[Any, Any]]) -> float:
        """Simulated step with the user's CTA range and stream priority on this group, minus the plan's."""
        plan, workload, hw = self.plan, self.workload, self.hw
        if plan is None or workload is None or hw is None:
            return 0.0
        problem = problem_for(workload, hw, self.capability)
        configs = plan.configs()
        user = {k: u for k, (u, _) in overridden.items()}
        groups = {e.group for e in plan.entries if pg_name in megatron_pg_names(e.group, self.cp)}
        mine = dict(configs)
        for e in plan.entries:
            if e.group not in groups or e.key not in configs:
                continue
            cfg = configs[e.key]
            low, high = int(user.get("min_ctas", 1)), int(user.get("max_ctas", cfg.channels))
            mine[e.key] = replace(cfg, channels=min(max(cfg.channels, low), high),
                                  priority=bool(user.get("is_high_priority_stream", cfg.priority)))
        return simulate(problem.graph, mine, problem.model).step_s - simulate(problem.graph, configs, problem.model).step_s

    def communicator_configs(self) -> dict[str, dict[str, Any]]:
        """The plan's communicator settings under every megatron pg_name they apply to."""
        if self.plan is None:
            return {}
        return {pg: cfg for group, cfg in super().communicator_configs().items()
                for pg in megatron_pg_names(group, self.cp)}

    def _install(self) -> None:
        from megatron.core import parallel_state

        if self.interceptor is not None:
            self.interceptor.install()
        self._swap(parallel_state, "get_nccl_options", self.nccl_options(parallel_state.get_nccl_options))
        self._swap(parallel_state, "initialize_model_parallel",
                   self._agreeing_first(parallel_state.initialize_model_parallel))

    def _agreeing_first(self, original: Any) -> Any:
        """megatron's initialize_model_parallel, after every rank has agreed on rank 0's start plan: the default
        group exists by then, and the groups whose NCCL options the plan sets do not yet."""
        @functools.wraps(original)
        def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
            self.agree_start()
            return original(*args, **kwargs)
        return initialize_model_parallel

    def close(self) -> None:
        if self.interceptor is not None:
            self.interceptor.uninstall()
        for owner, attr, original in reversed(self._restore):
            setattr(owner, attr, original)
        self._restore.clear()
        super().close()

    # -- per step (megatron's train_step, wrapped by hooks)
    def step_begin(self, iteration: int | None = None) -> None:
        self.begin_step(iteration)

    def step_end(self) -> None:
        plan = self.end_step()
        if plan is not None:
            self._flash_hint(plan)

    def _flash_hint(self, plan: Plan) -> None:
        """Say once per plan when it decomposes TP points that will run as collectives, and what would let them."""
        decomposed = [e.key for e in plan.entries if e.config.decomposition == "p2p"]
        if not decomposed or self.options.flash_overlap:
            return
        blockers = flash_overlap_blockers(self.args) if getattr(self.args, "lagom_flash_overlap", False) else []
        fix = ("Flash-Overlap is off: " + "; ".join(blockers)) if blockers else \
            "pass --lagom-flash-overlap to run them with Flash-Overlap"
        self.event(f"the plan decomposes {len(decomposed)} TP points ({', '.join(decomposed[:3])}); they run as "
                   f"collectives now. {fix}", level=logging.WARNING)

    # -- report
    def write_report(self) -> None:
        """JSON + Markdown on rank 0, and Megatron's TensorBoard / W&B writers when the run has them."""
        super().write_report()
        if self.plan is None or self.options.report_files is None:
            return
        try:
            from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
        except ImportError:
            return
        to_writers(self.report(), self.iteration, get_tensorboard_writer(), get_wandb_writer())


def to_writers(data: dict[str, Any], iteration: int, tensorboard: Any = None, wandb: Any = None) -> None:
    """Scalars and the Markdown report through Megatron's writers (each may be None)."""
    scalars = {"lagom/measured_step_ms": data["measured"]["tuned_step_ms"]}
    for name, value in (("lagom/measured_gain", data["measured"].get("gain")),
                        ("lagom/predicted_gain", data["predicted"].get("gain") if data["predicted"] else None)):
        if value is not None:
            scalars[name] = value
    if tensorboard is not None:
        for name, value in scalars.items():
            tensorboard.add_scalar(name, value, iteration)
        tensorboard.add_text("lagom/report", report.markdown(data), iteration)
    if wandb is not None:
        wandb.log(scalars, iteration)
