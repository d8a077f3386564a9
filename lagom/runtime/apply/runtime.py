"""A plan applied to NCCL for this process: ``init(plan)`` and the ``Runtime`` it returns.

``init`` checks the NCCL environment against the plan, exports the plan's process-wide NCCL
variables, turns on Lagom's NCCL tuner plugin with the plan's rules (per-size algorithm, protocol,
channels, chunk) and wraps ``torch.distributed.new_group`` so that communicators created afterwards get
the plan's per-group options (CTAs, stream priority, CTA policy, NVLS CTAs). The runtime's ``Recorder``
times every collective of a step: where NCCL is the backend, every runtime (with a plan or without) also
turns on Lagom's NCCL profiler plugin, whose records the recorder reads once per step.

A plan is made under a capability (``lagom.plan.capability``); ``init`` compares it with this process's
(the NCCL torch loads, whether Lagom's plugin is built) and refuses a plan that needs what is missing,
naming it. The adapters' sessions re-plan instead (they have the workload).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lagom import nccl_profiler, nccl_tuner
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.model.reconcile import Coverage, coverage
from lagom.plan.capability import Capability, capability_for
from lagom.plan.emit import (
    ALGO_PROTO_ENV,
    CTA_POLICY_VALUES,
    TUNER_PLUGIN_ENV,
    check_env,
    communicator_configs,
    env_conflicts,
    nccl_env,
    tuner_entries,
    tuner_env,
    tuner_rules,
)
from lagom.plan.plan import Plan
from lagom.runtime.apply import nccl_calls, torch_tap
from lagom.runtime.apply.nccl_calls import NcclGroup
from lagom.runtime.apply.recorder import Recorder

log = logging.getLogger("lagom.runtime")

# megatron-core's group_desc for the communicators a plan names (its gloo twins are never NCCL).
# Megatron group_desc -> plan group names, first match wins (with cp = 1 the dp_cp group is the dp group).
GROUP_DESC_ALIASES = {
    "DATA_PARALLEL_GROUP": ("dp",),
    "DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", "dp"),
    "TENSOR_MODEL_PARALLEL_GROUP": ("tp",),
    "PIPELINE_MODEL_PARALLEL_GROUP": ("pp",),
    "CONTEXT_PARALLEL_GROUP": ("cp",),
    "EXPERT_MODEL_PARALLEL_GROUP": ("ep",),
    "EXPERT_DATA_PARALLEL_GROUP": ("expt_dp",),
}
OPTION_KEYS = ("max_ctas", "min_ctas", "cga_cluster_size", "net_name", "cta_policy", "nvls_ctas")


def option_value(key: str, value: Any) -> Any:
    """A communicator config value as torch's ``Options().config`` holds it (CTA policy: NCCL's number)."""
    if key == "net_name":
        return value
    if key == "cta_policy":
        if str(value) not in CTA_POLICY_VALUES:
            raise ConfigError("communicator config.cta_policy", f"'{value}' is not one of {', '.join(CTA_POLICY_VALUES)}")
        return CTA_POLICY_VALUES[str(value)]
    return int(value)


def nccl_options(cfg: dict[str, Any]) -> Any:
    """``ProcessGroupNCCL.Options`` from one ``communicator_configs`` entry."""
    options_cls = getattr(dist, "ProcessGroupNCCL", None)
    if options_cls is None:
        raise ConfigError("torch", "this torch build has no NCCL", "install a CUDA build of torch, or run without a plan")
    unknown = set(cfg) - set(OPTION_KEYS) - {"is_high_priority_stream"}
    if unknown:
        raise ConfigError(f"communicator config.{sorted(unknown)[0]}", "unknown key",
                          f"known keys: {', '.join(OPTION_KEYS)}, is_high_priority_stream")
    for key in ("max_ctas", "min_ctas", "nvls_ctas"):
        if key in cfg and int(cfg[key]) < 1:
            raise ConfigError(f"communicator config.{key}", f"must be at least 1, got {cfg[key]}")
    if int(cfg.get("min_ctas", 1)) > int(cfg.get("max_ctas", cfg.get("min_ctas", 1))):
        raise ConfigError("communicator config.min_ctas", f"{cfg['min_ctas']} exceeds max_ctas {cfg['max_ctas']}")
    options = options_cls.Options(is_high_priority_stream=bool(cfg.get("is_high_priority_stream", False)))
    for key in OPTION_KEYS:
        if key in cfg:
            setattr(options.config, key, option_value(key, cfg[key]))
    return options


def runtime_capability(hw: Hardware) -> Capability | None:
    """What this process can apply: the NCCL torch loads and this install's plugin, on ``hw``'s topology.
    None without CUDA: no NCCL communicator is made, nothing to compare."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return capability_for(hw, f"{major}.{minor}.{patch}")


