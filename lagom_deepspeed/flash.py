"""ZeRO-3 bucket collectives as Flash-Overlap P2P steps, where the plan says ``decomposition: p2p``.

ZeRO-3 gathers parameters with ``all_gather_into_tensor`` and reduces gradients with
``reduce_scatter_tensor`` on the data-parallel group; the backend wrapper asks this router first.
For a call whose plan entry (same group and collective, nearest size) says p2p, the call runs as
the rank-ordered P2P schedule of lagom.flash_overlap: the local shard is placed first and each
peer's shard is copied into DeepSpeed's buffer as it lands; a reduce-scatter sends peers'
blocks first and adds its own last. DeepSpeed's modules need whole gathered parameters, so no
GEMM is split here: what changes is the transfer schedule, not the compute.
Anything else (other groups, non-sum reductions, shapes the schedule cannot cut) keeps the collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lagom import flash_overlap
from lagom.runtime.online.state import FlashRouter
from lagom_deepspeed.comm import SPECS, argument

log = logging.getLogger("lagom.deepspeed")

ROUTED = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class ZeroFlash:
    """The backend wrapper's decomposer: the core session's router decides, this reads DeepSpeed's arguments."""

    methods = frozenset(ROUTED)

    def __init__(self, router: FlashRouter) -> None:
        self.router = router
        self._refused: set[str] = set()

    def __call__(self, method: str, name: str, group: Any, size: int, args: tuple,
                 kwargs: dict) -> Callable[[], None] | None:
        """The decomposed call to run instead of the collective, or None to keep the collective."""
        collective = ROUTED.get(method)
        decided = (self.router.decision(name, collective, size, unmodelled_sizes=True)
                   if collective is not None else None)
        if decided is None:
            return None
        key, cfg = decided
        spec = SPECS[method]
        out = argument(spec, "output_tensor", args, kwargs)
        inp = argument(spec, "input_tensor", args, kwargs)
        if collective == "reduce_scatter" and "SUM" not in str(argument(spec, "op", args, kwargs, "SUM")):
            return self._refuse(method, "only sum reductions are decomposed")
        flat_in, flat_out = inp.reshape(-1), out.view(-1)
        rows = flat_in.numel() if collective == "all_gather" else flat_out.numel()
        if rows < cfg.num_chunks:
            return self._refuse(method, f"{rows} elements per shard cannot be cut into {cfg.num_chunks} chunks")
        self.router.count(key)

        def place(rank: int, shard: torch.Tensor) -> None:
            flat_out[rank * rows:(rank + 1) * rows].copy_(shard)

        if collective == "all_gather":
            return lambda: flash_overlap.all_gather(flat_in, group, on_shard=place, config=cfg)
        return lambda: flat_out.copy_(flash_overlap.reduce_scatter(flat_in, group, config=cfg))

    def _refuse(self, method: str, why: str) -> None:
        if method not in self._refused:
            self._refused.add(method)
            log.warning("Flash-Overlap: %s keeps the collective (%s)", method, why)
        return None
