"""Contention profiling: compute kernels timed alone and beside collectives on this machine's devices.

Each sample is one kernel (a bf16 GEMM of the workload, or a memory-bound pass) and one collective
setting: the kernel alone, the collective alone, the kernel while the collective runs the whole time
behind it, and the collective while the kernel runs behind it. Settings: channels 1, 2, 4, ... up to the
communicator's maximum at NCCL's default chunk and Simple, then other chunks, then other protocols.

How a setting is put in force: the tuner plugin's live table where the plugin is built (one communicator
made with room for the most channels; chunk only where NCCL's tuner interface sets it, >= 2.30), else one
communicator per channel count made with ``max_ctas = min_ctas = N``. On gloo the same schedule runs and
NCCL's settings change nothing; on one GPU with no peer a comm-like Triton kernel stands in for the
collective (``lagom.runtime.measure.comm_kernel``) and the samples say so (``source: emulated``).

Method: device events on a GPU (a compute and a comm stream), the wall clock and a second thread on CPU;
two warm-up calls; the median of ``repeats`` runs, inputs redrawn before each; the slowest rank's figure.
Every rank runs the same collectives in the same order: repeat counts come from times agreed by an
all-reduce, and the time budget from rank 0's clock (``calibrate._out_of_time``).
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from lagom import nccl_tuner
from lagom.model.contention import ContentionSample, KernelShape
from lagom.plan.capability import Capability, Scope
from lagom.plan.comm_config import CommConfig
from lagom.plan.emit import TUNER_COLL, TUNER_RULES_HEADER
from lagom.step.calls import SIZE_TOLERANCE
from lagom.step.graph import Collective

log = logging.getLogger("lagom.calibrate")

COLLECTIVES = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE)
WARMUP = 2
COVER = 1.5  # the background side runs at least this many times the foreground's time
HEAD_START_S = 20e-6  # the background starts this long before the timed foreground (CPU threads)
HEAD_START_CYCLES = 40_000  # the same on a GPU: about 20 us of a spinning kernel at 2 GHz


@dataclass(frozen=True)
class BenchSettings:
    """What one contention profile measures."""

    kernels: tuple[KernelShape, ...]
    comm_bytes: dict[Collective, int]
    channels: tuple[int, ...]
    chunks: tuple[int, ...]
    protocols: tuple[str, ...]
    default: CommConfig  # NCCL's default setting on the base profile (its threads run every setting)
    repeats: int
    budget_s: float

    def configs(self) -> list[CommConfig]:
        """Channel sweep at the default chunk and protocol, then other chunks, then other protocols."""
        base = self.default
        out = [replace(base, channels=c) for c in self.channels]
        out += [replace(base, chunk_bytes=c) for c in self.chunks if c != base.chunk_bytes]
        out += [replace(base, protocol=p) for p in self.protocols if p != str(base.protocol)]
        return out


# ---------------------------------------------------------------------------------------------
# Lanes: the foreground timed, the background running behind it


class Lanes:
    """Wall clock and a second thread (CPU): torch's CPU kernels and gloo's collectives release the GIL."""

    def alone(self, fn: Callable[[], None]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def beside(self, fg: Callable[[], None], bg: Callable[[], None], calls: int) -> float:
        started, failed = threading.Event(), []

        def loop() -> None:
            started.set()
            try:
                for _ in range(calls):
                    bg()
            except BaseException as err:  # noqa: BLE001 - raised again on the measuring thread
                failed.append(err)

        worker = threading.Thread(target=loop, name="lagom-calibrate-background")
        worker.start()
        started.wait()
        time.sleep(HEAD_START_S)
        try:
            return self.alone(fg)
        finally:
            worker.join()
            if failed:
                raise failed[0]


class CudaLanes(Lanes):
    """Device events on two streams: the background's calls queued first, the foreground after a head start."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fg, self.bg = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def _timed(self, fn: Callable[[], None], head_start: bool) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.fg):
            if head_start:
                torch.cuda._sleep(HEAD_START_CYCLES)
            begin.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return begin.elapsed_time(end) / 1e3

    def alone(self, fn: Callable[[], None]) -> float:
        torch.cuda.synchronize(self.device)
        return self._timed(fn, head_start=False)

    def beside(self, fg: Callable[[], None], bg: Callable[[], None], calls: int) -> float:
        torch.cuda.synchronize(self.device)
        with torch.cuda.stream(self.bg):
            for _ in range(calls):
                bg()
        return self._timed(fg, head_start=True)


