"""The torch.distributed tap (lagom.runtime.apply.torch_tap) on 2 real gloo ranks, and with megatron-core.

One spawn runs it all: every collective kind torch.distributed offers, issued under its public
names (aliases included), recorded once with its group's plan name and Lagom's byte convention;
async handles come back as torch made them; claimed calls, calls outside a step and groups of one
rank are left out; two sessions share the tap; closing the last removes every hook and puts torch's
group registration back. With real megatron-core groups and the Interceptor installed, calls made
through megatron-core's mappings are recorded once (by the Interceptor), and a Transformer-Engine-style
direct torch.distributed call on the tensor-parallel group is recorded by the tap as ``tp``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from lagom.runtime.apply.torch_tap import KINDS, call_sizes
from tests.distributed import run_ranks


def _all_kinds(rank: int, pair: Any, solo: Any) -> dict[str, Any]:
    """Each kind once; returns what the calls computed, for the numerics check."""
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from lagom.runtime.apply.torch_tap import claimed

    peer = 1 - rank
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)  # dp/all_reduce/16, synchronous
    handle = dist.all_reduce(t, group=pair, async_op=True)  # tp/all_reduce/16
    out: dict[str, Any] = {"handle_is_torch_work": isinstance(handle, dist.Work)}
    handle.wait()
    out["all_reduce"] = t.tolist()
    gathered = torch.zeros(8)
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank)), group=pair)  # tp/all_gather/32
    out["all_gather"] = gathered.tolist()
    dist._all_gather_base(gathered, t)  # dp/all_gather/32
    dist.all_gather([torch.zeros(4), torch.zeros(4)], t)  # dp/all_gather/32 (list form: one call)
    scattered = torch.zeros(2)
    dist.reduce_scatter_tensor(scattered, torch.arange(4.0))  # dp/reduce_scatter/16
    out["reduce_scatter"] = scattered.tolist()
    dist._reduce_scatter_base(scattered, t)  # dp/reduce_scatter/16
    dist.reduce_scatter(scattered, [torch.ones(2), torch.ones(2)])  # dp/reduce_scatter/16 (list form)
    dist.all_to_all_single(torch.zeros(4), t)  # dp/all_to_all/16
    dist.all_to_all([torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)])  # dp/all_to_all/16
    dist.broadcast(t, src=0)  # dp/broadcast/16
    dist.reduce(t, dst=0)  # dp/reduce/16
    if rank == 0:
        dist.send(t, 1)  # dp/send_recv/16
        dist.irecv(torch.zeros(4), 1).wait()  # dp/recv/16
    else:
        dist.recv(torch.zeros(4), 0)
        dist.isend(t, 0).wait()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, group_peer=peer, group=pair),
                                    dist.P2POp(dist.irecv, torch.zeros(4), group_peer=peer, group=pair)])
    for work in works:
        work.wait()  # tp/send_recv/16, tp/recv/16
    with _coalescing_manager(pair, async_ops=True) as coalesced:  # one operation, one NCCL call: tp/all_reduce/40
        dist.all_reduce(torch.ones(4), group=pair, async_op=True)
        dist.all_reduce(torch.ones(6), group=pair, async_op=True)
    coalesced.wait()
    dist.all_reduce(t, group=solo)  # one rank: moves nothing, not recorded
    with claimed:
        dist.all_reduce(t)  # an adapter layer's call: not recorded here
    return out


def expected_all_kinds(rank: int) -> list[tuple[str, str, int]]:
    first, second = ("send_recv", "recv") if rank == 0 else ("recv", "send_recv")
    return [("dp", "all_reduce", 16), ("tp", "all_reduce", 16), ("tp", "all_gather", 32), ("dp", "all_gather", 32),
            ("dp", "all_gather", 32), ("dp", "reduce_scatter", 16), ("dp", "reduce_scatter", 16),
            ("dp", "reduce_scatter", 16), ("dp", "all_to_all", 16), ("dp", "all_to_all", 16),
            ("dp", "broadcast", 16), ("dp", "reduce", 16), ("dp", first, 16), ("dp", second, 16),
            ("tp", "send_recv", 16), ("tp", "recv", 16), ("tp", "all_reduce", 40)]


def _calls(records: list) -> list[tuple[str, str, int]]:
    return [(r.group, r.collective, r.nbytes) for r in records]


def torch_only(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from lagom.runtime.apply import torch_tap
    from lagom.runtime.apply.recorder import Recorder

    registration = distributed_c10d._register_pg_in_world
    names: dict[int, str] = {id(dist.group.WORLD): "dp"}
    rec = Recorder(cuda=False)
    first = torch_tap.subscribe(lambda group: names[id(group)], rec)
    pair = dist.new_group([0, 1])  # made after the tap is in: hooked on registration
    names[id(pair)] = "tp"
    solos = [dist.new_group([r]) for r in range(world)]
    out: dict[str, Any] = {}

    rec.begin_step(1)
    out["numerics"] = _all_kinds(rank, pair, solos[rank])
    records = rec.end_step()
    out["calls"] = _calls(records)
    out["timed"] = all(r.end_s >= r.start_s >= 0 for r in records)
    out["exact"] = {(r.collective, r.exact) for r in records}
    dist.all_reduce(torch.ones(1))  # between steps (Lagom's own agreement calls are made here)
    out["between_steps"] = _calls(rec.end_step())

    # a blocking call is timed to its end: rank 0's all-reduce waits for rank 1, which comes 0.2 s late
    rec.begin_step(2)
    if rank == 1:
        time.sleep(0.2)
    dist.all_reduce(torch.ones(1))
    out["late_peer"] = [(r.collective, r.exact, r.duration_s) for r in rec.end_step()]

    # two sessions: the active one takes its calls, both take calls outside any active() block
    rec_two = Recorder(cuda=False)
    second = torch_tap.subscribe(lambda group: names[id(group)], rec_two)
    tap = torch_tap.current_tap()
    out["one_tap"] = tap is not None and second.tap is first.tap is tap

    def step(work: Any, *recorders: Recorder) -> list[list[tuple[str, str, int]]]:
        for r in recorders:
            r.begin_step(2)
        work()
        return [_calls(r.end_step()) for r in recorders]

    with second.active():
        out["second_active"] = step(lambda: dist.all_reduce(torch.ones(3)), rec, rec_two)
    out["both"] = step(lambda: dist.all_reduce(torch.ones(5), group=pair), rec, rec_two)
    first.close()
    first.close()  # idempotent
    out["after_first_close"] = step(lambda: dist.all_reduce(torch.ones(2)), rec, rec_two)
    second.close()
    out["tap_after_last_close"] = torch_tap.current_tap() is not None
    out["registration_restored"] = distributed_c10d._register_pg_in_world is registration
    # the closed tap's hooks are gone from every group: a recorder put on it now hears nothing
    probe = Recorder(cuda=False)
    tap.subscriptions.append(torch_tap.Subscription(tap, lambda group: "probe", probe))  # type: ignore[union-attr]
    out["after_last_close"] = step(lambda: (dist.all_reduce(torch.ones(2)), dist.all_reduce(torch.ones(2), group=pair)),
                                   probe, rec, rec_two)
    # a later session hooks the groups again, once
    again = torch_tap.subscribe(lambda group: names[id(group)], rec)
    out["resubscribed"] = step(lambda: dist.all_reduce(torch.ones(2), group=pair), rec)
    again.close()
    return out


def with_megatron(rank: int, world: int) -> dict[str, Any]:
    torch.cuda.current_device = lambda: "cpu"  # megatron-core on gloo (see FRAMEWORKS.md)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from lagom.runtime.apply import torch_tap
    from lagom.runtime.apply.recorder import Recorder
    from lagom_megatron.intercept import Interceptor

    parallel_state.initialize_model_parallel(2, 1)  # tp = both ranks, dp = one rank
    tp = parallel_state.get_tensor_model_parallel_group()
    rec = Recorder(cuda=False)
    interceptor = Interceptor(rec).install()
    rec.begin_step(0)
    local = torch.full((2, 3, 4), float(rank + 1))
    mappings.gather_from_sequence_parallel_region(local)  # megatron-core: tp/all_gather/192
    mappings.reduce_scatter_to_sequence_parallel_region(torch.ones(4, 3, 4))  # tp/reduce_scatter/192
    mappings.reduce_from_tensor_model_parallel_region(local.clone())  # tp/all_reduce/96
    mappings.all_to_all(tp, torch.ones(4, 3))  # torch.distributed directly inside megatron-core: tp/all_to_all/48
    # what Transformer Engine's layers do: torch.distributed on megatron's TP group, async
    gathered = torch.empty(4, 3, 4)
    handle = dist.all_gather_into_tensor(gathered, local, group=tp, async_op=True)  # tp/all_gather/192
    handle.wait()
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())  # one rank: nothing to record
    calls = _calls(rec.end_step())
    interceptor.uninstall()
    out = {"calls": calls, "gathered": gathered[:, 0, 0].tolist(), "tap_after_uninstall": torch_tap.current_tap()}
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return run_ranks(_both, 2)


def _both(rank: int, world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    return torch_only(rank, world), with_megatron(rank, world)


def test_every_collective_kind_is_recorded_once_with_its_group_and_bytes(ranks: list) -> None:
    for rank, (out, _) in enumerate(ranks):
        assert out["calls"] == expected_all_kinds(rank)
        assert out["timed"]
        # gloo gives reduce-scatter and p2p works no future: those end with the step (an upper bound) unless
        # they block (torch issues send and recv as async operations and waits for them itself)
        inexact = {c for c, exact in out["exact"] if not exact}
        assert inexact <= {"send_recv", "recv"} and {("all_reduce", True), ("reduce_scatter", True)} <= out["exact"]
        [(collective, exact, seconds)] = out["late_peer"]
        assert collective == "all_reduce" and exact
        assert (seconds > 0.15) if rank == 0 else (seconds < 0.15), seconds


def test_recording_leaves_results_and_handles_as_torch_made_them(ranks: list) -> None:
    for rank, (out, _) in enumerate(ranks):
        numerics = out["numerics"]
        assert numerics["handle_is_torch_work"]
        assert numerics["all_reduce"] == [6.0] * 4  # (1 + 2), then summed again over the pair
        assert numerics["all_gather"] == [0.0] * 4 + [1.0] * 4
        assert numerics["reduce_scatter"] == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])


def test_only_calls_inside_a_step_are_recorded(ranks: list) -> None:
    for out, _ in ranks:
        assert out["between_steps"] == []


def test_sessions_share_one_tap_and_the_active_one_takes_its_calls(ranks: list) -> None:
    for out, _ in ranks:
        assert out["one_tap"]
        assert out["second_active"] == [[], [("dp", "all_reduce", 12)]]
        assert out["both"] == [[("tp", "all_reduce", 20)]] * 2
        assert out["after_first_close"] == [[], [("dp", "all_reduce", 8)]]


def test_closing_the_last_session_removes_every_hook(ranks: list) -> None:
    for out, _ in ranks:
        assert not out["tap_after_last_close"] and out["registration_restored"]
        assert out["after_last_close"] == [[], [], []]
        assert out["resubscribed"] == [[("tp", "all_reduce", 8)]]


def test_megatron_mappings_once_and_transformer_engine_style_calls_by_the_tap(ranks: list) -> None:
    for _, out in ranks:
        assert out["calls"] == [("tp", "all_gather", 192), ("tp", "reduce_scatter", 192), ("tp", "all_reduce", 96),
                                ("tp", "all_to_all", 48), ("tp", "all_gather", 192)]
        assert out["gathered"] == [1.0, 1.0, 2.0, 2.0]
        assert out["tap_after_uninstall"] is None


@pytest.mark.parametrize("kind,inputs,outputs,sizes", [
    ("ALLREDUCE", [4], [], [(16, 1)]),
    ("ALLREDUCE", [4, 6], [], [(40, 2)]),  # coalesced: one NCCL aggregate of both
    ("ALLGATHER", [4], [8], [(32, 1)]),
    ("ALLGATHER", [4], [4, 4], [(32, 1)]),  # list form: one call, the gathered bytes
    ("ALLGATHER", [2, 3], [4, 6], [(40, 2)]),  # coalesced all_gather_single: one NCCL aggregate
    ("REDUCE_SCATTER", [2, 2], [2], [(16, 1)]),  # list form: the unreduced input
    ("REDUCE_SCATTER", [8, 4], [4, 2], [(48, 2)]),  # coalesced reduce_scatter_single
    ("ALLTOALL", [2, 2], [2, 2], [(16, 1)]),  # list form is one call
    ("BROADCAST", [], [4], [(16, 1)]),  # the buffer, on whichever side it comes
    ("SEND", [4], [], [(16, 1)]),
    ("RECV", [], [4], [(16, 1)]),
    # torch 2.15's own names for the tensor and coalesced forms
    ("ALLGATHER_BASE", [4], [8], [(32, 1)]),
    ("ALLGATHER_INTO_TENSOR_COALESCED", [2, 3], [4, 6], [(40, 2)]),
    ("REDUCE_SCATTER_BASE", [4], [2], [(16, 1)]),
    ("REDUCE_SCATTER_TENSOR_COALESCED", [8, 4], [4, 2], [(48, 2)]),
    ("ALLREDUCE_COALESCED", [1, 3, 16], [], [(16, 2), (64, 1)]),  # 64 B: over 4x the smallest, a call of its own
    ("ALLREDUCE_COALESCED", [3, 5], [], [(32, 2)]),
    ("ALLTOALL_BASE", [4], [4], [(16, 1)]),
])
def test_call_sizes(kind: str, inputs: list[int], outputs: list[int], sizes: list[tuple[int, int]]) -> None:
    as_tensors = [torch.zeros(n) for n in inputs], [torch.zeros(n) for n in outputs]
    assert call_sizes(KINDS[kind], *as_tensors) == sizes
