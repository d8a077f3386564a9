"""The machine a plan is made for: GPU, cluster links, NCCL behaviour and contention constants.

Every number the cost model uses lives in a YAML preset (shipped in ``lagom/configs/hardware/``, or a
user's own in a ``LAGOM_HARDWARE_PATH`` folder) or a file the user passes, e.g. one written by ``lagom
calibrate``; none is hard-coded here. A file may start with
``base: <preset or file>`` and override only what it measured; a relative file is found beside the
file that names it.

``closest_preset`` and ``with_cluster`` turn what a running job can see (its GPU's name, NVLink, ranks
per node, world size) into the machine to plan for; ``lagom.runtime.measure.probe`` gathers those facts.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.config_file import read_mapping
from lagom.errors import ConfigError
from lagom.resources import HARDWARE_DIR, HARDWARE_PATH_ENV, hardware_dirs

BASE_FILE = "_base.yaml"


@dataclass
class GemmCta:
    """One CTA of the GEMM library's usual large-GEMM kernel: its footprint and main-loop pipeline."""

    threads: int = 256
    registers: int = 0  # per thread
    smem_kb: float = 0.0
    stages: int = 0  # k-blocks in flight: loaded before the first MMA of a tile (the pipeline fill)
    tile_k: int = 0  # k-extent of one stage
    dtype_bytes: int = 2  # bf16 operands and output


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
    # What one SM holds (CUDA occupancy limits): decides whether a comm CTA leaves room for a GEMM CTA.
    sm_registers: int = 65536
    sm_smem_kb: float = 0.0  # shared memory per SM usable by CTAs
    sm_threads: int = 2048
    gemm_cta: GemmCta = field(default_factory=lambda: GemmCta())
    # Hopper cuBLAS/CUTLASS GEMMs launch at most one CTA per SM and loop over tiles: a grid of min(tiles, SMs)
    persistent_gemm: bool = False


@dataclass
class Link:
    kind: str = "???"  # nvlink | pcie | ib | ethernet
    gbps: float = 0.0  # GB/s, one direction: per GPU for intra-node links, per node for inter-node
    latency_us: float = 0.0  # one chunk's flight on this link: bounds a channel's throughput on the network


@dataclass
class Cluster:
    gpus_per_node: int = 0
    nodes: int = 0
    intra: Link = field(default_factory=Link)  # within an island of ``island_gpus`` GPUs (all of the node: 0)
    inter: Link = field(default_factory=Link)
    island_gpus: int = 0  # GPUs the intra link joins (A40 NVLink bridges: pairs); 0: the whole node
    bridge: Link = field(default_factory=lambda: Link(kind="none"))  # between islands of one node (PCIe) when island_gpus is set
    nvls: bool = False  # NVSwitch with NVLink SHARP (in-switch reduction) joins a node's GPUs

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def link_within_node(self, ranks_per_node: int) -> Link:
        """The slowest link a group with this many ranks on each node uses inside a node: a group larger
        than one island crosses the bridge (ranks are placed on consecutive GPUs, so pairs stay pairs)."""
        if self.island_gpus and ranks_per_node > self.island_gpus:
            return self.bridge
        return self.intra


@dataclass
class Protocol:
    """One NCCL protocol as NCCL's tuning model prices it (src/graph/tuning.cc)."""

    efficiency: float = 1.0  # payload share of the ring bus bandwidth (NCCL: LL 0.5, LL128 0.92)
    max_gbps: list[float] = field(default_factory=list)  # bus cap by nodes (1, 2, more); [] none (llMaxBws)
    channel_max_gbps: list[float] = field(default_factory=list)  # per-channel cap by nodes (perChMaxRingLL128Bws)
    thread_threshold: int = 64  # bytes per thread below which NCCL drops channels (LL: x ranks on a ring)
    base_latency_us: dict[str, float] = field(default_factory=dict)  # per algorithm, once per collective
    # per link class (nvlink | pci | net), then algorithm: latency of one step (hwLatencies)
    step_latency_us: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def latency_us(self) -> float:
        """NCCL's latency of one ring step over NVLink: what ``lagom calibrate`` counts a link's own beyond."""
        return self.step_latency_us.get("nvlink", {}).get("ring", 0.0)


