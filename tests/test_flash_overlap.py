"""Flash-Overlap operators against plain collectives, on real gloo ranks (world sizes 1 to 4).

Spawning process groups dominates the run time, so each world size is spawned once: ``_on_rank`` runs
every case and returns plain numbers and recorded schedules, and the tests below assert on them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from lagom.flash_overlap import (
    FlashOverlapConfig,
    Step,
    all_gather,
    all_gather_matmul,
    matmul_reduce_scatter,
    record_schedule,
    reduce_scatter,
)
from lagom.flash_overlap.ring import Ring
from tests.distributed import run_ranks

WORLDS = (1, 2, *(pytest.param(w, marks=pytest.mark.slow) for w in (3, 4)))  # 3 and 4 ranks: CI's slower tier
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
CHUNKS = (1, 2, 3)


# ---------------------------------------------------------------- references (plain collectives)

def _gathered(t: torch.Tensor, world: int) -> torch.Tensor:
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous())
    return out


def _scattered(t: torch.Tensor, world: int) -> torch.Tensor:
    out = t.new_empty((t.shape[0] // world, *t.shape[1:]))
    dist.reduce_scatter_tensor(out, t.contiguous())
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's scale; inf on a shape or dtype mismatch."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=gen).requires_grad_()


# ---------------------------------------------------------------- cases run on every rank

def _linear_cases(rank: int, world: int, dtype: torch.dtype, gen: torch.Generator) -> dict[str, float]:
    errors: dict[str, float] = {}
    for chunks in CHUNKS:
        # column parallel: 5 rows per shard, so chunks 2 and 3 are uneven
        x, w = _leaf((5, 2, 6), dtype, gen), _leaf((7, 6), dtype, gen)
        grad = torch.randn((5 * world, 2, 7), dtype=dtype, generator=gen)
        y = all_gather_matmul(x, w, num_chunks=chunks)
        y.backward(grad)
        gathered = _gathered(x.detach(), world)
        key = f"all_gather_matmul {dtype} chunks={chunks}"
        errors[key + " out"] = _error(y.detach(), gathered @ w.detach().t())
        errors[key + " grad_x"] = _error(x.grad, _scattered(grad @ w.detach(), world))
        errors[key + " grad_w"] = _error(w.grad, _flat(grad).t() @ _flat(gathered))

        # row parallel: 4 rows per rank's block, so chunks 3 is uneven
        x, w = _leaf((4 * world, 2, 6), dtype, gen), _leaf((7, 6), dtype, gen)
        grad = torch.randn((4, 2, 7), dtype=dtype, generator=gen)
        y = matmul_reduce_scatter(x, w, config=FlashOverlapConfig(num_chunks=chunks))
        y.backward(grad)
        grad_full = _gathered(grad, world)
        key = f"matmul_reduce_scatter {dtype} chunks={chunks}"
        errors[key + " out"] = _error(y.detach(), _scattered(x.detach() @ w.detach().t(), world))
        errors[key + " grad_x"] = _error(x.grad, grad_full @ w.detach())
        errors[key + " grad_w"] = _error(w.grad, _flat(grad_full).t() @ _flat(x.detach()))

    x, w = _leaf((3, 6), dtype, gen), _leaf((7, 6), dtype, gen)  # only the weight trains
    x.requires_grad_(False)
    all_gather_matmul(x, w).sum().backward()
    errors[f"all_gather_matmul {dtype} weight-only grad_w"] = _error(
        w.grad, torch.ones(3 * world, 7, dtype=dtype).t() @ _gathered(x, world))
    return errors


def _collective_cases(rank: int, world: int, dtype: torch.dtype,
                      gen: torch.Generator) -> tuple[dict[str, float], dict[str, list[int]]]:
    errors: dict[str, float] = {}
    orders: dict[str, list[int]] = {}
    for chunks in CHUNKS:
        bucket = torch.randn(10, dtype=dtype, generator=gen)  # a flat bucket, 10 rows per shard
        seen: list[int] = []
        shard_errors: list[float] = []
        reference = _gathered(bucket, world)

        def on_shard(src: int, shard: torch.Tensor) -> None:
            seen.append(src)
            shard_errors.append(_error(shard, reference[src * 10:(src + 1) * 10]))

        errors[f"all_gather {dtype} chunks={chunks}"] = _error(
            all_gather(bucket, on_shard=on_shard, num_chunks=chunks), reference)
        errors[f"all_gather {dtype} chunks={chunks} shards"] = max(shard_errors)
        orders[f"all_gather chunks={chunks}"] = seen

        bucket = torch.randn(6 * world, 3, dtype=dtype, generator=gen)
        errors[f"reduce_scatter {dtype} chunks={chunks}"] = _error(
            reduce_scatter(bucket, num_chunks=chunks), _scattered(bucket, world))
        asked: list[int] = []
        filled = torch.empty_like(bucket)

        def produce_shard(dst: int) -> torch.Tensor:
            asked.append(dst)
            block = filled[dst * 6:(dst + 1) * 6]
            return block.copy_(bucket[dst * 6:(dst + 1) * 6] * 2)

        errors[f"reduce_scatter produce_shard {dtype} chunks={chunks}"] = _error(
            reduce_scatter(filled, produce_shard=produce_shard, num_chunks=chunks), _scattered(bucket * 2, world))
        orders[f"reduce_scatter produce_shard chunks={chunks}"] = asked
    return errors, orders


def _error_cases(world: int) -> dict[str, str]:
    """The message of each bad call, or 'no error'; every rank raises before any transfer."""
    cases: dict[str, Callable[[], Any]] = {
        "rows exceed chunks": lambda: all_gather_matmul(torch.randn(2, 4), torch.randn(3, 4), num_chunks=3),
        "weight layout": lambda: all_gather_matmul(torch.randn(2, 4), torch.randn(4, 3)),
        "produce_shard shape": lambda: reduce_scatter(torch.zeros(2 * world, 3),
                                                      produce_shard=lambda dst: torch.zeros(3, 3)),
        "bad config": lambda: FlashOverlapConfig(num_chunks=0),
    }
    if world > 1:
        cases |= {
            "row parallel rows": lambda: matmul_reduce_scatter(torch.randn(2 * world + 1, 4), torch.randn(3, 4)),
            "reduce_scatter rows": lambda: reduce_scatter(torch.zeros(world + 1, 2)),
        }
    messages = {}
    for name, call in cases.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    return messages


def _schedules(world: int) -> dict[str, list[Step]]:
    gen = torch.Generator().manual_seed(0)
    with record_schedule() as column:
        all_gather_matmul(_leaf((4, 3), torch.float64, gen), _leaf((5, 3), torch.float64, gen),
                          num_chunks=2).sum().backward()
    with record_schedule() as row:
        matmul_reduce_scatter(_leaf((4 * world, 3), torch.float64, gen), _leaf((5, 3), torch.float64, gen),
                              num_chunks=2).sum().backward()
    return {"column": column, "row": row}


def _on_rank(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # ranks share two cores
    gen = torch.Generator().manual_seed(1000 + rank)
    errors: dict[str, float] = {}
    orders: dict[str, list[int]] = {}
    for dtype in TOLERANCE:
        errors |= _linear_cases(rank, world, dtype, gen)
        more_errors, more_orders = _collective_cases(rank, world, dtype, gen)
        errors |= more_errors
        orders |= more_orders
    return {"errors": errors, "orders": orders, "raised": _error_cases(world), "schedules": _schedules(world)}


@cache
def _results(world: int) -> list[dict[str, Any]]:
    return run_ranks(_on_rank, world)


# ---------------------------------------------------------------- exactness

@pytest.mark.parametrize("world", WORLDS)
def test_every_operator_matches_its_reference(world: int) -> None:
    for rank, result in enumerate(_results(world)):
        for case, error in result["errors"].items():
            tol = TOLERANCE[torch.float64 if "float64" in case else torch.float32]
            assert error <= tol, f"world {world} rank {rank}: {case} off by {error:.3g} (tolerance {tol})"
        assert len(result["errors"]) == 2 * (6 * len(CHUNKS) + 1 + 4 * len(CHUNKS))


@pytest.mark.parametrize("world", WORLDS)
def test_callbacks_see_shards_in_schedule_order(world: int) -> None:
    for rank, result in enumerate(_results(world)):
        gather_order = [(rank - o) % world for o in range(world)]
        scatter_order = [(rank + o) % world for o in range(1, world)] + [rank]
        for chunks in CHUNKS:
            assert result["orders"][f"all_gather chunks={chunks}"] == gather_order
            assert result["orders"][f"reduce_scatter produce_shard chunks={chunks}"] == scatter_order


@pytest.mark.parametrize("world", WORLDS)
def test_bad_shapes_raise_a_value_error_naming_the_shape(world: int) -> None:
    expected = {
        "rows exceed chunks": "(2, 4)",
        "weight layout": "(4, 3)",
        "produce_shard shape": "(3, 3)",
        "bad config": "num_chunks",
        "row parallel rows": f"({2 * world + 1}, 4)",
        "reduce_scatter rows": f"({world + 1}, 2)",
    }
    for result in _results(world):
        assert result["raised"], "no error case ran"
        for case, message in result["raised"].items():
            assert expected[case] in message, f"{case}: {message}"


def test_without_torch_distributed_it_is_plain_compute() -> None:
    assert not dist.is_initialized()
    x, w = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    with record_schedule() as steps:
        torch.testing.assert_close(all_gather_matmul(x, w, num_chunks=2), x @ w.t(), rtol=0, atol=0)
        torch.testing.assert_close(matmul_reduce_scatter(x, w), x @ w.t(), rtol=0, atol=0)
        torch.testing.assert_close(all_gather(x), x, rtol=0, atol=0)
        torch.testing.assert_close(reduce_scatter(x), x, rtol=0, atol=0)
    assert {s.kind for s in steps} == {"compute"}
    assert reduce_scatter(x).data_ptr() != x.data_ptr(), "a world of one still returns a new tensor"


# ---------------------------------------------------------------- schedule order

def _ops(steps: list[Step]) -> dict[str, list[Step]]:
    by_op: dict[str, list[Step]] = {}
    for step in steps:
        by_op.setdefault(step.op, []).append(step)
    return by_op


def _computes(steps: list[Step]) -> list[tuple[int, int | None]]:
    return [(s.peer, s.chunk) for s in steps if s.kind == "compute"]


def _assert_gather_order(steps: list[Step], rank: int, world: int, chunks: int) -> None:
    """Local shard first, while transfers fly; each piece computed right after it lands."""
    assert _computes(steps) == [(rank, None)] + [((rank - o) % world, c)
                                                  for o in range(1, world) for c in range(chunks)]
    first = next(i for i, s in enumerate(steps) if s.kind == "compute")
    assert all(s.kind in ("send", "recv") for s in steps[:first])
    assert world == 1 or steps[:first], "the first transfers are posted before the local compute"
    for i, step in enumerate(steps[first + 1:], first + 1):
        if step.kind == "compute":
            assert (steps[i - 1].kind, steps[i - 1].peer, steps[i - 1].chunk) == ("wait", step.peer, step.chunk)
    last = max(i for i, s in enumerate(steps) if s.kind == "compute")
    assert all(s.kind not in ("send", "recv") for s in steps[last:]), "no transfer trails the last compute"


def _assert_scatter_order(steps: list[Step], rank: int, world: int, chunks: int) -> None:
    """Peers' partials first, each sent as soon as computed; own partial last; then only reductions."""
    assert _computes(steps) == [((rank + o) % world, c)
                                for o in range(1, world) for c in range(chunks)] + [(rank, None)]
    for i, step in enumerate(steps):
        if step.kind == "compute" and step.peer != rank:
            assert (steps[i + 1].kind, steps[i + 1].peer, steps[i + 1].chunk) == ("send", step.peer, step.chunk)
    last = max(i for i, s in enumerate(steps) if s.kind == "compute")
    assert steps[last].peer == rank
    assert all(s.kind in ("wait", "reduce") for s in steps[last + 1:])
    reduced = sorted((s.peer, s.chunk) for s in steps if s.kind == "reduce" and s.peer != rank)
    assert reduced == sorted(((rank - o) % world, c) for o in range(1, world) for c in range(chunks))


