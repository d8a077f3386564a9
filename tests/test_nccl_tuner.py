"""Lagom's NCCL tuner plugin, called through ctypes exactly as NCCL calls it, against rules written from a plan.

The ABI facts the tests build on are restated here from NCCL's headers (not from the plugin's):
ncclFuncAllGather=2, ncclFuncReduceScatter=3, ncclFuncAllReduce=4; NCCL_ALGO_TREE=0, NCCL_ALGO_RING=1;
NCCL_PROTO_LL=0, NCCL_PROTO_LL128=1, NCCL_PROTO_SIMPLE=2; a 7x3 float cost table whose ignored entries are
-1.0; NCCL runs the cheapest entry >= 0.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lagom import nccl_tuner, runtime
from lagom.errors import ConfigError
from lagom.hardware import load_hardware
from lagom.nccl_tuner import build
from lagom.plan import emit
from lagom.plan.comm_config import CommConfig
from lagom.plan.plan import Plan, PlanEntry
from lagom.runtime import init

FUNC = {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 4}
ALGO = {"tree": 0, "ring": 1}
PROTO = {"LL": 0, "LL128": 1, "Simple": 2}
NUM_ALGO, NUM_PROTO = 7, 3
IGNORED = -1.0
LOG_WARN, LOG_INFO = 2, 3
HW = "a100-8x-100g"
NCCL_CHUNK = 1 << 19  # what NCCL proposes before the plugin speaks
STRESS_SOURCE = Path(__file__).with_name("nccl_tuner_stress.c")

LOGGER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_ulong, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_char_p)  # the plugin always logs ("%s", message)
CONTEXT_OUT = ctypes.POINTER(ctypes.c_void_p)
INIT_V6 = ctypes.CFUNCTYPE(ctypes.c_int, CONTEXT_OUT, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, LOGGER,
                           ctypes.c_void_p, ctypes.c_void_p)
INIT_V4 = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t, LOGGER, CONTEXT_OUT)
GET_COLL_INFO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
FINALIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
GET_CHUNK_SIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t))


class TunerV6(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT_V6), ("getCollInfo", GET_COLL_INFO),
                ("finalize", FINALIZE), ("getChunkSize", GET_CHUNK_SIZE)]


class TunerV5(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT_V6), ("getCollInfo", GET_COLL_INFO), ("finalize", FINALIZE)]


class TunerV4(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("init", INIT_V4), ("getCollInfo", GET_COLL_INFO), ("destroy", FINALIZE)]


def compiler_or_skip() -> list[str]:
    compiler = build.c_compiler()
    if compiler is None:
        pytest.skip("no C compiler: the plugin cannot be built here (install reports it unavailable)")
    return compiler


@pytest.fixture(scope="module")
def library() -> ctypes.CDLL:
    """The plugin the install built in the package."""
    compiler_or_skip()
    built = nccl_tuner.path()
    assert built is not None, "a C compiler exists but lagom/nccl_tuner has no plugin: run `pip install -e .`"
    return ctypes.CDLL(str(built))


class Comm:
    """One communicator's tuner context, driven as NCCL drives it; the log lines it produced."""

    def __init__(self, tuner: TunerV6, ranks: int, nodes: int, comm_id: int = 0x5EED) -> None:
        self.tuner = tuner
        self.log: list[tuple[int, str]] = []
        self._logger = LOGGER(lambda level, flags, file, line, fmt, message: self.log.append((level, message.decode())))
        self.context = ctypes.c_void_p()
        assert tuner.init(ctypes.byref(self.context), comm_id, ranks, nodes, self._logger, None, None) == 0

    def coll_info(self, collective: str, nbytes: int, table: np.ndarray) -> tuple[np.ndarray, int]:
        """The table after the plugin (a copy of ``table``) and the channels it set (0: none)."""
        out = np.ascontiguousarray(table, dtype=np.float32).copy()
        channels = ctypes.c_int(0)
        assert self.tuner.getCollInfo(self.context, FUNC[collective], nbytes, 1, out.ctypes.data, NUM_ALGO, NUM_PROTO,
                                      0, ctypes.byref(channels)) == 0
        return out, channels.value

    def chunk(self, collective: str, nbytes: int, algo: int, proto: int) -> int:
        size = ctypes.c_size_t(NCCL_CHUNK)
        assert self.tuner.getChunkSize(self.context, FUNC[collective], nbytes, algo, proto, 1, ctypes.byref(size)) == 0
        return size.value

    def close(self) -> None:
        assert self.tuner.finalize(self.context) == 0