@dataclass
class Nccl:
    """NCCL's defaults and the constants of its per-channel pipeline."""

    version: str = "2.30.7"  # the NCCL a plan is made for: it decides which knobs can be applied
    default_channels: int = 0
    max_channels: int = 0  # the topology's channels per communicator: no plan or rule asks for more
    nvls_channels: int = 16  # NCCL's NVLS CTAs for a communicator that sets none (nvlsChannels)
    default_threads: int = 512
    default_chunk_bytes: int = 0
    buffsize_per_chunk: int = 2  # NCCL_BUFFSIZE = this many chunks
    channel_gbps: dict[str, float] = field(default_factory=dict)  # per link kind, one channel, full threads
    threads_saturation: int = 256  # threads per CTA beyond which a channel goes no faster
    step_overhead_us: float = 0.0  # synchronisation cost of one chunk step on one channel
    protocols: dict[str, Protocol] = field(default_factory=dict)
    net_overhead_us: float = 1.0  # posting one network step; x3 on Simple (NCCL getNetOverhead, x86)
    net_pipeline_stages: int = 3  # store-and-forward stages of a network chunk: GPU buffer, NIC out, NIC in
    tree_min_nodes: int = 2  # tree all-reduce is only offered across this many nodes
    tree_efficiency: float = 0.92  # NCCL's tree all-reduce bus-bandwidth factor
    tree_channel_max_gbps: list[float] = field(default_factory=list)  # per channel by nodes (perChMaxTreeBws)
    nvls_efficiency: float = 0.0  # NVLS bandwidth factor per GPU generation (nvlsEfficiency; 0: no NVLS)
    # NVLS's time beyond its latency and its bytes at its rate: nvls_fill_us at large messages, half of it at
    # nvls_fill_half_mib (published-fit; NCCL's tuning has no such term); 0: none
    nvls_fill_us: float = 0.0
    nvls_fill_half_mib: float = 1.0
    # A one-node ring's time beyond NCCL's latency and its bytes, per algorithm step: ring_fill_us at large
    # messages, half of it where a step's slice (the buffer over the ranks) is ring_fill_half_mib (published-fit;
    # NCCL's tuning has no such term); 0: none
    ring_fill_us: float = 0.0
    ring_fill_half_mib: float = 1.0
    ce_gbps: float = 0.0  # copy-engine bandwidth per GPU (CTA policy ZERO); 0: no copy-engine collectives
    ce_launch_us: float = 0.0  # one copy-engine transfer's launch cost, paid per peer
    cta_registers: int = 96  # per thread: NCCL builds its kernels with -maxrregcount=96
    cta_smem_kb: float = 0.0  # dynamic shared memory of one NCCL CTA (ncclShmemDynamicSize)
    cta_extra_threads: int = 32  # ring Simple launches one more warp for synchronisation
    shm_gbps: float = 0.0  # intra-node transport through host shared memory

    @property
    def base_latency_us(self) -> float:
        """NCCL's base latency of a ring Simple collective: what ``lagom calibrate`` subtracts from a fit."""
        simple = self.protocols.get("Simple")
        return simple.base_latency_us.get("ring", 0.0) if simple else 0.0


@dataclass
class Contention:
    """How a running collective slows the compute beside it (and back).

    ``source`` says whether these were measured on the GPU (with ``measured`` giving date, GPU,
    driver, torch) or are estimates from datasheets and public reports.
    """

    source: str = "estimate"
    hbm_bytes_per_comm_byte: dict[str, float] = field(default_factory=dict)  # reduce | copy
    hbm_interference: float = 1.0  # how much of the comm HBM traffic compute loses
    l2_interference: float = 0.0  # extra memory-time slowdown when comm staging fills L2
    comm_slowdown_per_hbm_util: float = 0.0  # comm slows by 1 + this x compute HBM utilisation
    cta_wait_us: float = 0.0  # a normal-priority comm kernel waits this long for SMs held by compute
    # GEMM CTA slots one comm CTA takes (residency); None: worked out from both kernels' footprints
    gemm_slots_per_comm_cta: float | None = None
    measured: dict[str, Any] = field(default_factory=dict)


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
    """Every preset a name can reach: the user's (``LAGOM_HARDWARE_PATH``) and the shipped ones."""
    return sorted({p.stem for folder in hardware_dirs() for p in folder.glob("*.yaml") if not p.name.startswith("_")})


