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
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lagom.flash_overlap.config import FlashOverlapConfig
from lagom.flash_overlap.link import Link, Posted
from lagom.flash_overlap.schedule import note

WINDOW = 2


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; one when torch.distributed is not initialised and no group is named."""
    if group is None and not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


@dataclass(frozen=True)
class Transfer:
    """One paired send/receive of the schedule; ``rows`` are the shard rows it carries."""

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
           config: FlashOverlapConfig | None = None, num_chunks: int | None = None) -> Ring:
        """The ring of ``group`` (see ``group_size``) for one operator call: ``num_chunks``, when
        given, overrides the config's (as every operator's keyword does)."""
        world = group_size(group)
        config = (config or FlashOverlapConfig()).with_chunks(num_chunks)
        return cls(op, group, dist.get_rank(group) if world > 1 else 0, world, device, config)

    def renamed(self, op: str) -> Ring:
        return replace(self, op=op)

    def block_rows(self, tensor: torch.Tensor, name: str) -> int:
        """Rows per rank of ``tensor`` whose dim 0 holds one equal block per rank."""
        if tensor.dim() == 0 or tensor.shape[0] % self.world:
            raise ValueError(f"{self.op}: {name} has shape {tuple(tensor.shape)}; dim 0 must be divisible "
                             f"by the group size {self.world}")
        return tensor.shape[0] // self.world

    def transfers(self, rows: int, name: str, shape: torch.Size) -> list[Transfer]:
        """The schedule for shards of ``rows`` rows, cut into ``num_chunks`` chunks as even as can be."""
        chunks = self.config.num_chunks
        if rows < chunks:
            raise ValueError(f"{self.op}: {name} has shape {tuple(shape)}, giving shards of {rows} rows, "
                             f"which cannot be cut into num_chunks={chunks} non-empty chunks")
        bounds = [rows * c // chunks for c in range(chunks + 1)]
        return [Transfer(index=(o - 1) * chunks + c,
                         send_to=(self.rank + o) % self.world, recv_from=(self.rank - o) % self.world,
                         chunk=c, rows=slice(bounds[c], bounds[c + 1]))
                for o in range(1, self.world) for c in range(chunks)]


class Scratch:
    """``WINDOW`` receive buffers taken in turn: transfer t lands in slot t % WINDOW.

    The slot is free again because ``run`` posts transfer t only after t - WINDOW was consumed.
    """

    def __init__(self, transfers: list[Transfer]) -> None:
        self.rows = max((t.rows.stop - t.rows.start for t in transfers), default=0)
        self.slots = min(WINDOW, len(transfers))
        self.buffers: list[torch.Tensor] = []

    def __call__(self, t: Transfer, sent: torch.Tensor) -> torch.Tensor:
        if not self.buffers:
            self.buffers = [sent.new_empty((self.rows, *sent.shape[1:])) for _ in range(self.slots)]
        return self.buffers[t.index % WINDOW][: t.rows.stop - t.rows.start]


def run(ring: Ring, transfers: list[Transfer], *, outgoing: Callable[[Transfer], torch.Tensor],
        arrived: Callable[[Transfer, torch.Tensor], None], local: Callable[[], None], local_last: bool,
        landing: Callable[[Transfer, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Post ``transfers`` in order with ``WINDOW`` in flight, running ``local`` while some fly.

    ``outgoing(t)`` gives (and may compute) what t sends; ``landing(t, sent)`` where t receives a
    piece shaped like ``sent`` (default: ``Scratch``); ``arrived(t, piece)`` consumes it once landed.
    ``local`` runs after the first window is posted, or after the last transfer when ``local_last``.
    """
    link = Link(ring.group, ring.device, ring.config.comm_stream_priority)
    landing = landing or Scratch(transfers)
    local_at = len(transfers) if local_last else min(WINDOW, len(transfers))
    inflight: deque[tuple[Transfer, torch.Tensor, Posted]] = deque()

    def retire() -> None:
        t, recv, posted = inflight.popleft()
        link.land(posted)
        note(ring.op, "wait", t.recv_from, t.chunk)
        arrived(t, recv)

    if local_at == 0:
        local()
    for t in transfers:
        if len(inflight) == WINDOW:
            retire()
        send = outgoing(t).contiguous()
        recv = landing(t, send)
        note(ring.op, "send", t.send_to, t.chunk, send.numel())
        note(ring.op, "recv", t.recv_from, t.chunk, recv.numel())
        inflight.append((t, recv, link.post(send, t.send_to, recv, t.recv_from, tag=t.index)))
        if t.index + 1 == local_at:
            local()
    while inflight:
        retire()


def gather(ring: Ring, mine: torch.Tensor, consume: Callable[[int, slice, torch.Tensor], None],
           name: str, *, outgoing: Callable[[Transfer], torch.Tensor] | None = None,
           landing: Callable[[Transfer, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Collect one shard from every rank and consume each, this rank's own (``mine``) first.

    Every peer is sent ``mine`` (an all-gather) unless ``outgoing(t)`` picks a piece per destination
    (an all-to-all). ``consume(src, rows, piece)`` runs on all of ``mine``, then on each piece
    (rows ``rows`` of rank ``src``'s shard) as it lands. Pieces land in reused scratch buffers
    unless ``landing`` says where, so by default ``consume`` must be done with a piece on return.
    """
    mine = mine.contiguous()
    rows = mine.shape[0]

    def compute(src: int, chunk: int | None, part: slice, piece: torch.Tensor) -> None:
        note(ring.op, "compute", src, chunk)
        consume(src, part, piece)

    run(ring, ring.transfers(rows, name, mine.shape),
        outgoing=outgoing or (lambda t: mine[t.rows]),
        arrived=lambda t, piece: compute(t.recv_from, t.chunk, t.rows, piece),
        local=lambda: compute(ring.rank, None, slice(0, rows), mine),
        local_last=False, landing=landing)


def scatter_reduce(ring: Ring, rows: int, produce: Callable[[int, slice], torch.Tensor], name: str,
                   shape: torch.Size) -> torch.Tensor:
    """This rank's block of the sum over ranks of what each rank ``produce``s for it.

    ``produce(dst, rows)`` gives this rank's contribution to rows ``rows`` of rank ``dst``'s block
    (``rows`` rows in all). Contributions to peers are produced first and each is sent as soon as it
    exists; the one this rank keeps is produced last, while the last transfers fly; received
    contributions are summed as they land. With a world of one the result is what ``produce``
    returned, unchanged. ``name`` and ``shape`` describe the input for errors.
    """
    transfers = ring.transfers(rows, name, shape)
    total: torch.Tensor | None = None

    def contribution(dst: int, chunk: int | None, part: slice) -> torch.Tensor:
        note(ring.op, "compute", dst, chunk)
        return produce(dst, part)

    def add(src: int, chunk: int | None, part: slice, piece: torch.Tensor) -> None:
        nonlocal total
        note(ring.op, "reduce", src, chunk)
        if total is None:
            total = piece.new_zeros((rows, *piece.shape[1:]))
        total[part] += piece

    def keep_own() -> None:
        nonlocal total
        own = contribution(ring.rank, None, slice(0, rows))
        if transfers:
            add(ring.rank, None, slice(0, rows), own)
        else:
            total = own

    run(ring, transfers,
        outgoing=lambda t: contribution(t.send_to, t.chunk, t.rows),
        arrived=lambda t, piece: add(t.recv_from, t.chunk, t.rows, piece),
        local=keep_own, local_last=True)
    if total is None:  # run() calls keep_own exactly once; a schedule without it is a bug here
        raise RuntimeError("scatter_reduce: the local contribution was never added")
    return total
