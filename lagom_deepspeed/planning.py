"""The plan's bucket knobs, written into the engine's config before the engine exists.

DeepSpeed allocates its ZeRO bucket buffers and sizes its prefetch when the engine is built, so
these knobs are decided here, once, and only change on the next start.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from lagom.plan.plan import Plan
from lagom.runtime.online.state import KnobChange
from lagom.step.workload import Workload
from lagom_deepspeed.config import BucketPins
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

    def pin(value: Any, default: Any) -> Any:  # 0 is a real pin (e.g. prefetching off)
        return default if value is None else value

    return replace(wl, framework=replace(
        f, reduce_bucket_size=pin(pins.reduce_bucket_size, f.reduce_bucket_size),
        allgather_bucket_size=pin(pins.allgather_bucket_size, f.allgather_bucket_size),
        prefetch_bucket_size=pin(pins.stage3_prefetch_bucket_size, f.prefetch_bucket_size),
        overlap_comm=pin(pins.overlap_comm, f.overlap_comm)))


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
    prefetch = chosen["stage3_prefetch_bucket_size"] if pins.stage3_prefetch_bucket_size is None \
        else pins.stage3_prefetch_bucket_size
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
