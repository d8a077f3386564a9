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
from lagom.plan import Plan
from lagom_deepspeed.comm import SPECS, argument
from lagom_deepspeed.config import FlashOverlapSection

log = logging.getLogger("lagom.deepspeed")

ROUTED = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class FlashRouter:
    """Decides per (group, collective, size) from the current plan; ``plan`` may be swapped at run time."""

    methods = frozenset(ROUTED)

    def __init__(self, section: FlashOverlapSection, plan: Plan) -> None:
        self.section = section
        self.calls: dict[str, int] = {}  # plan key -> decomposed calls, for the report
        self._decisions: dict[tuple[str, str, int], flash_overlap.FlashOverlapConfig | None] = {}
        self._refused: set[str] = set()
        self.plan = plan

    @property
    def plan(self) -> Plan:
        return self._plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self._plan = plan
        self._decisions.clear()

    def decision(self, group: str, collective: str, size: int) -> flash_overlap.FlashOverlapConfig | None:
        key = (group, collective, size)
        if key not in self._decisions:
            entry = self._plan.lookup(group, collective, size)
            cfg = None
            if entry is not None and entry.config.decomposition == "p2p":
                cfg = flash_overlap.FlashOverlapConfig(
                    num_chunks=self.section.num_chunks or entry.config.num_chunks,
                    comm_stream_priority=self.section.comm_stream_priority)
            self._decisions[key] = cfg
        return self._decisions[key]

    def __call__(self, method: str, name: str, group: Any, size: int, args: tuple,
                 kwargs: dict) -> Callable[[], None] | None:
        """The decomposed call to run instead of the collective, or None to keep the collective."""
        collective = ROUTED.get(method)
        if collective is None or not self.section.enabled:
            return None
        cfg = self.decision(name, collective, size)
        if cfg is None:
            return None
        spec = SPECS[method]
        out = argument(spec, "output_tensor", args, kwargs)
        inp = argument(spec, "input_tensor", args, kwargs)
        if collective == "reduce_scatter" and "SUM" not in str(argument(spec, "op", args, kwargs, "SUM")):
            return self._refuse(method, "only sum reductions are decomposed")
        flat_in, flat_out = inp.reshape(-1), out.view(-1)
        rows = flat_in.numel() if collective == "all_gather" else flat_out.numel()
        if rows < cfg.num_chunks:
            return self._refuse(method, f"{rows} elements per shard cannot be cut into {cfg.num_chunks} chunks")
        entry = self._plan.lookup(name, collective, size)
        self.calls[entry.key] = self.calls.get(entry.key, 0) + 1  # type: ignore[union-attr]

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
