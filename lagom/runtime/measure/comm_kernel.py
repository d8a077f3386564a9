"""A comm-like kernel for one GPU, where no collective has a peer: NCCL's footprint without NCCL.

It launches exactly ``ctas`` CTAs (NCCL's channels) of ``threads`` threads and streams a buffer in
chunks of ``chunk_bytes``, chunk i on CTA i mod ctas as NCCL deals a step's slices to its channels, as a
copy (all-gather's traffic: one read, one write per byte) or a reduce-copy (reduce-scatter's and
all-reduce's: two reads, one write). It takes SMs and HBM bandwidth from the compute beside it the way
a collective's kernel does; the link it would cross is not there, so it runs at HBM speed. Triton,
because torch ships it; under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the tests check it so).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 2048  # elements one CTA moves per inner step


@triton.jit
def _stream_chunks(src, other, dst, n_elements, chunk_elements, ctas,
                   REDUCE: tl.constexpr, BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr convention
    cta = tl.program_id(0)
    chunks = tl.cdiv(n_elements, chunk_elements)
    for chunk in range(cta, chunks, ctas):
        start = chunk * chunk_elements
        for offset in range(0, chunk_elements, BLOCK):
            within = offset + tl.arange(0, BLOCK)
            index = start + within
            mask = (within < chunk_elements) & (index < n_elements)
            value = tl.load(src + index, mask=mask)
            if REDUCE:
                value += tl.load(other + index, mask=mask)
            tl.store(dst + index, value, mask=mask)


def warps(threads: int) -> int:
    """Triton's warps for NCCL's thread count (a power of two: NCCL's extra sync warp has no equivalent)."""
    if threads < 32 or threads % 32 or threads & (threads - 1):
        raise ValueError(f"threads must be a power of two of at least 32, got {threads}")
    return threads // 32


def stream_chunks(src: torch.Tensor, dst: torch.Tensor, *, ctas: int, chunk_bytes: int, threads: int = 512,
                  other: torch.Tensor | None = None) -> Any:
    """dst = src (copy), or dst = src + other (reduce-copy), on exactly ``ctas`` CTAs in ``chunk_bytes`` chunks."""
    if src.shape != dst.shape or (other is not None and other.shape != src.shape):
        raise ValueError("src, dst and other must have one shape")
    if ctas < 1 or chunk_bytes < src.element_size():
        raise ValueError(f"need ctas >= 1 and a chunk of at least one element, got {ctas} and {chunk_bytes} B")
    chunk_elements = chunk_bytes // src.element_size()
    return _stream_chunks[(ctas,)](src, src if other is None else other, dst, src.numel(), chunk_elements, ctas,
                                   REDUCE=other is not None, BLOCK=BLOCK, num_warps=warps(threads))
