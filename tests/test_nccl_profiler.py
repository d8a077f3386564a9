"""The profiler plugin called as NCCL calls it, drained through the path the recorder uses (CPU, no NCCL).

Each test gets its own copy of the built library, so its ring and counters start empty (the dynamic loader
maps a file once per process, and the ring is per library instance). NCCL's calls are made through the
exported ncclProfiler_v4/v5/v6 structs with descriptors laid out as lagom_nccl_profiler.h restates them
(tests/nccl_profiler_abi.c checks that layout against NCCL's own headers): Coll, P2p, network ProxyOp,
kernel-channel and copy-engine events.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import random
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from lagom import nccl_profiler
from lagom.nccl_profiler import drain as profiler
from lagom.nccl_profiler import what_ran
from lagom.nccl_tuner import build
from lagom.nccl_tuner.live import PluginCounters
from lagom.plan.capability import Capability
from lagom.plan.comm_config import Algorithm, CommConfig, CTAPolicy, Protocol
from lagom.plan.plan import Plan, PlanEntry
from lagom.runtime.apply import nccl_calls, torch_tap
from lagom.runtime.apply import runtime as apply_runtime
from lagom.runtime.apply.nccl_calls import NcclGroup
from lagom.runtime.apply.recorder import Recorder
from lagom.runtime.online import report
from lagom.runtime.online.session import TuningSession
from lagom.runtime.online.state import SessionOptions
from lagom.tune import make_plan
from tests.test_capability import tiny_job
from tests.test_nccl_tuner import compiler_or_skip

COLL, P2P, PROXY_OP, KERNEL_CH, CE_COLL, KERNEL_CH_STOP = 1 << 1, 1 << 2, 1 << 3, 1 << 6, 1 << 12, 22
ALL_EVENTS = COLL | P2P | PROXY_OP | KERNEL_CH | CE_COLL
STRESS = Path(__file__).with_name("nccl_profiler_stress.c")
SANITIZERS = {"plain": [], "address": ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
                                       "-fno-sanitize-recover=all"], "thread": ["-fsanitize=thread"]}


class CollV5(ctypes.Structure):
    _fields_ = [("seqNumber", ctypes.c_uint64), ("func", ctypes.c_char_p), ("sendBuff", ctypes.c_void_p),
                ("recvBuff", ctypes.c_void_p), ("count", ctypes.c_size_t), ("root", ctypes.c_int),
                ("datatype", ctypes.c_char_p), ("nChannels", ctypes.c_uint8), ("nWarps", ctypes.c_uint8),
                ("algo", ctypes.c_char_p), ("proto", ctypes.c_char_p), ("parentGroup", ctypes.c_void_p)]


class P2pV5(ctypes.Structure):
    _fields_ = [("func", ctypes.c_char_p), ("buff", ctypes.c_void_p), ("datatype", ctypes.c_char_p),
                ("count", ctypes.c_size_t), ("peer", ctypes.c_int), ("nChannels", ctypes.c_uint8),
                ("parentGroup", ctypes.c_void_p)]


class ProxyOp(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_int), ("channelId", ctypes.c_uint8), ("peer", ctypes.c_int), ("nSteps", ctypes.c_int),
                ("chunkSize", ctypes.c_int), ("isSend", ctypes.c_int)]


class KernelCh(ctypes.Structure):
    _fields_ = [("channelId", ctypes.c_uint8), ("pTimer", ctypes.c_uint64)]


class CeColl(ctypes.Structure):
    _fields_ = [("seqNumber", ctypes.c_uint64), ("func", ctypes.c_char_p), ("sendBuff", ctypes.c_void_p),
                ("recvBuff", ctypes.c_void_p), ("count", ctypes.c_size_t), ("root", ctypes.c_int),
                ("datatype", ctypes.c_char_p), ("syncStrategy", ctypes.c_char_p), ("intraBatchSync", ctypes.c_bool),
                ("batchSize", ctypes.c_uint32), ("numBatches", ctypes.c_uint32), ("ceSeqNum", ctypes.c_uint32),
                ("stream", ctypes.c_void_p)]


class Payload(ctypes.Union):
    _fields_ = [("coll", CollV5), ("p2p", P2pV5), ("proxyOp", ProxyOp), ("kernelCh", KernelCh), ("ceColl", CeColl)]


class DescrV6(ctypes.Structure):
    _anonymous_ = ("u",)
    _fields_ = [("type", ctypes.c_uint64), ("parentObj", ctypes.c_void_p), ("rank", ctypes.c_int), ("u", Payload)]


class DescrV4(ctypes.Structure):
    _anonymous_ = ("u",)
    _fields_ = [("type", ctypes.c_uint8), ("parentObj", ctypes.c_void_p), ("rank", ctypes.c_int), ("u", Payload)]


class StateArgs(ctypes.Union):
    _fields_ = [("pTimer", ctypes.c_uint64)]


HANDLE = ctypes.POINTER(ctypes.c_void_p)
INIT_V6 = ctypes.CFUNCTYPE(ctypes.c_int, HANDLE, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
INIT_V4 = ctypes.CFUNCTYPE(ctypes.c_int, HANDLE, ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_uint64,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
STOP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(StateArgs))


def _plugin_struct(init: type, descr: type) -> type:
    start = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, HANDLE, ctypes.POINTER(descr))
    return type("Plugin", (ctypes.Structure,), {"_fields_": [
        ("name", ctypes.c_char_p), ("init", init), ("startEvent", start), ("stopEvent", STOP),
        ("recordEventState", RECORD), ("finalize", STOP)]})


PLUGIN_V6 = _plugin_struct(INIT_V6, DescrV6)
PLUGIN_V4 = _plugin_struct(INIT_V4, DescrV4)


class Nccl:
    """Calls one plugin interface as NCCL does, on one communicator."""

    def __init__(self, lib: ctypes.CDLL, version: int, comm_hash: int = 0xC0FFEE, n_ranks: int = 4,
                 name: bytes = b"") -> None:
        self.version = version
        self.plugin = (PLUGIN_V4 if version == 4 else PLUGIN_V6).in_dll(lib, f"ncclProfiler_v{version}")
        self.descr_type = DescrV4 if version == 4 else DescrV6
        self.context = ctypes.c_void_p()
        self.mask = ctypes.c_int(0)
        if version == 4:
            self.plugin.init(ctypes.byref(self.context), ctypes.byref(self.mask), name, comm_hash, 1, n_ranks, 0, None)
        else:
            self.plugin.init(ctypes.byref(self.context), comm_hash, ctypes.byref(self.mask), name, 1, n_ranks, 0, None)

    def start(self, descr: ctypes.Structure) -> ctypes.c_void_p:
        handle = ctypes.c_void_p(0xDEAD)  # NCCL's slot holds garbage until the plugin writes it
        self.plugin.startEvent(self.context, ctypes.byref(handle), ctypes.byref(descr))
        return handle

    def coll(self, seq: int, func: bytes = b"AllReduce", count: int = 1024, datatype: bytes = b"ncclFloat32",
             channels: int = 2, warps: int = 16, algo: bytes = b"RING", proto: bytes = b"SIMPLE") -> ctypes.c_void_p:
        d = self.descr_type(type=COLL, rank=1)
        d.coll = CollV5(seqNumber=seq, func=func, count=count, datatype=datatype, nChannels=channels, nWarps=warps,
                        algo=algo, proto=proto)
        return self.start(d)

    def p2p(self, func: bytes = b"Send", count: int = 1024, datatype: bytes = b"ncclBfloat16", peer: int = 1,
            channels: int = 1) -> ctypes.c_void_p:
        d = self.descr_type(type=P2P, rank=1)
        d.p2p = P2pV5(func=func, count=count, datatype=datatype, peer=peer, nChannels=channels)
        return self.start(d)

    def proxy_op(self, parent: ctypes.c_void_p, chunk: int, pid: int | None = None) -> ctypes.c_void_p:
        """A network proxy operation of ``parent`` (made by this process unless ``pid`` says otherwise)."""
        d = self.descr_type(type=PROXY_OP, parentObj=parent)
        d.proxyOp = ProxyOp(pid=os.getpid() if pid is None else pid, nSteps=8, chunkSize=chunk)
        return self.start(d)

    def channel(self, parent: ctypes.c_void_p, channel: int, start_ns: int) -> ctypes.c_void_p:
        d = self.descr_type(type=KERNEL_CH, parentObj=parent)
        d.kernelCh = KernelCh(channelId=channel, pTimer=start_ns)
        return self.start(d)

    def channel_end(self, handle: ctypes.c_void_p, stop_ns: int) -> None:
        self.plugin.recordEventState(handle, KERNEL_CH_STOP, ctypes.byref(StateArgs(pTimer=stop_ns)))
        self.plugin.stopEvent(handle)

    def stop(self, handle: ctypes.c_void_p) -> None:
        self.plugin.stopEvent(handle)

    def run(self, seq: int, channel_times: list[tuple[int, int]], proxy_chunk: int = 0, **coll: object) -> None:
        """One collective as NCCL reports it: Coll start and stop on the launching thread, then (on the proxy thread)
        its network operation when ``proxy_chunk`` is given, then each channel."""
        handle = self.coll(seq, channels=len(channel_times), **coll)  # type: ignore[arg-type]
        self.stop(handle)
        self._proxy(handle, channel_times, proxy_chunk)

    def run_p2p(self, channel_times: list[tuple[int, int]], proxy_chunk: int = 0, **p2p: object) -> None:
        """One send or receive as NCCL reports it, as ``run`` a collective."""
        handle = self.p2p(channels=len(channel_times), **p2p)  # type: ignore[arg-type]
        self.stop(handle)
        self._proxy(handle, channel_times, proxy_chunk)

    def _proxy(self, handle: ctypes.c_void_p, channel_times: list[tuple[int, int]], proxy_chunk: int) -> None:
        if proxy_chunk:
            assert self.proxy_op(handle, proxy_chunk).value is None  # nothing for NCCL to stop or update
        for i, (start, stop) in enumerate(channel_times):
            self.channel_end(self.channel(handle, i, start), stop)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    compiler_or_skip()
    return build.compile_profiler(tmp_path_factory.mktemp("profiler") / nccl_profiler.LIBRARY_NAME, ["-Werror"])


@pytest.fixture
def library(built: Path, tmp_path: Path) -> Path:
    """A fresh instance of the plugin: a copy under another path, so its ring and counters start empty."""
    copy = tmp_path / built.name
    shutil.copy(built, copy)
    return copy


@pytest.fixture
def nccl(library: Path):
    lib = ctypes.CDLL(str(library))
    return lambda version=6, **kw: Nccl(lib, version, **kw)


def test_the_install_builds_the_profiler_beside_the_tuner() -> None:
    compiler_or_skip()
    assert nccl_profiler.path() is not None, "a C compiler exists but lagom/nccl_profiler has no plugin: pip install -e ."
    assert nccl_profiler.env() == {"NCCL_PROFILER_PLUGIN": str(nccl_profiler.path())}
    assert build.PROFILER.name == nccl_profiler.LIBRARY_NAME


def test_a_collective_is_one_record_with_what_nccl_ran_and_its_gpu_times(nccl, library) -> None:
    comm = nccl(6, comm_hash=0xABCDEF0123, n_ranks=4)
    assert comm.mask.value == ALL_EVENTS
    reader = profiler.ProfilerDrain(library)
    handle = comm.coll(7, func=b"AllGather", count=1024, datatype=b"ncclBfloat16", channels=2, warps=16,
                       algo=b"NVLS", proto=b"LL128")
    comm.stop(handle)  # NCCL stops Coll before the kernel runs: the record waits for its channels
    first = comm.channel(handle, 0, 5_000)
    second = comm.channel(handle, 1, 4_000)
    comm.channel_end(first, 9_000)
    assert len(reader.drain()) == 0
    comm.channel_end(second, 8_000)
    got = reader.drain()
    assert got.overwritten == 0
    [record] = got.collectives()
    assert (record.comm_hash, record.rank, record.n_ranks, record.function, record.seq_number, record.count,
            record.type_size, record.algorithm, record.protocol, record.channels, record.warps, record.copy_engine,
            record.gpu_start_ns, record.gpu_stop_ns, record.channel_events) == \
        (0xABCDEF0123, 1, 4, "all_gather", 7, 1024, 2, "nvls", "ll128", 2, 16, False, 4_000, 9_000, 2)
    assert record.bytes == 1024 * 2 * 4  # the whole gathered buffer, as the plan counts it
    assert record.time_source == "gpu" and record.duration_ns == 5_000
    assert 0 < record.host_start_ns <= record.host_stop_ns
    assert reader.stats().version == 6 and reader.stats().published == 1 and reader.stats().in_flight == 0


@pytest.mark.parametrize("version", [4, 5])
def test_older_interfaces_give_the_same_record(nccl, library, version) -> None:
    comm = nccl(version)
    assert comm.mask.value == ALL_EVENTS & ~CE_COLL  # no copy-engine events before v6
    comm.run(3, [(100, 300), (150, 250)], func=b"ReduceScatter", count=10, datatype=b"ncclFloat64", algo=b"PAT",
             proto=b"LL")
    [record] = profiler.ProfilerDrain(library).drain().collectives()
    assert (record.function, record.seq_number, record.bytes, record.algorithm, record.protocol, record.channels,
            record.gpu_start_ns, record.gpu_stop_ns) == ("reduce_scatter", 3, 10 * 8 * 4, "pat", "ll", 2, 100, 300)


def test_a_send_and_a_receive_are_records_with_their_peer_and_the_chunk_nccls_proxy_ran(nccl, library) -> None:
    comm = nccl(6, comm_hash=0x51, n_ranks=8)
    send = comm.p2p(func=b"Send", count=4096, datatype=b"ncclBfloat16", peer=3, channels=2)
    comm.stop(send)
    comm.proxy_op(send, 1 << 20, pid=os.getpid() + 1)  # PXN: another process's operation names its own parent
    comm.proxy_op(send, 256 << 10)
    comm.proxy_op(send, 64 << 10)  # every operation of one send shares its chunk: the first stays
    comm.channel_end(comm.channel(send, 0, 1_000), 4_000)
    comm.channel_end(comm.channel(send, 1, 1_500), 5_000)
    comm.proxy_op(send, 32 << 10)  # after the record is written its slot is free: nothing changes
    v4 = nccl(4, comm_hash=0x52, n_ranks=2)
    v4.run_p2p([(10, 20)], func=b"Recv", count=100, datatype=b"ncclFloat32", peer=0)
    v4.run_p2p([(30, 40)], func=b"Send", count=100, datatype=b"ncclFloat32", peer=1)
    for seq, (func, algo, proto) in enumerate(((b"AllReduce", b"RING", b"SIMPLE"), (b"Broadcast", b"RING", b"SIMPLE"),
                                               (b"AllReduce", b"TREE", b"SIMPLE"), (b"AllGather", b"RING", b"LL"))):
        comm.run(seq, [(0, 1)], func=func, algo=algo, proto=proto, proxy_chunk=1 << 20)
    sent, received, sent_again, *colls = profiler.ProfilerDrain(library).drain().collectives()
    assert (sent.function, sent.p2p, sent.peer, sent.bytes, sent.channels, sent.algorithm, sent.protocol,
            sent.seq_number, sent.proxy_chunk_bytes, sent.chunk_bytes, sent.time_source, sent.duration_ns) == \
        ("send", True, 3, 8192, 2, None, None, 0, 256 << 10, 256 << 10, "gpu", 4_000)
    assert [(r.function, r.peer, r.seq_number, r.bytes, r.chunk_bytes, r.comm_hash) for r in (received, sent_again)] == \
        [("recv", 0, 0, 400, 0, 0x52), ("send", 1, 1, 400, 0, 0x52)]  # the communicator's own count of its transfers
    # the proxy reports NCCL's chunk times its slice steps: 2 for ring all-reduce, all-gather, reduce-scatter on SIMPLE
    assert [(r.peer, r.p2p, r.chunk_bytes) for r in colls] == \
        [(-1, False, 512 << 10), (-1, False, 1 << 20), (-1, False, 1 << 20), (-1, False, 1 << 20)]


def test_copy_engine_collectives_and_host_times(nccl, library, monkeypatch) -> None:
    comm = nccl(6)
    d = DescrV6(type=CE_COLL)
    d.ceColl = CeColl(seqNumber=11, func=b"AllGather", count=256, datatype=b"ncclInt8", syncStrategy=b"MC")
    comm.stop(comm.start(d))
    monkeypatch.setenv("LAGOM_NCCL_PROFILER_GPU_TIMES", "0")
    host_only = nccl(6, comm_hash=2)
    assert host_only.mask.value == COLL | P2P | CE_COLL  # no channels, so no proxy operations either
    host_only.stop(host_only.coll(12, channels=4))  # no channel expected: published at Coll stop
    ce, kernel = profiler.ProfilerDrain(library).drain().collectives()
    assert (ce.copy_engine, ce.function, ce.seq_number, ce.bytes, ce.algorithm, ce.time_source) == \
        (True, "all_gather", 11, 256 * 4, None, "host")
    assert (kernel.comm_hash, kernel.seq_number, kernel.channels, kernel.channel_events, kernel.time_source) == \
        (2, 12, 4, 0, "host")


def test_malformed_calls_are_ignored_without_a_crash(nccl, library) -> None:
    comm = nccl(6)
    handle = ctypes.c_void_p(0xDEAD)
    comm.plugin.startEvent(comm.context, ctypes.byref(handle), None)  # no descriptor
    assert handle.value is None
    assert comm.start(DescrV6(type=1 << 40)).value is None  # a type from a later NCCL
    assert comm.start(DescrV6(type=1 << 0)).value is None  # groups are not recorded
    stray = ctypes.create_string_buffer(64)
    assert comm.channel(ctypes.c_void_p(ctypes.addressof(stray)), 0, 1).value is None  # parent not one of ours
    assert comm.channel(ctypes.c_void_p(None), 0, 1).value is None
    comm.plugin.stopEvent(ctypes.addressof(stray))
    comm.plugin.stopEvent(None)
    comm.plugin.recordEventState(ctypes.addressof(stray), KERNEL_CH_STOP, None)
    comm.plugin.startEvent(None, ctypes.byref(handle), ctypes.byref(DescrV6(type=COLL)))  # no context
    assert handle.value is None
    comm.stop(comm.coll(1, channels=0, func=b"NewCollective", datatype=b"ncclFloat4", algo=b"FUTURE", proto=b""))
    comm.plugin.finalize(None)
    [record] = profiler.ProfilerDrain(library).drain().collectives()  # only the unknown collective, as unknown
    assert (record.function, record.algorithm, record.protocol, record.type_size, record.bytes) == \
        (None, None, None, 0, 0)


def test_a_full_ring_drops_the_oldest_and_says_so_once(library, caplog) -> None:
    reader = profiler.ProfilerDrain(library)
    extra = 100
    for seq in range(reader.capacity + extra):
        reader.push(profiler.RecordC(comm_hash=9, seq_number=seq, func=4, type_size=4, count=seq))
    with caplog.at_level(logging.WARNING, logger="lagom.nccl_profiler"):
        got = reader.drain()
        assert got.overwritten == extra and len(got) == reader.capacity
        assert [int(s) for s in got.records["seq_number"][[0, -1]]] == [extra, reader.capacity + extra - 1]
        assert (got.records["count"] == got.records["seq_number"]).all()  # no record torn
        for seq in range(reader.capacity + 5):
            reader.push(profiler.RecordC(seq_number=seq))
        assert reader.drain().overwritten == 5
    said = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(said) == 1 and "dropped 100 " in said[0].getMessage()
    assert reader.dropped_total == 105 and reader.stats().overwritten == 105
    assert reader.drained_stats == reader.stats()  # the drain's one C call read the counters after its copy
    empty = reader.drain()
    assert len(empty) == 0 and empty.overwritten == 0 and empty.records.dtype == profiler.RECORD_DTYPE
    reader.push(profiler.RecordC(seq_number=7, count=3))
    again = reader.drain()  # a drain's records are its own: the next drain (into the same buffer) leaves them
    reader.push(profiler.RecordC(seq_number=8, count=4))
    assert len(reader.drain()) == 1 and again.records["seq_number"].tolist() == [7]
    assert not again.records.flags.writeable  # a drain's records are what NCCL reported: read, never written
    stats = reader.stats()
    assert reader.drained_stats == stats and stats.published == reader.capacity * 2 + extra + 7
    assert reader.drained_communicators == stats.communicators


def test_slots_run_out_and_finalize_frees_what_never_finished(nccl, library, caplog) -> None:
    comm = nccl(6)
    handles = [comm.coll(seq) for seq in range(1030)]  # never stopped: waiting like a kernel that never ran
    assert sum(h.value is None for h in handles) == 6
    reader = profiler.ProfilerDrain(library)
    with caplog.at_level(logging.WARNING, logger="lagom.nccl_profiler"):
        reader.drain()
        reader.drain()
    [said] = [r.getMessage() for r in caplog.records]
    assert said.startswith("NCCL profiler: 6 collectives were not recorded, 1024 are still waiting")
    assert (reader.drained_stats.no_slot, reader.drained_stats.in_flight) == (6, 1024)
    stats = reader.stats()
    assert (stats.no_slot, stats.in_flight) == (6, 1024)
    comm.plugin.finalize(comm.context)
    stats = reader.stats()
    assert (stats.abandoned, stats.in_flight, stats.dropped) == (1024, 0, 1030)
    other = nccl(6, comm_hash=5)
    other.run(1, [(1, 2)])
    assert len(reader.drain()) == 1  # the pool is free again


def test_communicators_map_to_groups_by_name_then_size(nccl, library) -> None:
    nccl(6, comm_hash=1, n_ranks=8, name=b"dp")
    nccl(6, comm_hash=2, n_ranks=2)
    nccl(6, comm_hash=3, n_ranks=4)
    nccl(6, comm_hash=4, n_ranks=4)
    comms = profiler.ProfilerDrain(library).communicators()
    assert [(c.comm_hash, c.n_ranks, c.name) for c in comms] == [(1, 8, "dp"), (2, 2, ""), (3, 4, ""), (4, 4, "")]
    groups = {"dp": 8, "tp": 2, "pp": 4, "cp": 4}
    got = profiler.group_names(comms, groups, known_hashes={4: "cp"})
    assert got == {1: profiler.GroupMatch("dp", "comm_name"), 2: profiler.GroupMatch("tp", "rank_count"),
                   3: profiler.GroupMatch(None, "ambiguous"), 4: profiler.GroupMatch("cp", "hash")}


def _entry(group: str, collective: str, nbytes: int, config: CommConfig) -> PlanEntry:
    return PlanEntry(f"{group}/{collective}/{nbytes}", group, 4, 1, collective, nbytes, 1, ["p"], config)


def test_the_what_ran_table_says_where_nccl_did_not_run_the_plan(nccl, library) -> None:
    plan = Plan("w", "wf", "h", "hf", 4, "priority", [
        _entry("dp", "all_reduce", 1 << 20, CommConfig(Algorithm.RING, Protocol.SIMPLE, channels=4, by_tuner=True,
                                                       chunk_bytes=512 << 10)),
        _entry("dp", "all_gather", 1 << 22, CommConfig(channels=4, cta_policy=CTAPolicy.ZERO)),
        _entry("dp", "reduce_scatter", 1 << 22, CommConfig(Algorithm.TREE, Protocol.LL, channels=2)),
        _entry("dp", "send_recv", 1 << 16, CommConfig(channels=2))],
        predicted_step_s={})
    comm = nccl(6, comm_hash=77, n_ranks=4)
    floats = (1 << 20) // 4
    # as planned: ring all-reduce on SIMPLE slices its chunk over 2 steps, and NCCL's proxy reports chunk x 2
    comm.run(1, [(0, 1)] * 4, count=floats, proxy_chunk=2 * (512 << 10))
    comm.run(2, [(0, 1)] * 2, count=floats)  # NCCL trimmed the channels
    comm.run(3, [(0, 1)] * 4, count=floats, algo=b"TREE", proto=b"LL")  # the rule did not fire
    comm.run(4, [(0, 1)] * 4, count=floats, proxy_chunk=2 * (256 << 10))  # NCCL clamped the chunk
    for seq in (5, 7):
        comm.run(seq, [(0, 1)] * 4, count=floats)  # inside a node: no proxy operation, no chunk to compare
    comm.run(1, [(0, 1)] * 8, func=b"AllGather", count=(1 << 22) // 16)  # ZERO planned, a kernel ran
    comm.run(1, [(0, 1)] * 8, func=b"ReduceScatter", count=(1 << 22) // 16)  # NCCL decides: never a mismatch
    comm.run(6, [(0, 1)], count=10)  # no key this small
    for func, peer in ((b"Send", 2), (b"Recv", 0)):  # both halves of a transfer count under its send_recv key
        comm.run_p2p([(0, 1)] * 2, func=func, count=(1 << 16) // 2, datatype=b"ncclBfloat16", peer=peer,
                     proxy_chunk=128 << 10)
    drained = profiler.ProfilerDrain(library)
    groups = profiler.group_names(drained.communicators(), {"dp": 4})
    records = drained.drain().collectives()
    comparison = what_ran.compare(records, plan, groups)
    assert comparison.unplanned == 1 and not comparison.unplaced
    assert what_ran.mismatch_lines(comparison) == [
        "dp/all_reduce/1048576: 3 of 6 calls not as planned: NCCL ran 2 channels of the planned 4 (too little data "
        "to fill them, or capped by the communicator's channels)",
        "dp/all_gather/4194304: 1 of 1 calls not as planned: planned on copy engines (CTA policy ZERO), ran as a "
        "kernel: NCCL uses copy engines only for buffers registered in a symmetric window on one NVLink domain"]
    assert what_ran.markdown(comparison).splitlines()[2:] == [
        "| dp/all_reduce/1048576 | ring/simple x4, chunk 512 KiB | ring/simple x4 | 6 | 3 |",
        "| dp/all_gather/4194304 | copy engines | ring/simple x8 | 1 | 1 |",
        "| dp/reduce_scatter/4194304 | NCCL decides | ring/simple x8 | 1 | 0 |",
        "| dp/send_recv/65536 | NCCL decides | send/recv x2, chunk 128 KiB | 2 | 0 |"]
    [all_reduce] = [r for r in comparison.keys if r.key == "dp/all_reduce/1048576"]
    assert [reason for reason, _ in all_reduce.reasons.most_common()[1:]] == [
        "the tuner rule did not fire: NCCL ran tree/ll (plugin not loaded, no rule for this communicator's rank and "
        "node counts, or an NCCL group asked once at its members' total size)",
        "NCCL clamped the chunk to 256 KiB of the planned 512 KiB (it caps a tuner's chunk at what its buffer holds, "
        "NCCL_BUFFSIZE / 8 steps times the algorithm's chunk steps, and rounds it down to the protocol's grain)"]
    assert [c for c, n in all_reduce.ran.items() if n == 2] == [what_ran.Ran("ring", "simple", 4, False, False, 0)]
    never_loaded = what_ran.compare(records, plan, groups, tuner=PluginCounters(inits=0, coll_infos=0, applied=0))
    assert "(NCCL never initialised Lagom's tuner plugin in this process (NCCL_TUNER_PLUGIN unset or set too late))" \
        in never_loaded.keys[0].reasons.most_common()[1][0]


def test_without_the_library_the_drain_says_the_profiler_is_absent(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(nccl_profiler, "path", lambda: None)
    with pytest.raises(FileNotFoundError, match="profiler plugin is not built"):
        profiler.ProfilerDrain()
    monkeypatch.setenv("CC", "/nonexistent")
    with pytest.raises(build.BuildError, match="^CC=/nonexistent names no program$"):
        build.compile_profiler(tmp_path / nccl_profiler.LIBRARY_NAME)


def _rows(records: list) -> list[tuple]:
    return [(r.group, r.collective, r.nbytes, r.step, r.exact) for r in records]


def test_the_recorder_takes_a_groups_collectives_from_nccl_from_the_step_after_its_match(nccl, library) -> None:
    rec = Recorder(cuda=False)
    calls = nccl_calls.NcclCalls(profiler.ProfilerDrain(library), lambda: [NcclGroup("dp", 4, ("7", "DATA_PARALLEL")),
                                                                           NcclGroup("tp", 2)])
    rec.nccl = calls
    dp = nccl(6, comm_hash=10, n_ranks=4, name=b"7")  # NCCL's commName: torch's name for the group
    rec.begin_step(1)
    dp.run(1, [(0, 100_000)], count=1024)  # the step the communicator appears: the tap records this call
    now = time.perf_counter()
    rec.ended("dp", "all_reduce", 4096, now, now + 0.001)
    first = rec.end_step()
    assert _rows(first) == [("dp", "all_reduce", 4096, 1, True)] and first[0].duration_s == pytest.approx(0.001)
    assert calls.matches == {10: profiler.GroupMatch("dp", "comm_name")}
    assert rec.from_nccl("dp", "all_reduce") and not rec.from_nccl("dp", "send_recv")
    assert not rec.from_nccl("tp", "all_reduce")
    dp.run(2, [(0, 5)], count=1024)  # between steps (Lagom's agreement, the framework's housekeeping): not the job's
    rec.begin_step(2)
    assert rec.track("dp", "all_reduce", 4096, work := object()) is work and rec.pending == 0  # NCCL's records have it
    rec.ended("dp", "all_reduce", 4096, now, now + 1.0)
    rec.track("dp", "send_recv", 64)  # no send of dp's reported by NCCL yet: the tap's
    rec.track("dp", "all_gather", 1 << 20, by_lagom=True)  # Flash-Overlap's p2p steps: the adapter's
    dp.run(3, [(1_000, 251_000), (2_000, 250_000)], count=1024)
    late = dp.coll(4, func=b"Broadcast", count=8, channels=1)
    dp.stop(late)  # its kernel channel reports after the step ends
    second = rec.end_step()
    assert _rows(second) == [("dp", "send_recv", 64, 2, True), ("dp", "all_gather", 1 << 20, 2, True),
                             ("dp", "all_reduce", 4096, 2, True)]
    assert [r.seq for r in second] == [0, 1, 2] and second[2].duration_s == pytest.approx(250e-6)
    rec.begin_step(3)
    dp.channel_end(dp.channel(late, 0, 10), 1_010)
    dp.run(5, [(0, 4_000)], count=1024)
    third = rec.end_step()  # the late one in the step that launched it, numbered after that step's rows
    assert _rows(third) == [("dp", "broadcast", 32, 2, True), ("dp", "all_reduce", 4096, 3, True)]
    assert [r.seq for r in third] == [3, 0] and [r.duration_s for r in third] == [pytest.approx(1e-6),
                                                                                  pytest.approx(4e-6)]
    assert rec.summary()["dp/all_reduce/4096"]["count"] == 3  # once per call: never the tap's and NCCL's both


def test_nccls_rows_come_in_step_order_beside_the_taps_and_add_up_to_the_last_bit(nccl, library) -> None:
    """A drain's rows, late ones of an earlier window among them, come out in (step, seq) order with the tap's, also
    where a job's step ids repeat or go back; and the summary is each key's rows added one by one in that order, to
    the last bit (NCCL's rows of a key, here on two communicators of one group, are added as one array)."""
    rec = Recorder(cuda=False)
    rec.nccl = nccl_calls.NcclCalls(profiler.ProfilerDrain(library),
                                    lambda: [NcclGroup("dp", 4, ("7",)), NcclGroup("tp", 2)])
    first, second = nccl(6, comm_hash=50, n_ranks=4, name=b"7"), nccl(6, comm_hash=51, n_ranks=4, name=b"7")
    rec.begin_step(1)
    first.run(1, [(0, 10)], count=1024)
    rec.end_step()  # both communicators are dp's by name: NCCL's records from the next step
    rows, late, order = [], None, []
    for step in (2, 3, 3, 1):
        rec.begin_step(step)
        if late is not None:  # the last step's late collective: its kernel channel reports now
            first.channel_end(first.channel(late, 0, 50), 50 + 7_919)
        now = time.perf_counter()
        rec.ended("tp", "all_reduce", 64, now, now + 1e-3 / step)  # the tap's, numbered first
        for i in range(12):
            (first, second)[i % 2].run(i, [(0, 1_000 + 137 * i * step)], count=1024)
        late = first.coll(99, count=1024, channels=1)
        first.stop(late)
        out = rec.end_step()
        assert out == sorted(out, key=lambda r: (r.step, r.seq))
        order.append([(r.key, r.step, r.seq) for r in out if r.seq in (0, 1, 13)])
        rows += out
    assert order == [  # the late one keeps its step and is numbered after that step's rows
        [("tp/all_reduce/64", 2, 0), ("dp/all_reduce/4096", 2, 1)],
        [("dp/all_reduce/4096", 2, 13), ("tp/all_reduce/64", 3, 0), ("dp/all_reduce/4096", 3, 1)],
        [("tp/all_reduce/64", 3, 0), ("dp/all_reduce/4096", 3, 1), ("dp/all_reduce/4096", 3, 13)],
        [("tp/all_reduce/64", 1, 0), ("dp/all_reduce/4096", 1, 1), ("dp/all_reduce/4096", 3, 13)]]
    totals: dict[str, dict[str, float]] = {}
    for r in rows:
        total = totals.setdefault(r.key, {"count": 0, "total_s": 0.0})
        total["count"] += 1
        total["total_s"] += r.end_s - r.start_s
    assert rec.summary() == totals and totals["dp/all_reduce/4096"]["count"] == 4 * 12 + 3


def _drain_scenario(rng: random.Random, reader: profiler.ProfilerDrain) -> tuple[nccl_calls.NcclCalls, np.ndarray]:
    """A reader mid-job and one drain's records, at random: up to four step windows (step ids repeated or going back,
    the last maybe still open), communicators matched by name, hash, rank count, ambiguously or not at all, groups
    whose collectives and transfers the profiler took over at some window or not, transfers handed back to the tap
    at some launch; records of any function (an unknown one too), in or outside the windows, in launch order or
    not, one launch each or several sharing one (coalesced), GPU-timed or not, some with a stop before their start."""
    calls = nccl_calls.NcclCalls(reader, lambda: [])
    begin, index = 10**12 + rng.randrange(10**9), rng.randrange(1, 200)
    for k in range(rng.randint(1, 4)):
        window = nccl_calls._Window(index + k, rng.choice([7, 8, 8, 3, index + k]), begin, None, rng.randrange(3))
        begin += rng.randrange(1, 400_000)
        window.end_ns = begin - rng.randrange(0, 50_000) if k or rng.random() < 0.5 else None
        if calls._windows:
            calls._windows[-1].end_ns = calls._windows[-1].end_ns or window.begin_ns - 1
        calls._windows.append(window)
        begin += rng.randrange(0, 80_000)
    calls._index = calls._windows[-1].index
    first, last = calls._windows[0], calls._windows[-1]
    methods = {101: "comm_name", 102: "hash", 103: "rank_count", 104: "call_order"}
    for comm_hash, method in methods.items():
        if rng.random() < 0.9:
            calls.matches[comm_hash] = profiler.GroupMatch(["dp", "tp", "pp"][comm_hash % 3], method)
    calls.matches[105] = profiler.GroupMatch(None, "ambiguous")  # 106: never matched
    windows = [w.index for w in calls._windows]
    for group in ("dp", "tp", "pp"):
        if rng.random() < 0.9:
            calls.owned[group] = rng.choice([windows[0] - 5, windows[0] - 5, *windows, windows[-1] + 1])
        if rng.random() < 0.4:
            calls.owned_p2p[group] = rng.choice([windows[0] - 5, *windows, windows[-1] + 1])
        if rng.random() < 0.3:
            calls.p2p_to_tap[group] = rng.randrange(first.begin_ns, last.begin_ns + 500_000)
    n = rng.choice([1, 2, 3, rng.randint(1, 24), rng.randint(1, 40)])
    records = np.zeros(n, dtype=profiler.RECORD_DTYPE)
    comms = rng.sample(range(101, 107), rng.choice([1, 1, 2, 3, 4]))
    span = last.begin_ns + 300_000 - first.begin_ns
    start = first.begin_ns + rng.randrange(-20_000, 200_000)
    for r in records:
        r["comm_hash"] = rng.choice(comms)
        r["func"] = rng.choice([4, 4, 4, 2, 3, 0, 1, 5, 6, 7, 6, 7, 6, 7, 8, 9, 10, 11, 200])
        r["count"], r["type_size"] = rng.choice([1, 7, 1024, 1 << 20, 3 << 28]), rng.choice([1, 2, 4, 8])
        r["n_ranks"] = rng.choice([2, 4, 8, 64])
        if rng.random() < 0.08:  # anywhere: outside the windows, or out of launch order
            start = first.begin_ns + rng.randrange(-100_000, span)
        else:  # after the last stopped (its own launch), or before (the same launch)
            start += rng.randrange(1, 30_000) if rng.random() < 0.85 else -rng.randrange(0, 5_000)
        r["host_start_ns"], r["host_stop_ns"] = start, start + rng.choice([rng.randrange(0, 20_000), -3])
        r["channel_events"] = rng.choice([0, 1, 8, 8])
        gpu = rng.randrange(10**9, 2 * 10**9)
        r["gpu_start_ns"], r["gpu_stop_ns"] = gpu, gpu + rng.choice([rng.randrange(1, 10**6), 0, -7])
        if rng.random() < 0.1:
            r["gpu_start_ns"] = r["gpu_stop_ns"] = 0
    return calls, records


def test_a_small_drains_plain_python_rows_are_the_array_paths_to_the_bit(library, monkeypatch, caplog) -> None:
    """``NcclCalls._rows`` makes a drain of at most ``SMALL_DRAIN`` records into rows in plain Python, a larger one on
    arrays. On 800 random drains, made both ways from the same state: the same rows (every float to the bit, by its
    repr), in the same order, each key's durations adding up to the same total, and the same state after (the windows'
    numbering, the transfers taken over, the call-order table, the records kept, what was logged)."""
    rng = random.Random(32)
    reader = profiler.ProfilerDrain(library)
    seen = {"rows": 0, "several windows": 0, "outside": 0, "coalesced": 0, "transfers": 0, "unmatched": 0,
            "several keys": 0, "reordered": 0, "none taken": 0, "transfers taken over": 0}
    joined = nccl_calls.NcclCalls._joined_rows

    def coalesced(self: nccl_calls.NcclCalls, records: list[profiler.CollectiveRecord],
                  windows: list[nccl_calls._Window]) -> nccl_calls.NcclRows:
        seen["coalesced"] += small  # counted once, on the plain-Python path's turn
        return joined(self, records, windows)

    monkeypatch.setattr(nccl_calls.NcclCalls, "_joined_rows", coalesced)
    for _ in range(800):
        state = rng.getstate()
        made = []
        for small in (False, True):  # the array path, then the plain-Python path
            rng.setstate(state)
            calls, records = _drain_scenario(rng, reader)
            before = dict(calls.owned_p2p)
            monkeypatch.setattr(nccl_calls, "SMALL_DRAIN", len(records) if small else 0)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="lagom.runtime"):
                rows = calls._rows(profiler.Drained(records.copy(), 0))
            rec = Recorder(cuda=False)
            rec._add_up(rows.fields) if rows.durations is None else rec._add_up_durations(rows.durations)
            kept = np.concatenate(list(calls.records)) if calls.records else None
            made.append((repr(rows.fields), repr(rec._totals), [w.next_seq for w in calls._windows],
                         calls.owned_p2p, calls._signatures.profiled, caplog.messages,
                         None if kept is None else kept.tobytes()))
        array, listed = made
        assert listed == array
        fields = rows.fields
        windows = calls._windows
        launches = records["host_start_ns"].astype(np.int64)
        seen["rows"] += bool(fields)
        seen["several windows"] += len({f[4] for f in fields}) > 1 or len(windows) > 1 and len(fields) > 1
        seen["outside"] += kept is not None and len(kept) < len(records)
        seen["transfers"] += any(f[1] in ("send_recv", "recv") for f in fields)
        seen["unmatched"] += bool(calls._signatures.profiled)
        seen["several keys"] += rows.durations is not None and len(rows.durations) > 1
        seen["reordered"] += bool(fields) and not (np.diff(launches) >= 0).all()
        seen["none taken"] += kept is not None and not fields
        seen["transfers taken over"] += len(calls.owned_p2p) > len(before)
    assert min(seen.values()) >= 20, seen  # every branch of both paths was gone through, many times


