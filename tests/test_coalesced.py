"""Coalesced collectives are recorded as NCCL runs them (issue 28, item 6).

NCCL plans a group's collectives of one function, op and type in aggregates (each under 4x the
bytes of its smallest) and asks the tuner once per aggregate, at its total size; per-tensor records
would give keys NCCL never sees. The rule alone, then real coalesced operations on 2 gloo ranks
through the torch.distributed tap.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lagom.step.calls import nccl_aggregates
from tests.distributed import run_ranks


@pytest.mark.parametrize("sizes,calls", [
    ([100], [(100, 1)]),
    ([100, 399], [(499, 2)]),  # under 4x: one call
    ([100, 400], [(100, 1), (400, 1)]),  # exactly 4x: NCCL's test is strict
    ([400, 100, 250, 1000, 3000], [(350, 2), (1400, 2), (3000, 1)]),  # smallest first, whatever the issue order
    ([8, 8, 8], [(24, 3)]),
    ([], []),
])
def test_nccl_aggregates(sizes: list[int], calls: list[tuple[int, int]]) -> None:
    assert nccl_aggregates(sizes) == calls


def coalesced_ops(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import _coalescing_manager

    from lagom.runtime.apply import torch_tap
    from lagom.runtime.apply.recorder import Recorder

    rec = Recorder(cuda=False)
    sub = torch_tap.subscribe(lambda group: "dp", rec)
    assert sub is not None
    rec.begin_step(0)
    small, near, far = torch.ones(10), torch.full((30,), 2.0), torch.ones(200)
    with _coalescing_manager(async_ops=True) as group_of_calls:
        for t in (far, small, near):
            dist.all_reduce(t, async_op=True)
    group_of_calls.wait()
    # all-gathers of two types: NCCL moves them as bytes, one aggregate
    outputs = [torch.zeros(2 * 10), torch.zeros(2 * 10, dtype=torch.float64)]
    with _coalescing_manager(async_ops=True) as gathers:
        for out in outputs:
            dist.all_gather_into_tensor(out, torch.full((10,), float(rank), dtype=out.dtype), async_op=True)
    gathers.wait()
    records = rec.end_step()
    sub.close()
    return {"calls": [(r.collective, r.nbytes, r.tensors) for r in records],
            "sums": [small[0].item(), near[0].item(), far[0].item()]}


def test_a_coalesced_operation_is_recorded_per_nccl_aggregate() -> None:
    for out in run_ranks(coalesced_ops, 2):
        # 40 B and 120 B join (120 < 4 x 40); 800 B is over 4x the smallest: a call of its own
        assert sorted(out["calls"][:2]) == [("all_reduce", 160, 2), ("all_reduce", 800, 1)]
        assert out["calls"][2:] == [("all_gather", 80 + 160, 2)]
        assert out["sums"] == [2.0, 4.0, 2.0]  # the job's results, as torch computed them


def deepspeed_coalesced(rank: int, world: int) -> dict[str, Any]:
    """DeepSpeed's own coalesced all-reduce, through Lagom's tap on its comm backend."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from lagom.runtime.apply.recorder import Recorder
    from lagom_deepspeed.comm import subscribe
    from lagom_deepspeed.groups import GroupNames

    deepspeed.init_distributed(dist_backend="gloo")
    sub = subscribe(GroupNames.for_job(torch.nn.Linear(2, 2), None, world))
    rec = Recorder(cuda=False)
    sub.attach(rec)
    tensors = [torch.ones(200), torch.ones(10), torch.full((30,), 2.0)]
    rec.begin_step(0)
    work = ds_comm.cdb.all_reduce_coalesced(tensors, async_op=True)
    if work is not None:
        work.wait()
    records = rec.end_step()
    sub.close()
    return {"calls": sorted((r.collective, r.nbytes, r.tensors) for r in records),
            "sums": [t[0].item() for t in tensors]}


def test_deepspeeds_coalesced_all_reduce_is_recorded_per_nccl_aggregate() -> None:
    pytest.importorskip("deepspeed")
    for out in run_ranks(deepspeed_coalesced, 2):
        assert out["calls"] == [("all_reduce", 160, 2), ("all_reduce", 800, 1)]
        assert out["sums"] == [2.0, 2.0, 4.0]
