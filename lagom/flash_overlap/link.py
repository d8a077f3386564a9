"""Issue the P2P transfers of a schedule and order them against compute, without host syncs.

On CUDA a transfer must wait for the compute that produced what it sends (or freed the buffer it
receives into) but for nothing enqueued later, or it would queue behind the GEMM it should hide
under. So transfers go out on a dedicated stream that waits on the compute stream when posted, and
compute waits on a CUDA event when it needs a landed piece. On CPU (gloo) compute is synchronous and
the same schedule just waits on the async work handles.

The transfers are pieces of one decomposed collective, which the adapter that decomposed it records
as a whole, so they are posted inside ``torch_tap.claimed``: the torch.distributed tap leaves them
out, in the forward and in the backward (on whichever thread autograd runs it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lagom.runtime.apply.torch_tap import claimed


@functools.cache
def _transfer_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """One transfer stream per device and priority, reused across calls like NCCL's own streams."""
    return torch.cuda.Stream(device=device, priority=priority)


@dataclass
class Posted:
    """A transfer in flight; holds its tensors so they outlive it."""

    works: list[dist.Work]
    landed: torch.cuda.Event | None
    tensors: tuple[torch.Tensor, torch.Tensor]


class Link:
    """Posts paired send/receive transfers within one process group."""

    def __init__(self, group: ProcessGroup | None, device: torch.device, stream_priority: int) -> None:
        self.group = group
        self.stream = _transfer_stream(device, stream_priority) if device.type == "cuda" else None

    def post(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, tag: int) -> Posted:
        """Send ``send`` to group rank ``dst`` while receiving ``recv`` from group rank ``src``."""
        ops = [dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=dst),
               dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=src)]
        if self.stream is None:
            with claimed:
                return Posted(dist.batch_isend_irecv(ops), None, (send, recv))
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            with claimed:
                works = dist.batch_isend_irecv(ops)
            for work in works:
                work.wait()  # NCCL: the transfer stream waits for the transfer; the host does not
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return Posted(works, landed, (send, recv))

    def land(self, posted: Posted) -> None:
        """Make the compute that follows see the received piece (and the send buffer released)."""
        if posted.landed is None:
            for work in posted.works:
                work.wait()
        else:
            torch.cuda.current_stream(self.stream.device).wait_event(posted.landed)
