"""One cost model for communication and computation running together.

Communication follows NCCL's own tuning model (``src/graph/tuning.cc``): per-algorithm and per-protocol
base and step latencies, network latency only on the steps that cross nodes, LL/LL128 bandwidth caps,
fewer channels (and threads) for small messages. On top of it, what NCCL's model leaves out: each
channel is a CTA pipelining chunks (small chunks pay a per-step overhead, network chunks a
store-and-forward fill), the node's NIC is shared by the groups crossing it, tree all-reduce moves less
over the NIC than ring, NVLS reduces in the switch, copy engines (CTA policy ZERO) take no SMs.

Computation: a roofline of FLOPs and HBM bytes. A comm CTA costs the GEMM CTAs that can no longer be
resident on its SM (registers, shared memory, threads), whatever its thread count; a persistent GEMM
(one CTA per SM looping over tiles) loses whole rounds. Comm HBM traffic slows memory-bound kernels
and the part of a compute-bound GEMM that is not hidden behind its math: each tile's pipeline fill.
Every constant comes from the ``Hardware`` profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache

from lagom.errors import ConfigError
from lagom.hardware import Hardware, Protocol
from lagom.plan.capability import Capability, channel_cap
from lagom.plan.comm_config import Algorithm, CommConfig, CTAPolicy, run_chunk
from lagom.step.graph import Collective, ComputeSegment, Group

GB = 1e9
US = 1e-6
KB = 1024
MIB = 1 << 20


@dataclass(frozen=True)
class RunningComm:
    """A collective running beside a compute kernel: what it takes from it."""

    config: CommConfig
    hbm_rate: float  # bytes/s of HBM traffic it causes on this GPU
    ctas: int  # CTAs it actually runs (``CostModel.launch_shape``: fewer for small messages, none on copy engines)


def ring_shape(coll: Collective, n: int, algorithm: str) -> tuple[int, float]:
    """(latency steps, bus-bytes factor) of one collective over n ranks."""
    if algorithm == Algorithm.NVLS and coll in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        # the switch reduces (or multicasts): each GPU sends its data once and receives the result once
        return 1, (n - 1) / n if coll == Collective.ALL_REDUCE else 1.0
    if coll == Collective.ALL_REDUCE:
        steps = 2 * math.ceil(math.log2(n)) if algorithm == Algorithm.TREE else 2 * (n - 1)
        return steps, 2 * (n - 1) / n
    if coll in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return n - 1, (n - 1) / n
    if coll == Collective.BROADCAST:  # a ring pipeline from the root: every rank receives the whole buffer once
        return n - 1, 1.0
    return 1, 1.0  # send/recv


def _fill(full_us: float, half_mib: float, nbytes: float) -> float:
    """Seconds of a fill that grows with the bytes and levels off: ``full_us`` at large sizes, half at ``half_mib``."""
    return full_us * US * nbytes / (nbytes + half_mib * MIB)


def _by_nodes(values: list[float], nodes: int) -> float:
    """NCCL's per-node-count tables: one node, two nodes, more."""
    return values[min(nodes, 3) - 1] if values else math.inf