PATTERNS = {
    ("column", "all_gather_matmul.forward"): _assert_gather_order,
    ("column", "all_gather_matmul.backward.dgrad"): _assert_scatter_order,
    ("column", "all_gather_matmul.backward.wgrad"): _assert_gather_order,
    ("row", "matmul_reduce_scatter.forward"): _assert_scatter_order,
    ("row", "matmul_reduce_scatter.backward"): _assert_gather_order,
}


@pytest.mark.parametrize("world", WORLDS)
def test_schedule_order_forward_and_backward(world: int) -> None:
    for rank, result in enumerate(_results(world)):
        for (layer, op), check in PATTERNS.items():
            check(_ops(result["schedules"][layer])[op], rank, world, chunks=2)


@pytest.mark.parametrize("world", WORLDS)
def test_sends_and_receives_pair_up_across_ranks(world: int) -> None:
    results = _results(world)
    for layer, op in PATTERNS:
        per_rank = [_ops(r["schedules"][layer])[op] for r in results]
        for rank, steps in enumerate(per_rank):
            sends = [s for s in steps if s.kind == "send"]
            assert len(sends) == 2 * (world - 1)
            for i, send in enumerate(sends):
                recv = [s for s in per_rank[send.peer] if s.kind == "recv"][i]
                assert (recv.peer, recv.chunk, recv.numel) == (rank, send.chunk, send.numel), \
                    f"{op}: rank {rank}'s send #{i} is not rank {send.peer}'s receive #{i}"


