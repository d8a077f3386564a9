"""The tuner plugin's live table: written privately, read whole by the plugin, refused when unsafe or wrong,
switched under concurrent getCollInfo calls (ThreadSanitizer, AddressSanitizer/UBSan)."""

from __future__ import annotations

import ctypes
import os
import stat
import subprocess
from pathlib import Path

import pytest

from lagom.nccl_tuner import build
from lagom.nccl_tuner.live import LiveTable, LiveTableError, PluginCounters, RuleChoice
from tests.test_nccl_tuner import Comm, TunerV6, compiler_or_skip, cost_table

LIVE_STRESS = Path(__file__).with_name("nccl_tuner_live_stress.c")
TABLE_A = "lagom-nccl-tuner 1\nworld 4\nallreduce 1 4294967296 4 1 ring simple 2 524288\n"
TABLE_B = "lagom-nccl-tuner 1\nworld 4\nallreduce 1 4294967296 4 1 tree ll 7 65536\n"


@pytest.fixture
def private_plugin(tmp_path: Path) -> Path:
    """A copy of the plugin of this test's own: the live table is per library instance, and other tests
    in this process use the installed one."""
    compiler_or_skip()
    return build.compile_plugin(tmp_path / "lib" / "live-plugin.so")


@pytest.fixture
def table(private_plugin: Path, tmp_path: Path):
    live = LiveTable.create(4, tmp_path, private_plugin)
    yield live
    live.close()


def test_put_writes_a_private_file_and_the_plugin_picks_from_it(table: LiveTable) -> None:
    assert table.lookup("all_reduce", 1 << 20, 4, 1) is None  # nothing in force yet: NCCL decides
    table.put(TABLE_A)
    assert stat.S_IMODE(table.directory.stat().st_mode) == 0o700 and stat.S_IMODE(table.path.stat().st_mode) == 0o600
    assert table.lookup("all_reduce", 1 << 20, 4, 1) == RuleChoice("ring", "simple", 2, 524288)
    assert table.lookup("all_reduce", 1 << 20, 8, 1) is None  # another communicator's rank count
    assert table.lookup("all_gather", 1 << 20, 4, 1) is None
    table.put(TABLE_B)
    assert table.lookup("all_reduce", 1 << 20, 4, 1) == RuleChoice("tree", "ll", 7, 65536)
    table.put("")  # no rules: every call back to NCCL
    assert table.lookup("all_reduce", 1 << 20, 4, 1) is None and table.generation == 3
    table.close()
    assert not table.directory.exists()


@pytest.mark.parametrize("text,reason", [
    ("lagom-nccl-tuner 1\nworld 8\n", "written for 8 ranks, this job has 4"),
    ("lagom-nccl-tuner 2\nworld 4\n", "format version 2"),
    ("lagom-nccl-tuner 1\nworld 4\nallreduce 1 2 4 1 ring bogus 2 524288\n", "unknown protocol 'bogus'"),
    ("lagom-nccl-tuner 1\nworld 4\nallreduce 1 2 4 1 ring simple 2 100\n", "below simple's grain"),
])
def test_a_bad_table_is_refused_and_the_one_in_force_stays(table: LiveTable, text: str, reason: str) -> None:
    table.put(TABLE_A)
    with pytest.raises(LiveTableError, match=reason):
        table.put(text)
    assert table.lookup("all_reduce", 1 << 20, 4, 1) == RuleChoice("ring", "simple", 2, 524288)


def test_a_table_others_could_write_or_own_is_refused(table: LiveTable) -> None:
    table.put(TABLE_A)
    table.path.write_text(TABLE_B)
    os.chmod(table.path, 0o666)
    with pytest.raises(LiveTableError, match="writable by group or others"):
        table.stage_file(table.path)
    os.chmod(table.path, 0o600)
    if os.geteuid() == 0:  # root can hand the file to another user, as an attacker's file would be
        os.chown(table.path, 65534, 65534)
        with pytest.raises(LiveTableError, match="owned by another user"):
            table.stage_file(table.path)
    link = table.directory / "link.lagom"
    link.symlink_to(table.path)
    table.path = link
    with pytest.raises(LiveTableError, match="cannot open"):
        table.stage_file(table.path)
    assert table.lookup("all_reduce", 1 << 20, 4, 1) == RuleChoice("ring", "simple", 2, 524288)


