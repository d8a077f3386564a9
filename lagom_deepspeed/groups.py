"""Lagom's names for DeepSpeed's process groups (dp, pp, tp, ep, expt_dp), found by their ranks.

DeepSpeed builds its groups inside the engine with ``deepspeed.comm.new_group(ranks)``, and hands
them to collectives as opaque objects (``None`` for the world). Which ranks an axis spans is known
before the engine exists (the pipeline topology, the mpu, the world size), so a group is named by
its rank tuple: the name is what the plan's keys use and what ``group_desc`` tells NCCL.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

TOPOLOGY_AXES = (("model", "tp"), ("pipe", "pp"), ("data", "dp"))  # later axes win on equal ranks


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class GroupNames:
    """Callable: process group (or None for the world) -> lagom group name, cached per group object."""

    def __init__(self, by_ranks: dict[tuple[int, ...], str], world: int, p2p: str) -> None:
        self.by_ranks = by_ranks
        self.world = world
        self.p2p = p2p  # the name of point-to-point traffic with no group (pipeline send/recv)
        self._world_name: str | None = None  # group None: the world
        # weak: a group the job destroys is not kept alive, and a new group at its address is named afresh
        self._cache: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def name_of_ranks(self, ranks: tuple[int, ...]) -> str:
        if ranks in self.by_ranks:
            return self.by_ranks[ranks]
        expert = _expert_names().get(ranks)
        if expert:
            return expert
        return "world" if len(ranks) == self.world else "ranks" + "-".join(map(str, ranks))

    def __call__(self, group: Any) -> str:
        if group is None:
            if self._world_name is None:
                self._world_name = self.name_of_ranks(_ranks(None))
            return self._world_name
        name = self._cache.get(group)
        if name is None:
            name = self._cache[group] = self.name_of_ranks(_ranks(group))
        return name

    @classmethod
    def for_job(cls, model: Any, mpu: Any, world: int) -> GroupNames:
        """Names from the pipeline topology (PipelineModule) or the mpu; pure data parallel otherwise."""
        by_ranks: dict[tuple[int, ...], str] = {}
        topology = model.topology() if hasattr(model, "topology") and callable(model.topology) else None
        if topology is not None:
            axes = topology.get_axis_names()
            for axis, name in TOPOLOGY_AXES:
                if axis in axes:
                    for ranks in topology.get_axis_comm_lists(axis):
                        by_ranks[tuple(sorted(ranks))] = name
        elif mpu is not None:
            by_ranks[_ranks(mpu.get_model_parallel_group())] = "tp"
            by_ranks[_ranks(mpu.get_data_parallel_group())] = "dp"
        else:
            by_ranks[tuple(range(world))] = "dp"
        return cls(by_ranks, world, "pp" if topology is not None else "world")


def _expert_names() -> dict[tuple[int, ...], str]:
    """Expert-parallel groups DeepSpeed made for MoE layers (created inside the engine)."""
    from deepspeed.utils import groups

    out: dict[tuple[int, ...], str] = {}
    for table, name in ((groups._EXPERT_DATA_PARALLEL_GROUP, "expt_dp"), (groups._EXPERT_PARALLEL_GROUP, "ep")):
        for group in (table or {}).values():
            out[_ranks(group)] = name
    return out