# ---------------------------------------------------------------------------------------------
# Kernels and collectives


def dtype_on(device: torch.device) -> torch.dtype:
    """bf16 as training runs on a GPU; fp32 on CPU, where bf16 matmuls are emulated and not what a job runs."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class Kernel:
    """A compute kernel by shape on this device, with inputs redrawn on ``refresh``."""

    def __init__(self, shape: KernelShape, device: torch.device) -> None:
        self.shape = shape
        dtype = dtype_on(device)
        if shape.gemm is not None:
            m, n, k = shape.gemm
            self.a, self.b = torch.empty(m, k, device=device, dtype=dtype), torch.empty(k, n, device=device, dtype=dtype)
            self.out = torch.empty(m, n, device=device, dtype=dtype)
        else:
            self.a = torch.empty(shape.elements or 1, device=device, dtype=dtype)
            self.out = torch.empty_like(self.a)
        self.refresh()

    def refresh(self) -> None:
        for t in (self.a, getattr(self, "b", None)):
            if t is not None:
                t.normal_()

    def __call__(self) -> None:
        if self.shape.gemm is not None:
            torch.mm(self.a, self.b, out=self.out)
        else:  # one read, one write per element: memory-bound
            torch.mul(self.a, 1.0009765625, out=self.out)


def rule_table(world: int, coll: Collective, nbytes: int, nodes: int, cfg: CommConfig) -> str:
    """A live table of one rule: this collective about this size (the buffer is rounded to whole elements per
    rank, so the rule spans the size tolerance plans use) on all ``world`` ranks over ``nodes``, at ``cfg``."""
    low, high = math.floor(nbytes * (1 - SIZE_TOLERANCE)), math.ceil(nbytes * (1 + SIZE_TOLERANCE))
    return (f"{TUNER_RULES_HEADER}\nworld {world}\n{TUNER_COLL[str(coll)]} {low} {high} {world} {nodes} "
            f"{cfg.algorithm} {str(cfg.protocol).lower()} {cfg.channels} {cfg.chunk_bytes}\n")


class Collectives:
    """Real collectives on the initialised group (NCCL or gloo), with a setting put in force per call."""

    def __init__(self, device: torch.device, settings: BenchSettings, capability: Capability | None,
                 nodes: int) -> None:
        self.device, self.settings, self.nodes = device, settings, nodes
        self.world = dist.get_world_size()
        self.nccl = "nccl" in str(dist.get_backend()).lower()
        self.source = "nccl" if self.nccl else "gloo"
        self.table: Any = None
        self.chunk_applies = capability is None or capability.scope("chunk") == Scope.PER_SIZE
        self.groups: dict[int, Any] = {}
        self.buffers: dict[Collective, tuple[torch.Tensor, torch.Tensor]] = {}
        self.skipped: list[str] = []
        self._open_table()
        if self.nccl and self.table is None:
            self.skipped.append("chunk and protocol (no tuner plugin table: channels through one communicator each)")
        elif self.nccl and not self.chunk_applies:
            self.skipped.append("chunk (NCCL's tuner interface before 2.30 sets none per size)")

    def _open_table(self) -> None:
        if nccl_tuner.path() is None:
            return
        from lagom.nccl_tuner.live import LiveTable, LiveTableError

        try:
            self.table = LiveTable.create(self.world)
        except (LiveTableError, OSError) as err:
            log.warning("contention profiling without the tuner plugin's live table: %s", err)

    def applies(self, cfg: CommConfig) -> bool:
        """Whether this setting can be put in force here (gloo: the schedule runs, nothing changes)."""
        default = self.settings.default
        if not self.nccl:
            return True
        if self.table is None:
            return cfg.chunk_bytes == default.chunk_bytes and cfg.protocol == default.protocol
        return self.chunk_applies or cfg.chunk_bytes == default.chunk_bytes

    def _group(self, cfg: CommConfig) -> Any:
        """The communicator for this setting: one with room for every channel count where the table sets
        them per call, else one per channel count; gloo: the world."""
        if not self.nccl:
            return None
        key = max(self.settings.channels) if self.table is not None else cfg.channels
        if key not in self.groups:
            from lagom.runtime.apply.runtime import nccl_options

            low = 1 if self.table is not None else key
            self.groups[key] = dist.new_group(list(range(self.world)),
                                              pg_options=nccl_options({"max_ctas": key, "min_ctas": low}))
        return self.groups[key]

    def call(self, coll: Collective, cfg: CommConfig) -> Callable[[], None]:
        nbytes = self.settings.comm_bytes[coll]
        if self.table is not None:
            self.table.put(rule_table(self.world, coll, nbytes, self.nodes, cfg))
        group = self._group(cfg)
        if coll not in self.buffers:
            dtype = dtype_on(self.device)
            elements = max(self.world, nbytes // (torch.finfo(dtype).bits // 8) // self.world * self.world)
            full = torch.empty(elements, device=self.device, dtype=dtype)
            self.buffers[coll] = (full, torch.empty(elements // self.world, device=self.device, dtype=dtype))
        full, part = self.buffers[coll]
        if coll == Collective.ALL_GATHER:
            return lambda: dist.all_gather_into_tensor(full, part, group=group)
        if coll == Collective.REDUCE_SCATTER:
            return lambda: dist.reduce_scatter_tensor(part, full, group=group)
        return lambda: dist.all_reduce(full, group=group)

    def refresh(self) -> None:
        for full, part in self.buffers.values():
            full.normal_()
            part.normal_()

    def close(self) -> None:
        for group in self.groups.values():
            dist.destroy_process_group(group)
        self.groups.clear()
        if self.table is not None:
            self.table.close()


class EmulatedCollectives:
    """One GPU, no peer: the comm-like kernel moves what one rank of two would (the bus bytes) on N CTAs."""

    source = "emulated"

    def __init__(self, device: torch.device, settings: BenchSettings) -> None:
        self.device, self.settings = device, settings
        self.world, self.nodes = 2, 1  # the collective it stands in for: two ranks on one node
        self.skipped = ["protocol (the comm-like kernel has none)"]
        self.buffers: dict[Collective, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def applies(self, cfg: CommConfig) -> bool:
        return cfg.protocol == self.settings.default.protocol

    def call(self, coll: Collective, cfg: CommConfig) -> Callable[[], None]:
        from lagom.runtime.measure.comm_kernel import stream_chunks

        bus = self.settings.comm_bytes[coll] // (1 if coll == Collective.ALL_REDUCE else 2)
        if coll not in self.buffers:
            n = max(1, bus // 2)
            self.buffers[coll] = tuple(torch.empty(n, device=self.device, dtype=torch.bfloat16) for _ in range(3))  # type: ignore[assignment]
        src, other, dst = self.buffers[coll]
        reduce = coll != Collective.ALL_GATHER
        return lambda: stream_chunks(src, dst, ctas=cfg.channels, chunk_bytes=cfg.chunk_bytes, threads=cfg.threads,
                                     other=other if reduce else None)

    def refresh(self) -> None:
        for buffers in self.buffers.values():
            for t in buffers:
                t.normal_()

    def close(self) -> None:
        self.buffers.clear()


# ---------------------------------------------------------------------------------------------
# The sweep


def agree_max(values: list[float], device: torch.device) -> list[float]:
    """The slowest rank's figures (every rank calls this at the same point of the schedule)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _median(fn: Callable[[], float], refresh: Callable[[], None], repeats: int) -> float:
    """The median of ``repeats`` timings, inputs redrawn before each."""
    times = []
    for _ in range(repeats):
        refresh()
        times.append(fn())
    return statistics.median(times)


