"""Choosing the plan before the engine exists, and writing its bucket knobs into the engine's config.

DeepSpeed allocates its ZeRO bucket buffers and sizes its prefetch when the engine is built, so
these knobs are decided here, once, and only change on the next start.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lagom.errors import ConfigError
from lagom.hardware import Hardware
from lagom.plan import Plan
from lagom.tune import make_plan
from lagom.workload import Workload
from lagom_deepspeed.config import BucketPins, LagomConfig
from lagom_deepspeed.workload import zero_knobs

# What each ZeRO stage reads at engine build (stage 0 buckets are fixed inside DeepSpeed).
STAGE_KNOBS = {
    0: (),
    1: ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"),
    2: ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"),
    3: ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "overlap_comm"),
}


def pinned(wl: Workload, pins: BucketPins) -> Workload:
    """The workload with the user's pinned bucket knobs, which the search must take as given."""
    f = wl.framework
    return replace(wl, framework=replace(
        f, reduce_bucket_size=pins.reduce_bucket_size or f.reduce_bucket_size,
        allgather_bucket_size=pins.allgather_bucket_size or f.allgather_bucket_size,
        prefetch_bucket_size=pins.stage3_prefetch_bucket_size or f.prefetch_bucket_size,
        overlap_comm=f.overlap_comm if pins.overlap_comm is None else pins.overlap_comm))


def search(wl: Workload, hw: Hardware, strategy: str, pins: BucketPins) -> Plan:
    """A plan from the cost model; bucket sizes are searched unless the user pinned them."""
    return make_plan(wl, hw, strategy, search_buckets=pins.reduce_bucket_size is None and pins.allgather_bucket_size is None)


def check(plan: Plan, world_size: int, wl: Workload, hw: Hardware, where: str) -> Plan:
    """Refuse a plan for another layout, workload or machine, naming the section key."""
    try:
        plan.check_for(world_size, wl, hw)
    except ConfigError as err:
        raise ConfigError(f"lagom.plan ({where}): {err.key}", err.problem, err.fix) from None
    if "deepspeed" not in plan.framework:
        raise ConfigError(f"lagom.plan ({where})", f"has no DeepSpeed bucket sizes (framework: {list(plan.framework)})",
                          "make the plan from a deepspeed workload")
    return plan


def load(path: str, world_size: int, wl: Workload, hw: Hardware) -> Plan:
    try:
        plan = Plan.load(path)
    except ConfigError as err:
        raise ConfigError(f"lagom.plan: {err.key}", err.problem, err.fix) from None
    return check(plan, world_size, wl, hw, path)


def same_on_all_ranks(plan: Plan) -> Plan:
    """Rank 0's plan on every rank, so no rank runs with other buckets than its peers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    box: list[Any] = [plan if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class StartPlan:
    plan: Plan
    source: str  # where it came from, for the log and the report


def offline_plan(section: LagomConfig, wl: Workload, hw: Hardware, world_size: int) -> StartPlan:
    """Load ``plan`` when it exists; otherwise search now (and save to ``plan`` when it is set)."""
    if section.plan and Path(section.plan).exists():
        return StartPlan(load(section.plan, world_size, wl, hw), f"loaded from {section.plan}")
    plan = same_on_all_ranks(search(wl, hw, section.strategy, section.buckets))
    if section.plan and (not dist.is_initialized() or dist.get_rank() == 0):
        plan.save(section.plan)
        return StartPlan(plan, f"searched with the cost model at start-up, saved to {section.plan}")
    return StartPlan(plan, "searched with the cost model at start-up")


@dataclass
class KnobChange:
    key: str
    before: Any
    after: Any
    why: str


def engine_config(ds_config: dict[str, Any], plan: Plan, pins: BucketPins,
                  largest_layer: int) -> tuple[dict[str, Any], list[KnobChange]]:
    """A copy of the DeepSpeed config with the plan's ZeRO knobs; the user's config is not modified.

    ``stage3_max_live_parameters`` is raised (never lowered) to what the plan's prefetch depth needs:
    the prefetched bucket plus the largest module being computed, or ZeRO-3 stops prefetching early
    and the overlap the plan counted on does not happen.
    """
    current = zero_knobs(ds_config)
    stage = current["stage"]
    chosen = dict(plan.framework["deepspeed"])
    prefetch = pins.stage3_prefetch_bucket_size or chosen["stage3_prefetch_bucket_size"]
    chosen["stage3_max_live_parameters"] = max(current["stage3_max_live_parameters"], prefetch + largest_layer)
    out = copy.deepcopy(ds_config)
    zero = out.setdefault("zero_optimization", {})
    changes: list[KnobChange] = []
    for key in STAGE_KNOBS[stage]:
        pin = getattr(pins, key)
        value = pin if pin is not None else chosen[key]
        zero.pop(key.removeprefix("stage3_"), None)  # DeepSpeed accepts either spelling; keep one
        zero[key] = value
        if value != current[key]:
            why = "pinned in lagom.buckets" if pin is not None else (
                "prefetch bucket + largest module" if key == "stage3_max_live_parameters" else f"plan ({plan.strategy})")
            changes.append(KnobChange(key, current[key], value, why))
    return out, changes
