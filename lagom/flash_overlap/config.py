"""The knobs a plan sets on a Flash-Overlap operator, in one value object."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FlashOverlapConfig:
    """How one decomposed collective is scheduled.

    num_chunks: pieces each peer's shard is cut into (along dim 0). More pieces start compute
        sooner and shrink the un-overlapped head, at the price of smaller messages and GEMMs.
    comm_stream_priority: CUDA priority of the stream that issues the transfers (torch.cuda.Stream
        semantics: 0 is default, negative is higher). Ignored on CPU.
    """

    num_chunks: int = 1
    comm_stream_priority: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise ValueError(f"FlashOverlapConfig.num_chunks must be a positive int, got {self.num_chunks!r}")
        if not isinstance(self.comm_stream_priority, int):
            raise ValueError(
                f"FlashOverlapConfig.comm_stream_priority must be an int, got {self.comm_stream_priority!r}")

    def with_chunks(self, num_chunks: int | None) -> FlashOverlapConfig:
        """This config, with num_chunks replaced when a call site overrides it."""
        if num_chunks is None:
            return self
        return replace(self, num_chunks=num_chunks)
