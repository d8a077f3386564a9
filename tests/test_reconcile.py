"""The modelled step reconciled with measured calls (lagom.model.reconcile): calls no key matched become keys placed
by their measured times, keys nothing called are dropped, and the coverage before and after is exact."""

from __future__ import annotations

from pathlib import Path

from lagom.hardware import load_hardware
from lagom.model.reconcile import coverage, reconcile
from lagom.model.simulator import Simulator
from lagom.search.base import Problem, nccl_configs
from lagom.step.calls import CallRecord
from lagom.step.points import points_for
from lagom.step.workload import load_workload
from tests.helpers import gpt_workload, write_yaml


def graph_and_hw(tmp_path: Path):
    wl = load_workload(write_yaml(tmp_path / "w.yaml", gpt_workload(
        parallel={"tp": 1, "dp": 8, "sequence_parallel": False}, framework={"name": "deepspeed"})))
    hw = load_hardware("a100-8x-100g")
    return points_for(wl, hw), hw


def record(group: str, collective: str, nbytes: int, start: float, end: float, seq: int, step: int = 3) -> CallRecord:
    return CallRecord(group, collective, nbytes, seq, step, start, end)


def test_unmatched_calls_become_keys_placed_by_their_times_and_uncalled_keys_go(tmp_path: Path) -> None:
    graph, hw = graph_and_hw(tmp_path)
    modelled = list(graph.keys())
    kept = modelled[0]
    group, collective, size = kept.split("/")
    records = [record(group, collective, int(size), 0.80, 0.85, 0),  # a modelled key: it stays
               record("dp", "all_reduce", 3_000_000, 0.50, 0.70, 1),  # no modelled key near it: a new one
               record("dp", "all_reduce", 3_000_000, 0.90, 0.99, 2),  # its second call of the step
               record("world", "all_gather", 1024, 0.05, 0.06, 3),  # a group the model lacks, named by its ranks
               record("dp", "gather", 64, 0.1, 0.2, 4)]  # a collective the model has no notion of
    out = reconcile(graph, hw, records, {3: 1.0})
    keys = out.graph.keys()
    assert kept in keys and "dp/all_reduce/3000000" in keys and "world/all_gather/1024" in keys
    assert len(keys["dp/all_reduce/3000000"]) == 2  # once per call of the step
    assert set(out.dropped) == set(modelled) - {kept} and not set(out.dropped) & set(keys)
    assert out.unplanned == ["dp/gather/64"]
    assert out.before.calls == 1 / 5 and out.after.calls == 4 / 5
    total = sum(r.nbytes for r in records)
    assert out.before.bytes == int(size) / total and out.after.bytes == (total - 64) / total
    assert out.graph.groups["world"].size == hw.cluster.world_size
    segments = [s.name for ph in out.graph.phases for seg in ph.segments.values() for s in seg]
    first, second = keys["dp/all_reduce/3000000"]
    assert first.after in segments and second.after in segments
    assert segments.index(first.after) < segments.index(second.after)  # placed in the order they ran
    # the reconciled graph is a problem the simulator runs
    problem = Problem(out.graph, hw)
    assert Simulator(problem.graph).run(nccl_configs(problem), problem.model).step_s > 0


def test_coverage_counts_calls_and_bytes_within_the_size_tolerance() -> None:
    records = [record("dp", "all_reduce", 1000, 0, 0, 0), record("dp", "all_reduce", 3000, 0, 0, 1)]
    assert coverage(["dp/all_reduce/1020"], records).calls == 0.5
    assert coverage(["dp/all_reduce/1020"], records).bytes == 0.25
    assert coverage([], []).calls == 1.0


def test_a_key_called_in_another_step_only_is_placed_from_that_step(tmp_path: Path) -> None:
    graph, hw = graph_and_hw(tmp_path)
    records = [record("dp", "all_reduce", 3_000_000, 0.5, 0.6, 0, step=3),
               record("dp", "all_reduce", 3_000_000, 0.5, 0.6, 0, step=4),
               record("dp", "all_gather", 777_000, 0.2, 0.3, 1, step=4)]  # a prefetch that step 3 did not issue
    records += [record("dp", "broadcast", 880, 0.1, 0.12, 2, step=4),  # ZeRO-3's, or a pipeline's loss
                record("dp", "recv", 3_000_000, 0.5, 0.6, 3, step=4)]  # the receiving half of a send_recv
    records += [record("dp", "send_recv", 3_000_000, 0.5, 0.6, 4, step=4)]
    out = reconcile(graph, hw, records, {3: 1.0, 4: 1.0})
    keys = out.graph.keys()
    assert len(keys["dp/all_reduce/3000000"]) == 1 and len(keys["dp/all_gather/777000"]) == 1
    assert len(keys["dp/broadcast/880"]) == 1 and len(keys["dp/send_recv/3000000"]) == 1  # a receive adds no point
    assert "dp/recv/3000000" not in keys and out.after.calls == 1.0 and out.after.bytes == 1.0
    problem = Problem(out.graph, hw)
    assert Simulator(problem.graph).run(nccl_configs(problem), problem.model).step_s > 0
