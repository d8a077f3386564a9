"""Sequence-parallel linear layers with their collective fused into the GEMM, forward and backward.

``all_gather_matmul`` is the column-parallel linear (all-gather the sequence, then GEMM);
``matmul_reduce_scatter`` the row-parallel one (GEMM, then reduce-scatter the sequence). Weights are
in torch.nn.Linear layout [out_features, in_features]. Every pass is one or two rings of
``lagom.flash_overlap.ring``: a gather whose pieces are multiplied as they land (local first), or a
scatter whose partial products are sent as they are computed (local last), so no GEMM waits on a
whole collective and no transfer trails the last GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from lagom.flash_overlap.config import FlashOverlapConfig
from lagom.flash_overlap.ring import Ring, gather, scatter_reduce

Ctx = torch.autograd.function.FunctionCtx


def _sequence_rows(rank: int, shard_rows: int, part: slice) -> slice:
    """Rows of the full sequence that ``part`` of rank ``rank``'s shard covers."""
    return slice(rank * shard_rows + part.start, rank * shard_rows + part.stop)


def _add_weight_grad(grad_weight: torch.Tensor, grad_out: torch.Tensor, inputs: torch.Tensor) -> None:
    """grad_weight += grad_out^T @ inputs over all leading dims (the Linear weight gradient)."""
    grad_weight.addmm_(grad_out.reshape(-1, grad_out.shape[-1]).t(), inputs.reshape(-1, inputs.shape[-1]))


def _gather_gemms(ring: Ring, shard: torch.Tensor, name: str, rhs: torch.Tensor | None,
                  also: Callable[[slice, torch.Tensor], None] | None = None) -> torch.Tensor | None:
    """One gather of ``shard`` whose pieces are used as soon as they land, the local shard first.

    Returns ``all_gather(shard) @ rhs`` when ``rhs`` is given (else None); ``also(seq, piece)``
    runs on each piece too, ``seq`` being the rows of the full sequence the piece holds.
    """
    rows = shard.shape[0]
    out = None if rhs is None else shard.new_empty((ring.world * rows, *shard.shape[1:-1], rhs.shape[1]))

    def consume(src: int, part: slice, piece: torch.Tensor) -> None:
        seq = _sequence_rows(src, rows, part)
        if out is not None:
            torch.matmul(piece, rhs, out=out[seq])
        if also is not None:
            also(seq, piece)

    gather(ring, shard, consume, name)
    return out


def _scattered_product(ring: Ring, full: torch.Tensor, rhs: torch.Tensor, name: str) -> torch.Tensor:
    """reduce_scatter(full @ rhs) along dim 0, each peer's partial product sent as it is computed."""
    rows = ring.block_rows(full, name)
    return scatter_reduce(ring, rows, lambda dst, part: full[_sequence_rows(dst, rows, part)] @ rhs,
                          name, full.shape)


class _AllGatherMatmul(torch.autograd.Function):
    """Forward: gather x and multiply. Backward: dgrad as a scattered product of grad_out @ W,
    then wgrad over a second gather of x (x is not kept gathered, as Megatron's sequence parallel)."""

    @staticmethod
    def forward(ctx: Ctx, x_shard: torch.Tensor, weight: torch.Tensor, ring: Ring) -> torch.Tensor:
        x_shard = x_shard.contiguous()
        ctx.save_for_backward(x_shard, weight)
        ctx.ring = ring
        return _gather_gemms(ring.renamed(f"{ring.op}.forward"), x_shard, "x_shard", weight.t())

    @staticmethod
    def backward(ctx: Ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x_shard, weight = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = _scattered_product(ctx.ring.renamed(f"{ctx.ring.op}.backward.dgrad"), grad_out, weight,
                                        "grad_output")
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight)
            _gather_gemms(ctx.ring.renamed(f"{ctx.ring.op}.backward.wgrad"), x_shard, "x_shard", None,
                          lambda seq, piece: _add_weight_grad(grad_weight, grad_out[seq], piece))
        return grad_x, grad_weight, None


class _MatmulReduceScatter(torch.autograd.Function):
    """Forward: scattered product of x @ W^T. Backward: one gather of grad_out whose pieces feed
    both the dgrad GEMM (piece @ W) and the wgrad GEMM (piece^T @ x[rows])."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, weight: torch.Tensor, ring: Ring) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.ring = ring
        return _scattered_product(ring.renamed(f"{ring.op}.forward"), x, weight.t(), "x")

    @staticmethod
    def backward(ctx: Ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_x = _gather_gemms(
            ctx.ring.renamed(f"{ctx.ring.op}.backward"), grad_out.contiguous(), "grad_output",
            weight if ctx.needs_input_grad[0] else None,
            None if grad_weight is None else lambda seq, piece: _add_weight_grad(grad_weight, piece, x[seq]))
        return grad_x, grad_weight, None


def _check_linear(op: str, x: torch.Tensor, name: str, weight: torch.Tensor) -> None:
    if x.dim() < 2 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: {name} has shape {tuple(x.shape)} and weight {tuple(weight.shape)}; expected "
                         f"{name} [sequence, ..., in_features] and weight [out_features, in_features] "
                         "(torch.nn.Linear layout)")


def all_gather_matmul(x_shard: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None = None, *,
                      num_chunks: int | None = None, config: FlashOverlapConfig | None = None) -> torch.Tensor:
    """``all_gather(x_shard, dim 0) @ weight.t()``: a sequence-parallel column-parallel linear.

    x_shard: this rank's sequence shard [s, ..., in_features], the same shape on every rank;
    weight: [out_features, in_features] (torch.nn.Linear layout). Returns [world * s, ..., out_features].
    ``num_chunks`` overrides ``config.num_chunks``.
    """
    _check_linear("all_gather_matmul", x_shard, "x_shard", weight)
    return _AllGatherMatmul.apply(x_shard, weight, Ring.of("all_gather_matmul", group, x_shard.device, config, num_chunks))


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None = None, *,
                          num_chunks: int | None = None, config: FlashOverlapConfig | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ weight.t(), dim 0, sum)``: a sequence-parallel row-parallel linear.

    x: the full sequence [world * s, ..., in_features] (dim 0 must divide by the group size);
    weight: [out_features, in_features] (torch.nn.Linear layout). Returns [s, ..., out_features].
    ``num_chunks`` overrides ``config.num_chunks``.
    """
    _check_linear("matmul_reduce_scatter", x, "x", weight)
    ring = Ring.of("matmul_reduce_scatter", group, x.device, config, num_chunks)
    ring.block_rows(x, "x")
    return _MatmulReduceScatter.apply(x, weight, ring)