def _preset_file(name: str, key: str, taken: tuple[Path, ...]) -> Path:
    """The first file for preset ``name`` along the search path that is not ``taken`` (already in the
    base chain): a user's preset may shadow a shipped one and still build on it with ``base: <name>``."""
    dirs = hardware_dirs()
    found = [path.resolve() for folder in dirs if (path := folder / f"{name}.yaml").is_file()]
    free = [path for path in found if path not in taken]
    if free:
        return free[0]
    if found:
        return found[0]  # every file of that name is already in the chain: _layers reports the cycle
    looked = ", ".join(str(folder) for folder in dirs)
    raise ConfigError(key, f"unknown hardware '{name}' (no {name}.yaml in {looked})",
                      f"use one of {', '.join(preset_names())}, a YAML file, or a folder in {HARDWARE_PATH_ENV} holding {name}.yaml")


def _is_preset_name(ref: str) -> bool:
    """A bare name (``a40-2x8-nvlink``) is a preset; anything with a suffix or a folder is a file."""
    return not Path(ref).suffix and "/" not in ref and "\\" not in ref


def _resolve(ref: str, key: str, folder: Path | None, taken: tuple[Path, ...] = ()) -> Path:
    """The file a hardware reference names; ``folder``: where a relative file is looked for."""
    if _is_preset_name(ref):
        return _preset_file(ref, key, taken)
    path = Path(ref).expanduser()
    if folder is not None and not path.is_absolute():
        path = folder / path
    if path.is_dir():
        raise ConfigError(key, f"{ref} is a folder", "pass a preset name or a YAML file")
    if not path.is_file():
        where = f" (looked in {folder})" if folder is not None else ""
        raise ConfigError(key, f"file {ref} does not exist{where}", "pass a preset name or an existing YAML file")
    return path.resolve()


Layer = tuple[Path, bytes, DictConfig]  # a YAML file, the digest of its text when read, its keys less ``base``
_PARSED: dict[tuple[Path, bytes], tuple[Any, DictConfig]] = {}  # never mutated once stored
_LOADED: dict[tuple[tuple[Path, bytes], ...], Hardware] = {}


def _parsed(path: Path) -> tuple[bytes, Any, DictConfig]:
    """A hardware file's digest, its ``base`` and its other keys, parsed once per text of the file: detection
    loads every preset, and OmegaConf takes tens of milliseconds a file. Keyed by the text, not the file's
    mtime, which the kernel advances only once per tick: a file rewritten at once would look unchanged."""
    try:
        digest = hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
    except OSError:
        digest = b""  # read_mapping says why the file cannot be read
    found = _PARSED.get((path, digest))
    if found is None:
        layer = read_mapping(path)
        found = _PARSED[(path, digest)] = (layer.pop("base", None), layer)
    return (digest, *found)


def _layers(ref: str, key: str = "hardware", folder: Path | None = None,
            chain: tuple[tuple[Path, str], ...] = ()) -> list[Layer]:
    """The YAML layers of a preset or file, base first: ``base:`` chains are followed, each relative
    file from the folder of the file that names it, and a chain that comes back is refused as a cycle."""
    path = _resolve(ref, key, folder, tuple(seen for seen, _ in chain))
    label = ref if _is_preset_name(ref) else path.name
    if any(seen == path for seen, _ in chain):
        cycle = " -> ".join([name for _, name in chain] + [label])
        raise ConfigError("hardware.base", f"the base files form a cycle: {cycle}", "remove one of the 'base' keys")
    digest, base, layer = _parsed(path)
    if base is None:
        root = HARDWARE_DIR / BASE_FILE
        root_digest, _, root_layer = _parsed(root)
        return [(root, root_digest, root_layer), (path, digest, layer)]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path.name}: base", f"must be a preset name or a YAML file, got {base!r}",
                          f"use one of {', '.join(preset_names())} or a file path")
    return _layers(base, f"{path.name}: base", path.parent, chain + ((path, label),)) + [(path, digest, layer)]