def _sample(settings: BenchSettings, lanes: Lanes, comms: Collectives | EmulatedCollectives, kernel: Kernel,
            coll: Collective, cfg: CommConfig, device: torch.device) -> ContentionSample:
    """One kernel and one collective setting: each alone, each beside the other (slowest rank's medians)."""
    call = comms.call(coll, cfg)

    def refresh() -> None:
        kernel.refresh()
        comms.refresh()

    for fn in (kernel, call) * WARMUP:
        fn()
    kernel_alone = _median(lambda: lanes.alone(kernel), refresh, settings.repeats)
    comm_alone = _median(lambda: lanes.alone(call), refresh, settings.repeats)
    kernel_alone, comm_alone = agree_max([kernel_alone, comm_alone], device)
    # the background covers the whole foreground; counts from agreed times, so every rank issues as many collectives
    comm_calls = math.ceil(COVER * kernel_alone / comm_alone) + 1
    kernel_calls = math.ceil(COVER * comm_alone / kernel_alone) + 1
    kernel_beside = _median(lambda: lanes.beside(kernel, call, comm_calls), refresh, settings.repeats)
    comm_beside = _median(lambda: lanes.beside(call, kernel, kernel_calls), refresh, settings.repeats)
    kernel_beside, comm_beside = agree_max([kernel_beside, comm_beside], device)
    nbytes = settings.comm_bytes[coll]
    sample_id = f"{kernel.shape.label}/{coll}-{nbytes}/ch{cfg.channels}-ck{cfg.chunk_bytes}-{str(cfg.protocol).lower()}"
    return ContentionSample(sample_id, kernel.shape, coll, nbytes, comms.world, comms.nodes, cfg, comms.source,
                            kernel_alone, kernel_beside, comm_alone, comm_beside)


