"""The frameworks' own bucket rules, as functions of the tensors' sizes: how megatron-core's DDP lays gradient
buffers out and cuts them into buckets (``megatron_buckets``), and how DeepSpeed's ZeRO flushes its gradient buckets
(``deepspeed_buckets``). ``lagom.step.points`` applies them to a stage's tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of a pipeline stage, as megatron-core's DDP lays it out in a gradient buffer."""

    numel: int  # elements this rank holds
    seq: int  # position in registration order (model.parameters()); backward produces gradients in reverse
    ready: int | str  # the backward block that completes its gradient: a layer index, "head" or "embed"
    expert: bool = False
    shared_embedding: bool = False  # the word embedding tied to the output layer across stages: own bucket


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: its elements (padding included) and the tensor that completes it."""

    numel: int
    ready: int | str
    seq: int


def megatron_buckets(tensors: list[ParamTensor], bucket_elems: int | None, dp: int, distributed_optimizer: bool,
                     pad_for_busbw: bool = False) -> list[Bucket]:
    """The buckets megatron-core 0.19 DDP cuts one gradient buffer into (param_and_grad_buffer.py).

    Tensors go in reverse registration order; a bucket closes once it holds ``bucket_elems`` or more
    (None: one bucket). The distributed optimizer's layout also starts every tensor on a 64-element
    boundary, ends every bucket on a multiple of lcm(dp, 128) (and of 2^16 with ``pad_for_busbw``) so
    it shards evenly, and gives a shared embedding a bucket of its own.
    """
    divisor = math.lcm(dp, 128, 2**16) if pad_for_busbw else math.lcm(dp, 128)
    buckets: list[Bucket] = []
    start = position = end = 0
    last: ParamTensor | None = None  # the latest tensor of the open bucket

    def close(at: int) -> None:
        nonlocal start, position, last
        if distributed_optimizer:
            at = math.ceil(at / divisor) * divisor
        buckets.append(Bucket(at - start, last.ready, last.seq))  # type: ignore[union-attr]
        start = position = at
        last = None

    for tensor in reversed(tensors):
        if distributed_optimizer:
            position = math.ceil(position / 64) * 64
            if tensor.shared_embedding and last is not None:
                close(position)
        end = position + tensor.numel
        last = tensor
        if (bucket_elems is not None and end - start >= bucket_elems) or (distributed_optimizer and tensor.shared_embedding):
            close(end)
        else:
            position = end
    if last is not None:
        close(end)
    return buckets


def deepspeed_buckets(numels: list[int], bucket_elems: int) -> list[int]:
    """The gradient buckets DeepSpeed 0.19's ZeRO cuts backward into (``reduce_independent_p_g_buckets_and_remove_grads``
    of stage_1_and_2.py and stage3.py): gradients join the open bucket in the order they are ready; the bucket is
    reduced first when the next gradient would not fit (an empty one never is), and the last one when backward ends.
    Elements per bucket."""
    out: list[int] = []
    elems = 0
    for n in numels:
        if n <= 0:
            continue
        if elems and elems + n > bucket_elems:
            out.append(elems)
            elems = 0
        elems += n
    return out + [elems] if elems else out