def test_the_rows_a_recorder_keeps_are_nothing_pythons_garbage_collector_walks(nccl, library) -> None:
    """A recorder keeps its last 100,000 rows. As objects, each step's rows added to what every full collection of the
    process walks (in a long job that cost more per call than recording it); kept as tuples of strings and numbers,
    which the collector stops tracking, the rows of many steps, the tap's and NCCL's, add none."""
    rec = Recorder(cuda=False)
    rec.nccl = nccl_calls.NcclCalls(profiler.ProfilerDrain(library), lambda: [NcclGroup("dp", 4, ("7",))])
    dp = nccl(6, comm_hash=60, n_ranks=4, name=b"7")

    def steps(first: int, count: int) -> None:
        for step in range(first, first + count):
            rec.begin_step(step)
            now = time.perf_counter()
            for i in range(20):
                rec.ended("tp", "all_gather", 64, now, now + 1e-4)  # the tap's
                dp.run(i, [(0, 1_000)], count=1024)
            rec.end_step()  # its rows are let go, as a session lets them go once it has added them up

    steps(1, 2)  # dp's communicator is matched at the first step's end
    gc.collect()
    tracked = len(gc.get_objects())
    steps(3, 50)
    gc.collect()
    assert len(rec.records) == 20 + 40 + 50 * 40 and rec.records[-1].key == "dp/all_reduce/4096"
    assert len(gc.get_objects()) - tracked < 200  # the windows of the steps, not their 2,000 rows


