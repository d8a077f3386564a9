"""Ulysses sequence parallelism: swap a sequence shard for a head shard around attention.

Layout [sequence, ..., heads, head_dim]. Before attention each rank holds all heads of its sequence
shard and needs all of the sequence for heads/world of the heads; after attention the reverse. Both
are one decomposed ``all_to_all``, so the blocks (one per peer) can be worked on as they land.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from lagom.flash_overlap.collectives import OnShard, all_to_all
from lagom.flash_overlap.config import FlashOverlapConfig
from lagom.flash_overlap.ring import group_size


def _world(op: str, x: torch.Tensor, group: ProcessGroup | None) -> int:
    if x.dim() < 3:
        raise ValueError(f"{op}: input has shape {tuple(x.shape)}; expected [sequence, ..., heads, head_dim]")
    return group_size(group)


def seq_to_heads(x: torch.Tensor, group: ProcessGroup | None = None, on_block: OnShard | None = None, *,
                 num_chunks: int | None = None, config: FlashOverlapConfig | None = None) -> torch.Tensor:
    """[s, ..., heads, d] (sequence shard) -> [world * s, ..., heads / world, d] (head shard).

    ``on_block(rank, block)`` gets rank's sequence shard of this rank's heads as it lands.
    """
    world = _world("seq_to_heads", x, group)
    heads = x.shape[-2]
    if heads % world:
        raise ValueError(f"seq_to_heads: input has shape {tuple(x.shape)}; its {heads} heads (dim -2) "
                         f"must be divisible by the group size {world}")
    blocks = x.unflatten(-2, (world, heads // world)).movedim(-3, 0)  # [world, s, ..., heads/world, d]
    return all_to_all(blocks.flatten(0, 1), group, on_block, num_chunks=num_chunks, config=config)


def heads_to_seq(y: torch.Tensor, group: ProcessGroup | None = None, on_block: OnShard | None = None, *,
                 num_chunks: int | None = None, config: FlashOverlapConfig | None = None) -> torch.Tensor:
    """[world * s, ..., heads / world, d] (head shard) -> [s, ..., heads, d] (sequence shard).

    ``on_block(rank, block)`` gets rank's heads of this rank's sequence shard as it lands.
    """
    world = _world("heads_to_seq", y, group)
    if y.shape[0] % world:
        raise ValueError(f"heads_to_seq: input has shape {tuple(y.shape)}; its sequence (dim 0) must be "
                         f"divisible by the group size {world}")
    out = all_to_all(y, group, on_block, num_chunks=num_chunks, config=config)  # block i: rank i's heads
    return out.unflatten(0, (world, -1)).movedim(0, -3).flatten(-3, -2)
