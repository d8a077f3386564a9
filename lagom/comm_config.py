"""Per-point communication settings, and the space of settings a strategy may choose from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from itertools import product
from typing import Any

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.points import Collective, OverlapPoint


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
    """The values each knob may take. Strategies search inside it; tests shrink it."""

    channels: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    threads: tuple[int, ...] = (128, 256, 512)
    chunks: tuple[int, ...] = tuple(64 * 1024 * 2**i for i in range(7))  # 64 KiB .. 4 MiB
    protocols: tuple[str, ...] = ("LL", "LL128", "Simple")
    splits: tuple[int, ...] = (1, 2, 4)  # Flash-Overlap chunks per peer step; () turns decomposition off
    priorities: tuple[int, ...] = (0, 1)  # 1: the communicator's high-priority stream


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


def subspaces(point: OverlapPoint, hw: Hardware,
              space: SearchSpace = SearchSpace()) -> list[tuple[Algorithm, Protocol, Transport]]:
    """(algorithm, protocol, transport) combinations NCCL would offer for this point."""
    algos = [Algorithm.RING]
    if point.collective == Collective.ALL_REDUCE and point.group.nodes >= hw.nccl.tree_min_nodes:
        algos.append(Algorithm.TREE)
    protos = [Protocol(pr) for pr in space.protocols if pr in hw.nccl.protocols]
    if hw.cluster.intra.kind != "nvlink" or not is_intra_node(point):
        protos = [pr for pr in protos if pr != Protocol.LL128]  # LL128 needs NVLink ordering guarantees
    transports = [Transport.P2P, Transport.SHM] if is_intra_node(point) and hw.nccl.shm_gbps > 0 else [Transport.P2P]
    if point.collective in (Collective.SEND_RECV, Collective.ALL_TO_ALL):
        algos = [Algorithm.RING]  # P2P operations have no algorithm choice
    return list(product(algos, protos, transports))


def channel_choices(hw: Hardware, space: SearchSpace = SearchSpace()) -> list[int]:
    return [c for c in space.channels if c <= hw.nccl.max_channels]


def can_decompose(point: OverlapPoint) -> bool:
    """Flash-Overlap applies where the collective feeds (or is fed by) one GEMM it can be fused with."""
    return point.fuse_with is not None and point.collective in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)


def default_config(hw: Hardware) -> CommConfig:
    n = hw.nccl
    return CommConfig(channels=n.default_channels, threads=n.default_threads, chunk_bytes=n.default_chunk_bytes)


def candidates(point: OverlapPoint, hw: Hardware, space: SearchSpace = SearchSpace()) -> list[CommConfig]:
    """Every setting of the space for one point (the exhaustive search's per-point choices)."""
    out = [CommConfig(algo, proto, transport, nc, nt, chunk, prio)
           for (algo, proto, transport), nc, nt, chunk, prio in product(
               subspaces(point, hw, space), channel_choices(hw, space), space.threads, space.chunks, space.priorities)]
    if can_decompose(point):
        base = default_config(hw)
        out += [replace(base, decomposition=Decomposition.P2P, num_chunks=k, channels=nc, priority=prio)
                for k in space.splits for nc in channel_choices(hw, space) for prio in space.priorities]
    return out