def check_capability(plan: Plan, available: Capability | None) -> None:
    """Refuse a plan that needs what ``available`` lacks, naming each missing piece."""
    missing = plan.needs(available) if available is not None else []
    if missing:
        raise ConfigError("plan.capability", f"plan '{plan.workload}' needs {'; '.join(missing)}",
                          "re-plan for this process (`lagom tune --nccl-version X.Y.Z`, with --no-tuner-plugin where "
                          "the plugin is missing), or run through the Megatron/DeepSpeed adapter, which re-plans")


def registration_message(plan: Plan) -> str | None:
    """Which buffers the plan's ZERO CTA policy relies on, once; None if it has none. ZERO is planned only for
    groups whose buffers the job registers symmetrically (``Capability.symmetric_groups``)."""
    if not plan.registration:
        return None
    needs = "; ".join(f"group {r['group']}: {', '.join(r['collectives'])} buffers up to {r['max_bytes']} bytes"
                      for r in plan.registration)
    return (f"the plan's ZERO CTA policy runs on copy engines on the buffers this job registers symmetrically ({needs}); "
            f"they must stay registered ({plan.registration[0]['how']}), else NCCL runs these collectives with SMs as "
            "under the DEFAULT policy")


_current: Runtime | None = None  # the runtime ``init`` made (the plain torch.distributed entry)
_open: list[Runtime] = []  # every runtime with a plan in force, oldest first (sessions may overlap)
_NEW_GROUP_OWNERS = (dist, dist.distributed_c10d)
_original_new_group: Callable[..., Any] | None = None  # what Lagom's wrapper calls, kept once it was seen
_hooked = False


@dataclass
class _Export:
    """A process-wide NCCL variable Lagom set, the runtimes that want it, and what to undo with it."""

    value: str
    owners: set[int] = field(default_factory=set)
    cleanup: Path | None = None  # a file the variable names (the tuner rules), removed with the variable


_exports: dict[str, _Export] = {}


def current() -> Runtime | None:
    """The runtime ``init`` made and ``close`` has not undone yet."""
    return _current


def open_runtimes() -> list[Runtime]:
    """Every runtime with a plan in force, oldest first."""
    return list(_open)


def exported() -> dict[str, str]:
    """The NCCL variables Lagom has set in this process and not removed yet."""
    return {var: e.value for var, e in _exports.items()}


def _export(owner: Runtime, var: str, value: str, cleanup: Path | None = None) -> bool:
    """Set ``var`` for ``owner`` unless the environment already holds it; True when ``owner`` now shares it.

    A variable another open runtime exported with the same value is shared (removed with its last owner);
    anything else already in the environment wins, as a user's setting does.
    """
    held = _exports.get(var)
    if held is not None and held.value == value and os.environ.get(var) == value:
        held.owners.add(id(owner))
        return True
    if var in os.environ:
        return False
    os.environ[var] = value
    _exports[var] = _Export(value, {id(owner)}, cleanup)
    return True


def _release(owner: Runtime) -> None:
    """Drop ``owner`` from every variable it shares; a variable nobody wants any more is removed."""
    for var, held in list(_exports.items()):
        held.owners.discard(id(owner))
        if held.owners:
            continue
        del _exports[var]
        if os.environ.get(var) == held.value:
            del os.environ[var]
        if held.cleanup is not None:
            held.cleanup.unlink(missing_ok=True)