class CostModel:
    """Seconds for collectives and compute on ``hw``, for a target that can apply ``capability`` (it
    decides which chunk NCCL runs: ``comm_config.run_chunk``; default: Lagom's own target)."""

    def __init__(self, hw: Hardware, capability: Capability | None = None) -> None:
        self.hw = hw
        self.capability = capability or Capability()
        self._comm = lru_cache(maxsize=200_000)(self._comm_time)
        self._lost = lru_cache(maxsize=1024)(self._slots_lost)
        self._p2p = lru_cache(maxsize=65_536)(self._p2p_channels)
        self._channel_cap = lru_cache(maxsize=256)(channel_cap)  # checks its arguments each call; asked per estimate
        # what compute_time reads of the GPU for every segment (a search asks for tens of thousands): HBM B/s, GEMM
        # CTA slots of the whole GPU, tile_fill_bytes and GEMM FLOP/s. Set here, not on first use: a model's
        # attributes are its state to the simulator (simulator._model_state)
        g = hw.gpu
        self._gemm_constants = (g.hbm_gbps * GB * g.hbm_efficiency, g.sms * max(1, self.gemm_ctas_per_sm()),
                                self.tile_fill_bytes(), g.peak_tflops * 1e12 * g.gemm_efficiency)

    #: this model prices collectives as NCCL's own tuning does (``as_nccl_tunes``), not as they run
    nccl_tuning = False

    @cached_property
    def as_nccl_tunes(self) -> CostModel:
        """This model as NCCL's own tuning prices a call, to pick its algorithm and protocol: without a fitted fill
        (NVLS, ring), which its latency and bandwidth tables do not have (8 H100s run NVLS from 2 MiB, NVIDIA/nccl-tests
        #309, where NVLS with the fill is priced slower than ring), and with a tree across more than two nodes at its
        bus bandwidth over the network (``_tree_time``)."""
        nccl = self.hw.nccl
        hw = self.hw if nccl.nvls_fill_us == 0 and nccl.ring_fill_us == 0 else replace(
            self.hw, nccl=replace(nccl, nvls_fill_us=0.0, ring_fill_us=0.0))
        model = CostModel(hw, self.capability)
        model.nccl_tuning = True
        return model

    # -- communication: links
    def _within_bw(self, group: Group, transport: str) -> float:
        """B/s of the slowest link a group uses inside a node (host shared memory for the shm transport)."""
        if transport == "shm":
            return self.hw.nccl.shm_gbps * GB
        return self.hw.cluster.link_within_node(group.ranks_per_node).gbps * GB

    def _links(self, group: Group, transport: str, nic_share: float = 1.0) -> tuple[float, float, str]:
        """(bandwidth B/s, per-chunk network latency s, the slowest link kind, which bounds each channel).

        A group larger than one NVLink island (A40 pairs) runs at the bridge's (PCIe) speed. Across nodes
        the node's NICs are shared by the sibling groups crossing at the same time and, by ``nic_share``,
        with the other communicators' collectives running beside this one."""
        c = self.hw.cluster
        within = c.link_within_node(group.ranks_per_node)
        intra_bw = self._within_bw(group, transport)
        if group.nodes > 1:
            bw = min(intra_bw, c.inter.gbps * GB * group.ranks_per_node / c.gpus_per_node * nic_share)
            slow = min((within.kind, c.inter.kind), key=lambda k: self.hw.nccl.channel_gbps[k])
            return bw, max(within.latency_us, c.inter.latency_us) * US, slow
        return intra_bw, within.latency_us * US, within.kind

    def _link_class(self, group: Group, transport: str) -> str:
        """NCCL's latency table row for the steps inside a node: nvlink or pci (shared memory goes through PCIe)."""
        kind = self.hw.cluster.link_within_node(group.ranks_per_node).kind
        return "nvlink" if kind == "nvlink" and transport != "shm" else "pci"

    def _protocol(self, cfg: CommConfig) -> Protocol:
        proto = self.hw.nccl.protocols.get(str(cfg.protocol))
        if proto is None:
            raise ConfigError(f"hardware {self.hw.name}: nccl.protocols", f"has no entry for protocol '{cfg.protocol}'",
                              "add one, or leave the protocol out of the search space")
        return proto

    def channel_peak(self, group: Group, cfg: CommConfig) -> float:
        """B/s one channel moves while a chunk is on the wire (its threads copying, its slowest link)."""
        n = self.hw.nccl
        _, _, kind = self._links(group, cfg.transport)
        peak = n.channel_gbps[kind] * GB * min(1.0, cfg.threads / n.threads_saturation)
        return min(peak, n.shm_gbps * GB) if cfg.transport == "shm" else peak

    def channel_bandwidth(self, group: Group, cfg: CommConfig, chunk: float, bus: float, steps: int,
                          link_bw: float = math.inf, slow: float = 1.0) -> float:
        """B/s one channel sustains over a call: its share of the bus bytes at its copy rate (its own peak, slowed
        by ``slow``, or its share of ``link_bw``, whichever is lower), plus a synchronisation overhead (across
        nodes also the network's latency) for every chunk after the first of each algorithm step (NCCL's step
        latency covers the first). A channel copies a chunk, then waits on its peer's flag: sharing the link
        with the other channels does not hide its waits."""
        n = self.hw.nccl
        _, lat, _ = self._links(group, cfg.transport)
        share = bus / cfg.channels
        copy = min(self.channel_peak(group, cfg) / slow, link_bw / cfg.channels)
        chunks = math.ceil(share / chunk)
        overhead = n.step_overhead_us * US + (lat if group.nodes > 1 else 0.0)
        return share / (share / copy + max(0, chunks - steps) * overhead)

    # -- communication: what NCCL launches
    def uses_copy_engines(self, coll: Collective, cfg: CommConfig) -> bool:
        """CTA policy ZERO moves all-gather and all-to-all with copy engines (no reduce-scatter or all-reduce exists)."""
        return cfg.cta_policy == CTAPolicy.ZERO and coll in (Collective.ALL_GATHER, Collective.ALL_TO_ALL)

    def launch_shape(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig) -> tuple[int, int]:
        """(CTAs, threads per CTA) NCCL runs for this call.

        Like NCCL (``topoGetAlgoInfo``), a message smaller than channels x threads x the protocol's thread
        threshold runs on fewer channels, then fewer threads; a tuner plugin's channel count then replaces
        the trimmed one as it is (``by_tuner``), within the topology's channels; NVLS runs its configured
        CTAs; EFFICIENCY keeps only the channels that still add bandwidth; copy engines run none."""
        if self.uses_copy_engines(coll, cfg):
            return 0, 0
        channels, threads = cfg.channels, cfg.threads
        if coll == Collective.SEND_RECV and group.nodes == 1:
            channels = self.p2p_channels(group, nbytes, cfg)
        elif cfg.algorithm != Algorithm.NVLS:
            proto = self._protocol(cfg)
            per_thread = proto.thread_threshold * (group.size if cfg.protocol == "LL" and cfg.algorithm == Algorithm.RING else 1)
            channels = max(1, min(channels, int(nbytes) // (threads * per_thread)))
            while nbytes < channels * threads * per_thread and threads % 128 == 0:
                threads //= 2
            if cfg.by_tuner:
                channels = min(cfg.channels, self._channel_cap(str(cfg.algorithm), group.nodes, self.hw.nccl.max_channels))
        if cfg.cta_policy == CTAPolicy.EFFICIENCY:
            link_bw, _, kind = self._links(group, cfg.transport)
            per_channel = self.hw.nccl.channel_gbps[kind] * GB * min(1.0, threads / self.hw.nccl.threads_saturation)
            channels = min(channels, max(1, math.ceil(link_bw / per_channel)))
        return channels, threads

    def p2p_channels(self, group: Group, nbytes: int, cfg: CommConfig) -> int:
        """Channels NCCL splits one send over inside a node (``_p2p_channels``), cached: the simulator asks per task."""
        return self._p2p(group, int(nbytes), cfg)

    def _p2p_channels(self, group: Group, nbytes: int, cfg: CommConfig) -> int:
        """Channels NCCL splits one send (and its matching receive) over inside a node (``addP2pToPlan`` in
        enqueue.cc, NCCL 2.22 on; ``calcP2pChunkSize`` from 2.13 cuts the same parts, where up to 2.18 a send also
        used at most 4 x the P2P channels over the ranks).

        The communicator has ``cfg.channels`` channels, rounded up to a power of two for P2P; a peer may use all
        of them over NVLink (two per NVLink, more than any node has channels) but 2 over PCIe. An operation
        starts on the per-peer channels halved until one per operation fits when every rank has one (per-peer x
        ranks <= P2P channels), at least a part of 1/8 P2P chunk each, and doubles them while a part exceeds
        32 P2P chunks (16 MiB over NVLink). So a message does not use every channel until it is large: on 8
        A100s with 32 P2P channels a 128 MiB send runs on 8, 256 MiB on 16 (li-plus/playground's sendrecv_perf:
        111 GB/s at 128 MiB, 189 from 256 MiB). The communicator's ranks are the group's on this node (a
        decomposition's P2P step is a 2-rank group that keeps its communicator's ranks per node)."""
        p2p = 1 << max(0, cfg.channels - 1).bit_length()
        nvlink = self.hw.cluster.link_within_node(group.ranks_per_node).kind == "nvlink" and cfg.transport != "shm"
        per_peer = p2p if nvlink else min(p2p, 2)
        fewest = per_peer
        while fewest * max(group.size, group.ranks_per_node) > p2p and fewest > 1:
            fewest //= 2
        step = self.run_chunk(Collective.SEND_RECV, group, cfg)
        min_part, max_part = max(1, step // 8), step * 32
        channels = max(1, min(fewest, -(-int(nbytes) // min_part)))
        part = max(min_part, -(-int(nbytes) // channels))
        while part > max_part and channels <= per_peer // 2:
            channels *= 2
            part = -(-int(nbytes) // channels)
        return channels

    def latency(self, coll: Collective, group: Group, cfg: CommConfig) -> float:
        """NCCL's latency: the base of the algorithm and protocol, then each step at its link's latency,
        the network's only on the steps that cross nodes."""
        n, nodes, nccl = group.size, group.nodes, self.hw.nccl
        proto = self._protocol(cfg)
        algo = str(cfg.algorithm)
        intra = proto.step_latency_us.get(self._link_class(group, cfg.transport), {})
        net = proto.step_latency_us.get("net", {})
        # with one rank per node every step is a network step: NCCL then charges the tree's network latency
        inter_lat = net.get(algo if group.ranks_per_node > 1 else "tree", 0.0)
        if cfg.algorithm == Algorithm.NVLS:
            return (intra.get(algo, 0.0) + (inter_lat if nodes > 1 else 0.0)) * US
        base = proto.base_latency_us.get(algo, 0.0)
        if cfg.algorithm == Algorithm.TREE and coll == Collective.ALL_REDUCE:
            per_node = group.ranks_per_node - 1
            return (base + 2 * (per_node * intra.get(algo, 0.0) + int(math.log2(nodes)) * inter_lat)) * US
        steps = 2 * (n - 1) if coll == Collective.ALL_REDUCE else max(1, n - 1) if coll != Collective.SEND_RECV else 1
        intra_lat = intra.get("ring", 0.0)
        inter_steps = 0
        if nodes > 1:
            intra_lat = max(intra_lat, nccl.net_overhead_us * (3 if cfg.protocol == "Simple" else 1))
            inter_steps = min(steps, 2 * (nodes - 1) if coll == Collective.ALL_REDUCE else nodes - 1)
        return (base + (steps - inter_steps) * intra_lat + inter_steps * inter_lat) * US

    # -- communication: time
    def _protocol_bandwidth(self, raw: float, cfg: CommConfig, channels: int, nodes: int) -> float:
        """NCCL's protocol refinements: payload efficiency, LL's cap, LL128's per-channel cap."""
        proto = self._protocol(cfg)
        return min(raw * proto.efficiency, _by_nodes(proto.max_gbps, nodes) * GB,
                   channels * _by_nodes(proto.channel_max_gbps, nodes) * GB)

    def _alltoall_link(self, group: Group, nbytes: int, link_bw: float, nic_share: float) -> float:
        """The bandwidth an all-to-all sees: off-node blocks share the node's NICs among all its GPUs
        (sibling groups exchange at the same time), on-node blocks use the local link."""
        c = self.hw.cluster
        n = group.size
        bus = nbytes * (n - 1) / n
        off = nbytes * (n - group.ranks_per_node) / n
        nic = c.inter.gbps * GB / c.gpus_per_node * nic_share
        return bus / max(off / nic, (bus - off) / link_bw)

    def _comm_time(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig, util: float,
                   nic_share: float = 1.0) -> float:
        n = group.size
        if n <= 1 or nbytes <= 0:
            return 0.0
        channels, threads = self.launch_shape(coll, group, nbytes, cfg)
        link_bw, _, _ = self._links(group, cfg.transport, nic_share)
        if coll == Collective.ALL_TO_ALL and group.nodes > 1:
            link_bw = self._alltoall_link(group, nbytes, self._within_bw(group, cfg.transport), nic_share)
        slow = 1.0 + self.hw.contention.comm_slowdown_per_hbm_util * util
        if channels == 0:
            return self._copy_engine_time(coll, group, nbytes, link_bw / slow)
        run = cfg if (channels, threads) == (cfg.channels, cfg.threads) else replace(cfg, channels=channels, threads=threads)
        latency = self.latency(coll, group, run)
        if cfg.algorithm == Algorithm.NVLS:
            return latency + self._nvls_time(coll, group, nbytes, run, link_bw, slow)
        steps, factor = ring_shape(coll, n, str(cfg.algorithm))
        bus = nbytes * factor
        # A channel carries 1/channels of each step's slice; small messages use smaller chunks. The chunk
        # is the one NCCL runs: cut to its buffer, its protocol's, or the P2P chunk.
        chunk = max(1024.0, min(float(self.run_chunk(coll, group, cfg)), bus / max(1, steps) / channels))
        tree = cfg.algorithm == Algorithm.TREE and coll == Collective.ALL_REDUCE and group.nodes > 1
        # Inside a node a channel copies at its share of the link and then waits (the one-node sweeps: A100, H100
        # rings). Across nodes the proxy forwards network chunks while the channel waits (the fill below), and
        # the link bounds all channels together after their waits; a tree's channels are bounded in _tree_time.
        share_of = link_bw if group.nodes == 1 else math.inf
        ch_bw = self.channel_bandwidth(group, run, chunk, bus, steps, share_of, slow)
        # A network chunk is forwarded whole through each stage of the proxy path: the first one fills it
        # (its transmission only: the steps' latencies are NCCL's latency above).
        fill = (self.hw.nccl.net_pipeline_stages - 1) * chunk / self.channel_peak(group, run) * slow if group.nodes > 1 else 0.0
        if tree:
            return latency + fill + self._tree_time(group, nbytes, run, ch_bw, nic_share)
        bw = self._protocol_bandwidth(min(link_bw, channels * ch_bw), run, channels, group.nodes)
        ring_fill = self.ring_fill(coll, group, nbytes) if cfg.algorithm == Algorithm.RING else 0.0
        return latency + fill + ring_fill + bus / bw

    def ring_fill(self, coll: Collective, group: Group, nbytes: int) -> float:
        """A one-node ring collective's time beyond NCCL's latency and its bytes at the channels' rate, per algorithm
        step: ``ring_fill_us`` once a step's slice (the buffer over the ranks) is large, half of it at
        ``ring_fill_half_mib``. A bare-metal 8-A100 all-reduce sweep took 41-165 us more than that from 1 to 512 MiB
        on every protocol, more than NCCL's own latency there (15-56 us); the form is the sweeps', not a
        mechanism's, and the split over steps (an all-gather pays half an all-reduce's) an assumption no source
        checks. Not on a send/recv or all-to-all (one exchange, no ring steps) nor across nodes, where no source
        measured it."""
        nccl = self.hw.nccl
        if nccl.ring_fill_us == 0 or group.nodes > 1 or coll in (Collective.SEND_RECV, Collective.ALL_TO_ALL):
            return 0.0
        steps, _ = ring_shape(coll, group.size, Algorithm.RING)
        return steps * _fill(nccl.ring_fill_us, nccl.ring_fill_half_mib, nbytes / group.size)

    def _tree_time(self, group: Group, nbytes: int, cfg: CommConfig, ch_bw: float, nic_share: float) -> float:
        """Tree all-reduce: a chain inside each node (every GPU sends the buffer up and down it) and a double
        binary tree across nodes, over which each node's NICs carry 2 (N - 1) / N of the buffer per
        direction where a ring carries 2 (n - 1) / n: half as much on two nodes."""
        c, nccl = self.hw.cluster, self.hw.nccl
        nodes = group.nodes
        within = self._within_bw(group, cfg.transport)
        nic = c.inter.gbps * GB * group.ranks_per_node / c.gpus_per_node * nic_share
        # the protocol's payload efficiency on every link, as a ring's (LL: half of each 8-byte line is its flag)
        efficiency = self._protocol(cfg).efficiency
        chain = 2 * nbytes / (within * efficiency) if group.ranks_per_node > 1 else 0.0
        across = 2 * nbytes * (nodes - 1) / nodes / (nic * efficiency)
        if self.nccl_tuning and nodes > 2:
            # NCCL's tuning (tuning.cc) takes a tree's bus bandwidth from the graph's network rate beyond two nodes
            # (its intra-node rate, which its search raises up to twice the network's for trees, on one or two) at
            # 0.92, and halves it into the algorithm's: the buffer twice over the NICs, where a ring's
            # 2 (n - 1) / n is less, so it prices no tree above a ring once bandwidth rules
            across = 2 * nbytes / (nccl.tree_efficiency * nic * efficiency)
        per_channel = min(ch_bw * nccl.tree_efficiency, _by_nodes(nccl.tree_channel_max_gbps, nodes) * GB)
        channels = 2 * nbytes / self._protocol_bandwidth(cfg.channels * per_channel, cfg, cfg.channels, nodes)
        return max(chain, across, channels)

    def _nvls_time(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig, link_bw: float,
                   slow: float) -> float:
        """NVLink SHARP: the switch reduces, so each GPU's link carries the buffer once each way, at the NVLS
        efficiency of what the CTAs (or the link) move.

        NCCL runs as many NVLS CTAs as the communicator's NVLS channels, clamped to its CTA limits, one at the
        least (``ncclNvlsTuning``): no floor of two. Its tuning's (nChannels - 1) / nChannels is over the
        topology graph's NVLS channels (the node's NVLS heads), not the CTAs, so it is part of the fitted
        efficiency and the time scales with the CTAs until the link binds.

        Published sweeps (8 H100 or H200 on one node) take longer than latency plus bytes at that rate from 2 MiB
        up, by a fill that grows with the message and levels off: ``nvls_fill_us`` at large messages, half of it at
        ``nvls_fill_half_mib``. The form is the sweeps', not a mechanism's; it depends on the bytes, not the CTAs."""
        nccl, c = self.hw.nccl, self.hw.cluster
        if not c.nvls or nccl.nvls_efficiency <= 0:
            raise ConfigError(f"hardware {self.hw.name}: cluster.nvls", "NVLS is planned but this machine has no NVLink SHARP",
                              "leave nvls out of the search space or set cluster.nvls and nccl.nvls_efficiency")
        _, factor = ring_shape(coll, group.size, Algorithm.NVLS)
        ctas = max(1, cfg.channels)
        fill = _fill(nccl.nvls_fill_us, nccl.nvls_fill_half_mib, nbytes)
        return fill + nbytes * factor / (min(link_bw, ctas * nccl.channel_gbps["nvlink"] * GB / slow) * nccl.nvls_efficiency)

    def _copy_engine_time(self, coll: Collective, group: Group, nbytes: int, link_bw: float) -> float:
        """Copy-engine all-gather / all-to-all: one copy per peer, at the copy engines' rate."""
        nccl = self.hw.nccl
        if nccl.ce_gbps <= 0:
            raise ConfigError(f"hardware {self.hw.name}: nccl.ce_gbps", "CTA policy zero is planned but no copy-engine rate is known",
                              "set nccl.ce_gbps or leave the zero policy out of the search space")
        n = group.size
        return (n - 1) * nccl.ce_launch_us * US + nbytes * (n - 1) / n / min(link_bw, nccl.ce_gbps * GB)

    def run_chunk(self, coll: Collective, group: Group, cfg: CommConfig) -> int:
        """The chunk NCCL runs for ``cfg`` here (``comm_config.run_chunk`` under the model's capability)."""
        return run_chunk(cfg, coll, group, self.hw, self.capability)

    def comm_time(self, coll: Collective, group: Group, nbytes: int, cfg: CommConfig, compute_hbm_util: float = 0.0,
                  nic_share: float = 1.0) -> float:
        """Seconds for one collective; ``compute_hbm_util`` is the HBM share the compute beside it uses,
        ``nic_share`` the share of the NIC it gets beside other communicators' collectives."""
        return self._comm(coll, group, int(nbytes), cfg, round(compute_hbm_util, 2), nic_share)

    def p2p_group(self, group: Group) -> Group:
        """One ring-exchange step of a decomposition: two ranks, on the group's slowest hop (the bridge
        when the group spans NVLink islands, the network when it spans nodes)."""
        if group.nodes > 1:
            return Group(group.name, 2, 1, 2)
        return Group(group.name, 2, group.ranks_per_node, 1)

    def p2p_step_time(self, group: Group, nbytes: float, cfg: CommConfig, compute_hbm_util: float = 0.0,
                      nic_share: float = 1.0) -> float:
        """One ring-exchange step of a Flash-Overlap decomposition: send one block, receive one."""
        # the cached model itself, not comm_time: a calibrated subclass scales comm_time per tuning key,
        # which a decomposition's steps do not have
        return self._comm(Collective.SEND_RECV, self.p2p_group(group), int(nbytes), cfg,
                          round(compute_hbm_util, 2), nic_share)

    def comm_peak_time(self, coll: Collective, group: Group, nbytes: int) -> float:
        """The physical limit: bus bytes at the link's peak, no latency (all-to-all: its NIC path too;
        all-reduce across nodes: the tree's, where its NIC carries less than the ring's)."""
        if group.size <= 1:
            return 0.0
        _, factor = ring_shape(coll, group.size, "ring")
        link_bw, _, _ = self._links(group, "p2p")
        if coll == Collective.ALL_TO_ALL and group.nodes > 1:
            link_bw = self._alltoall_link(group, nbytes, self._within_bw(group, "p2p"), 1.0)
        peak = nbytes * factor / link_bw
        if coll == Collective.ALL_REDUCE and group.nodes >= max(2, self.hw.nccl.tree_min_nodes):
            c = self.hw.cluster
            chain = 2 * nbytes / self._within_bw(group, "p2p") if group.ranks_per_node > 1 else 0.0
            nic = c.inter.gbps * GB * group.ranks_per_node / c.gpus_per_node
            peak = min(peak, max(chain, 2 * nbytes * (group.nodes - 1) / group.nodes / nic))
        return peak

    def comm_hbm_rate(self, coll: Collective, group: Group, nbytes: int, seconds: float, cfg: CommConfig | None = None) -> float:
        """HBM traffic (B/s) one GPU sees while the collective runs: payload times reads and writes per payload
        byte (``contention.hbm_bytes_per_comm_byte``): ``reduce`` for a reduction, ``copy`` for a collective that
        moves data through NCCL's FIFO buffers on SMs, ``copy_engine`` for one ``cfg`` runs on copy engines (CTA
        policy ZERO: no FIFO, each byte read from its source and written to its destination)."""
        if seconds <= 0 or group.size <= 1:
            return 0.0
        _, factor = ring_shape(coll, group.size, "ring")
        kind = ("reduce" if coll in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)
                else "copy_engine" if cfg is not None and self.uses_copy_engines(coll, cfg) else "copy")
        return nbytes * factor * self.hw.contention.hbm_bytes_per_comm_byte[kind] / seconds

    # -- computation
    def compute_solo(self, seg: ComputeSegment) -> float:
        hbm, _, _, flop_rate = self._gemm_constants
        return max(seg.flops / flop_rate, seg.bytes / hbm)

    def hbm_util(self, seg: ComputeSegment) -> float:
        t = self.compute_solo(seg)
        return 0.0 if t <= 0 else min(1.0, seg.bytes / t / self._gemm_constants[0])

    def _resident(self, registers: float, smem_kb: float, threads: float) -> int:
        """GEMM CTAs one SM holds with these registers, shared memory and threads free."""
        cta = self.hw.gpu.gemm_cta
        if min(registers, smem_kb, threads) < 0:
            return 0
        return int(min(registers // (cta.threads * cta.registers), smem_kb // cta.smem_kb, threads // cta.threads))

    def gemm_ctas_per_sm(self) -> int:
        g = self.hw.gpu
        return self._resident(g.sm_registers, g.sm_smem_kb, g.sm_threads)

    def _slots_lost(self, threads: int) -> float:
        """GEMM CTAs an SM can no longer hold once one comm CTA of ``threads`` threads sits on it: the
        measured figure where the profile has one (``lagom calibrate --contention``), else the footprints'."""
        measured = self.hw.contention.gemm_slots_per_comm_cta
        return self.footprint_slots_lost(threads) if measured is None else measured

    def footprint_slots_lost(self, threads: int) -> int:
        """GEMM CTAs one comm CTA leaves no room for, from both kernels' registers, shared memory and threads.

        On every shipped preset this is the SM's one GEMM CTA, whatever the comm CTA's threads: the two never
        share an SM, as NCCL's maintainers say of its kernels (NVIDIA/nccl #689), so a comm CTA's share of an
        SM's issue slots beside a GEMM CTA is not priced; a profile where they fit together would need it."""
        g, nccl = self.hw.gpu, self.hw.nccl
        beside = self._resident(g.sm_registers - threads * nccl.cta_registers, g.sm_smem_kb - nccl.cta_smem_kb,
                                g.sm_threads - threads)
        return self.gemm_ctas_per_sm() - beside

    def launched_threads(self, cfg: CommConfig, threads: int | None = None) -> int:
        """Threads of one comm CTA as NCCL launches it: ring Simple adds a sync warp, tree runs all 640."""
        if cfg.algorithm == Algorithm.TREE:
            return 640
        return (threads or cfg.threads) + (self.hw.nccl.cta_extra_threads if cfg.protocol == "Simple" else 0)

    def sm_taken(self, cfg: CommConfig, ctas: int) -> float:
        """SMs' worth of GEMM residency ``ctas`` comm CTAs of ``cfg`` take (``launch_shape`` gives how many
        NCCL launches: none on copy engines, fewer for small messages): a CTA costs the GEMM CTAs it
        leaves no room for."""
        return ctas * self._lost(self.launched_threads(cfg)) / max(1, self.gemm_ctas_per_sm())

    def grid(self, seg: ComputeSegment) -> int:
        """CTAs the segment's kernel launches: its tiles, or at most one round of the GPU for a persistent GEMM."""
        if self.hw.gpu.persistent_gemm and seg.flops > 0:
            return min(seg.ctas, self._gemm_constants[1])
        return seg.ctas

    def tile_fill_bytes(self) -> float:
        """HBM bytes a GEMM CTA moves without math to hide them: its pipeline's first stages of a tile's
        operands (loaded before the first MMA) and the output tile it stores at the end."""
        g = self.hw.gpu
        tm, tn = g.gemm_tile
        cta = g.gemm_cta
        return (cta.stages * (tm + tn) * cta.tile_k + tm * tn) * cta.dtype_bytes

    def compute_time(self, seg: ComputeSegment, running: tuple[RunningComm, ...] = ()) -> float:
        """Seconds for a compute segment while the given collectives run beside it."""
        if not running:
            return self.compute_solo(seg)
        g, con, nccl = self.hw.gpu, self.hw.contention, self.hw.nccl
        hbm, slots, fill_bytes, flop_rate = self._gemm_constants
        hbm_left = max(0.1 * hbm, hbm - con.hbm_interference * sum(r.hbm_rate for r in running))
        staged = sum(r.ctas * r.config.chunk_bytes * nccl.buffsize_per_chunk for r in running)
        l2 = 1.0 + con.l2_interference * min(1.0, staged / (g.l2_mb * 2**20))
        memory = seg.bytes / hbm_left * l2
        if seg.flops <= 0:
            return memory
        lost = sum(r.ctas * self._lost(self.launched_threads(r.config)) for r in running if r.ctas)
        grid = self.grid(seg)
        rounds = math.ceil(grid / max(1, slots - lost)) / math.ceil(grid / slots)
        # each tile (each CTA of a persistent GEMM) fills its pipeline once, at the HBM bandwidth left
        fills = grid if g.persistent_gemm else seg.ctas
        exposed = fills * fill_bytes / hbm
        flop_t = seg.flops / flop_rate
        math_t = max(0.0, flop_t - exposed)
        return max(math_t * rounds + min(flop_t, exposed) * hbm / hbm_left * l2, memory)

    def launch_wait(self, cfg: CommConfig) -> float:
        """Delay before a comm kernel gets SMs while compute holds them (none on a high-priority stream)."""
        return 0.0 if cfg.priority else self.hw.contention.cta_wait_us * US
