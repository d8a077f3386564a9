"""The machine a running job is on, when the user names none: ``--lagom`` alone (Megatron) and
``"lagom": {"enabled": true}`` alone (DeepSpeed) plan for what this finds.

In order:

1. a hardware name or file the user gave wins (source ``explicit``);
2. a GPU whose model a preset has: that preset, resized to the job's layout (GPUs per node from the
   local world size, nodes from the world size) and with the intra-node link the node reports (NVLink
   or not, where NVML can tell) (source ``preset``);
3. otherwise (no GPU, or a GPU no preset has) the links are measured: a short, time-bounded
   calibration of the job's own collectives on its world group, on top of ``FALLBACK_PRESET``'s GPU
   and NCCL figures; the profile is cached in ``cache_dir`` by host, device and layout, and read back
   next time (sources ``measured`` and ``cached``);
4. where nothing can be measured because torch.distributed is not initialised yet (Megatron asks
   before it builds its process groups), ``FALLBACK_PRESET`` resized to the job (source ``assumed``).

With torch.distributed initialised, rank 0 decides and broadcasts, so every rank plans for the same
machine; before that, each rank decides from facts that agree across ranks (the GPU model, the
layout), and reads a cached profile only when the job runs on one node (the cache is that node's).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from lagom.errors import ConfigError, LagomError
from lagom.hardware import (
    Hardware,
    closest_preset,
    load_hardware,
    preset_link,
    with_cluster,
)
from lagom.runtime.apply.control import Control
from lagom.runtime.measure.calibrate import fit, measure, measured_profile, write_profile

log = logging.getLogger("lagom.probe")

# What a GPU without a preset (or a CPU) plans with besides its measured links: a widely deployed
# datacenter GPU's compute figures and NCCL constants. The reason string always says so.
FALLBACK_PRESET = "a100-8x-100g"
# Two sizes fit latency and bandwidth; far apart, so that noise on a busy host does not hide the slope.
CALIBRATION_SIZES = (64 * 1024, 16 * 1024 * 1024)
CALIBRATION_ITERS = 3
CALIBRATION_BUDGET_S = 20.0


@dataclass
class HardwareChoice:
    """The machine to plan for, where it came from, and why (the report prints ``reason``)."""

    hardware: Hardware
    source: str  # explicit | preset | measured | cached | assumed
    reason: str


@dataclass(frozen=True)
class Facts:
    """What this process can see of the machine, gathered by ``gather_facts``."""

    world_size: int
    gpus_per_node: int
    nodes: int
    gpu_name: str | None  # None: no GPU
    nvlink: bool | None  # None: unknown (no NVML)
    host: str
    layout_note: str  # where gpus_per_node came from

    @property
    def device(self) -> str:
        return self.gpu_name or "cpu"


def _nvlink(device: int) -> bool | None:
    """Whether the GPU has an active NVLink, from NVML when it is installed (nvidia-ml-py), else None.

    The GPU is found by its PCI address: CUDA's device numbers follow CUDA_VISIBLE_DEVICES, NVML's do not.
    """
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    props = torch.cuda.get_device_properties(device)
    address = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(address)
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                        return True
                except pynvml.NVMLError:
                    break  # past the links this GPU has (a GPU without NVLink has none)
            return False
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def gather_facts(world_size: int, local_world_size: int | None = None) -> Facts:
    """The GPU model, NVLink, and the job's layout: ranks per node from ``local_world_size``, else
    LOCAL_WORLD_SIZE (torchrun, deepspeed), else the GPUs this node has, never more than the world."""
    if world_size <= 0:
        raise ConfigError("world_size", f"must be positive, got {world_size}")
    gpu = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if local_world_size is not None:
        per_node, note = local_world_size, "given"
    elif os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        per_node, note = int(os.environ["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    elif gpu:
        per_node, note = torch.cuda.device_count(), "the GPUs this node has"
    else:
        per_node, note = world_size, "no GPU and no LOCAL_WORLD_SIZE: all ranks on this host"
    per_node = max(1, min(per_node, world_size))
    nodes = -(-world_size // per_node)
    if nodes * per_node != world_size:
        note += f"; {world_size} ranks do not fill {nodes} nodes of {per_node}, planned as {nodes} full nodes"
    device = torch.cuda.current_device() if gpu else 0
    return Facts(world_size=world_size, gpus_per_node=per_node, nodes=nodes,
                 gpu_name=torch.cuda.get_device_name(device) if gpu else None,
                 nvlink=_nvlink(device) if gpu else None, host=socket.gethostname(), layout_note=note)


def from_preset(facts: Facts) -> HardwareChoice | None:
    """The preset for this GPU, resized to the job, with the NVLink fact applied; None where none fits."""
    if facts.gpu_name is None:
        return None
    name = closest_preset(facts.gpu_name, nvlink=facts.nvlink, gpus_per_node=facts.gpus_per_node, nodes=facts.nodes)
    if name is None:
        return None
    preset = load_hardware(name)
    layout = f"{facts.nodes} node(s) x {facts.gpus_per_node} GPUs ({facts.layout_note})"
    reason = f"GPU '{facts.gpu_name}' matches preset {name}; cluster set to {layout}"
    intra = None
    if facts.nvlink is not None and facts.gpus_per_node > 1:
        wanted = "nvlink" if facts.nvlink else "pcie"
        borrowed = preset_link(wanted) if preset.cluster.intra.kind != wanted else None
        if borrowed is not None:
            intra = borrowed[1]
            reason += f"; NVML reports {'an' if facts.nvlink else 'no'} NVLink, so the {wanted} link of {borrowed[0]}"
        elif preset.cluster.intra.kind != wanted:
            reason += f"; NVML reports {'an' if facts.nvlink else 'no'} NVLink but no preset has a {wanted} link: kept {name}'s"
    elif facts.gpus_per_node > 1:
        reason += f"; links are {name}'s (NVML not available to check NVLink)"
    return HardwareChoice(with_cluster(preset, facts.gpus_per_node, facts.nodes, intra), "preset", reason)


def assumed(facts: Facts, why: str) -> HardwareChoice:
    """The fallback preset resized to the job, for when nothing matches and nothing could be measured."""
    hw = with_cluster(load_hardware(FALLBACK_PRESET), facts.gpus_per_node, facts.nodes)
    return HardwareChoice(hw, "assumed", f"{_unknown(facts)} and {why}: assumed {FALLBACK_PRESET}'s figures "
                                         f"for {facts.nodes} node(s) x {facts.gpus_per_node} ranks (source: assumed; "
                                         "name the hardware for a better plan)")


def _unknown(facts: Facts) -> str:
    return f"no preset has GPU '{facts.gpu_name}'" if facts.gpu_name else "no GPU"


def cache_file(cache_dir: Path, facts: Facts) -> Path:
    """One profile per host, device and layout."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{facts.host}-{facts.device}").strip("-")
    return Path(cache_dir) / f"hardware-{slug}-{facts.nodes}x{facts.gpus_per_node}.yaml"


