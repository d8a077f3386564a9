"""One cost model for communication and computation running together.

Communication: latency per algorithm step plus bus bytes over an effective bandwidth that grows
with channels (each a CTA pipelining chunks) up to the link, hierarchical across nodes.
Computation: roofline of FLOPs and HBM bytes, with the SMs taken by comm CTAs (wave quantised) and
the HBM bandwidth taken by comm traffic removed. Every constant comes from the ``Hardware`` profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from lagom.comm_config import CommConfig
from lagom.hardware import Hardware
from lagom.points import Collective, ComputeSegment, Group

GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class RunningComm:
    """A collective running beside a compute kernel: what it takes from it."""

    config: CommConfig
    hbm_rate: float  # bytes/s of HBM traffic it causes on this GPU


def ring_shape(coll: Collective, n: int, algorithm: str) -> tuple[int, float]:
    """(latency steps, bus-bytes factor) of one collective over n ranks."""
    if coll == Collective.ALL_REDUCE:
        steps = 2 * math.ceil(math.log2(n)) if algorithm == "tree" else 2 * (n - 1)
        return steps, 2 * (n - 1) / n
    if coll in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return n - 1, (n - 1) / n
    return 1, 1.0  # send/recv


class CostModel:
    def __init__(self, hw: Hardware) -> None:
        self.hw = hw
        self._comm = lru_cache(maxsize=200_000)(self._comm_time)

    # -- communication
    def _links(self, group: Group, transport: str) -> tuple[float, float, str]:
        """(bandwidth B/s, per-step latency s, the slowest link kind, which bounds each channel)."""
        c = self.hw.cluster
        intra_bw = (self.hw.nccl.shm_gbps if transport == "shm" else c.intra.gbps) * GB
        if group.nodes > 1:
            # the node's NICs are shared by the sibling groups crossing nodes at the same time
            bw = min(intra_bw, c.inter.gbps * GB * group.ranks_per_node / c.gpus_per_node)
            slow = min((c.intra.kind, c.inter.kind), key=lambda k: self.hw.nccl.channel_gbps[k])
            return bw, max(c.intra.latency_us, c.inter.latency_us) * US, slow
        return intra_bw, c.intra.latency_us * US, c.intra.kind

    def channel_bandwidth(self, group: Group, cfg: CommConfig, chunk: float) -> float:
        """B/s of one channel: a pipeline of chunk steps, each paying a synchronisation overhead."""
        n = self.hw.nccl
        _, lat, kind = self._links(group, cfg.transport)
        peak = n.channel_gbps[kind] * GB * min(1.0, cfg.threads / n.threads_saturation)
        if cfg.transport == "shm":
            peak = min(peak, n.shm_gbps * GB)
        step = chunk / peak + n.step_overhead_us * US + (lat if group.nodes > 1 else 0.0)
        return chunk / step

    def _comm_time(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig, util: float) -> float:
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        proto = self.hw.nccl.protocols[cfg.protocol]
        steps, factor = ring_shape(coll, n, cfg.algorithm)
        bus = nbytes * factor
        link_bw, lat, _ = self._links(group, cfg.transport)
        if coll == Collective.ALL_TO_ALL and group.nodes > 1:
            # Off-node blocks share the node's NICs among all its GPUs (sibling groups exchange at the same
            # time); on-node blocks use the local link.
            c = self.hw.cluster
            off = nbytes * (n - group.ranks_per_node) / n
            link_bw = nbytes * factor / max(off / (c.inter.gbps * GB / c.gpus_per_node), (bus - off) / link_bw)
        # A channel carries 1/channels of each step's slice; small messages use smaller chunks.
        per_channel_step = bus / max(1, steps) / cfg.channels
        chunk = max(1024.0, min(float(cfg.chunk_bytes), per_channel_step))
        ch_bw = self.channel_bandwidth(group, cfg, chunk) / (1.0 + self.hw.contention.comm_slowdown_per_hbm_util * util)
        bw = min(link_bw, cfg.channels * ch_bw) * proto.efficiency
        latency = self.hw.nccl.base_latency_us * US + steps * (proto.latency_us * US + lat)
        return latency + bus / bw

    def comm_time(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig, compute_hbm_util: float = 0.0) -> float:
        """Seconds for one collective; ``compute_hbm_util`` is the HBM share the compute beside it uses."""
        return self._comm(coll, group, int(nbytes), cfg, round(compute_hbm_util, 2))

    def p2p_step_time(self, group: Group, nbytes: float, cfg: CommConfig, compute_hbm_util: float = 0.0) -> float:
        """One ring-exchange step of a Flash-Overlap decomposition: send one block, receive one."""
        p2p = Group(group.name, 2, 2, 1) if group.nodes == 1 else Group(group.name, 2, 1, 2)
        # the cached model itself, not comm_time: a calibrated subclass scales comm_time per tuning key,
        # which a decomposition's steps do not have
        return self._comm(Collective.SEND_RECV, p2p, int(nbytes), cfg, round(compute_hbm_util, 2))

    def comm_peak_time(self, coll: Collective, group: Group, nbytes: int) -> float:
        """The physical limit: bus bytes at the link's peak, no latency."""
        if group.size <= 1:
            return 0.0
        _, factor = ring_shape(coll, group.size, "ring")
        link_bw, _, _ = self._links(group, "p2p")
        return nbytes * factor / link_bw

    def comm_hbm_rate(self, coll: Collective, group: Group, nbytes: int, seconds: float) -> float:
        """HBM traffic (B/s) one GPU sees while the collective runs: payload times reads and writes."""
        if seconds <= 0 or group.size <= 1:
            return 0.0
        _, factor = ring_shape(coll, group.size, "ring")
        kind = "reduce" if coll in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER) else "copy"
        return nbytes * factor * self.hw.contention.hbm_bytes_per_comm_byte[kind] / seconds

    # -- computation
    def compute_solo(self, seg: ComputeSegment) -> float:
        g = self.hw.gpu
        return max(seg.flops / (g.peak_tflops * 1e12 * g.gemm_efficiency), seg.bytes / (g.hbm_gbps * GB * g.hbm_efficiency))

    def hbm_util(self, seg: ComputeSegment) -> float:
        t = self.compute_solo(seg)
        g = self.hw.gpu
        return 0.0 if t <= 0 else min(1.0, seg.bytes / t / (g.hbm_gbps * GB * g.hbm_efficiency))

    def sm_taken(self, cfg: CommConfig) -> float:
        return cfg.channels * self.hw.contention.sm_share_per_cta * cfg.threads / 512

    def compute_time(self, seg: ComputeSegment, running: tuple[RunningComm, ...] = ()) -> float:
        """Seconds for a compute segment while the given collectives run beside it."""
        if not running:
            return self.compute_solo(seg)
        g, con = self.hw.gpu, self.hw.contention
        flop_t = seg.flops / (g.peak_tflops * 1e12 * g.gemm_efficiency)
        avail = max(1.0, g.sms - sum(self.sm_taken(r.config) for r in running))
        waves = math.ceil(seg.ctas / avail) / math.ceil(seg.ctas / g.sms)
        hbm = g.hbm_gbps * GB * g.hbm_efficiency
        hbm_left = max(0.1 * hbm, hbm - con.hbm_interference * sum(r.hbm_rate for r in running))
        staged = sum(r.config.channels * r.config.chunk_bytes * self.hw.nccl.buffsize_per_chunk for r in running)
        l2 = 1.0 + con.l2_interference * min(1.0, staged / (g.l2_mb * 2**20))
        return max(flop_t * waves, seg.bytes / hbm_left * l2)

    def launch_wait(self, cfg: CommConfig) -> float:
        """Delay before a comm kernel gets SMs while compute holds them (none on a high-priority stream)."""
        return 0.0 if cfg.priority else self.hw.contention.cta_wait_us * US
