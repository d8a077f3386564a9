"""Per-point communication settings, and the space of settings a strategy may choose from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from itertools import product
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan.capability import (
    DEFAULT_BUFFSIZE,
    PROTOCOL_GRAIN,
    Capability,
    Scope,
    buffsize_for,
    capability_for,
    channel_cap,
)
from lagom.step.graph import Collective, Group, OverlapPoint

TUNER_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # what NCCL asks a tuner about, of Lagom's
SMALL_CHUNK_STEPS = 2  # halvings offered below a protocol's largest chunk when every chunk of the space exceeds it


class Algorithm(StrEnum):
    RING = "ring"
    TREE = "tree"
    NVLS = "nvls"  # NVLink SHARP: reduction in the NVSwitch (H100/H200 SXM nodes)


class Protocol(StrEnum):
    """NCCL's protocols, spelled as NCCL_PROTO spells them."""

    LL = "LL"
    LL128 = "LL128"
    SIMPLE = "Simple"


class Transport(StrEnum):
    P2P = "p2p"  # NVLink / PCIe peer-to-peer
    SHM = "shm"  # through host shared memory (NCCL_P2P_DISABLE=1)
    NET = "net"


class CTAPolicy(StrEnum):
    """The communicator's ``ncclConfig_t.CTAPolicy`` (NCCL >= 2.27)."""

    DEFAULT = "default"
    EFFICIENCY = "efficiency"  # the fewest CTAs that keep decent speed
    ZERO = "zero"  # copy engines, no SMs: all-gather / all-to-all on symmetric buffers (NCCL >= 2.28)


class Decomposition(StrEnum):
    COLLECTIVE = "collective"
    P2P = "p2p"  # Flash-Overlap P2P steps fused with compute


_ENUM_FIELDS = {"algorithm": Algorithm, "protocol": Protocol, "transport": Transport, "decomposition": Decomposition,
                "cta_policy": CTAPolicy}


@dataclass(frozen=True)
class SearchSpace:
    """The values each knob may take. Strategies search inside it; tests shrink it.

    ``capability`` narrows it to what the target can apply (``Problem`` sets it; ``under``): per-process
    knobs are pinned to one value at a time by the search (``pinned``), CTA policies and NVLS CTAs are
    offered only where the NCCL version and topology have them.
    """

    channels: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    threads: tuple[int, ...] = (128, 256, 512)
    # 64 KiB .. 4 MiB, as asked for: each (algorithm, protocol) is offered the distinct chunks NCCL runs for
    # them (``chunk_choices``: LL 8-32 KiB, LL128 up to 576,000 B, tree and NVLS up to their buffer's)
    chunks: tuple[int, ...] = tuple(64 * 1024 * 2**i for i in range(7))
    protocols: tuple[str, ...] = ("LL", "LL128", "Simple")
    splits: tuple[int, ...] = (1, 2, 4)  # Flash-Overlap chunks per peer step; () turns decomposition off
    priorities: tuple[int, ...] = (0, 1)  # 1: the communicator's high-priority stream
    transports: tuple[str, ...] = ("p2p", "shm")  # NCCL_P2P_DISABLE=1 sends intra-node traffic through shm
    cta_policies: tuple[str, ...] = ("default", "efficiency", "zero")
    nvls_ctas: tuple[int, ...] = (2, 4, 8, 16, 32)  # NVLS CTAs per communicator (channels of an NVLS config)
    capability: Capability | None = None

    def under(self, capability: Capability) -> SearchSpace:
        """This space limited to what ``capability`` can apply (idempotent)."""
        nvls_ctas = self.nvls_ctas if capability.scope("nvls_ctas") != Scope.NOT_SETTABLE else ()
        policies = tuple(p for p in self.cta_policies if p in capability.cta_policies()) or ("default",)
        return replace(self, cta_policies=policies, nvls_ctas=nvls_ctas, capability=capability)

    def pinned(self, process: ProcessSettings) -> SearchSpace:
        """The space with every per-process knob at ``process``'s value: what one process decision leaves."""
        fields = self.capability.process_fields() if self.capability is not None else PROCESS_FIELDS
        pins: dict[str, Any] = {"threads": (process.threads,), "transports": (process.transport,)}
        if "chunk_bytes" in fields:
            pins["chunks"] = (process.chunk_bytes,)
        return replace(self, **pins)