def test_the_recorder_takes_a_groups_transfers_once_nccl_reports_them_and_an_all_to_all_gives_them_back(
        nccl, library, caplog) -> None:
    """NCCL's sends and receives are recorded from its records from the step after a communicator matched by name
    reported one; one matched by rank count alone (torch's two-rank pair communicators look like any group of two)
    leaves them to the tap; an all-to-all, which NCCL runs as transfers, hands the group's back to the tap."""
    rec = Recorder(cuda=False)
    calls = nccl_calls.NcclCalls(profiler.ProfilerDrain(library),
                                 lambda: [NcclGroup("pp", 2, ("5",)), NcclGroup("tp", 4)])
    rec.nccl = calls
    pp, tp = nccl(6, comm_hash=40, n_ranks=2, name=b"5"), nccl(6, comm_hash=41, n_ranks=4)

    def transfers(group: str, comm: Nccl) -> None:
        for func, collective in ((b"Send", "send_recv"), (b"Recv", "recv")):
            now = time.perf_counter()
            rec.ended(group, collective, 4096, now, now + 1e-3)  # the tap: left at once where NCCL's records have it
            comm.run_p2p([(0, 2_000)], func=func, count=2048, datatype=b"ncclBfloat16", peer=1)

    def all_to_all() -> None:
        assert not rec.from_nccl("pp", "all_to_all")  # the tap's pre-hook asks, then records it
        now = time.perf_counter()
        rec.ended("pp", "all_to_all", 8192, now, now + 1e-3)
        for func in (b"Send", b"Recv"):  # what NCCL reports of it
            pp.run_p2p([(0, 9_000)], func=func, count=2048, datatype=b"ncclBfloat16", peer=1)

    def step(n: int, *calls: Callable[[], None]) -> list[tuple[str, float]]:
        rec.begin_step(n)
        for call in calls:
            call()
        return [(r.key, round(r.duration_s, 6)) for r in sorted(rec.end_step(), key=lambda r: r.seq)]

    tapped = [("pp/send_recv/4096", 1e-3), ("pp/recv/4096", 1e-3)]
    ours = [("pp/send_recv/4096", 2e-6), ("pp/recv/4096", 2e-6)]
    tp_tapped = [("tp/send_recv/4096", 1e-3), ("tp/recv/4096", 1e-3)]
    with caplog.at_level(logging.INFO, logger="lagom.runtime"):
        both = (lambda: transfers("pp", pp), lambda: transfers("tp", tp))
        assert step(1, *both) == tapped + tp_tapped  # the communicators appear and are matched at this step's end
        assert step(2, *both) == tapped + tp_tapped  # pp's reported its transfers: NCCL's records from the next
        assert step(3, *both) == tp_tapped + ours  # the tap's rows come first, then the profiler's
        assert rec.track("pp", "send_recv", 64, work := object()) is work and rec.track("pp", "recv", 64) is None
        assert rec.pending == 0  # the adapters' calls of pp's transfers are left at once too
        assert step(4, both[0], all_to_all, *both) == [("pp/all_to_all/8192", 1e-3), *tapped, *tp_tapped, *ours[:1],
                                                      ("pp/recv/4096", 2e-6)]
        assert step(5, *both) == tapped + tp_tapped
        rec.track("pp", "send_recv", 64)
        assert rec.pending == 1  # handed back: the adapters' calls are timed again
    assert calls.owned_p2p == {"pp": 3} and set(calls.p2p_to_tap) == {"pp"}
    assert calls.matches[41] == profiler.GroupMatch("tp", "rank_count")
    said = [r.getMessage() for r in caplog.records if "sends and receives" in r.getMessage()]
    assert len(said) == 2 and "NCCL reports pp's sends" in said[0] and "pp ran all_to_all" in said[1]