def test_a_missing_table_is_refused(table: LiveTable) -> None:
    with pytest.raises(LiveTableError, match="cannot open"):
        table.stage_file(table.path)


def test_a_staged_table_is_in_force_only_once_published(table: LiveTable) -> None:
    """The two phases of a switch: staging parses and holds a table (the one in force stays); publishing puts
    it in force; a refused stage or a discard keeps the table in force; staging None stages the start rules."""
    table.put(TABLE_A)
    table.stage(TABLE_B)
    assert table.lookup("all_reduce", 1 << 20, 4, 1) == RuleChoice("ring", "simple", 2, 524288)
    assert table.publish()
    assert table.lookup("all_reduce", 1 << 20, 4, 1) == RuleChoice("tree", "ll", 7, 65536)
    assert not table.publish()  # nothing staged: nothing changes
    table.stage(TABLE_A)
    table.discard()
    assert not table.publish() and table.lookup("all_reduce", 1 << 20, 4, 1).algorithm == "tree"
    table.stage(TABLE_A)
    with pytest.raises(LiveTableError, match="written for 8 ranks"):  # a refusal drops what was staged before
        table.stage("lagom-nccl-tuner 1\nworld 8\n")
    assert not table.publish() and table.lookup("all_reduce", 1 << 20, 4, 1).algorithm == "tree"
    table.stage(None)
    assert table.publish() and table.lookup("all_reduce", 1 << 20, 4, 1) is None  # the start rules again


def test_counters_count_nccls_calls_and_the_rules_applied_not_lagoms_lookups(table: LiveTable,
                                                                                private_plugin: Path) -> None:
    """A job learns from the counters whether NCCL consults the plugin: inits and getCollInfo calls made as NCCL
    makes them are counted, and those a rule was applied to; Lagom's own lookups are not."""
    table.put(TABLE_A)
    table.lookup("all_reduce", 1 << 20, 4, 1)
    assert table.counters() == PluginCounters(0, 0, 0)
    tuner = TunerV6.in_dll(ctypes.CDLL(str(private_plugin)), "ncclTunerPlugin_v6")
    comm = Comm(tuner, 4, 1)
    comm.coll_info("all_reduce", 1 << 20, cost_table())  # the live rule applies
    comm.coll_info("all_gather", 1 << 20, cost_table())  # no rule: NCCL decides
    comm.close()
    assert table.counters() == PluginCounters(1, 2, 1)
    assert table.counters().since(PluginCounters(1, 1, 0)) == PluginCounters(0, 1, 1)


def _stress(tmp_path: Path, flags: list[str], threads: int, calls: int, reloads: int) -> str:
    compiler_or_skip()
    plugin = build.compile_plugin(tmp_path / "plugin.so", [*flags, "-g", "-Werror"])
    try:
        driver = build.compile_driver(LIVE_STRESS, tmp_path / "live-stress", [build.SOURCE_DIR],
                                      ["-g", "-O1", "-Werror", *flags])
    except build.BuildError as err:
        pytest.skip(f"this compiler cannot build with {flags}: {str(err)[-300:]}")
    a, b = tmp_path / "a.lagom", tmp_path / "b.lagom"
    a.write_text(TABLE_A)
    b.write_text(TABLE_B)
    a.chmod(0o600)
    b.chmod(0o600)
    done = subprocess.run([str(driver), str(plugin), str(a), str(b), str(threads), str(calls), str(reloads)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_tables_switched_under_concurrent_calls_are_seen_whole(tmp_path: Path, sanitizer: str) -> None:
    out = _stress(tmp_path, [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"],
                  threads=4, calls=20_000, reloads=2_000)
    fields = dict(zip(out.split()[::2], out.split()[1::2]))
    assert fields["mixed"] == "0" and int(fields["a"]) > 0 and int(fields["b"]) > 0, out