@dataclass(frozen=True)
class ProcessSettings:
    """The per-process knobs' values: one for every collective of the step (NCCL reads them from the
    environment when a communicator is made). ``chunk_bytes`` is per process only without the plugin's
    getChunkSize; with it, the largest planned chunk sizes NCCL_BUFFSIZE."""

    threads: int
    transport: str
    chunk_bytes: int

    def to_dict(self, fields: tuple[str, ...]) -> dict[str, Any]:
        return {name: getattr(self, name) for name in fields}


PROCESS_FIELDS = ("threads", "transport", "chunk_bytes")  # CommConfig fields NCCL may read once per process


@dataclass(frozen=True)
class CommConfig:
    """What a plan sets for one tuning key (communicator, collective, size).

    ``decomposition="p2p"`` replaces the collective by Flash-Overlap P2P steps fused with the compute
    beside it, each peer step split into ``num_chunks`` transfers.
    """

    algorithm: Algorithm = Algorithm.RING
    protocol: Protocol = Protocol.SIMPLE
    transport: Transport = Transport.P2P
    channels: int = 8
    threads: int = 512
    chunk_bytes: int = 2 * 1024 * 1024
    priority: int = 0  # 1: high-priority stream
    decomposition: Decomposition = Decomposition.COLLECTIVE
    num_chunks: int = 1
    cta_policy: CTAPolicy = CTAPolicy.DEFAULT
    # Lagom's tuner plugin has a rule for this call: NCCL runs its channels as given (its own count is
    # trimmed for small messages) and, with getChunkSize, asks for its chunk. False: NCCL decides (its
    # baseline, no plugin, P2P operations, copy engines)
    by_tuner: bool = False

    def __post_init__(self) -> None:
        """Plain strings (plans read from JSON, tests) become the typed values; unknown ones stay for ``check``."""
        for name, kind in _ENUM_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, kind) and value in kind._value2member_map_:
                object.__setattr__(self, name, kind(value))

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> CommConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"{where}.{sorted(unknown)[0]}", "unknown key", f"known keys: {', '.join(cls.__dataclass_fields__)}")
        cfg = cls(**data)
        cfg.check(where)
        return cfg

    def check(self, where: str = "config") -> None:
        for key, kind in _ENUM_FIELDS.items():
            if not isinstance(getattr(self, key), kind):
                raise ConfigError(f"{where}.{key}", f"'{getattr(self, key)}' is not one of {', '.join(kind)}")
        for key in ("channels", "threads", "chunk_bytes", "num_chunks"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{where}.{key}", f"must be positive, got {getattr(self, key)}")
        if self.threads % 32:
            raise ConfigError(f"{where}.threads", f"{self.threads} is not a multiple of the warp size 32")

    def describe(self) -> str:
        if self.decomposition == "p2p":
            return f"p2p x{self.num_chunks} nc={self.channels}"
        return f"{self.algorithm}/{self.protocol} nc={self.channels} nt={self.threads} c={self.chunk_bytes // 1024}K"


def is_intra_node(point: OverlapPoint) -> bool:
    return point.group.nodes == 1


def space_capability(space: SearchSpace, hw: Hardware) -> Capability:
    return space.capability if space.capability is not None else capability_for(hw)


def transports_for(point: OverlapPoint, hw: Hardware, space: SearchSpace = SearchSpace()) -> list[Transport]:
    """The transports the space's values give this point: shm only reaches peers inside a node, so an
    inter-node point (or a space that offers nothing it can use) runs over p2p/net."""
    shm_ok = is_intra_node(point) and hw.nccl.shm_gbps > 0
    usable = [Transport(t) for t in space.transports if t == Transport.P2P or (t == Transport.SHM and shm_ok)]
    return usable or [Transport.P2P]


def subspaces(point: OverlapPoint, hw: Hardware,
              space: SearchSpace = SearchSpace()) -> list[tuple[Algorithm, Protocol, Transport]]:
    """(algorithm, protocol, transport) combinations NCCL would offer for this point."""
    cap = space_capability(space, hw)
    algos = [Algorithm.RING]
    if point.collective == Collective.ALL_REDUCE and point.group.nodes >= hw.nccl.tree_min_nodes:
        algos.append(Algorithm.TREE)
    if cap.nvls_applies(point.collective, point.group.nodes):
        algos.append(Algorithm.NVLS)
    protos = [Protocol(pr) for pr in space.protocols if pr in hw.nccl.protocols]
    if hw.cluster.intra.kind != "nvlink" or not is_intra_node(point):
        protos = [pr for pr in protos if pr != Protocol.LL128]  # LL128 needs NVLink ordering guarantees
    if point.collective in (Collective.SEND_RECV, Collective.ALL_TO_ALL):
        algos = [Algorithm.RING]  # P2P operations have no algorithm choice
    return [(algo, proto, transport) for algo, proto, transport in product(algos, protos, transports_for(point, hw, space))
            if algo != Algorithm.NVLS or proto == Protocol.SIMPLE]  # NVLS runs the Simple protocol only


def channel_choices(hw: Hardware, space: SearchSpace = SearchSpace()) -> list[int]:
    """Ring and tree channel counts the topology has (a rule asking for more runs fewer)."""
    return [c for c in space.channels if c <= channel_cap("ring", 1, hw.nccl.max_channels)]


def run_chunk(cfg: CommConfig, collective: str, group: Group, hw: Hardware, cap: Capability) -> int:
    """The chunk NCCL runs for ``cfg`` on this collective and group (``Capability.run_chunk``, with the
    group's P2P link): the cost model prices it."""
    nvlink = hw.cluster.link_within_node(group.ranks_per_node).kind == "nvlink"
    return cap.run_chunk(str(cfg.algorithm), str(cfg.protocol), str(collective), cfg.chunk_bytes, group.nodes, nvlink,
                         asked=cfg.by_tuner)


def plan_buffsize(space: SearchSpace, cap: Capability) -> int:
    """The NCCL_BUFFSIZE a plan's chunks must fit in: the process's where it has read it already (a live
    search), else room for the space's largest ring chunk and never below NCCL's default."""
    return cap.buffsize or max(DEFAULT_BUFFSIZE, buffsize_for("ring", "Simple", "all_reduce", max(space.chunks)))


def planned_chunk(cfg: CommConfig, collective: str, group: Group, hw: Hardware,
                  space: SearchSpace = SearchSpace()) -> int:
    """The chunk a plan keeps for ``cfg``: the one NCCL runs, within ``plan_buffsize`` (per process the
    process's own chunk, which sizes NCCL_BUFFSIZE: ``run_chunk`` turns it into each call's)."""
    cap = space_capability(space, hw)
    if cap.scope("chunk") == Scope.PER_PROCESS:
        return cfg.chunk_bytes
    return run_chunk(cfg, collective, group, hw, replace(cap, buffsize=plan_buffsize(space, cap)))


def chunk_choices(point: OverlapPoint, algorithm: Algorithm, protocol: Protocol, hw: Hardware,
                  space: SearchSpace = SearchSpace()) -> list[int]:
    """The distinct chunks NCCL runs for the space's chunks on this point (no two that collapse to one),
    and where every chunk of the space exceeds the protocol's largest (LL's 32 KiB), its halvings too."""
    cfg = CommConfig(algorithm, protocol)
    cfg = replace(cfg, by_tuner=tuner_sets_channels(point, cfg, space_capability(space, hw)))
    runs = {planned_chunk(replace(cfg, chunk_bytes=c), point.collective, point.group, hw, space) for c in space.chunks}
    if cfg.by_tuner and len(space.chunks) > 1 and len(runs) == 1 and max(runs) < min(space.chunks):
        grain, ceiling = PROTOCOL_GRAIN[str(protocol)], max(runs)
        runs |= {max(grain, (ceiling >> k) // grain * grain) for k in range(1, SMALL_CHUNK_STEPS + 1)}
    return sorted(runs)


def tuner_sets_channels(point: OverlapPoint, cfg: CommConfig, cap: Capability) -> bool:
    """Whether Lagom's plugin gives this call its channel count (a rule for it: a collective NCCL asks
    a tuner about, not decomposed, not on copy engines)."""
    return (cap.per_size and point.collective in TUNER_COLLECTIVES and cfg.decomposition == Decomposition.COLLECTIVE
            and not _on_copy_engines(point, cfg, cap))


def can_decompose(point: OverlapPoint) -> bool:
    """Flash-Overlap applies where the collective feeds (or is fed by) one GEMM it can be fused with."""
    return point.fuse_with is not None and point.collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)


def default_config(hw: Hardware) -> CommConfig:
    n = hw.nccl
    return CommConfig(channels=n.default_channels, threads=n.default_threads, chunk_bytes=n.default_chunk_bytes)



def channels_for(algorithm: Algorithm, hw: Hardware, space: SearchSpace = SearchSpace()) -> list[int]:
    """Channel counts a config of this algorithm can have: NVLS takes the communicator's NVLS CTAs, or
    NCCL's default NVLS CTAs (what NCCL runs when they are not set), within the topology's channels."""
    if algorithm == Algorithm.NVLS:
        most = channel_cap("ring", 1, hw.nccl.max_channels)
        return [c for c in dict.fromkeys((*space.nvls_ctas, hw.nccl.nvls_channels)) if c <= most]
    return channel_choices(hw, space)



# -- what one value per process or per communicator means for each key ---------------------------------


def with_process(cfg: CommConfig, point: OverlapPoint, hw: Hardware, process: ProcessSettings,
                 fields: tuple[str, ...]) -> CommConfig:
    """``cfg`` under the process's values of ``fields`` (shm only where the point can use it)."""
    values: dict[str, Any] = {name: getattr(process, name) for name in fields}
    if "transport" in values:
        values["transport"] = transports_for(point, hw, replace(SearchSpace(), transports=(process.transport,)))[0]
    return replace(cfg, **values)



COMMUNICATOR_KNOBS = ("cta_policy", "channels", "nvls_ctas", "priority")  # in the order they are settled


def communicator_knobs(cap: Capability) -> tuple[str, ...]:
    """The knobs that take one value per communicator under ``cap`` (channels only without the plugin)."""
    return tuple(k for k in COMMUNICATOR_KNOBS if cap.scope(k) == Scope.PER_COMMUNICATOR)


def _on_copy_engines(point: OverlapPoint, cfg: CommConfig, cap: Capability) -> bool:
    return cfg.cta_policy == CTAPolicy.ZERO and cap.zero_applies(point.collective, point.group.nodes, point.group.name)


def _affected(knob: str, point: OverlapPoint, cfg: CommConfig, cap: Capability) -> bool:
    """Whether the communicator's value of ``knob`` acts on this key (a decomposition is Lagom's own
    P2P code; NVLS takes the NVLS CTAs, copy engines take no CTAs)."""
    if cfg.decomposition == Decomposition.P2P:
        return False
    if knob == "channels":
        return cfg.algorithm != Algorithm.NVLS and not _on_copy_engines(point, cfg, cap)
    if knob == "nvls_ctas":
        return cfg.algorithm == Algorithm.NVLS
    return True


def _knob_value(knob: str, cfg: CommConfig) -> Any:
    return cfg.cta_policy if knob == "cta_policy" else cfg.priority if knob == "priority" else cfg.channels


def with_communicator_value(knob: str, value: Any, point: OverlapPoint, cfg: CommConfig, cap: Capability) -> CommConfig:
    """``cfg`` as the communicator's ``value`` of ``knob`` leaves it: ZERO runs what copy engines cannot
    (reduce-scatter, all-reduce) as DEFAULT does."""
    if not _affected(knob, point, cfg, cap):
        return cfg
    if knob == "cta_policy":
        if value == CTAPolicy.ZERO and not cap.zero_applies(point.collective, point.group.nodes, point.group.name):
            value = CTAPolicy.DEFAULT
        return replace(cfg, cta_policy=CTAPolicy(value))
    return replace(cfg, **{"priority" if knob == "priority" else "channels": value})


def communicator_values(knob: str, items: list[tuple[OverlapPoint, CommConfig]], cap: Capability) -> list[Any]:
    """The values the keys of one communicator ask for (first-seen order)."""
    return list(dict.fromkeys(_knob_value(knob, cfg) for point, cfg in items if _affected(knob, point, cfg, cap)))


def agreed_value(knob: str, items: list[tuple[OverlapPoint, CommConfig]], cap: Capability) -> Any:
    """The one value of ``knob`` that leaves every key of the communicator as it is, else None (also None
    when no key is affected: the communicator keeps NCCL's default)."""
    for value in communicator_values(knob, items, cap):
        if all(with_communicator_value(knob, value, point, cfg, cap) == cfg for point, cfg in items):
            return value
    return None


def is_consistent(knob: str, items: list[tuple[OverlapPoint, CommConfig]], cap: Capability) -> bool:
    return not communicator_values(knob, items, cap) or agreed_value(knob, items, cap) is not None