def test_communicators_of_one_size_are_told_apart_by_call_order(nccl, library, caplog) -> None:
    rec = Recorder(cuda=False)
    calls = nccl_calls.NcclCalls(profiler.ProfilerDrain(library), lambda: [NcclGroup("dp", 4), NcclGroup("cp", 4)])
    rec.nccl = calls
    dp, cp = nccl(6, comm_hash=20, n_ranks=4), nccl(6, comm_hash=21, n_ranks=4)
    keys = []
    with caplog.at_level(logging.INFO, logger="lagom.runtime"):
        for step in range(1, 7):
            rec.begin_step(step)
            now = time.perf_counter()
            for group, collective, nbytes in (("dp", "all_reduce", 4096), ("dp", "all_gather", 8192),
                                              ("cp", "all_gather", 16384)):
                rec.ended(group, collective, nbytes, now, now + 1e-3)  # the tap: left at once once NCCL's records have it
            dp.run(step, [(0, 2_000)], count=1024)
            dp.run(step, [(0, 2_000)], func=b"AllGather", count=512)
            cp.run(step, [(0, 2_000)], func=b"AllGather", count=1024)
            keys.append(sorted((r.key, r.duration_s) for r in rec.end_step()))
    assert calls.matches == {20: profiler.GroupMatch("dp", "call_order"), 21: profiler.GroupMatch("cp", "call_order")}
    # matched on step 1's calls at step 3's end: NCCL's records from step 4, exactly one record per call throughout
    tap = [("cp/all_gather/16384", pytest.approx(1e-3)), ("dp/all_gather/8192", pytest.approx(1e-3)),
           ("dp/all_reduce/4096", pytest.approx(1e-3))]
    ours = [(k, pytest.approx(2e-6)) for k, _ in tap]
    assert keys == [tap, tap, tap, ours, ours, ours]
    said = [r.getMessage() for r in caplog.records if "NCCL profiler" in r.getMessage()]
    assert len(said) == 2 and "several groups of its rank count" in said[0] and "by call order" in said[1]