def nccl_choice(table: np.ndarray) -> tuple[int, int]:
    """What NCCL runs: the first cheapest entry that is not negative."""
    allowed = np.where(table >= 0, table, np.inf)
    return divmod(int(np.argmin(allowed)), NUM_PROTO)


def cost_table(ignored: tuple[tuple[int, int], ...] = ((4, 0), (4, 1), (5, 0), (6, 1))) -> np.ndarray:
    """Distinct positive costs, NCCL's own pick being tree/LL (0, 0), with some entries ignored."""
    table = np.arange(1, NUM_ALGO * NUM_PROTO + 1, dtype=np.float32).reshape(NUM_ALGO, NUM_PROTO)
    for algo, proto in ignored:
        table[algo, proto] = IGNORED
    return table


def entry(group: str, ranks: int, nodes: int, collective: str, nbytes: int, algorithm: str = "ring",
          protocol: str = "Simple", channels: int = 8, chunk: int = 1 << 20, comm_s: float = 1e-3,
          decomposition: str = "collective") -> PlanEntry:
    config = CommConfig(algorithm=algorithm, protocol=protocol, channels=channels, chunk_bytes=chunk,
                        decomposition=decomposition)
    return PlanEntry(key=f"{group}/{collective}/{nbytes}", group=group, group_size=ranks, group_nodes=nodes,
                     collective=collective, bytes=nbytes, count=1, points=[], config=config, predicted_comm_s=comm_s)


def make_plan(entries: list[PlanEntry], world_size: int = 16) -> Plan:
    hw = load_hardware(HW)
    return Plan(workload="unit", workload_fingerprint="0" * 16, hardware=hw.name, hardware_fingerprint=hw.fingerprint(),
                world_size=world_size, strategy="lagom", entries=entries, predicted_step_s={"lagom": 0.1})


# dp: 16 ranks on 2 nodes; tp: 8 ranks on 1 node; two dp all-reduce sizes close enough for their ranges to overlap.
PLAN_ENTRIES = [
    entry("dp", 16, 2, "all_reduce", 1_000_000, "tree", "LL128", channels=4, chunk=128 * 1920),  # LL128's grain
    entry("dp", 16, 2, "all_reduce", 1_060_000, "ring", "LL", channels=2, chunk=1 << 15),  # LL's largest
    entry("dp", 16, 2, "reduce_scatter", 64 << 20, "ring", "Simple", channels=16, chunk=4 << 20),
    entry("tp", 8, 1, "all_gather", 4 << 20, "ring", "LL128", channels=24, chunk=256 * 1920),
    entry("tp", 8, 1, "all_reduce", 1_000_000, "ring", "Simple", channels=32, chunk=2 << 20),
    entry("tp", 8, 1, "reduce_scatter", 8 << 20, "ring", "LL", channels=12, chunk=1 << 16, decomposition="p2p"),
    entry("ep", 8, 1, "all_to_all", 2 << 20),
]


@pytest.fixture
def plan() -> Plan:
    return make_plan([PlanEntry(**vars(e)) for e in PLAN_ENTRIES])


@pytest.fixture
def rules_file(plan, tmp_path, monkeypatch) -> Path:
    path = tmp_path / "nccl_tuner.lagom"
    path.write_text(emit.tuner_rules(plan))
    monkeypatch.setenv("LAGOM_NCCL_TUNER_FILE", str(path))
    monkeypatch.setenv("WORLD_SIZE", "16")
    return path


@pytest.fixture(params=["ncclTunerPlugin_v6", "ncclTunerPlugin_v7"])
def v6(library, request) -> TunerV6:
    """The v6 interface and v7 (NCCL >= 2.32), which has v6's layout and calls: every test runs through both."""
    tuner = TunerV6.in_dll(library, request.param)
    assert tuner.name == b"Lagom"
    return tuner


# -- the rules file


