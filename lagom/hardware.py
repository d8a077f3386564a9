"""The machine a plan is made for: GPU, cluster links, NCCL behaviour and contention constants.

Every number the cost model uses lives in a YAML preset under ``configs/hardware/`` (or a file the
user passes, e.g. one written by ``lagom calibrate``); none is hard-coded here. A file may start with
``base: <preset>`` and override only what it measured.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.errors import ConfigError

HARDWARE_DIR = Path(__file__).resolve().parent.parent / "configs" / "hardware"
BASE_FILE = "_base.yaml"


@dataclass
class GPU:
    name: str = "???"
    sms: int = 0
    peak_tflops: float = 0.0  # dense bf16 (fp16 where the GPU has no bf16)
    hbm_gbps: float = 0.0  # GB/s
    l2_mb: float = 0.0
    gemm_efficiency: float = 0.0  # fraction of peak a large GEMM reaches
    hbm_efficiency: float = 0.0  # fraction of HBM bandwidth a streaming kernel reaches
    gemm_tile: list[int] = field(default_factory=lambda: [128, 128])  # output tile of one GEMM CTA


@dataclass
class Link:
    kind: str = "???"  # nvlink | pcie | ib | ethernet
    gbps: float = 0.0  # GB/s, one direction: per GPU for intra-node links, per node for inter-node
    latency_us: float = 0.0


@dataclass
class Cluster:
    gpus_per_node: int = 0
    nodes: int = 0
    intra: Link = field(default_factory=Link)
    inter: Link = field(default_factory=Link)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass
class Protocol:
    efficiency: float = 1.0  # payload fraction of what crosses the link
    latency_us: float = 0.0  # per algorithm step, added to the link's latency


@dataclass
class Nccl:
    """NCCL's defaults and the constants of its per-channel pipeline."""

    default_channels: int = 0
    max_channels: int = 0
    default_threads: int = 512
    default_chunk_bytes: int = 0
    buffsize_per_chunk: int = 2  # NCCL_BUFFSIZE = this many chunks
    channel_gbps: dict[str, float] = field(default_factory=dict)  # per link kind, one channel, full threads
    threads_saturation: int = 256  # threads per CTA beyond which a channel goes no faster
    step_overhead_us: float = 0.0  # synchronisation cost of one chunk step on one channel
    base_latency_us: float = 0.0  # launch + setup, once per collective
    protocols: dict[str, Protocol] = field(default_factory=dict)
    tree_min_nodes: int = 2  # tree all-reduce is only offered across this many nodes
    shm_gbps: float = 0.0  # intra-node transport through host shared memory


@dataclass
class Contention:
    """How a running collective slows the compute beside it (and back).

    ``source`` says whether these were measured on the GPU (with ``measured`` giving date, GPU,
    driver, torch) or are estimates from datasheets and public reports.
    """

    source: str = "estimate"
    sm_share_per_cta: float = 1.0  # fraction of one SM a comm CTA with 512 threads takes from GEMMs
    hbm_bytes_per_comm_byte: dict[str, float] = field(default_factory=dict)  # reduce | copy
    hbm_interference: float = 1.0  # how much of the comm HBM traffic compute loses
    l2_interference: float = 0.0  # extra memory-time slowdown when comm staging fills L2
    comm_slowdown_per_hbm_util: float = 0.0  # comm slows by 1 + this x compute HBM utilisation
    cta_wait_us: float = 0.0  # a normal-priority comm kernel waits this long for SMs held by compute
    measured: dict[str, str] = field(default_factory=dict)


@dataclass
class Hardware:
    name: str = "???"
    description: str = ""
    gpu: GPU = field(default_factory=GPU)
    cluster: Cluster = field(default_factory=Cluster)
    nccl: Nccl = field(default_factory=Nccl)
    contention: Contention = field(default_factory=Contention)
    # Filled by ``lagom calibrate``: measured collective times, {collective: [[bytes, seconds], ...]}.
    calibration: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """Stable hash of everything the model reads, so a plan can refuse another machine."""
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def preset_names() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml") if not p.name.startswith("_"))


def _read_yaml(path: Path, key: str) -> Any:
    try:
        return OmegaConf.load(path)
    except (OSError, OmegaConfBaseException, ValueError) as err:
        raise ConfigError(key, f"cannot read {path}: {err}") from None


def _layers(source: str, seen: tuple[str, ...] = ()) -> list[Any]:
    """The YAML layers of a preset or file, base first (``base:`` chains are followed)."""
    path = Path(source)
    if not path.suffix:
        path = HARDWARE_DIR / f"{source}.yaml"
        if not path.exists():
            raise ConfigError(
                "hardware", f"unknown hardware '{source}'", f"use one of {', '.join(preset_names())} or a YAML file"
            )
    elif not path.exists():
        raise ConfigError("hardware", f"file {source} does not exist", "pass a preset name or an existing YAML file")
    if str(path) in seen:
        raise ConfigError("hardware.base", f"{path} includes itself through 'base'")
    layer = _read_yaml(path, "hardware")
    base = layer.pop("base", None) if isinstance(layer, dict) or OmegaConf.is_dict(layer) else None
    below = _layers(str(base), seen + (str(path),)) if base else [_read_yaml(HARDWARE_DIR / BASE_FILE, "hardware")]
    return below + [layer]


def load_hardware(source: str) -> Hardware:
    """Load a preset by name (``a40-2x8-nvlink``) or a YAML file, strictly: unknown keys are errors."""
    schema = OmegaConf.structured(Hardware)
    try:
        merged = OmegaConf.merge(schema, *_layers(source))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "hardware"
        raise ConfigError(f"hardware.{key}", str(err).splitlines()[0], "check the key against configs/hardware/_base.yaml") from None
    hw: Hardware = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(hw)
    return hw


def _validate(hw: Hardware) -> None:
    positive = {
        "gpu.sms": hw.gpu.sms,
        "gpu.peak_tflops": hw.gpu.peak_tflops,
        "gpu.hbm_gbps": hw.gpu.hbm_gbps,
        "gpu.l2_mb": hw.gpu.l2_mb,
        "cluster.gpus_per_node": hw.cluster.gpus_per_node,
        "cluster.nodes": hw.cluster.nodes,
        "cluster.intra.gbps": hw.cluster.intra.gbps,
        "nccl.default_channels": hw.nccl.default_channels,
        "nccl.max_channels": hw.nccl.max_channels,
        "nccl.default_chunk_bytes": hw.nccl.default_chunk_bytes,
    }
    if hw.cluster.nodes > 1:
        positive["cluster.inter.gbps"] = hw.cluster.inter.gbps
    for key, value in positive.items():
        if not value or value <= 0:
            raise ConfigError(f"hardware {hw.name}: {key}", f"must be positive, got {value}")
    for kind in {hw.cluster.intra.kind} | ({hw.cluster.inter.kind} if hw.cluster.nodes > 1 else set()):
        if kind not in hw.nccl.channel_gbps:
            raise ConfigError(
                f"hardware {hw.name}: nccl.channel_gbps", f"has no entry for link kind '{kind}'", "add one"
            )
