"""The rank-dependent P2P schedule that every decomposed collective shares.

Transfer t = (offset o, chunk c), o = 1..n-1: rank r sends to r+o and receives from r-o (mod n).
Rank r+o receives from r at the very same index t, so sends and receives line up on every rank
with no coordination, and each ordered pair of ranks is used once per chunk. At most ``WINDOW``
transfers are in flight, which is what lets receives alternate between two buffers.

Where the local work sits is what removes the tail: a gather computes the local shard first, while
the first transfers fly; a scatter computes the partial it keeps last, while the last ones fly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lagom.flash_overlap.config import FlashOverlapConfig
from lagom.flash_overlap.link import Link, Posted
from lagom.flash_overlap.schedule import note

WINDOW = 2

Produce = Callable[[int, slice], torch.Tensor]
"""(peer, rows) -> the piece for those rows of that peer's shard."""
Consume = Callable[[int, slice, torch.Tensor], None]
"""(peer, rows, piece) -> None: work on a piece that has landed (or the local shard)."""


@dataclass(frozen=True)
class Transfer:
    """One paired send/receive of the schedule."""

    index: int
    send_to: int
    recv_from: int
    chunk: int
    rows: slice


@dataclass(frozen=True)
class Ring:
    """Who takes part in one decomposed collective call, and how it is cut."""

    op: str
    group: ProcessGroup | None
    rank: int
    world: int
    device: torch.device
    config: FlashOverlapConfig

    @classmethod
    def of(cls, op: str, group: ProcessGroup | None, device: torch.device,
           config: FlashOverlapConfig) -> Ring:
        """The ring of ``group``; without torch.distributed initialised, a world of one."""
        if group is None and not dist.is_initialized():
            return cls(op, None, 0, 1, device, config)
        return cls(op, group, dist.get_rank(group), dist.get_world_size(group), device, config)

    def renamed(self, op: str) -> Ring:
        return Ring(op, self.group, self.rank, self.world, self.device, self.config)

    def block_rows(self, tensor: torch.Tensor, name: str) -> int:
        """Rows of ``tensor`` per rank when dim 0 holds one block per rank."""
        if tensor.dim() == 0 or tensor.shape[0] % self.world:
            raise ValueError(f"{self.op}: {name} has shape {tuple(tensor.shape)}; dim 0 must be divisible "
                             f"by the group size {self.world}")
        return tensor.shape[0] // self.world

    def transfers(self, rows: int, what: str) -> list[Transfer]:
        """The schedule for shards of ``rows`` rows; ``what`` names the tensor in errors."""
        chunks = self.config.num_chunks
        if rows < chunks:
            raise ValueError(f"{self.op}: {what} gives shards of {rows} rows, which cannot be cut into "
                             f"num_chunks={chunks} non-empty chunks")
        bounds = [rows * c // chunks for c in range(chunks + 1)]
        offsets = range(1, self.world)
        return [Transfer(index=(o - 1) * chunks + c,
                         send_to=(self.rank + o) % self.world, recv_from=(self.rank - o) % self.world,
                         chunk=c, rows=slice(bounds[c], bounds[c + 1]))
                for o in offsets for c in range(chunks)]


def run(ring: Ring, transfers: list[Transfer], *, outgoing: Produce,
        landing: Callable[[Transfer], torch.Tensor], arrived: Consume, local: Callable[[], None],
        local_last: bool) -> None:
    """Post ``transfers`` in order, keep ``WINDOW`` in flight, and run ``local`` while some fly.

    ``outgoing(dst, rows)`` gives what to send (it may compute it), ``landing(t)`` where to receive,
    ``arrived(src, rows, piece)`` consumes a received piece. Transfer t+WINDOW is posted only after
    transfer t was consumed, so ``landing`` may reuse a buffer every WINDOW transfers.
    """
    link = Link(ring.group, ring.device, ring.config.comm_stream_priority)
    local_at = len(transfers) if local_last else min(WINDOW, len(transfers))
    inflight: deque[tuple[Transfer, torch.Tensor, Posted]] = deque()

    def retire() -> None:
        t, recv, posted = inflight.popleft()
        link.land(posted)
        note(ring.op, "wait", t.recv_from, t.chunk)
        arrived(t.recv_from, t.rows, recv)

    if local_at == 0:
        local()
    for t in transfers:
        if len(inflight) == WINDOW:
            retire()
        send, recv = outgoing(t.send_to, t.rows).contiguous(), landing(t)
        note(ring.op, "send", t.send_to, t.chunk, send.numel())
        note(ring.op, "recv", t.recv_from, t.chunk, recv.numel())
        inflight.append((t, recv, link.post(send, t.send_to, recv, t.recv_from, tag=t.index)))
        if t.index + 1 == local_at:
            local()
    while inflight:
        retire()


def scratch(transfers: list[Transfer], like: torch.Tensor) -> Callable[[Transfer], torch.Tensor]:
    """Receive buffers for ``transfers``: one per window slot, shaped like rows of ``like``."""
    rows = max((t.rows.stop - t.rows.start for t in transfers), default=0)
    buffers = [like.new_empty((rows, *like.shape[1:])) for _ in range(min(WINDOW, len(transfers)))]
    return lambda t: buffers[t.index % WINDOW][: t.rows.stop - t.rows.start]


def gather(ring: Ring, shard: torch.Tensor, consume: Consume, what: str,
           landing: Callable[[Transfer], torch.Tensor] | None = None) -> None:
    """Give every rank this rank's ``shard`` and consume every rank's, local first.

    ``consume(src, rows, piece)`` runs on the whole local shard, then on each piece as it lands.
    Pieces land in two alternating scratch buffers unless ``landing`` says otherwise, so
    ``consume`` must be done with a piece when it returns.
    """
    shard = shard.contiguous()
    transfers = ring.transfers(shard.shape[0], what)

    def work(src: int, rows: slice, piece: torch.Tensor, chunk: int | None) -> None:
        note(ring.op, "compute", src, chunk)
        consume(src, rows, piece)

    run(ring, transfers,
        outgoing=lambda dst, rows: shard[rows],
        landing=landing or scratch(transfers, shard),
        arrived=lambda src, rows, piece: work(src, rows, piece, _chunk_of(transfers, rows)),
        local=lambda: work(ring.rank, slice(0, shard.shape[0]), shard, None),
        local_last=False)


def scatter_reduce(ring: Ring, rows: int, produce: Produce, what: str) -> torch.Tensor:
    """Sum over ranks of the partial each one produces for this rank's block, local partial last.

    ``produce(dst, rows)`` computes this rank's contribution to those rows of ``dst``'s block. Peers'
    partials are produced first and each is sent as soon as it exists; the partial this rank keeps
    is produced while the last transfers fly; received partials are added as they land.
    """
    transfers = ring.transfers(rows, what)
    total: torch.Tensor | None = None

    def partial(dst: int, part: slice, chunk: int | None) -> torch.Tensor:
        note(ring.op, "compute", dst, chunk)
        return produce(dst, part)

    def keep_local() -> None:
        nonlocal total
        mine = partial(ring.rank, slice(0, rows), None)
        if total is None:
            total = mine
        else:
            note(ring.op, "reduce", ring.rank, None)
            total.add_(mine)

    def add(src: int, part: slice, piece: torch.Tensor) -> None:
        nonlocal total
        if total is None:
            total = piece.new_zeros((rows, *piece.shape[1:]))
        note(ring.op, "reduce", src, _chunk_of(transfers, part))
        total[part] += piece

    run(ring, transfers,
        outgoing=lambda dst, part: partial(dst, part, _chunk_of(transfers, part)),
        landing=lambda t: landing_for(t),
        arrived=add, local=keep_local, local_last=True)
    assert total is not None
    return total