def test_rules_cover_the_sizes_key_index_matches_and_only_collectives_nccl_tunes(plan):
    text = emit.tuner_rules(plan)
    rules = [line.split("#")[0].split() for line in text.splitlines() if line and not line.startswith(("#", "lagom-", "world"))]
    assert text.splitlines()[0] == "lagom-nccl-tuner 1" and "world 16" in text.splitlines()
    assert [r[0] for r in rules] == ["allgather", "allreduce", "allreduce", "allreduce", "reducescatter"]  # by ranks, nodes
    by_key = {line.split("#")[1].strip(): line.split("#")[0].split() for line in text.splitlines() if "  # " in line}
    # 5% of 1_000_000 = 50_000 around each size; the overlap with 1_060_000 is cut at 1_030_000 (nearest wins).
    assert by_key["dp/all_reduce/1000000"] == ["allreduce", "950000", "1030000", "16", "2", "tree", "ll128", "4", "245760"]
    assert by_key["dp/all_reduce/1060000"] == ["allreduce", "1030001", "1113000", "16", "2", "ring", "ll", "2", "32768"]
    assert by_key["tp/all_gather/4194304"][1:3] == [str((4 << 20) - 209715), str((4 << 20) + 209715)]


def test_communicators_the_plugin_cannot_tell_apart_share_rules_and_the_heavier_wins():
    plan = make_plan([entry("tp", 2, 1, "all_reduce", 1 << 20, channels=4, comm_s=1e-3),
                      entry("cp", 2, 1, "all_reduce", 1 << 20, channels=16, comm_s=5e-3)], world_size=4)
    text = emit.tuner_rules(plan)
    rules = [line for line in text.splitlines() if line.startswith("allreduce")]
    assert len(rules) == 1 and rules[0].split()[7] == "16" and rules[0].endswith("# cp/all_reduce/1048576")
    assert "# cp, tp have 2 ranks on 1 node(s): NCCL cannot tell them apart, they share these rules" in text
    assert "# tp/all_reduce/1048576: settings of cp/all_reduce/1048576 used (same size and counts, more time)" in text


# -- the plugin, as NCCL calls it