def preset_base(name: str) -> str | None:
    """The preset a preset is built on (its ``base:``), where that is a preset name; None for a file or none."""
    _, base, _ = _parsed(_preset_file(name, "hardware", ()))
    return base if isinstance(base, str) and _is_preset_name(base) else None


def load_hardware(source: str) -> Hardware:
    """Load a preset by name (``a40-2x8-nvlink``) or a YAML file, strictly: unknown keys are errors. A chain of
    files loaded before with the same texts gives a copy of what it gave then."""
    layers = _layers(source)
    chain = tuple((path, digest) for path, digest, _ in layers)
    hw = _LOADED.get(chain)
    if hw is None:
        hw = _LOADED[chain] = _merged([layer for _, _, layer in layers])
    return copy.deepcopy(hw)


def _merged(layers: list[DictConfig]) -> Hardware:
    schema = OmegaConf.structured(Hardware)
    try:
        hw: Hardware = OmegaConf.to_object(OmegaConf.merge(schema, *layers))  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "hardware"
        raise ConfigError(f"hardware.{key}", str(err).splitlines()[0], f"check the key against {HARDWARE_DIR / BASE_FILE}") from None
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
        "nccl.nvls_channels": hw.nccl.nvls_channels,
        "nccl.default_chunk_bytes": hw.nccl.default_chunk_bytes,
        "nccl.nvls_fill_half_mib": hw.nccl.nvls_fill_half_mib,
        "nccl.ring_fill_half_mib": hw.nccl.ring_fill_half_mib,
    }
    if hw.cluster.nodes > 1:
        positive["cluster.inter.gbps"] = hw.cluster.inter.gbps
    for key, value in positive.items():
        if not value or value <= 0:
            raise ConfigError(f"hardware {hw.name}: {key}", f"must be positive, got {value}")
    for key in ("nvls_fill_us", "ring_fill_us"):
        if getattr(hw.nccl, key) < 0:
            raise ConfigError(f"hardware {hw.name}: nccl.{key}", f"must be 0 or more, got {getattr(hw.nccl, key)}",
                              "set it to 0 where no fit gives it")
    if hw.nccl.max_channels > 64:
        raise ConfigError(f"hardware {hw.name}: nccl.max_channels", f"{hw.nccl.max_channels} exceeds NCCL's 64 channels "
                          "per communicator", "set it to the channels NCCL builds for this topology, at most 64")
    if hw.gpu.sm_smem_kb <= 0 or min(hw.gpu.gemm_cta.threads, hw.gpu.gemm_cta.registers, hw.gpu.gemm_cta.smem_kb) <= 0:
        raise ConfigError(f"hardware {hw.name}: gpu.gemm_cta", "the SM's shared memory and the GEMM CTA's threads, "
                          "registers and shared memory must be positive", "set gpu.sm_smem_kb and gpu.gemm_cta")
    cta = hw.gpu.gemm_cta
    if min(hw.gpu.sm_registers // (cta.threads * cta.registers), hw.gpu.sm_smem_kb // cta.smem_kb,
           hw.gpu.sm_threads // cta.threads) < 1:
        raise ConfigError(f"hardware {hw.name}: gpu.gemm_cta", "one GEMM CTA does not fit on an SM",
                          "check gpu.gemm_cta against gpu.sm_registers, sm_smem_kb and sm_threads")
    kinds = {hw.cluster.intra.kind}
    if hw.cluster.island_gpus and hw.cluster.island_gpus < hw.cluster.gpus_per_node:
        if hw.cluster.bridge.gbps <= 0:
            raise ConfigError(f"hardware {hw.name}: cluster.bridge.gbps", f"must be positive when island_gpus "
                              f"({hw.cluster.island_gpus}) joins fewer GPUs than a node has", "set the link between islands")
        kinds.add(hw.cluster.bridge.kind)
    for kind in kinds | ({hw.cluster.inter.kind} if hw.cluster.nodes > 1 else set()):
        if kind not in hw.nccl.channel_gbps:
            raise ConfigError(
                f"hardware {hw.name}: nccl.channel_gbps", f"has no entry for link kind '{kind}'", "add one"
            )


# ---------------------------------------------------------------------------------------------
# From what a running job sees to the machine to plan for (torch-free: lagom.runtime.measure.probe gathers the facts)

_FAMILY = re.compile(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b")  # A100, H100, A40, V100, L40S, GH200


def gpu_family(gpu_name: str) -> str | None:
    """The model token of a GPU name: 'NVIDIA A100-SXM4-80GB' and 'A100-SXM4-80GB' -> 'A100'; 'NVIDIA A10' -> 'A10'."""
    found = _FAMILY.search(gpu_name.upper())
    return found.group(1) if found else None


def _form_factor(gpu_name: str) -> str | None:
    upper = gpu_name.upper()
    return "pcie" if "PCIE" in upper else "sxm" if "SXM" in upper else None


def measured_without_gpu(hw: Hardware) -> bool:
    """A profile `lagom calibrate` measured over gloo (CPU tensors): its figures are the CPU's, so it is never
    offered for a GPU, whatever GPU its base names."""
    cal = hw.calibration or {}
    return any((m or {}).get("backend") == "gloo" or (m or {}).get("device_type") == "cpu"
               for m in (cal.get("measured"), (cal.get("contention") or {}).get("measured"), hw.contention.measured))


def closest_preset(gpu_name: str, *, nvlink: bool | None = None, gpus_per_node: int | None = None,
                   nodes: int | None = None) -> str | None:
    """The preset for a GPU seen at run time, or None where no preset has its model.

    Among presets of the same model, the one whose intra-node link agrees with ``nvlink`` (unknown:
    guessed from a 'PCIe' in the name), then the same form factor (SXM or PCIe), then the same number
    of GPUs per node and nodes; ties go to the first name.
    """
    family = gpu_family(gpu_name)
    if family is None:
        return None
    if nvlink is None and _form_factor(gpu_name) == "pcie":
        nvlink = False
    wanted_kind = None if nvlink is None else "nvlink" if nvlink else "pcie"
    form = _form_factor(gpu_name)
    scored = []
    for name in preset_names():
        hw = load_hardware(name)
        if gpu_family(hw.gpu.name) != family or measured_without_gpu(hw):
            continue
        preset_form = _form_factor(hw.gpu.name)
        scored.append((
            wanted_kind is not None and hw.cluster.intra.kind != wanted_kind,
            form is not None and preset_form is not None and form != preset_form,
            gpus_per_node is not None and hw.cluster.gpus_per_node != gpus_per_node,
            nodes is not None and hw.cluster.nodes != nodes,
            name,
        ))
    return min(scored)[-1] if scored else None


def preset_link(kind: str) -> tuple[str, Link] | None:
    """The intra-node link of the first preset whose intra-node link is of this kind (nvlink, pcie)."""
    for name in preset_names():
        intra = load_hardware(name).cluster.intra
        if intra.kind == kind:
            return name, intra
    return None


def with_cluster(hw: Hardware, gpus_per_node: int, nodes: int, intra: Link | None = None) -> Hardware:
    """``hw`` resized to a job's layout (and, given ``intra``, with another intra-node link).

    The name says the layout when it differs from the preset's, and the fingerprint follows the
    cluster, so a plan made for one layout is refused on another.
    """
    if gpus_per_node <= 0 or nodes <= 0:
        raise ConfigError("hardware.cluster", f"needs at least one GPU per node and one node, got {gpus_per_node} x {nodes}")
    cluster = replace(hw.cluster, gpus_per_node=gpus_per_node, nodes=nodes, intra=intra or hw.cluster.intra,
                      island_gpus=0 if intra else hw.cluster.island_gpus)
    if cluster == hw.cluster:
        return hw
    resized = replace(hw, name=f"{hw.name}-{nodes}x{gpus_per_node}", cluster=cluster,
                      description=f"{hw.description}; resized to {nodes} node(s) x {gpus_per_node} GPUs"
                                  + (f", {cluster.intra.kind} within a node" if intra else ""))
    _validate(resized)
    return resized