def test_world_of_one_records_no_communication() -> None:
    for layer, steps in _results(1)[0]["schedules"].items():
        assert steps and {s.kind for s in steps} == {"compute"}, layer


# ---------------------------------------------------------------- the schedule itself, without ranks

@given(world=st.integers(1, 8), rows=st.integers(1, 40), chunks=st.integers(1, 6))
def test_transfers_cover_every_peer_and_row_once_and_match_across_ranks(world: int, rows: int,
                                                                        chunks: int) -> None:
    config = FlashOverlapConfig(num_chunks=chunks)
    rings = [Ring("op", None, rank, world, torch.device("cpu"), config) for rank in range(world)]
    if rows < chunks:
        with pytest.raises(ValueError, match=f"shape \\({rows},\\)"):
            rings[0].transfers(rows, "x", torch.Size([rows]))
        return
    plans = [ring.transfers(rows, "x", torch.Size([rows])) for ring in rings]
    for rank, plan in enumerate(plans):
        assert [t.index for t in plan] == list(range((world - 1) * chunks))
        assert sorted(t.send_to for t in plan) == sorted([p for p in range(world) if p != rank] * chunks)
        for peer in range(world):
            covered = [r for t in plan if t.recv_from == peer for r in range(t.rows.start, t.rows.stop)]
            assert covered == ([] if peer == rank else list(range(rows)))
        for t in plan:
            partner = plans[t.send_to][t.index]
            assert (partner.recv_from, partner.rows) == (rank, t.rows)