def test_every_planned_size_gets_its_algorithm_protocol_channels_and_chunk(v6, plan, rules_file):
    for planned in emit.tuner_entries(plan):
        comm = Comm(v6, planned.group_size, planned.group_nodes)
        table = cost_table()
        after, channels = comm.coll_info(planned.collective, planned.bytes, table)
        algo, proto = ALGO[planned.config.algorithm], PROTO[planned.config.protocol]
        changed = np.argwhere(after != table).tolist()
        assert changed == [[algo, proto]] and after[algo, proto] == 0.0, planned.key
        assert nccl_choice(after) == (algo, proto) != nccl_choice(table)
        assert channels == planned.config.channels
        assert comm.chunk(planned.collective, planned.bytes // planned.config.channels, algo, proto) == planned.config.chunk_bytes
        comm.close()


def test_calls_match_exactly_the_sizes_the_runtime_matches_to_a_key(v6, plan, rules_file):
    """Sizes around every range edge, checked against lagom.step.calls.KeyIndex (via Plan.lookup)."""
    comms = {(16, 2): Comm(v6, 16, 2), (8, 1): Comm(v6, 8, 1)}
    sizes = {950_000 + d for d in (-1, 0, 1)} | {1_030_000 + d for d in (-1, 0, 1, 2)} | {1_113_000 + d for d in (0, 1)}
    for planned in emit.tuner_entries(plan):
        reach = int(0.05 * planned.bytes)
        sizes |= {planned.bytes + d for d in (-reach - 1, -reach, 0, reach, reach + 1)}
    checked = 0
    for planned in emit.tuner_entries(plan):
        comm = comms[(planned.group_size, planned.group_nodes)]
        for nbytes in sorted(sizes):
            expected = plan.lookup(planned.group, planned.collective, nbytes)
            table = cost_table()
            after, channels = comm.coll_info(planned.collective, nbytes, table)
            if expected is None:
                assert (after == table).all() and channels == 0, (planned.key, nbytes)
                assert comm.chunk(planned.collective, nbytes, *nccl_choice(after)) == NCCL_CHUNK
            else:
                want = (ALGO[expected.config.algorithm], PROTO[expected.config.protocol])
                assert nccl_choice(after) == want and channels == expected.config.channels, (planned.key, nbytes)
                assert comm.chunk(planned.collective, nbytes // channels, *want) == expected.config.chunk_bytes
                checked += 1
    assert checked >= 20
    for comm in comms.values():
        comm.close()


def test_an_nvls_rule_picks_the_nvls_row_unless_nccl_ignores_it(v6, tmp_path, monkeypatch):
    """The search plans NVLS (NCCL_ALGO_NVLS = 4, Simple only) on NVSwitch nodes; the plugin applies it, and
    leaves the table to NCCL where NCCL has marked that entry ignored (no NVLS on this communicator)."""
    plan = make_plan([entry("tp", 8, 1, "all_reduce", 8 << 20, "nvls", "Simple", channels=16)], world_size=8)
    path = tmp_path / "nvls.lagom"
    path.write_text(emit.tuner_rules(plan))
    monkeypatch.setenv("LAGOM_NCCL_TUNER_FILE", str(path))
    monkeypatch.setenv("WORLD_SIZE", "8")
    comm = Comm(v6, 8, 1)
    after, channels = comm.coll_info("all_reduce", 8 << 20, cost_table())
    assert nccl_choice(after) == (4, PROTO["Simple"]) and channels == 16
    ignored = cost_table(ignored=((4, 0), (4, 1), (4, 2)))
    after, channels = comm.coll_info("all_reduce", 8 << 20, ignored)
    assert (after == ignored).all() and nccl_choice(after) != (4, PROTO["Simple"])
    comm.close()


def test_two_communicators_with_different_rank_counts_keep_their_own_rules(v6, rules_file):
    dp, tp = Comm(v6, 16, 2), Comm(v6, 8, 1)
    for _ in range(3):  # interleaved, as two process groups issue
        dp_table, dp_channels = dp.coll_info("all_reduce", 1_000_000, cost_table())
        tp_table, tp_channels = tp.coll_info("all_reduce", 1_000_000, cost_table())
        assert (nccl_choice(dp_table), dp_channels) == ((ALGO["tree"], PROTO["LL128"]), 4)
        assert (nccl_choice(tp_table), tp_channels) == ((ALGO["ring"], PROTO["Simple"]), 32)
        assert dp.chunk("all_reduce", 250_000, ALGO["tree"], PROTO["LL128"]) == 128 * 1920
        assert tp.chunk("all_reduce", 31_250, ALGO["ring"], PROTO["Simple"]) == 2 << 20
    assert dp.log == [(LOG_INFO, f"Lagom tuner: {rules_file}: 3 of 5 rules are for this communicator (16 ranks, 2 nodes)")]
    # No rule for 4 ranks: nothing changes; nor for the tp all-gather asked of the dp communicator.
    other = Comm(v6, 4, 1)
    assert other.coll_info("all_reduce", 1_000_000, cost_table())[1] == 0
    table = cost_table()
    assert (dp.coll_info("all_gather", 4 << 20, table)[0] == table).all()
    for comm in (dp, tp, other):
        comm.close()


def test_an_ignored_entry_is_never_chosen_and_the_call_is_left_to_nccl(v6, rules_file):
    comm = Comm(v6, 16, 2)
    table = cost_table(ignored=((ALGO["tree"], PROTO["LL128"]),))  # the plan wants tree/LL128 at 1_000_000
    after, channels = comm.coll_info("all_reduce", 1_000_000, table)
    assert (after == table).all() and after[0, 1] == IGNORED and channels == 0
    assert comm.chunk("all_reduce", 500_000, *nccl_choice(after)) == NCCL_CHUNK
    assert comm.chunk("all_reduce", 500_000, ALGO["tree"], PROTO["LL128"]) == NCCL_CHUNK  # not applied this round
    comm.close()


def test_chunk_is_left_to_nccl_when_a_prepared_group_is_ambiguous(v6, rules_file):
    # One NCCL group with two planned all-reduces of the same algorithm/protocol but different chunks.
    plan_b = make_plan([entry("dp", 16, 2, "all_reduce", 1 << 20, channels=2, chunk=1 << 18),
                        entry("dp", 16, 2, "all_reduce", 8 << 20, channels=2, chunk=1 << 21)])
    rules_file.write_text(emit.tuner_rules(plan_b))
    comm_b = Comm(v6, 16, 2)
    ring_simple = (ALGO["ring"], PROTO["Simple"])
    comm_b.coll_info("all_reduce", 1 << 20, cost_table())
    comm_b.coll_info("all_reduce", 8 << 20, cost_table())
    assert comm_b.chunk("all_reduce", 1 << 18, *ring_simple) == NCCL_CHUNK
    # The next group has one of them only: a new round, an unambiguous chunk.
    comm_b.coll_info("all_reduce", 8 << 20, cost_table())
    assert comm_b.chunk("all_reduce", 1 << 20, *ring_simple) == 1 << 21
    # A group with a planned and an unplanned all-reduce: NCCL cannot say whose chunk it asks for.
    comm_b.coll_info("all_reduce", 8 << 20, cost_table())
    comm_b.coll_info("all_reduce", 3 << 20, cost_table())
    assert comm_b.chunk("all_reduce", 1 << 20, *ring_simple) == NCCL_CHUNK
    # A chunk share larger than the rule's largest size is not this rule's.
    comm_b.coll_info("all_reduce", 1 << 20, cost_table())
    assert comm_b.chunk("all_reduce", 2 << 20, *ring_simple) == NCCL_CHUNK
    comm_b.close()


BAD_FILES = {
    "empty": ("", "empty file"),
    "blank": ("\n# only a comment\n\n", "empty file"),
    "not ours": ("coll,min_bytes,max_bytes\n", "line 1: the first line must be 'lagom-nccl-tuner 1'"),
    "version": ("lagom-nccl-tuner 2\n", "line 1: format version 2; this plugin reads version 1"),
    "no world": ("lagom-nccl-tuner 1\n", "no 'world' line"),
    "rule first": ("lagom-nccl-tuner 1\nallreduce 1 2 2 1 ring simple 1 1\nworld 2\n", "line 2: a rule before the 'world' line"),
    "two worlds": ("lagom-nccl-tuner 1\nworld 2\nworld 2\n", "line 3: a second 'world' line"),
    "protocol": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ring bogus 1 1\n", "line 3: unknown protocol 'bogus'"),
    "algorithm": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ringo simple 1 1\n", "line 3: unknown algorithm 'ringo'"),
    "collective": ("lagom-nccl-tuner 1\nworld 16\nalltoall 1 2 16 2 ring simple 1 1\n", "line 3: unknown collective 'alltoall'"),
    "negative": ("lagom-nccl-tuner 1\nworld 16\nallreduce -1 2 16 2 ring simple 1 1\n", "line 3: min_bytes '-1' is not a count"),
    "overflow": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 99999999999999999999 16 2 ring simple 1 1\n",
                 "line 3: max_bytes '99999999999999999999' is not a count"),
    "reversed": ("lagom-nccl-tuner 1\nworld 16\nallreduce 5 2 16 2 ring simple 1 1\n", "line 3: min_bytes 5 exceeds max_bytes 2"),
    "short": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ring simple 1\n", "line 3: a rule has 9 fields"),
    "long": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ring simple 1 1 extra\n", "this line has more than 9"),
    "zero channels": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ring simple 0 1\n", "line 3: channels '0' is not a positive int"),
    "nodes": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 2 4 ring simple 1 1\n", "line 3: 4 nodes for 2 ranks"),
    "bigger than world": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 32 4 ring simple 1 512\n", "line 3: a rule for 32 ranks in a world of 16"),
    "huge line": ("lagom-nccl-tuner 1\nworld 16\n#" + "x" * 5000 + "\n", "line 3: longer than 1023 characters"),
    # NCCL rounds a chunk down to the protocol's grain and divides by the result (enqueue.cc, 2.30.7)
    "chunk below simple's grain": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ring simple 1 100\n",
                                   "line 3: chunk_bytes 100 is below simple's grain of 512 bytes"),
    "chunk below ll128's grain": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 ring ll128 1 1024\n",
                                  "line 3: chunk_bytes 1024 is below ll128's grain of 1920 bytes"),
    "channels over 64": ("lagom-nccl-tuner 1\nworld 16\nallreduce 1 2 16 2 collnet_direct simple 65 512\n",
                         "line 3: channels 65 exceeds NCCL's 64 channels per communicator"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_file_is_one_warning_and_nccl_tunes_alone(v6, rules_file, name):
    text, reason = BAD_FILES[name]
    rules_file.write_text(text)
    comm = Comm(v6, 16, 2)
    table = cost_table()
    after, channels = comm.coll_info("all_reduce", 1_000_000, table)
    assert (after == table).all() and channels == 0
    assert comm.chunk("all_reduce", 1_000_000, 0, 1) == NCCL_CHUNK
    assert len(comm.log) == 1 and comm.log[0][0] == LOG_WARN, comm.log
    assert comm.log[0][1].startswith(f"Lagom tuner: ignoring {rules_file}") and reason in comm.log[0][1], comm.log
    assert comm.log[0][1].endswith("NCCL tunes this communicator")
    comm.close()


def test_a_file_for_another_world_size_or_none_leaves_nccl_alone(v6, rules_file, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "32")
    other_world = Comm(v6, 16, 2)
    assert other_world.log == [(LOG_WARN, f"Lagom tuner: ignoring {rules_file}: written for 16 ranks, this job has 32; "
                                   "NCCL tunes this communicator")]
    monkeypatch.delenv("WORLD_SIZE")  # no launcher variable: a communicator bigger than the file's world tells
    bigger = Comm(v6, 32, 4)
    assert bigger.log[0][0] == LOG_WARN and "written for 16 ranks, this job has 32" in bigger.log[0][1]
    monkeypatch.setenv("LAGOM_NCCL_TUNER_FILE", str(tmp_path / "missing.lagom"))
    missing = Comm(v6, 16, 2)
    assert missing.log[0][0] == LOG_WARN and "missing.lagom: cannot open (No such file or directory)" in missing.log[0][1]
    monkeypatch.delenv("LAGOM_NCCL_TUNER_FILE")
    unset = Comm(v6, 16, 2)
    assert unset.log == [(LOG_INFO, "Lagom tuner: LAGOM_NCCL_TUNER_FILE is not set; NCCL tunes this communicator")]
    for comm in (other_world, bigger, missing, unset):
        assert comm.coll_info("all_reduce", 1_000_000, cost_table())[1] == 0
        comm.close()


def test_older_nccl_finds_the_v5_and_v4_interfaces(library, rules_file):
    lines: list[str] = []
    logger = LOGGER(lambda level, flags, file, line, fmt, message: lines.append(message.decode()))

    def asks_all_gather(tuner: TunerV5 | TunerV4, context: ctypes.c_void_p) -> None:
        table = cost_table()
        channels = ctypes.c_int(0)
        assert tuner.getCollInfo(context, FUNC["all_gather"], 4 << 20, 1, table.ctypes.data, NUM_ALGO, NUM_PROTO, 0,
                                 ctypes.byref(channels)) == 0
        assert nccl_choice(table) == (ALGO["ring"], PROTO["LL128"]) and channels.value == 24

    v5, v5_context = TunerV5.in_dll(library, "ncclTunerPlugin_v5"), ctypes.c_void_p()
    assert v5.init(ctypes.byref(v5_context), 7, 8, 1, logger, None, None) == 0
    asks_all_gather(v5, v5_context)
    assert v5.finalize(v5_context) == 0
    v4, v4_context = TunerV4.in_dll(library, "ncclTunerPlugin_v4"), ctypes.c_void_p()
    assert v4.init(8, 1, logger, ctypes.byref(v4_context)) == 0
    asks_all_gather(v4, v4_context)
    assert v4.destroy(v4_context) == 0
    assert len(lines) == 2 and all("2 of 5 rules are for this communicator (8 ranks, 1 nodes)" in m for m in lines)


def test_a_table_smaller_than_the_rule_needs_is_not_touched(v6, rules_file):
    comm = Comm(v6, 16, 2)
    table = np.full((1, 1), 5.0, dtype=np.float32)  # an NCCL with a single algorithm and protocol
    channels = ctypes.c_int(0)
    comm.tuner.getCollInfo(comm.context, FUNC["all_reduce"], 1_000_000, 1, table.ctypes.data, 1, 1, 0,
                           ctypes.byref(channels))
    assert table[0, 0] == 5.0 and channels.value == 0
    comm.close()


# -- memory: many init/getCollInfo/getChunkSize/finalize under a sanitizer or valgrind


@pytest.fixture
def stress_files(plan, tmp_path) -> list[Path]:
    files = {"good": emit.tuner_rules(plan), "empty": "", "malformed": BAD_FILES["protocol"][0],
             "other_world": emit.tuner_rules(make_plan(plan.entries, world_size=64))}
    paths = [tmp_path / f"{name}.lagom" for name in files]
    for path, text in zip(paths, files.values()):
        path.write_text(text)
    return [*paths, tmp_path / "missing.lagom"]


def _stress(command: list[str], stress_files: list[Path]) -> str:
    env = {**os.environ, "WORLD_SIZE": "16"}
    done = subprocess.run([*command, "16", "2", *map(str, stress_files)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _compile_stress(tmp_path: Path, flags: list[str]) -> tuple[Path, Path]:
    compiler_or_skip()
    plugin = build.compile_plugin(tmp_path / "plugin.so", [*flags, "-g", "-Werror"])
    driver = build.compile_driver(STRESS_SOURCE, tmp_path / "stress", [build.SOURCE_DIR], ["-g", "-Werror", *flags])
    return plugin, driver


def test_thousands_of_calls_leak_nothing_under_address_sanitizer(tmp_path, stress_files):
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
    try:
        plugin, driver = _compile_stress(tmp_path, flags)
    except build.BuildError as err:
        pytest.skip(f"this compiler cannot build with -fsanitize=address: {str(err)[-300:]}")
    out = _stress([str(driver), str(plugin), "200"], stress_files)
    # 200 rounds x 5 files x 3 interfaces; rules applied only from the good file, to the 16-rank communicator.
    assert out.startswith("inits=3000 calls=") and " applied=0 " not in out and " chunks=0 " not in out, out
    assert "log_lines=3000" in out


def test_thousands_of_calls_leak_nothing_under_valgrind(tmp_path, stress_files):
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed")
    plugin, driver = _compile_stress(tmp_path, [])
    out = _stress(["valgrind", "-q", "--leak-check=full", "--errors-for-leak-kinds=all", "--error-exitcode=3",
                   str(driver), str(plugin), "20"], stress_files)
    assert out.startswith("inits=300 calls=") and " applied=0 " not in out, out


# -- turning it on: lagom.runtime.init


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("NCCL_TUNER_PLUGIN", "LAGOM_NCCL_TUNER_FILE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE",
                "NCCL_NTHREADS", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    yield
    if runtime.current() is not None:
        runtime.current().close()


def test_init_points_nccl_at_the_plugin_and_a_rules_file_for_the_plan_then_close_removes_both(library, plan, clean_env):
    rt = init(plan)
    plugin, rules = os.environ["NCCL_TUNER_PLUGIN"], Path(os.environ["LAGOM_NCCL_TUNER_FILE"])
    assert Path(plugin) == nccl_tuner.path() and rt.tuner_env_set == {"NCCL_TUNER_PLUGIN": plugin,
                                                                      "LAGOM_NCCL_TUNER_FILE": str(rules)}
    assert rules.read_text() == emit.tuner_rules(plan) and rules == rt.tuner_rules_file
    assert emit.env_conflicts(plan, load_hardware(HW), os.environ) == []  # our own settings are no conflict
    rt.close()
    assert "NCCL_TUNER_PLUGIN" not in os.environ and "LAGOM_NCCL_TUNER_FILE" not in os.environ and not rules.exists()


@pytest.mark.parametrize("var, value", [("NCCL_TUNER_PLUGIN", "/opt/aws-ofi-nccl/libnccl-tuner.so"),
                                        ("NCCL_ALGO", "ring"), ("NCCL_PROTO", "Simple")])
def test_a_users_tuner_algorithm_or_protocol_is_a_conflict_and_wins(library, plan, clean_env, monkeypatch, caplog,
                                                                   var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        init(plan)
    with caplog.at_level(logging.INFO, logger="lagom.runtime"):
        rt = init(plan, strict_env=False)
    assert any(m.startswith(f"{var}={value} overrides the plan") for m in caplog.messages)
    assert rt.tuner_env_set == {} and rt.tuner_rules_file is None and os.environ[var] == value
    assert "LAGOM_NCCL_TUNER_FILE" not in os.environ and (var == "NCCL_TUNER_PLUGIN") == ("NCCL_TUNER_PLUGIN" in os.environ)
    rt.close()
    assert os.environ[var] == value


def test_a_rules_file_from_emit_for_the_same_plan_is_no_conflict_another_is(library, plan, clean_env, monkeypatch,
                                                                            tmp_path):
    hw = load_hardware(HW)
    same = tmp_path / "same.lagom"
    same.write_text(emit.tuner_rules(plan))
    env = emit.tuner_env(plan, same)
    assert env == {"NCCL_TUNER_PLUGIN": str(nccl_tuner.path()), "LAGOM_NCCL_TUNER_FILE": str(same.resolve())}
    assert emit.env_conflicts(plan, hw, env) == []
    other = tmp_path / "other.lagom"
    other.write_text(emit.tuner_rules(make_plan(plan.entries[:1])))
    assert emit.env_conflicts(plan, hw, {**env, "LAGOM_NCCL_TUNER_FILE": str(other)}) == [
        f"LAGOM_NCCL_TUNER_FILE={other} overrides the plan's tuner rules (that file is not this plan's)"]
    monkeypatch.setenv("LAGOM_NCCL_TUNER_FILE", str(same))
    rt = init(plan)  # the user's (identical) rules stand: Lagom only adds the plugin
    assert rt.tuner_env_set == {"NCCL_TUNER_PLUGIN": str(nccl_tuner.path())} and rt.tuner_rules_file is None
    assert os.environ["LAGOM_NCCL_TUNER_FILE"] == str(same)
    rt.close()
    monkeypatch.delenv("LAGOM_NCCL_TUNER_FILE")
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", str(nccl_tuner.path()))  # e.g. from a sourced nccl.env
    rt = init(plan)
    assert list(rt.tuner_env_set) == ["LAGOM_NCCL_TUNER_FILE"] and rt.tuner_rules_file is not None
    rt.close()
    assert os.environ["NCCL_TUNER_PLUGIN"] == str(nccl_tuner.path()) and "LAGOM_NCCL_TUNER_FILE" not in os.environ


def test_without_a_built_plugin_init_warns_once_and_sets_nothing(plan, clean_env, monkeypatch, caplog):
    monkeypatch.setattr(nccl_tuner, "path", lambda: None)
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", "/opt/other.so")  # nothing of ours to conflict with
    with caplog.at_level(logging.WARNING, logger="lagom.runtime"):
        rt = init(plan)
    assert rt.tuner_env_set == {} and "LAGOM_NCCL_TUNER_FILE" not in os.environ
    assert [m for m in caplog.messages if "tuner plugin" in m] == [nccl_tuner.UNAVAILABLE]
    assert emit.tuner_env(plan, "rules.lagom") == {}
    rt.close()


def test_a_plan_with_nothing_for_the_tuner_turns_nothing_on(library, clean_env):
    plan = make_plan([entry("ep", 8, 1, "all_to_all", 2 << 20),
                      entry("tp", 8, 1, "all_gather", 1 << 20, decomposition="p2p")], world_size=8)
    rt = init(plan)
    assert rt.tuner_env_set == {} and "NCCL_TUNER_PLUGIN" not in os.environ
    assert emit.tuner_env(plan, "rules.lagom") == {}
    rt.close()


def test_a_last_line_of_1023_characters_without_a_newline_is_read(v6, rules_file):
    rule = "allreduce 1 2000000 16 2 ring simple 4 524288"
    rules_file.write_text("lagom-nccl-tuner 1\nworld 16\n" + rule + " #" + "x" * (1023 - len(rule) - 2))
    comm = Comm(v6, 16, 2)
    _, channels = comm.coll_info("all_reduce", 1_000_000, cost_table())
    assert channels == 4 and comm.log[0][0] == LOG_INFO, comm.log
