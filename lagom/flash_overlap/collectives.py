"""Decomposed collectives for buckets (data parallel, ZeRO).

Each equals its torch.distributed counterpart but moves one shard at a time over P2P transfers and
hands each shard to a callback as soon as it is complete (or asks a callback for it just before it
is sent), so a framework can put shard-level compute beside the transfers instead of after a
monolithic collective. Both act on buffers and, like the collectives they replace, are not recorded
by autograd.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from lagom.flash_overlap.config import FlashOverlapConfig
from lagom.flash_overlap.ring import Ring, Transfer, gather, scatter_reduce

OnShard = Callable[[int, torch.Tensor], None]
"""(rank, shard) -> None: called once per rank's shard when it is complete; read-only use."""


def _gather_into(ring: Ring, out: torch.Tensor, mine: torch.Tensor, on_shard: OnShard | None,
                 outgoing: Callable[[Transfer], torch.Tensor] | None = None) -> torch.Tensor:
    """Fill ``out`` (block i = rank i's shard) with pieces landing in place; ``mine`` is copied."""
    rows = mine.shape[0]

    def block(rank: int) -> torch.Tensor:
        return out[rank * rows:(rank + 1) * rows]

    def consume(src: int, part: slice, piece: torch.Tensor) -> None:
        if src == ring.rank:
            block(src).copy_(piece)
        if on_shard is not None and part.stop == rows:
            on_shard(src, block(src))

    gather(ring, mine, consume, "tensor", outgoing=outgoing,
           landing=lambda t, sent: block(t.recv_from)[t.rows])
    return out


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None, on_shard: OnShard | None = None,
               *, num_chunks: int | None = None, config: FlashOverlapConfig | None = None) -> torch.Tensor:
    """``all_gather_into_tensor`` along dim 0, calling ``on_shard(rank, shard)`` as each shard lands.

    The local shard is handed over first, then peers' shards in schedule order (r-1, r-2, ...).
    """
    ring = Ring.of("all_gather", group, tensor.device, config, num_chunks)
    if tensor.dim() == 0:
        raise ValueError("all_gather: tensor has shape (); it needs a dim 0 to gather along")
    out = tensor.new_empty((ring.world * tensor.shape[0], *tensor.shape[1:]))
    return _gather_into(ring, out, tensor, on_shard)


def reduce_scatter(tensor: torch.Tensor, group: ProcessGroup | None = None,
                   produce_shard: Callable[[int], torch.Tensor] | None = None, *,
                   num_chunks: int | None = None, config: FlashOverlapConfig | None = None) -> torch.Tensor:
    """``reduce_scatter_tensor`` (sum) along dim 0: block i of ``tensor`` is rank i's contribution.

    With ``produce_shard``, block i is instead ``produce_shard(i)``, asked for just before it is
    sent (peers first, this rank's own last), so a framework can compute a bucket's blocks in the
    order they leave; ``tensor`` then fixes shape and dtype (fill it, or a view of it, and return it).
    """
    ring = Ring.of("reduce_scatter", group, tensor.device, config, num_chunks)
    rows = ring.block_rows(tensor, "tensor")
    tensor = tensor.contiguous()
    block_shape = (rows, *tensor.shape[1:])
    produced: dict[int, torch.Tensor] = {}

    def block(dst: int) -> torch.Tensor:
        if produce_shard is None:
            return tensor[dst * rows:(dst + 1) * rows]
        if dst not in produced:
            shard = produce_shard(dst)
            if tuple(shard.shape) != block_shape or shard.dtype != tensor.dtype:
                raise ValueError(f"reduce_scatter: produce_shard({dst}) returned {shard.dtype} of shape "
                                 f"{tuple(shard.shape)}; expected {tensor.dtype} of shape {block_shape}")
            produced[dst] = shard
        return produced[dst]

    def produce(dst: int, part: slice) -> torch.Tensor:
        piece = block(dst)[part]
        if part.stop == rows:
            produced.pop(dst, None)
        return piece

    result = scatter_reduce(ring, rows, produce, "tensor", tensor.shape)
    return result if ring.world > 1 else result.clone()