def _cached(cache_dir: Path, facts: Facts) -> HardwareChoice | None:
    path = cache_file(cache_dir, facts)
    if not path.is_file():
        return None
    try:
        hw = with_cluster(load_hardware(str(path)), facts.gpus_per_node, facts.nodes)
    except LagomError as err:
        log.warning("lagom: ignoring the cached hardware profile %s: %s", path, err)
        return None
    return HardwareChoice(hw, "cached", f"{_unknown(facts)}: links measured earlier on this host, read from {path}")


def _explicit(name: str) -> HardwareChoice:
    try:
        hw = load_hardware(name)
    except ConfigError as err:
        if err.key.startswith("hardware"):
            raise
        raise ConfigError(f"hardware: {err.key}", err.problem, err.fix) from None
    return HardwareChoice(hw, "explicit", f"named by the user: {name}")


def _known(explicit: str | None, facts: Facts, cache_dir: Path, read_cache: bool) -> HardwareChoice | None:
    """The hardware without measuring anything: explicit, preset or cached; None where none applies."""
    if explicit:
        return _explicit(explicit)
    return from_preset(facts) or (_cached(cache_dir, facts) if read_cache else None)


def _calibrated(facts: Facts, cache_dir: Path, samples: dict[str, list[list[float]]], backend: str,
                elapsed: float) -> HardwareChoice:
    """Rank 0: the profile fitted from the samples, cached; the fallback where no fit or no cache works."""
    name = re.sub(r"[^A-Za-z0-9.-]+", "-", f"measured-{facts.device}-{facts.nodes}x{facts.gpus_per_node}")
    usable = {}
    for coll, rows in samples.items():  # one noisy collective must not discard the others
        try:
            fit({coll: rows}, facts.world_size)
            usable[coll] = rows
        except LagomError as err:
            log.warning("lagom: calibration left out %s: %s", coll, err)
    try:
        data = measured_profile(FALLBACK_PRESET, name, usable, facts.world_size, facts.gpus_per_node, backend)
    except ConfigError as err:
        return assumed(facts, f"the calibration gave no usable fit ({err.problem})")
    path = cache_file(cache_dir, facts)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_profile(path, data)
    except OSError as err:  # an unwritable cache must not stop the job
        log.warning("lagom: cannot cache the measured profile in %s: %s", path, err)
        return assumed(facts, f"the measured profile could not be cached ({err.strerror or err})")
    hw = with_cluster(load_hardware(str(path)), facts.gpus_per_node, facts.nodes)
    link = data["calibration"]["measured"]["link"]
    measured_link = getattr(hw.cluster, link)
    return HardwareChoice(hw, "measured", f"{_unknown(facts)}: {link}-node link measured by a {elapsed:.1f} s "
                                          f"{backend} calibration of the job's collectives ({measured_link.gbps:.3g} GB/s, "
                                          f"{measured_link.latency_us:.3g} us per step), GPU and NCCL figures from "
                                          f"{FALLBACK_PRESET}; cached in {path}")