def test_the_runtime_points_nccl_at_its_profiler_and_a_users_profiler_wins(library, monkeypatch, caplog) -> None:
    monkeypatch.setattr(nccl_profiler, "path", lambda: library)
    monkeypatch.delenv("NCCL_PROFILER_PLUGIN", raising=False)
    on_cpu = apply_runtime.open_runtime(None)
    assert on_cpu.recorder.nccl is None and "do not run on NCCL" in (on_cpu.nccl_records_off or "")
    on_cpu.close()
    rt = apply_runtime.open_runtime(None)
    rt.record_nccl(nccl=True)  # as on a GPU: before any communicator exists
    assert os.environ["NCCL_PROFILER_PLUGIN"] == str(library) and rt.profiler_env_set == {
        "NCCL_PROFILER_PLUGIN": str(library)}
    assert isinstance(rt.recorder.nccl, nccl_calls.NcclCalls) and rt.recorder.nccl.reader.path == library
    second = apply_runtime.open_runtime(None)  # one reader per process: a second session records through the tap
    second.record_nccl(nccl=True)
    assert second.recorder.nccl is None and "another Lagom session" in (second.nccl_records_off or "")
    second.close()
    nccl_calls.detach(rt.recorder)  # as a session's close does
    again = apply_runtime.open_runtime(None)
    again.record_nccl(nccl=True)
    assert again.recorder.nccl is not None and again.nccl_records_off is None
    nccl_calls.detach(again.recorder)
    again.close()
    rt.close()
    assert "NCCL_PROFILER_PLUGIN" not in os.environ
    monkeypatch.setenv("NCCL_PROFILER_PLUGIN", "/opt/their-profiler.so")
    del rt, second
    theirs = apply_runtime.open_runtime(None)
    with caplog.at_level(logging.WARNING, logger="lagom.runtime"):
        theirs.record_nccl(nccl=True)
    assert os.environ["NCCL_PROFILER_PLUGIN"] == "/opt/their-profiler.so" and theirs.recorder.nccl is None
    assert "NCCL_PROFILER_PLUGIN=/opt/their-profiler.so is set in the environment" in caplog.text
    theirs.close()