def measure(settings: BenchSettings, lanes: Lanes, comms: Collectives | EmulatedCollectives, device: torch.device,
            out_of_time: Callable[[], bool]) -> list[ContentionSample]:
    """Every kernel beside every collective at every setting that applies, until the budget is spent (the
    channel sweep first, so a short budget still measures residency)."""
    kernels = [Kernel(shape, device) for shape in settings.kernels]
    samples: list[ContentionSample] = []
    for cfg in settings.configs():
        if not comms.applies(cfg):
            continue
        for coll in COLLECTIVES:
            for kernel in kernels:
                if out_of_time():
                    log.warning("contention profiling stopped by its budget (%.0f s) after %d samples",
                                settings.budget_s, len(samples))
                    return samples
                samples.append(_sample(settings, lanes, comms, kernel, coll, cfg, device))
    return samples


def sweep(settings: BenchSettings, device: torch.device, capability: Capability | None, nodes: int,
          out_of_time: Callable[[], bool]) -> tuple[list[ContentionSample], list[str], str]:
    """(samples, what could not be set here and why, their source) on this process's devices and group:
    real collectives where there is a peer, the comm-like kernel on one GPU alone."""
    lanes = CudaLanes(device) if device.type == "cuda" else Lanes()
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    if alone and device.type != "cuda":
        raise ValueError("contention profiling on one rank needs a GPU (the comm-like kernel runs there)")
    comms: Collectives | EmulatedCollectives = (EmulatedCollectives(device, settings) if alone
                                                else Collectives(device, settings, capability, nodes))
    try:
        samples = measure(settings, lanes, comms, device, out_of_time)
    finally:
        comms.close()
    return samples, comms.skipped, comms.source
