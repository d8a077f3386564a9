"""Reads the profiler's ring from Python: one C call per step, no Python work on NCCL's path.

``ProfilerDrain`` talks to the library instance NCCL loaded (ctypes opens the same file, which the dynamic
loader maps once per process). ``drain()`` has the library copy every finished record, and its counters after
them, into buffers allocated once (one C call, lagom_profiler_read), and returns the records as a read-only NumPy
structured array of their own (cheap to aggregate per step); ``Drained.collectives()`` turns them into
``CollectiveRecord`` objects for reports. Records the ring dropped before a drain are counted, and said
once in the log. ``group_names`` maps NCCL's communicator hashes to Lagom's group names.

The recorder's use of it (one drain per step, on the thread that ends the step, the groups matched as
communicators appear, the torch tap left to what NCCL does not report here) is lagom.runtime.apply.nccl_calls.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from lagom import nccl_profiler
from lagom.step.calls import nccl_aggregates

log = logging.getLogger("lagom.nccl_profiler")

# Lagom's names for NCCL's ids, indexed as the record stores them (lagom_nccl_profiler.h): ncclFunc_t,
# NCCL_ALGO_* and NCCL_PROTO_*.
FUNCTIONS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_reduce", "send_recv", "send", "recv",
             "all_to_all", "scatter", "gather")
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls", "nvls_tree", "pat")
PROTOCOLS = ("ll", "ll128", "simple")
UNKNOWN = 255
KIND_COPY_ENGINE = 1
# Collectives whose descriptor count is one rank's share: Lagom's plan counts the whole buffer.
PER_RANK_COUNT = ("all_gather", "reduce_scatter")
P2P_FUNCTIONS = ("send", "recv")  # NCCL's P2p events: one send or receive each, with its peer, never joined with another
# A network ProxyOp's chunkSize is NCCL's chunk times its slice steps (NCCL_STEPS is 8): a quarter of them for ring
# all-reduce, all-gather and reduce-scatter on SIMPLE, one for every other algorithm, protocol and send/receive.
RING_SIMPLE_SLICE_STEPS = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 2}


class RecordC(ctypes.Structure):
    """lagom_prof_record, field for field."""

    _fields_ = [("comm_hash", ctypes.c_uint64), ("seq_number", ctypes.c_uint64), ("count", ctypes.c_uint64),
                ("host_start_ns", ctypes.c_uint64), ("host_stop_ns", ctypes.c_uint64),
                ("gpu_start_ns", ctypes.c_uint64), ("gpu_stop_ns", ctypes.c_uint64),
                ("n_ranks", ctypes.c_uint32), ("rank", ctypes.c_int32), ("peer", ctypes.c_int32),
                ("proxy_chunk_bytes", ctypes.c_uint32), ("func", ctypes.c_uint8), ("algorithm", ctypes.c_uint8), ("protocol", ctypes.c_uint8),
                ("type_size", ctypes.c_uint8), ("channels", ctypes.c_uint8), ("warps", ctypes.c_uint8),
                ("kind", ctypes.c_uint8), ("channel_events", ctypes.c_uint8)]


RECORD_DTYPE = np.dtype([(name, np.dtype(kind)) for name, kind in (
    ("comm_hash", "u8"), ("seq_number", "u8"), ("count", "u8"), ("host_start_ns", "u8"), ("host_stop_ns", "u8"),
    ("gpu_start_ns", "u8"), ("gpu_stop_ns", "u8"), ("n_ranks", "u4"), ("rank", "i4"), ("peer", "i4"),
    ("proxy_chunk_bytes", "u4"), ("func", "u1"),
    ("algorithm", "u1"), ("protocol", "u1"), ("type_size", "u1"), ("channels", "u1"), ("warps", "u1"),
    ("kind", "u1"), ("channel_events", "u1"))])
RECORD_SIZE = RECORD_DTYPE.itemsize
assert RECORD_SIZE == ctypes.sizeof(RecordC) == 80


class CommInfoC(ctypes.Structure):
    """lagom_prof_comm_info."""

    _fields_ = [("comm_hash", ctypes.c_uint64), ("n_ranks", ctypes.c_uint32), ("n_nodes", ctypes.c_uint32),
                ("rank", ctypes.c_int32), ("name", ctypes.c_char * 64)]


def _name(names: tuple[str, ...], index: int) -> str | None:
    return names[index] if index < len(names) else None


@dataclass(slots=True)
class CollectiveRecord:
    """One collective, send or receive as NCCL ran it. Names are NCCL's, lowercase (``FUNCTIONS``, ``ALGORITHMS``,
    ``PROTOCOLS``); None where NCCL gave a name this plugin does not know, or, for a copy-engine collective or a
    send/receive, no algorithm at all. Host times are time.monotonic_ns(); GPU times NCCL's globaltimer ns (0 when
    no channel reported). A send/receive's ``seq_number`` is the plugin's count of its communicator's (NCCL gives
    none), its ``peer`` the other rank (-1 for a collective)."""

    comm_hash: int
    rank: int
    n_ranks: int
    function: str | None
    seq_number: int
    count: int
    type_size: int
    algorithm: str | None
    protocol: str | None
    channels: int
    warps: int
    copy_engine: bool
    host_start_ns: int
    host_stop_ns: int
    gpu_start_ns: int
    gpu_stop_ns: int
    channel_events: int
    peer: int = -1
    proxy_chunk_bytes: int = 0  # a network ProxyOp's chunkSize (see ``chunk_bytes``); 0 when none came
    tensors: int = 1  # collectives NCCL ran as this one aggregate (``joined``); their counts are summed

    @property
    def p2p(self) -> bool:
        return self.function in P2P_FUNCTIONS

    @property
    def chunk_bytes(self) -> int:
        """The chunk NCCL ran, from its network proxy's operations; 0 where none reported (a transfer inside a node
        has none, and GPU times off asks for none)."""
        if not self.proxy_chunk_bytes:
            return 0
        ring_simple = (self.algorithm, self.protocol) == ("ring", "simple")
        return self.proxy_chunk_bytes // (RING_SIMPLE_SLICE_STEPS.get(self.function or "", 1) if ring_simple else 1)

    @property
    def bytes(self) -> int:
        """The whole buffer, as Lagom's plan and NCCL's tuner count it (an all-gather's output, a
        reduce-scatter's input)."""
        share = self.count * self.type_size
        return share * self.n_ranks if self.function in PER_RANK_COUNT else share

    @property
    def time_source(self) -> str:
        """"gpu" when kernel channels reported their times, else "host" (NCCL's launch preparation only)."""
        return "gpu" if self.channel_events > 0 and self.gpu_stop_ns > self.gpu_start_ns else "host"

    @property
    def duration_ns(self) -> int:
        if self.time_source == "gpu":
            return self.gpu_stop_ns - self.gpu_start_ns
        return max(0, self.host_stop_ns - self.host_start_ns)


def launches(host_start_ns: np.ndarray, host_stop_ns: np.ndarray, comm_hash: np.ndarray) -> np.ndarray:
    """Each record's launch, numbered, for records in (communicator, host start) order: NCCL starts the Coll events
    of every collective of one launch (a group's plan) before it stops any, so a record that starts before the one
    before it stopped, on the same communicator, is of the same launch."""
    new = np.ones(len(host_start_ns), dtype=bool)
    new[1:] = (comm_hash[1:] != comm_hash[:-1]) | (host_start_ns[1:].astype(np.int64) > host_stop_ns[:-1].astype(np.int64))
    return np.cumsum(new)


def joined(records: list[CollectiveRecord]) -> list[CollectiveRecord]:
    """The records as NCCL planned them: the collectives of one launch that share function and element size
    (NCCL's function, op and type; the record has no op) joined as ``calls.nccl_aggregates`` joins them, smallest
    first, each run of under 4x the smallest's bytes one aggregate, which NCCL tuned at its total size and ran on one
    algorithm and protocol. An aggregate's count is its members' total, its channels the most any member ran, its
    times from its first start to its last stop (GPU times only where every member has them); the rest, sends and
    receives among them (each its own transfer), pass as they are. In (communicator, launch) order."""
    ordered = sorted(records, key=lambda r: (r.comm_hash, r.host_start_ns))
    if len(ordered) < 2:
        return ordered
    launch = launches(np.array([r.host_start_ns for r in ordered], dtype=np.uint64),
                      np.array([r.host_stop_ns for r in ordered], dtype=np.uint64),
                      np.array([r.comm_hash for r in ordered], dtype=np.uint64)).tolist()
    out: list[CollectiveRecord] = []
    i = 0
    while i < len(ordered):
        j = i + 1
        while j < len(ordered) and launch[j] == launch[i]:
            j += 1
        kinds: dict[tuple[str | None, int, bool], list[CollectiveRecord]] = {}
        for r in ordered[i:j]:
            if r.p2p:
                out.append(r)
            else:
                kinds.setdefault((r.function, r.type_size, r.copy_engine), []).append(r)
        for members in kinds.values():
            members.sort(key=lambda r: r.bytes)
            k = 0
            for _, n in nccl_aggregates([r.bytes for r in members]):  # smallest first, as ``members``
                out.append(_join(members[k:k + n]))
                k += n
        i = j
    return out


def _join(members: list[CollectiveRecord]) -> CollectiveRecord:
    if len(members) == 1:
        return members[0]
    first = min(members, key=lambda r: r.host_start_ns)
    timed = all(r.time_source == "gpu" for r in members)
    return replace(first, count=sum(r.count for r in members), channels=max(r.channels for r in members),
                   host_start_ns=first.host_start_ns, host_stop_ns=max(r.host_stop_ns for r in members),
                   gpu_start_ns=min(r.gpu_start_ns for r in members) if timed else 0,
                   gpu_stop_ns=max(r.gpu_stop_ns for r in members) if timed else 0,
                   channel_events=min(r.channel_events for r in members) if timed else 0,
                   proxy_chunk_bytes=max(r.proxy_chunk_bytes for r in members), tensors=sum(r.tensors for r in members))


@dataclass(frozen=True)
class Drained:
    """One drain: the records in the order NCCL finished them, and how many the ring dropped before it."""

    records: np.ndarray  # RECORD_DTYPE, a copy the next drain does not touch (read-only: its memory is a bytes')
    overwritten: int

    def __len__(self) -> int:
        return len(self.records)

    def collectives(self) -> list[CollectiveRecord]:
        """The records as objects (for reports; per-step sums are cheaper on ``records`` itself)."""
        out = []
        for (comm_hash, seq, count, host_start, host_stop, gpu_start, gpu_stop, n_ranks, rank, peer, proxy_chunk, func,
             algorithm, protocol, type_size, channels, warps, kind, channel_events) in self.records.tolist():
            out.append(CollectiveRecord(
                comm_hash, rank, n_ranks, _name(FUNCTIONS, func), seq, count, type_size, _name(ALGORITHMS, algorithm),
                _name(PROTOCOLS, protocol), channels, warps, kind == KIND_COPY_ENGINE, host_start, host_stop,
                gpu_start, gpu_stop, channel_events, peer, proxy_chunk))
        return out


@dataclass(frozen=True)
class ProfilerStats:
    """The plugin's counters since it was loaded (lagom_prof_stats). ``version`` 0 and ``communicators`` 0:
    NCCL never initialised it (not named by NCCL_PROFILER_PLUGIN before the first communicator)."""

    published: int
    overwritten: int
    no_slot: int
    lost_writes: int
    abandoned: int
    in_flight: int
    communicators: int
    version: int

    @property
    def dropped(self) -> int:
        """Collectives that happened and will never be drained."""
        return self.overwritten + self.no_slot + self.lost_writes + self.abandoned


_STATS = [f.name for f in fields(ProfilerStats)]
NO_SLOT, COMMUNICATORS = _STATS.index("no_slot"), _STATS.index("communicators")  # their positions in the counters


@dataclass(frozen=True)
class Communicator:
    """A communicator as NCCL described it to the profiler at init; ``name`` is its commName ('' when unset)."""

    comm_hash: int
    n_ranks: int
    n_nodes: int
    rank: int
    name: str


class ProfilerDrain:
    """The profiler NCCL loaded in this process (``library``: default this install's, the file
    ``NCCL_PROFILER_PLUGIN`` should name). One reader per process: the recorder, once per step."""

    def __init__(self, library: Path | None = None) -> None:
        path = library or nccl_profiler.path()
        if path is None:
            raise FileNotFoundError(nccl_profiler.UNAVAILABLE)
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.lagom_profiler_drain.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]
        lib.lagom_profiler_drain.restype = ctypes.c_size_t
        lib.lagom_profiler_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.lagom_profiler_stats.restype = ctypes.c_size_t
        lib.lagom_profiler_communicators.argtypes = [ctypes.POINTER(CommInfoC), ctypes.c_size_t]
        lib.lagom_profiler_communicators.restype = ctypes.c_size_t
        lib.lagom_profiler_test_push.argtypes = [ctypes.POINTER(RecordC)]
        lib.lagom_profiler_test_push.restype = None
        lib.lagom_profiler_capacity.argtypes = []
        lib.lagom_profiler_capacity.restype = ctypes.c_size_t
        self._lib = lib
        self.capacity = int(lib.lagom_profiler_capacity())  # records the ring holds: one drain takes them all
        self._buffer = np.zeros(self.capacity, dtype=RECORD_DTYPE)  # allocated once: a drain allocates only its copy
        self._bytes = memoryview(self._buffer.view(np.uint8))  # copied as bytes: a structured copy costs 4x as much
        self._stats = (ctypes.c_uint64 * 8)()
        # the drain: one C call (lagom_profiler_read) that copies the records and the counters, its arguments made
        # once (ctypes converts none of them per call); the counters are this drain's dropped records, then stats'
        self._counters = np.zeros(1 + len(self._stats), dtype=np.uint64)
        read = ctypes.CDLL(str(path)).lagom_profiler_read  # a function object of its own: no argtypes to convert
        read.restype = ctypes.c_size_t
        self._read = read
        self._read_args = (ctypes.c_void_p(self._buffer.ctypes.data), ctypes.c_size_t(self.capacity),
                           ctypes.c_void_p(self._counters.ctypes.data), ctypes.c_size_t(len(self._counters)))
        self._empty = Drained(self._buffer[:0].copy(), 0)
        self._drained: ProfilerStats | None = ProfilerStats(0, 0, 0, 0, 0, 0, 0, 0)
        self._drained_counters = [0] * len(self._stats)
        self.drained_communicators = 0  # communicators NCCL had initialised at the last drain (its ``stats``' own)
        self.dropped_total = 0
        self._dropped_said = self._no_slot_said = False

    @property
    def drained_stats(self) -> ProfilerStats:
        """The counters as the last drain read them."""
        if self._drained is None:  # made when asked: most steps read none but the communicators
            self._drained = ProfilerStats(*self._drained_counters)
        return self._drained

    def drain(self) -> Drained:
        """Every record finished since the last drain, oldest first, and the counters after it (one C call)."""
        n = self._read(*self._read_args)
        overwritten, *counters = self._counters.tolist()
        self._drained_counters, self._drained = counters, None
        self.drained_communicators = counters[COMMUNICATORS]
        if overwritten:
            self.dropped_total += overwritten
            if not self._dropped_said:
                self._dropped_said = True
                log.warning("NCCL profiler: the ring dropped %d collective records before they were read (it holds "
                            "%d; drain more often); later drops are counted in dropped_total, not logged",
                            overwritten, self.capacity)
        if counters[NO_SLOT] and not self._no_slot_said:
            self._say_unrecorded(self.drained_stats)
        if not n and not overwritten:
            return self._empty
        return Drained(np.frombuffer(self._bytes[:n * RECORD_SIZE].tobytes(), RECORD_DTYPE), overwritten)

    def _say_unrecorded(self, stats: ProfilerStats) -> None:
        """Says once when collectives went unrecorded for want of an in-flight slot: NCCL announced kernel
        channels it never reported (1024 such collectives fill the pool), so GPU times are better left off."""
        if stats.no_slot and not self._no_slot_said:
            self._no_slot_said = True
            log.warning("NCCL profiler: %d collectives were not recorded, %d are still waiting for kernel-channel "
                        "events NCCL announced and has not sent; set LAGOM_NCCL_PROFILER_GPU_TIMES=0 before the "
                        "first communicator to record host times only", stats.no_slot, stats.in_flight)

    def stats(self) -> ProfilerStats:
        """The counters now (a C call of their own; a drain reads them too: ``drained_stats``)."""
        self._lib.lagom_profiler_stats(self._stats, len(self._stats))
        return ProfilerStats(*self._stats)  # a c_uint64 array's items are ints

    def communicators(self) -> list[Communicator]:
        infos = (CommInfoC * 256)()
        n = self._lib.lagom_profiler_communicators(infos, len(infos))
        return [Communicator(int(c.comm_hash), int(c.n_ranks), int(c.n_nodes), int(c.rank),
                             c.name.decode(errors="replace")) for c in infos[:n]]

    def push(self, record: RecordC) -> None:
        """Writes a record into the ring as a finished collective does (tests and the benchmark)."""
        self._lib.lagom_profiler_test_push(ctypes.byref(record))