def _new_group(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.new_group`` while any runtime is open: the newest runtime whose plan names the
    group gives it options."""
    original = _original_new_group
    assert original is not None  # set before the wrapper is ever installed
    bound = inspect.signature(original).bind(*args, **kwargs)
    for rt in reversed(_open):
        if rt.plan_group(bound.arguments.get("group_desc")) is not None:
            rt._apply_options(bound.arguments)
            break
    return original(*bound.args, **bound.kwargs)


def _hook_new_group() -> None:
    global _original_new_group, _hooked
    if _hooked:
        return
    _hooked = True
    if dist.new_group is not _new_group:  # still in place when an earlier unhook could not remove it
        _original_new_group = dist.new_group
    _new_group.__wrapped__ = _original_new_group  # type: ignore[attr-defined]
    for owner in _NEW_GROUP_OWNERS:
        owner.new_group = _new_group  # type: ignore[attr-defined]


def _unhook_new_group() -> None:
    global _hooked
    if not _hooked:
        return
    _hooked = False
    for owner in _NEW_GROUP_OWNERS:
        if owner.new_group is _new_group:
            owner.new_group = _original_new_group  # type: ignore[attr-defined]
        else:
            log.warning("%s.new_group was re-wrapped after lagom.runtime.init; left as it is", owner.__name__)


class Runtime:
    """A plan in force (or none) and the recorder. ``close`` undoes the env and the wrapper.

    ``group_options``: options built for each plan group created since ``init`` (on gloo too, so the
    plan's values can be checked); ``applied_groups``: those actually passed to NCCL.
    """

    def __init__(self, plan: Plan | None, hw: Hardware | None, recorder: Recorder,
                 capability: Capability | None = None, explore_channels: int | None = None) -> None:
        self.plan, self.hw, self.recorder = plan, hw, recorder
        self.capability = capability  # what this process can apply (None: not known, no CUDA)
        self.group_options: dict[str, Any] = {}
        self.applied_groups: set[str] = set()
        self.env_set: dict[str, str] = {}  # the plan's process-wide NCCL variables
        self.tuner_env_set: dict[str, str] = {}  # NCCL_TUNER_PLUGIN and the plugin's rules file
        self.tuner_rules_file: Path | None = None
        self.profiler_env_set: dict[str, str] = {}  # NCCL_PROFILER_PLUGIN, where this runtime set it
        self.nccl_records_off: str | None = None  # why the recorder does not read NCCL's own records (None: it does)
        self._comm_cfgs = communicator_configs(plan) if plan is not None else {}
        if explore_channels is not None:  # online mode: room for every channel count the live search may try
            for cfg in self._comm_cfgs.values():
                cfg["max_ctas"] = max(int(cfg["max_ctas"]), explore_channels)
        self.tap: torch_tap.Subscription | None = None  # ``init``'s: the plain torch.distributed entry records through it
        self._closed = False

    def export(self, var: str, value: str) -> bool:
        """Set a process-wide variable for as long as this runtime is open (shared with other runtimes that want
        the same value); False when the environment already holds another value, which wins."""
        if _export(self, var, value):
            self.env_set[var] = value
            return True
        return False

    def comm_configs(self) -> dict[str, dict[str, Any]]:
        """Per plan group, the communicator settings this runtime gives it."""
        return {group: dict(cfg) for group, cfg in self._comm_cfgs.items()}

    def options_for(self, group_name: str) -> Any:
        """NCCL options the plan gives a group (by plan name or megatron group_desc), else None."""
        name = self.plan_group(group_name)
        return nccl_options(self._comm_cfgs[name]) if name is not None else None

    def _matches_plan(self, name: str, options: Any) -> bool:
        """Whether options a caller built carry this plan's values (e.g. megatron's, routed through the plan)."""
        cfg = self._comm_cfgs[name]
        config = getattr(options, "config", None)
        same = all(getattr(config, key, None) == option_value(key, cfg[key]) for key in OPTION_KEYS if key in cfg)
        return same and bool(getattr(options, "is_high_priority_stream", False)) == bool(cfg.get("is_high_priority_stream", False))

    def group_name(self, group: Any) -> str:
        """A process group's name in the plan: its ``group_desc`` mapped as ``plan_group`` does, else the desc."""
        desc = getattr(group, "group_desc", None) or getattr(group, "group_name", "") or "world"
        return self.plan_group(desc) or desc

    def plan_group(self, desc: str | None) -> str | None:
        if desc is None:
            return None
        names = (desc, *GROUP_DESC_ALIASES.get(desc, ()))
        return next((n for n in names if n in self._comm_cfgs), None)

    # -- environment
    def _export_env(self, strict: bool) -> None:
        if self.plan is None or self.hw is None:
            raise ValueError("Runtime._export_env needs a plan and its hardware")
        # what another open runtime exported is Lagom's own, not a user's setting that contradicts the plan
        environ = {k: v for k, v in os.environ.items() if k not in _exports or _exports[k].value != v}
        if strict:
            check_env(self.plan, self.hw, environ)
        for conflict in env_conflicts(self.plan, self.hw, environ):
            log.warning("%s; the environment wins (strict_env=False)", conflict)
        for var, value in nccl_env(self.plan, self.hw).items():
            if _export(self, var, value):
                self.env_set[var] = value
        self._export_tuner()
        if self.env_set:
            log.info("exported %s (read by NCCL when a communicator is created)",
                     ", ".join(f"{k}={v}" for k, v in self.env_set.items()))
            if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
                log.warning("NCCL communicators created before lagom.runtime.init keep their old settings")

    def _export_tuner(self) -> None:
        """Point NCCL at Lagom's tuner plugin and a rules file written for the plan. A tuner, algorithm or
        protocol the user set wins (env_conflicts reports it); so does a rules file the user named."""
        if self.plan is None or not tuner_entries(self.plan):
            return
        plugin = nccl_tuner.path()
        if plugin is None:
            log.warning(nccl_tuner.UNAVAILABLE)
            return
        if self._tuner_overridden(plugin):
            return
        rules_file = os.environ.get(nccl_tuner.RULES_FILE_ENV)
        if rules_file is None:
            self.tuner_rules_file = self._write_tuner_rules(self.plan)
            if self.tuner_rules_file is None:
                return
            rules_file = str(self.tuner_rules_file)
        elif nccl_tuner.RULES_FILE_ENV in _exports:
            log.warning("NCCL tuner plugin: the rules of the Lagom runtime opened first (%s) stay in force for "
                        "communicators created now (NCCL reads one tuner environment per process)", rules_file)
        for var, value in tuner_env(self.plan, rules_file).items():
            cleanup = self.tuner_rules_file if var == nccl_tuner.RULES_FILE_ENV else None
            if _export(self, var, value, cleanup):
                self.tuner_env_set[var] = value
        log.info("NCCL tuner plugin on: %s reads %s", plugin, rules_file)

    @staticmethod
    def _tuner_overridden(plugin: Path) -> bool:
        """Whether the user's environment keeps Lagom's plugin off (another tuner, or NCCL_ALGO/NCCL_PROTO), said once."""
        overriding = [var for var in ALGO_PROTO_ENV if var in os.environ]
        if os.environ.get(TUNER_PLUGIN_ENV, str(plugin)) != str(plugin):
            overriding.insert(0, TUNER_PLUGIN_ENV)
        if overriding:
            log.info("NCCL tuner plugin left off: %s set in the environment", ", ".join(overriding))
        return bool(overriding)

    def plugin_without_rules(self) -> bool:
        """Turn Lagom's tuner plugin on with no rules file, for a session that starts without a plan and may put
        one in force later through the live table: NCCL loads a tuner only when it makes a communicator, and
        tunes every size itself until a table is published. False where the plugin is not built or the
        user's environment keeps it off."""
        plugin = nccl_tuner.path()
        if plugin is None or self._tuner_overridden(plugin) or not _export(self, TUNER_PLUGIN_ENV, str(plugin)):
            return False
        self.tuner_env_set[TUNER_PLUGIN_ENV] = str(plugin)
        return True

    def record_nccl(self, nccl: bool | None = None, groups: Callable[[], list[NcclGroup]] | None = None) -> None:
        """Point NCCL at Lagom's profiler plugin and have the recorder read its records once per step, where NCCL
        is the backend (``nccl``: default, as ``nccl_backend`` finds). Done before the process makes an NCCL
        communicator: NCCL reads NCCL_PROFILER_PLUGIN at its first. A profiler the user named wins, and is said
        once; the tap then records every call, as it does without NCCL or without the built library. ``groups``:
        the process's NCCL groups (default: those the torch tap names for this runtime's recorder)."""
        self.nccl_records_off = None
        if not (nccl_backend() if nccl is None else nccl):
            self.nccl_records_off = "the job's collectives do not run on NCCL (no CUDA device or no NCCL in torch)"
            return
        library = nccl_profiler.path()
        if library is None:
            self.nccl_records_off = nccl_profiler.UNAVAILABLE
            log.info("%s", self.nccl_records_off)
            return
        var = nccl_profiler.PLUGIN_ENV
        if _export(self, var, str(library)):
            self.profiler_env_set[var] = str(library)
        elif os.environ.get(var) != str(library):
            self.nccl_records_off = (f"{var}={os.environ.get(var)} is set in the environment: NCCL loads that profiler "
                                     "instead of Lagom's, so collectives are recorded through torch's hooks")
            log.warning("%s (left as it is)", self.nccl_records_off)
            return
        held = weakref.ref(self.recorder)  # the reader lives in the recorder: no cycle keeps either alive
        if not nccl_calls.attach(self.recorder, groups or (lambda: torch_tap.nccl_groups(held())), library):
            self.nccl_records_off = "another Lagom session of this process reads NCCL's records"
        else:
            log.info("NCCL profiler plugin on: %s (NCCL's own record of each collective, read once per step)", library)

    def _write_tuner_rules(self, plan: Plan) -> Path | None:
        """The plan's rules in a file of this process's own (removed with its variable), or None if it cannot be written."""
        path: Path | None = None
        try:
            handle, name = tempfile.mkstemp(prefix=f"lagom-nccl-tuner-{os.getpid()}-", suffix=".lagom")
            path = Path(name)
            with os.fdopen(handle, "w") as out:
                out.write(tuner_rules(plan))
        except OSError as err:
            log.warning("NCCL tuner plugin left off: cannot write its rules file (%s)", err)
            if path is not None:
                path.unlink(missing_ok=True)
            return None
        return path

    # -- group creation
    def _install(self) -> None:
        """Join the process's ``new_group`` hook: groups the plan names get its options while this runtime is open."""
        _open.append(self)
        _hook_new_group()

    def _apply_options(self, arguments: dict[str, Any]) -> None:
        name = self.plan_group(arguments.get("group_desc"))
        if name is None:
            return
        backend = arguments.get("backend") or (dist.get_backend() if dist.is_initialized() else "")
        is_nccl = "nccl" in str(backend).lower()
        given = arguments.get("pg_options")
        if given is not None:
            if self._matches_plan(name, given):
                self.group_options[name] = given  # e.g. megatron's get_nccl_options, routed through the plan
            else:
                log.warning("group %s: the caller passed its own pg_options; the plan's %s is not applied",
                            name, self._comm_cfgs[name])
            return
        options = self.options_for(name)
        self.group_options[name] = options
        if is_nccl:
            arguments["pg_options"] = options
            self.applied_groups.add(name)
            log.info("group %s: NCCL options %s", name, self._comm_cfgs[name])
        else:
            log.debug("group %s: options built but not passed (backend %s is not NCCL)", name, backend)

    def coverage(self) -> Coverage | None:
        """The share of the recorded calls and of their bytes that are keys of the plan (None without a plan or a
        recorded call): whether the plan describes the collectives this process really issued."""
        records = self.recorder.records
        if self.plan is None or not records:
            return None
        return coverage([e.key for e in self.plan.entries], records)

    def _log_coverage(self) -> None:
        covered = self.coverage()
        if covered is not None:
            log.info("the plan's keys were %s recorded in this process%s", covered.describe(),
                     "" if covered.calls >= 0.95 else "; run online (or tune on a workload that matches the job) so "
                     "that the plan's settings reach the calls that happen")

    def close(self) -> None:
        """Leave the ``new_group`` hook (the last runtime out removes it) and drop the NCCL variables and the
        tuner rules file this runtime exported, unless another open runtime still shares them."""
        global _current
        if self._closed:
            return
        self._closed = True
        if self.tap is not None:  # ``init``'s runtime: no session reports for it, and its recorder is its own
            self._log_coverage()
            self.tap.close()
            self.tap = None
            nccl_calls.detach(self.recorder)
        if self in _open:
            _open.remove(self)
            if not _open:
                _unhook_new_group()
        _release(self)
        if self.tuner_rules_file is not None and nccl_tuner.RULES_FILE_ENV not in self.tuner_env_set:
            self.tuner_rules_file.unlink(missing_ok=True)  # written, never exported
        self.tuner_rules_file = None
        if _current is self:
            _current = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def nccl_backend() -> bool:
    """Whether this process's collectives run on NCCL: the default group's backend once it exists, else whether
    torch has NCCL and a CUDA device (the backend a GPU job gets)."""
    import torch

    if dist.is_initialized():
        return "nccl" in str(dist.get_backend()).lower()
    return bool(torch.cuda.is_available() and dist.is_nccl_available())


def job_world_size() -> int | None:
    """The job's rank count: the default group's, else the launcher's WORLD_SIZE (torchrun, DeepSpeed), else None."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else None


def _hardware_for(plan: Plan, hw: Hardware | str | None) -> Hardware:
    if isinstance(hw, Hardware):
        return hw
    try:
        return load_hardware(hw or plan.hardware)
    except ConfigError as err:
        raise ConfigError("hardware", f"cannot load the plan's hardware '{hw or plan.hardware}' ({err})",
                          "pass init(plan, hw=<profile file the plan was made with>)") from None


def open_runtime(plan: Plan | str | Path | None = None, *, strict_env: bool = True,
                 hw: Hardware | str | None = None, capability: Capability | None = None,
                 explore_channels: int | None = None, recorder: Recorder | None = None) -> Runtime:
    """A runtime with ``plan`` in force (or one that only records, with ``plan=None``), beside any other open
    one: each tuning session owns its own and closes it with itself. See ``init`` for the arguments;
    ``explore_channels``: communicators are made with at least this many CTAs, so the tuner plugin's live
    table can give a call up to that many channels (a communicator cannot grow its channels later);
    ``recorder``: the recorder to keep (a session that puts its plan in force later keeps its taps' one)."""
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    hardware = None
    if plan is not None:
        hardware = _hardware_for(plan, hw)
        world = job_world_size()
        plan.check_for(world if world is not None else plan.world_size, hw=hardware)
        capability = capability or runtime_capability(hardware)
        check_capability(plan, capability)
    runtime = Runtime(plan, hardware, recorder or Recorder(), capability, explore_channels)
    runtime.record_nccl()
    if plan is not None:
        runtime._export_env(strict_env)
        runtime._install()
        log.info("plan '%s' (%s, %d keys) in force; communicator options for groups %s",
                 plan.workload, plan.strategy, len(plan.entries), ", ".join(sorted(runtime._comm_cfgs)) or "none")
        message = registration_message(plan)
        if message is not None:
            log.warning("%s", message)
    return runtime


def init(plan: Plan | str | Path | None = None, *, strict_env: bool = True,
         hw: Hardware | str | None = None, capability: Capability | None = None) -> Runtime:
    """Put a plan in force for this process (or only record, with ``plan=None``): the entry for plain
    torch.distributed scripts, one runtime at a time (calling it again closes the previous one).

    Call it before the process groups are created: NCCL reads its environment and a group's options
    when the communicator is made. ``hw`` defaults to the preset the plan names. ``capability``: what this
    process can apply (default: detected, ``runtime_capability``); a plan needing more is refused.
    """
    global _current
    if _current is not None:
        log.warning("lagom.runtime.init called again: closing the previous runtime first")
        _current.close()
    _current = open_runtime(plan, strict_env=strict_env, hw=hw, capability=capability)
    # every torch.distributed collective between the recorder's begin_step and end_step is recorded
    _current.tap = torch_tap.subscribe(_current.group_name, _current.recorder)
    return _current


@atexit.register
def _close_at_exit() -> None:
    """``init``'s runtime when the script never closed it: its tap, ``new_group`` hook, NCCL variables and rules
    file go before the interpreter finalises (a hook left on a group crashes the exit, see torch_tap)."""
    if _current is not None:
        _current.close()