def built_under(sanitizer: str, tmp_path: Path, driver: Path, include_dirs: list[Path]) -> tuple[Path, Path]:
    """The profiler and a C driver of it, both built under ``sanitizer`` (skipped where this compiler lacks it; the
    plain build must always work)."""
    compiler_or_skip()
    flags = [*SANITIZERS[sanitizer], "-g"]
    try:
        plugin = build.compile_profiler(tmp_path / "plugin.so", [*flags, "-Werror"])
        program = build.compile_driver(driver, tmp_path / driver.stem, include_dirs, ["-Werror", *flags])
    except build.BuildError as err:
        if sanitizer == "plain":
            raise
        pytest.skip(f"this compiler cannot build with {flags[0]}: {str(err)[-300:]}")
    return plugin, program


@pytest.mark.parametrize("sanitizer", list(SANITIZERS))
def test_threads_calling_as_nccl_does_lose_and_tear_nothing_under_sanitizers(tmp_path, sanitizer) -> None:
    """tests/nccl_profiler_stress.c: launcher, proxy and reader threads; v4/v5; malformed calls; a full ring."""
    plugin, driver = built_under(sanitizer, tmp_path, STRESS, [build.PROFILER.source_dir])
    done = subprocess.run([str(driver), str(plugin)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.endswith("stress ok\n") and "WARNING: ThreadSanitizer" not in done.stderr
    assert done.stdout.startswith("threads: ") and " 0 lost, 0 without a slot" in done.stdout


def test_a_session_measures_drifts_and_reports_what_ran_from_nccls_records(nccl, library, monkeypatch,
                                                                             tmp_path) -> None:
    """A real session with a plan in force, whose collectives reach it only as NCCL's records (the tap's role is
    played on the first step only, before the communicators are matched): the monitor sees a key slow down from
    those records alone, and the report's what-ran table says where NCCL did not run the plan."""
    wl, hw = tiny_job(tmp_path)
    cap = Capability("2.30.7", True, False, True)
    plan_file = tmp_path / "plan.json"
    make_plan(wl, hw, "lagom", capability=cap).save(plan_file)
    monkeypatch.setattr(nccl_profiler, "path", lambda: library)
    monkeypatch.delenv("NCCL_PROFILER_PLUGIN", raising=False)
    # the steps' wall time is a 20 ms sleep: on a loaded machine it wanders by more than the default 10% before any
    # slowdown; the slowed steps below halve the efficiency and triple one key's calls, well past 30%
    session = TuningSession(wl, hw, SessionOptions(plan_in=plan_file, capability=cap, cache_dir=tmp_path / "cache",
                                                   retune_threshold=0.3), world_size=8)
    session.start()
    try:
        plan = session.plan
        assert plan is not None and session.monitor is not None
        untouched = report.build(session)["nccl_ran"]
        assert untouched == {"recorded": False, "why": "the job's collectives do not run on NCCL (no CUDA device or "
                                                       "no NCCL in torch)"}
        sizes = {e.group: e.group_size for e in plan.entries}
        session.runtime.record_nccl(nccl=True, groups=lambda: [NcclGroup(g, n) for g, n in sizes.items()])
        comms = {g: nccl(6, comm_hash=100 + i, n_ranks=n, name=g.encode()) for i, (g, n) in enumerate(sizes.items())}
        funcs = {"all_reduce": b"AllReduce", "all_gather": b"AllGather", "reduce_scatter": b"ReduceScatter"}
        tuned = [e for e in plan.entries if e.collective in funcs and e.config.by_tuner]
        assert tuned, "the plan has no tuner rule to check"
        off_rule = tuned[0]
        slow = sorted(e.key for e in plan.entries if e.collective in funcs)[-1]

        def step(factor: float = 1.0) -> None:
            session.begin_step()
            start = time.perf_counter()
            for e in plan.entries:
                if e.collective not in funcs:
                    continue
                if not session.runtime.recorder.from_nccl(e.group, e.collective):  # the tap, until NCCL's records take over
                    session.runtime.recorder.ended(e.group, e.collective, e.bytes, start, start + 2e-4)
                algo = str(e.config.algorithm).upper().encode() if e.config.by_tuner else b"RING"
                proto = str(e.config.protocol).upper().encode() if e.config.by_tuner else b"SIMPLE"
                if e is off_rule:
                    algo, proto = (b"TREE", b"LL") if algo != b"TREE" else (b"RING", b"SIMPLE")
                count = e.bytes // 4 // (e.group_size if e.collective != "all_reduce" else 1)
                ns = 200_000 * (3 if e.key == slow and factor > 1 else 1)
                comms[e.group].run(session.iteration, [(0, ns)] * max(1, e.config.channels), func=funcs[e.collective],
                                   count=count, algo=algo, proto=proto)
            time.sleep(0.02 * factor)
            session.end_step()

        for _ in range(8):
            step()
        measured = session.measured.per_key
        assert measured and all(calls == session.measured.steps for calls, _ in measured.values())
        assert {key: seconds for key, (calls, seconds) in measured.items()} == \
            {key: pytest.approx(calls * 2e-4) for key, (calls, _) in measured.items()}
        for _ in range(40):
            step(factor=2.0)
            if any("may be stale" in e for e in session.events):
                break
        stale = [e for e in session.events if "may be stale" in e]
        assert stale and f"slower per call: {slow}" in stale[0], session.events[-3:]
        ran = report.build(session)["nccl_ran"]
        assert ran["recorded"] and ran["matched_by"] == ["comm_name"] and ran["dropped"] == 0
        assert f"| {off_rule.key} |" in ran["table"]
        assert len(ran["mismatches"]) == 1 and ran["mismatches"][0].startswith(f"{off_rule.key}: ")
        assert "the tuner rule did not fire" in ran["mismatches"][0]
        text = report.markdown(report.build(session))
        assert "## What NCCL ran (" in text and ran["mismatches"][0] in text
        session.close()  # the ring's one reader is released for the process's next session
        assert session.runtime.recorder.nccl is None and "NCCL_PROFILER_PLUGIN" not in os.environ
        assert report.build(session)["nccl_ran"]["why"] == "the session is closed (NCCL's records are read while it runs)"
    finally:
        session.close()


def _tap_beside_nccl_records(rank: int, world_size: int, library: str) -> list[list[tuple]]:
    """One gloo rank: the torch tap records as in a job, the profiler's records arrive as NCCL would write them."""
    lib = ctypes.CDLL(library)
    rec = Recorder(cuda=False)
    subscription = torch_tap.subscribe(lambda group: "world", rec)
    assert subscription is not None
    try:
        rec.nccl = nccl_calls.NcclCalls(profiler.ProfilerDrain(Path(library)),
                                        lambda: torch_tap.nccl_groups(rec, backend="gloo"))
        assert torch_tap.nccl_groups(rec, backend="gloo") == [
            NcclGroup("world", 2, (dist.group.WORLD.group_name, dist.group.WORLD.group_desc))]
        comm = Nccl(lib, 6, comm_hash=0xD0, n_ranks=world_size, name=dist.group.WORLD.group_name.encode())
        t = torch.ones(1024)
        steps = []
        for step in (1, 2, 3, 4):
            rec.begin_step(step)
            dist.all_reduce(t)
            comm.run(step, [(0, 3_000)], count=1024)  # what NCCL would record of that all-reduce
            if step == 4:  # the group's first all-to-all: its transfers are the tap's from now on
                dist.all_to_all_single(torch.empty(2), torch.ones(2))
            if rank == 0:
                dist.send(t[:16], 1)
            else:
                dist.recv(t[:16], 0)
            comm.run_p2p([(0, 3_000)], func=(b"Send", b"Recv")[rank], count=16, datatype=b"ncclFloat32", peer=1 - rank)
            steps.append(sorted((r.key, r.step, r.duration_s == pytest.approx(3e-6)) for r in rec.end_step()))
        return steps
    finally:
        subscription.close()


def test_the_torch_tap_leaves_the_collectives_nccls_records_carry_and_records_the_rest(library) -> None:
    from tests.distributed import run_ranks

    for rank, steps in enumerate(run_ranks(_tap_beside_nccl_records, 2, str(library))):
        p2p = ("world/send_recv/64", "world/recv/64")[rank]
        tapped = [("world/all_reduce/4096", 1, False), (p2p, 1, False)]
        assert steps[0] == sorted(tapped), steps[0]  # the communicator appears: the tap has this step's calls
        # NCCL's records: the tap's pre-hook leaves the all-reduce from step 2, the transfer once NCCL reported one
        assert steps[1] == sorted([("world/all_reduce/4096", 2, True), (p2p, 2, False)]), steps[1]
        assert steps[2] == sorted([("world/all_reduce/4096", 3, True), (p2p, 3, True)]), steps[2]
        assert steps[3] == sorted([("world/all_reduce/4096", 4, True), ("world/all_to_all/8", 4, False),
                                   (p2p, 4, False)]), steps[3]


def test_a_coalesced_launch_is_recorded_as_the_aggregates_nccl_tuned(nccl, library) -> None:
    """NCCL starts every collective of a group's launch before it stops any, and joins those of one function and
    type, smallest first, while under 4x the smallest's bytes: the recorder and the what-ran table see those
    aggregates, as the tap and the plan count them (bytes in all, tensors)."""
    rec = Recorder(cuda=False)
    rec.nccl = nccl_calls.NcclCalls(profiler.ProfilerDrain(library), lambda: [NcclGroup("dp", 4)])
    dp = nccl(6, comm_hash=30, n_ranks=4)
    rec.begin_step(1)
    dp.run(1, [(0, 10)], count=8)  # matched at this step's end, recorded from NCCL's records from the next
    rec.end_step()

    def coalesced(seq: int) -> None:
        handles = [dp.coll(seq + i, func=b"ReduceScatter", count=n, channels=1) for i, n in enumerate((1024, 2048, 16384))]
        for h in handles:  # stopped after the launch, all of them
            dp.stop(h)
        for i, h in enumerate(handles):
            dp.channel_end(dp.channel(h, 0, 1_000 * (i + 1)), 1_000 * (i + 1) + 500)

    rec.begin_step(2)
    coalesced(10)
    dp.run(20, [(0, 700)], count=1024, func=b"ReduceScatter")  # its own launch: never joined
    rows = rec.end_step()
    assert [(r.key, r.tensors, r.exact) for r in rows] == [
        ("dp/reduce_scatter/49152", 2, True), ("dp/reduce_scatter/262144", 1, True), ("dp/reduce_scatter/16384", 1, True)]
    assert [r.seq for r in rows] == [0, 1, 2]
    assert [round(r.duration_s * 1e9) for r in rows] == [1_500, 500, 700]  # the aggregate: first start to last stop
    coalesced(30)
    plan = Plan("w", "wf", "h", "hf", 4, "priority", [
        _entry("dp", "reduce_scatter", 49152, CommConfig(Algorithm.RING, Protocol.SIMPLE, channels=1, by_tuner=True))],
        predicted_step_s={})
    records = profiler.ProfilerDrain(library).drain().collectives()
    comparison = what_ran.compare(records, plan, {30: profiler.GroupMatch("dp", "rank_count")})
    assert [(run.key, run.calls, run.mismatched) for run in comparison.keys] == [("dp/reduce_scatter/49152", 1, 0)]
    assert comparison.unplanned == 1  # the 256 KiB aggregate has no key
