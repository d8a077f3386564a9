"""Flash-Overlap: collectives decomposed into P2P transfers, each paired with compute on one shard.

The rank-dependent order puts the local shard first in a gather and last in a scatter, so the
last compute step never waits on communication. Works on NCCL (transfers on their own CUDA
stream, ordered by events) and on gloo (async work handles).
"""

from lagom.flash_overlap.collectives import all_gather, reduce_scatter
from lagom.flash_overlap.config import FlashOverlapConfig
from lagom.flash_overlap.linear import all_gather_matmul, matmul_reduce_scatter
from lagom.flash_overlap.schedule import Step, record_schedule

__all__ = [
    "FlashOverlapConfig",
    "Step",
    "all_gather",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "record_schedule",
    "reduce_scatter",
]
