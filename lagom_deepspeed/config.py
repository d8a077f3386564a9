"""The ``"lagom"`` section of a DeepSpeed JSON config, validated the way DeepSpeed validates its own.

DeepSpeed ignores top-level keys it does not know, so the section is free to define; inside it,
``DeepSpeedConfigModel`` forbids unknown keys and pydantic checks types and ranges. Every failure
becomes a ``ConfigError`` whose key is the dotted path in the DeepSpeed config (``lagom.tune_steps``).
"""

from __future__ import annotations

from typing import Any, Literal

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, ValidationError, field_validator

from lagom.errors import ConfigError
from lagom.runtime.apply.control import DEFAULT_TIMEOUT_S
from lagom.runtime.online.background import DEFAULT_SEARCH_S
from lagom.runtime.online.live import DEFAULT_BUDGET_S
from lagom.search import STRATEGIES

SECTION = "lagom"


class FlashOverlapSection(DeepSpeedConfigModel):
    """Whether ZeRO-3 bucket collectives may run as Flash-Overlap P2P steps where the plan says so."""

    enabled: bool = True
    num_chunks: int | None = Field(None, ge=1)
    """Pieces per peer shard; None: the plan's ``num_chunks`` for that collective."""
    comm_stream_priority: int = 0
    """CUDA priority of the stream that issues the transfers (negative is higher); ignored on CPU."""


class BucketPins(DeepSpeedConfigModel):
    """ZeRO bucket knobs the user fixes; None (or "auto") lets the plan choose.

    A pinned value is what the plan is searched and evaluated with, and what the engine gets. Each
    knob takes what ``zero_optimization`` takes for it (DeepSpeedZeroConfig's bounds: 0 turns the
    stage-3 prefetch off; 5e8 and "auto" are accepted as there).
    """

    reduce_bucket_size: int | None = Field(None, gt=0)
    allgather_bucket_size: int | None = Field(None, ge=0)
    stage3_prefetch_bucket_size: int | None = Field(None, ge=0)
    stage3_max_live_parameters: int | None = Field(None, ge=0)
    overlap_comm: bool | None = None


class LagomConfig(DeepSpeedConfigModel):
    """What a user writes under ``"lagom"``; see examples/deepspeed/ for a commented config."""

    enabled: bool = False
    mode: Literal["offline", "online"] = "offline"
    plan: str | None = None
    """Plan file to start from; when it does not exist, the plan searched beside the job is saved there once adopted.
    online: used until tuned; the tuned plan is cached in ``cache_dir`` and preferred on the next start."""
    hardware: str | None = None
    """Preset name (shipped, or in a LAGOM_HARDWARE_PATH folder) or YAML file whose cluster has as many GPUs as ranks;
    None: the session detects the machine."""
    strategy: str = "lagom"
    tune_steps: int = Field(60, gt=0)
    """online: the step budget of tuning; the first 5 steps fit the model, the rest try settings live."""
    tune_seconds: float = Field(DEFAULT_BUDGET_S, gt=0.0)
    """online: the wall-clock budget of trying settings live."""
    search_seconds: float = Field(DEFAULT_SEARCH_S, gt=0.0)
    """The wall-clock budget of each search Lagom runs beside the job (at start-up without a plan, on the
    calibrated model, after a drift); at its end the best plan found so far is taken, and the report says so."""
    report: str | None = None
    """Path prefix: writes <report>.json and <report>.md on rank 0; None writes no report."""
    workload: str | dict[str, Any] | None = None
    """A workload YAML used instead of the one derived from the model, or overrides of derived fields."""
    buckets: BucketPins = Field(default_factory=BucketPins)
    cache_dir: str = ".lagom-cache"
    strict_env: bool = True
    """NCCL variables that contradict the plan are errors (else a logged warning)."""
    retune_threshold: float = Field(0.1, gt=0.0, lt=1.0)
    """online: relative drop in overlap efficiency that starts a new tuning round."""
    monitor_interval: int = Field(20, gt=0)
    """online: every this many steps the ranks agree (one tiny all-reduce) whether any saw drift."""
    flash_overlap: FlashOverlapSection = Field(default_factory=FlashOverlapSection)
    collective_timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0.0)
    """Lagom's own collectives (start plan, agreements): a rank missing this long switches Lagom off on
    every rank instead of hanging the job."""

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        if value not in STRATEGIES:
            raise ValueError(f"unknown strategy '{value}'; use one of {', '.join(STRATEGIES)}")
        return value


def _first_error(err: ValidationError) -> ConfigError:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    key = f"{SECTION}.{loc}" if loc else SECTION
    if e["type"] == "extra_forbidden":
        model = LagomConfig
        for part in e["loc"][:-1]:
            model = model.model_fields[str(part)].annotation  # type: ignore[assignment]
        known = ", ".join(model.model_fields)  # type: ignore[union-attr]
        return ConfigError(key, "unknown key", f"known keys here: {known}")
    if e["type"] == "value_error":  # our own validators say what was wrong and how to fix it
        return ConfigError(key, e["msg"].removeprefix("Value error, "))
    return ConfigError(key, f"{e['msg']}, got {e['input']!r}", "see the schema in lagom_deepspeed/config.py")


def parse_section(ds_config: dict[str, Any]) -> LagomConfig | None:
    """The validated section, or None when it is absent; raises ConfigError naming the bad key."""
    raw = ds_config.get(SECTION)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(SECTION, f"must be a JSON object, got {type(raw).__name__}")
    try:
        section = LagomConfig(**raw)
    except ValidationError as err:
        raise _first_error(err) from None
    return section
