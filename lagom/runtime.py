"""The runtime a training job runs under: a plan applied to NCCL, and a recorder of its collectives.

``init(plan)`` checks the NCCL environment against the plan, exports the plan's process-wide NCCL
variables and wraps ``torch.distributed.new_group`` so that communicators created afterwards get the
plan's per-group options (CTAs, stream priority). ``Recorder`` times every collective the adapters
report without adding a synchronisation: wall clock and the work's completion callback on CPU,
CUDA events on the current stream on GPU, resolved when the step ends.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from lagom.emit import check_env, communicator_configs, env_conflicts, nccl_env
from lagom.errors import ConfigError
from lagom.hardware import Hardware, load_hardware
from lagom.plan import Plan

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
OPTION_KEYS = ("max_ctas", "min_ctas", "cga_cluster_size", "net_name")
CALLBACK_GRACE_S = 0.01  # a completed future runs its callbacks right after waking its waiters
STALE_STEPS = 100  # a call still open this many steps after its own was never completed: dropped


# ---------------------------------------------------------------------------------------------
# Recording


@dataclass(slots=True)
class CallRecord:
    """One collective call: times in seconds from the start of the step it was issued in.

    ``exact`` is False when the work had no completion callback, so ``end_s`` is when its caller
    waited for it or the step ended: an upper bound.
    """

    group: str
    collective: str
    nbytes: int
    seq: int  # issue order within the step
    step: int
    start_s: float
    end_s: float
    exact: bool = True

    @property
    def key(self) -> str:
        return f"{self.group}/{self.collective}/{self.nbytes}"

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class _Open:
    """A call whose end is not known yet. ``t0``/``start``/``end``: floats on CPU, CUDA events on GPU."""

    __slots__ = ("group", "collective", "nbytes", "seq", "step", "t0", "start", "end", "future", "exact")

    def __init__(self, group: str, collective: str, nbytes: int, seq: int, step: int, t0: Any, start: Any) -> None:
        self.group, self.collective, self.nbytes, self.seq, self.step = group, collective, nbytes, seq, step
        self.t0, self.start, self.end = t0, start, None
        self.future: Any = None
        self.exact = True

    def finish_cpu(self, _future: Any = None) -> None:
        self.end = time.perf_counter()

    def finish_cuda(self, _future: Any = None) -> None:
        # Run by the future with current streams that wait for the work's kernels: this event
        # completes when the collective does, and nothing on the host waits for it.
        self.end = _event()


def _event() -> Any:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


class _TimedWork:
    """A work without a completion future: its end is taken when the caller waits for it."""

    __slots__ = ("_work", "_op", "_now")

    def __init__(self, work: Any, op: _Open, now: Callable[[], Any]) -> None:
        self._work, self._op, self._now = work, op, now

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._op.end is None:
            self._op.end = self._now()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Recorder:
    """Times the collectives of each step; never waits for one.

    ``track`` is called by the adapters right after issuing a call. Records come out of
    ``end_step``; a call whose completion is not visible yet (CUDA events not reached, future not
    done) stays open and comes out of a later ``end_step`` with its own step number.
    ``records`` keeps the last ``max_records`` records; ``summary`` covers every step.
    """

    def __init__(self, *, cuda: bool | None = None, max_records: int = 100_000) -> None:
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.max_records = max_records
        self.step = 0
        self.records: list[CallRecord] = []
        self._seq = 0
        self._t0: Any = None
        self._open: list[_Open] = []
        self._totals: dict[str, list[float]] = {}  # key -> [count, total seconds]

    def _now(self) -> Any:
        return _event() if self.cuda else time.perf_counter()

    @property
    def pending(self) -> int:
        """Calls tracked but not resolved yet."""
        return len(self._open)

    def begin_step(self, step: int) -> None:
        self.step, self._seq, self._t0 = step, 0, self._now()

    def track(self, group: str, collective: str, nbytes: int, work: Any = None) -> Any:
        """Start timing a call now; it ends when ``work`` completes (now if there is no work).

        Returns what the caller should hand on instead of ``work``: the work itself, or, for a
        work without a completion future, a proxy that takes the end time when it is waited on.
        """
        if self._t0 is None:
            self._t0 = self._now()
        op = _Open(group, collective, int(nbytes), self._seq, self.step, self._t0, self._now())
        self._seq += 1
        self._open.append(op)
        if work is None:
            op.end = op.start
            return None
        try:
            op.future = work.get_future()
        except (AttributeError, RuntimeError):  # gloo send/recv and reduce_scatter: no future
            op.exact = False
            return _TimedWork(work, op, self._now)
        op.future.add_done_callback(op.finish_cuda if self.cuda else op.finish_cpu)
        return work

    def end_step(self) -> list[CallRecord]:
        """Resolve what has completed; return those records (this step's and late earlier ones)."""
        done: list[CallRecord] = []
        still: list[_Open] = []
        step_end = None
        stale = [op for op in self._open if op.step < self.step - STALE_STEPS]
        if stale:
            log.warning("dropping %d calls that never completed (e.g. %s issued in step %d): their works' futures "
                        "were never marked done", len(stale), f"{stale[0].group}/{stale[0].collective}", stale[0].step)
            self._open = [op for op in self._open if op.step >= self.step - STALE_STEPS]
        for op in self._open:
            if op.end is None and op.future is None:  # no future, not waited through the proxy: the step end bounds it
                step_end = step_end or self._now()
                op.end = step_end
            elif op.end is None and not self.cuda and op.future.done():
                deadline = time.perf_counter() + CALLBACK_GRACE_S
                while op.end is None and time.perf_counter() < deadline:
                    time.sleep(0)
            record = self._resolve(op)
            if record is None:
                still.append(op)
            else:
                done.append(record)
        self._open = still
        done.sort(key=lambda r: (r.step, r.seq))
        self.records.extend(done)
        if len(self.records) > self.max_records:
            del self.records[: len(self.records) - self.max_records]
        for r in done:
            total = self._totals.setdefault(r.key, [0, 0.0])
            total[0] += 1
            total[1] += r.duration_s
        return done

    def _resolve(self, op: _Open) -> CallRecord | None:
        if op.end is None:
            return None
        if self.cuda:
            if not (op.t0.query() and op.start.query() and op.end.query()):
                return None
            start, end = op.t0.elapsed_time(op.start) / 1e3, op.t0.elapsed_time(op.end) / 1e3
        else:
            start, end = op.start - op.t0, op.end - op.t0
        return CallRecord(op.group, op.collective, op.nbytes, op.seq, op.step, start, max(start, end), op.exact)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per key over every resolved call: how many, and their total seconds."""
        return {k: {"count": int(c), "total_s": t} for k, (c, t) in self._totals.items()}


class KeyIndex:
    """Matches an observed call key to a known key: same group and collective, nearest size.

    Frameworks pad buffers (megatron rounds buckets up), so a size within ``tolerance`` of a known
    one is the same tuning key.
    """

    def __init__(self, keys: Iterable[str], tolerance: float = 0.05) -> None:
        self.tolerance = tolerance
        self._sizes: dict[tuple[str, str], list[int]] = {}
        for key in keys:
            group, coll, size = split_key(key)
            self._sizes.setdefault((group, coll), []).append(size)

    def match(self, key: str) -> str | None:
        group, coll, size = split_key(key)
        sizes = self._sizes.get((group, coll))
        if not sizes:
            return None
        best = min(sizes, key=lambda s: abs(s - size))
        return f"{group}/{coll}/{best}" if abs(best - size) <= self.tolerance * max(best, 1) else None


def split_key(key: str) -> tuple[str, str, int]:
    group, coll, size = key.rsplit("/", 2)
    return group, coll, int(size)


# ---------------------------------------------------------------------------------------------
# NCCL options and the runtime


def nccl_options(cfg: dict[str, Any]) -> Any:
    """``ProcessGroupNCCL.Options`` from one ``communicator_configs`` entry."""
    options_cls = getattr(dist, "ProcessGroupNCCL", None)
    if options_cls is None:
        raise ConfigError("torch", "this torch build has no NCCL", "install a CUDA build of torch, or run without a plan")
    unknown = set(cfg) - set(OPTION_KEYS) - {"is_high_priority_stream"}
    if unknown:
        raise ConfigError(f"communicator config.{sorted(unknown)[0]}", "unknown key",
                          f"known keys: {', '.join(OPTION_KEYS)}, is_high_priority_stream")
    for key in ("max_ctas", "min_ctas"):
        if key in cfg and int(cfg[key]) < 1:
            raise ConfigError(f"communicator config.{key}", f"must be at least 1, got {cfg[key]}")
    if int(cfg.get("min_ctas", 1)) > int(cfg.get("max_ctas", cfg.get("min_ctas", 1))):
        raise ConfigError("communicator config.min_ctas", f"{cfg['min_ctas']} exceeds max_ctas {cfg['max_ctas']}")
    options = options_cls.Options(is_high_priority_stream=bool(cfg.get("is_high_priority_stream", False)))
    for key in OPTION_KEYS:
        if key in cfg:
            setattr(options.config, key, cfg[key] if key == "net_name" else int(cfg[key]))
    return options


_current: Runtime | None = None
_NEW_GROUP_OWNERS = (dist, dist.distributed_c10d)


def free_port() -> int:
    """A free TCP port on this host, for MASTER_PORT when Lagom spawns local ranks itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def current() -> Runtime | None:
    """The runtime ``init`` made and ``close`` has not undone yet."""
    return _current


class Runtime:
    """A plan in force (or none) and the recorder. ``close`` undoes the env and the wrapper.

    ``group_options``: options built for each plan group created since ``init`` (on gloo too, so the
    plan's values can be checked); ``applied_groups``: those actually passed to NCCL.
    """

    def __init__(self, plan: Plan | None, hw: Hardware | None, recorder: Recorder) -> None:
        self.plan, self.hw, self.recorder = plan, hw, recorder
        self.group_options: dict[str, Any] = {}
        self.applied_groups: set[str] = set()
        self.env_set: dict[str, str] = {}
        self._comm_cfgs = communicator_configs(plan) if plan is not None else {}
        self._original_new_group: Callable[..., Any] | None = None
        self._closed = False

    def options_for(self, group_name: str) -> Any:
        """NCCL options the plan gives a group (by plan name or megatron group_desc), else None."""
        name = self.plan_group(group_name)
        return nccl_options(self._comm_cfgs[name]) if name is not None else None

    def _matches_plan(self, name: str, options: Any) -> bool:
        """Whether options a caller built carry this plan's values (e.g. megatron's, routed through the plan)."""
        cfg = self._comm_cfgs[name]
        config = getattr(options, "config", None)
        same = all(getattr(config, key, None) == cfg[key] for key in OPTION_KEYS if key in cfg)
        return same and bool(getattr(options, "is_high_priority_stream", False)) == bool(cfg.get("is_high_priority_stream", False))

    def plan_group(self, desc: str | None) -> str | None:
        if desc is None:
            return None
        names = (desc, *GROUP_DESC_ALIASES.get(desc, ()))
        return next((n for n in names if n in self._comm_cfgs), None)

    # -- environment
    def _export_env(self, strict: bool) -> None:
        assert self.plan is not None and self.hw is not None
        if strict:
            check_env(self.plan, self.hw, os.environ)
        for conflict in env_conflicts(self.plan, self.hw, os.environ):
            log.warning("%s; the environment wins (strict_env=False)", conflict)
        for var, value in nccl_env(self.plan, self.hw).items():
            if var not in os.environ:
                os.environ[var] = value
                self.env_set[var] = value
        if self.env_set:
            log.info("exported %s (read by NCCL when a communicator is created)",
                     ", ".join(f"{k}={v}" for k, v in self.env_set.items()))
            if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower():
                log.warning("NCCL communicators created before lagom.runtime.init keep their old settings")

    # -- group creation
    def _install(self) -> None:
        original = dist.new_group
        signature = inspect.signature(original)

        def new_group(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            self._apply_options(bound.arguments)
            return original(*bound.args, **bound.kwargs)

        new_group.__wrapped__ = original  # type: ignore[attr-defined]
        new_group.lagom_runtime = self  # type: ignore[attr-defined]
        self._original_new_group = original
        for owner in _NEW_GROUP_OWNERS:
            owner.new_group = new_group  # type: ignore[attr-defined]

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

    def close(self) -> None:
        """Put ``new_group`` back and remove the NCCL variables ``init`` exported."""
        global _current
        if self._closed:
            return
        self._closed = True
        if self._original_new_group is not None:
            for owner in _NEW_GROUP_OWNERS:
                if getattr(owner.new_group, "lagom_runtime", None) is self:
                    owner.new_group = self._original_new_group  # type: ignore[attr-defined]
                else:
                    log.warning("%s.new_group was re-wrapped after lagom.runtime.init; left as it is", owner.__name__)
        for var, value in self.env_set.items():
            if os.environ.get(var) == value:
                del os.environ[var]
        if _current is self:
            _current = None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _world_size() -> int | None:
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


def init(plan: Plan | str | Path | None = None, *, strict_env: bool = True,
         hw: Hardware | str | None = None) -> Runtime:
    """Put a plan in force for this process (or only record, with ``plan=None``).

    Call it before the process groups are created: NCCL reads its environment and a group's options
    when the communicator is made. ``hw`` defaults to the preset the plan names.
    """
    global _current
    if _current is not None:
        log.warning("lagom.runtime.init called again: closing the previous runtime first")
        _current.close()
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    hardware = None
    if plan is not None:
        hardware = _hardware_for(plan, hw)
        world = _world_size()
        plan.check_for(world if world is not None else plan.world_size, hw=hardware)
    runtime = Runtime(plan, hardware, Recorder())
    if plan is not None:
        runtime._export_env(strict_env)
        runtime._install()
        log.info("plan '%s' (%s, %d keys) in force; communicator options for groups %s",
                 plan.workload, plan.strategy, len(plan.entries), ", ".join(sorted(runtime._comm_cfgs)) or "none")
    _current = runtime
    return runtime