def _measure_world(facts: Facts, budget_s: float) -> tuple[dict[str, list[list[float]]], str, float]:
    """Every rank: time the world group's collectives at a few sizes, within ``budget_s``."""
    backend = "nccl" if "nccl" in str(dist.get_backend()).lower() else "gloo"
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    log.info("lagom: %s; measuring this job's collectives (%s, %d ranks, at most %.0f s)",
             _unknown(facts), backend, facts.world_size, budget_s)
    start = time.perf_counter()
    samples = measure(list(CALIBRATION_SIZES), CALIBRATION_ITERS, device, budget_s=budget_s)
    elapsed = time.perf_counter() - start
    log.info("lagom: calibration took %.1f s", elapsed)
    return samples, backend, elapsed


def resolve_hardware(explicit: str | None, world_size: int, *, cache_dir: Path,
                     local_world_size: int | None = None, budget_s: float = CALIBRATION_BUDGET_S,
                     control: Control | None = None) -> HardwareChoice:
    """The hardware to plan for (see the module's docstring for the order); the same on every rank.

    Rank 0 decides and ``control`` (Lagom's agreement channel; a temporary one when None) carries the
    decision. A bad explicit name or file is a ConfigError naming the key ``hardware``; with
    torch.distributed initialised it is raised on every rank.
    """
    if control is None:
        channel = Control()
        try:
            return resolve_hardware(explicit, world_size, cache_dir=cache_dir, local_world_size=local_world_size,
                                    budget_s=budget_s, control=channel)
        finally:
            channel.close()
    cache_dir = Path(cache_dir)
    if not (dist.is_available() and dist.is_initialized()):
        facts = gather_facts(world_size, local_world_size)
        why = ("torch.distributed is not initialised yet, so nothing could be measured" if world_size > 1
               else "a single rank has no collectives to measure")
        choice = _known(explicit, facts, cache_dir, read_cache=facts.nodes == 1) or assumed(facts, why)
    else:
        if dist.get_world_size() != world_size:
            raise ConfigError("world_size", f"{world_size} ranks asked for, torch.distributed has {dist.get_world_size()}")

        def first_look() -> tuple[Facts, HardwareChoice | None]:
            facts = gather_facts(world_size, local_world_size)
            known = _known(explicit, facts, cache_dir, read_cache=True)
            if known is None and world_size == 1:
                known = assumed(facts, "a single rank has no collectives to measure")
            return facts, known

        facts, choice = control.on_rank0(first_look, "the hardware")
        if choice is None:  # every rank measures; rank 0 fits and caches
            samples, backend, elapsed = _measure_world(facts, budget_s)
            choice = control.on_rank0(lambda: _calibrated(facts, cache_dir, samples, backend, elapsed),
                                      "the measured hardware profile")
    log.info("lagom: hardware %s (%s): %s", choice.hardware.name, choice.source, choice.reason)
    return choice