@dataclass(frozen=True)
class GroupMatch:
    """Which Lagom group a communicator is, and how that was decided: "hash" (torch gave the communicator's
    hash), "comm_name" (NCCL's commName is the group's name), "rank_count" (the only group of that size),
    "call_order" (``lagom.runtime.apply.nccl_calls``: its calls in a step were one group's), or "ambiguous"
    (``group`` is None: several groups of that size, none named)."""

    group: str | None
    method: str


def group_names(communicators: list[Communicator], groups: Mapping[str, int],
                known_hashes: Mapping[int, str] | None = None,
                known_names: Mapping[str, str] | None = None) -> dict[int, GroupMatch]:
    """Maps each communicator's hash to a group of ``groups`` ({name: rank count}), by the surest method that
    applies: a hash torch exposed, then NCCL's commName (a group's name, or one of ``known_names``: torch's
    names of a group -> its name here), then a unique rank count."""
    by_size: dict[int, list[str]] = {}
    for name, size in groups.items():
        by_size.setdefault(size, []).append(name)
    out: dict[int, GroupMatch] = {}
    for comm in communicators:
        named = comm.name if comm.name in groups else (known_names or {}).get(comm.name) if comm.name else None
        if known_hashes and comm.comm_hash in known_hashes:
            out[comm.comm_hash] = GroupMatch(known_hashes[comm.comm_hash], "hash")
        elif named is not None:
            out[comm.comm_hash] = GroupMatch(named, "comm_name")
        elif len(by_size.get(comm.n_ranks, [])) == 1:
            out[comm.comm_hash] = GroupMatch(by_size[comm.n_ranks][0], "rank_count")
        else:
            out[comm.comm_hash] = GroupMatch(None, "ambiguous")
    return out
