"""The lagom Workload of a DeepSpeed job, read off the torch model and the DeepSpeed config.

``describe`` is the one entry point. Fields the user sets under ``"lagom": {"workload": {...}}`` are
taken as given and never inferred; the rest is inferred as follows (each choice is also written to
``Derived.notes`` and the report):
- model.layers: the largest set of sibling modules of one class that hold Linear layers (the
  transformer blocks), summed over pipeline stages; or ``config.num_hidden_layers``/``n_layer``.
- model.vocab, model.hidden: the largest ``nn.Embedding`` (``vocab_size``/``hidden_size`` of a
  Hugging Face style ``model.config`` win when present).
- model.seq_len: a position table (an Embedding or Parameter whose name contains "pos" or "wpe"),
  or ``max_position_embeddings``/``n_positions``; that is the longest sequence the model accepts,
  so set ``"workload": {"model": {"seq_len": N}}`` when training uses shorter ones.
- model.heads / kv_heads: ``nn.MultiheadAttention.num_heads`` or a ``num_heads``-like attribute;
  else one head per 64 channels (logged).
- model.ffn / gated_mlp: in one block, a Linear back to ``hidden`` gives the FFN width; two
  Linears from ``hidden`` to it (or one to twice it) mean a gated MLP; else 4 x hidden (logged).
- training, parallel.zero_stage, framework: parsed by DeepSpeed's own ``DeepSpeedConfig`` (batch
  rules, "auto" values, aliases, defaults), so Lagom reads exactly what the engine will read.
- parallel: pp from a ``PipelineModule``, tp from the ``mpu``, dp = world / (pp x tp).
- framework.grad_tensors: the trainable parameters' sizes in the order backward completes their gradients, so that
  the plan's gradient buckets are the ones DeepSpeed's own rule cuts from this model (``lagom.step.points``).
A model Lagom cannot describe (no embedding, no repeated blocks, a mixture of experts, a shape the
workload checks refuse) is not an error: ``Derived.workload`` is None and ``missing``/``why`` say
which workload fields would let Lagom plan for it, so the session can fall back and warn once.
The parameter count the workload implies (lagom.step.points' per-layer count) is compared with the
count on the model and both go to the report, so a poor inference is visible.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.errors import ConfigError
from lagom.step.points import rank_params
from lagom.step.workload import (
    Framework,
    Model,
    Parallel,
    Training,
    Workload,
    load_workload,
    validate,
)

HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads", "nhead")
KV_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads")
HF_FIELDS = {  # workload field -> Hugging Face config attributes, first found wins
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": KV_ATTRS,
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions", "seq_length"),
}
REQUIRED = ("layers", "vocab", "hidden", "seq_len")  # model fields with no sensible fallback
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def numel(p: torch.Tensor) -> int:
    """Elements of a parameter, also when ZeRO-3 has already partitioned it (``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


@dataclass
class ModelFacts:
    """What one rank sees of its model (a pipeline stage sees only its own layers)."""

    params: int = 0
    blocks: int = 0
    block_class: str = ""
    block_params: int = 0
    vocab: int = 0
    hidden: int = 0
    seq_len: int = 0
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0
    gated: bool = False
    largest_layer: int = 0  # params of the largest module ZeRO-3 gathers at once (a block or the embedding)
    moe: bool = False
    hf: dict[str, int] = field(default_factory=dict)


def _linears(module: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in module.modules() if isinstance(m, torch.nn.Linear)]


CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # hold layers, have no forward: never a layer


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest set of same-class siblings that contain Linear layers: the repeated layers."""
    best: list[torch.nn.Module] = []
    for parent in model.modules():
        by_class: dict[type, list[torch.nn.Module]] = defaultdict(list)
        for child in parent.children():
            if not isinstance(child, CONTAINERS) and any(True for _ in child.children()) and _linears(child):
                by_class[type(child)].append(child)
        for group in by_class.values():
            if len(group) > len(best):
                best = group
    return best


def _ffn(block: torch.nn.Module, hidden: int) -> tuple[int, bool]:
    lin = _linears(block)
    down = [m.in_features for m in lin if m.out_features == hidden and m.in_features != hidden]
    if not down:
        return 0, False
    ffn = max(down)
    ups = [m for m in lin if m.in_features == hidden and m.out_features in (ffn, 2 * ffn)]
    gated = len([m for m in ups if m.out_features == ffn]) >= 2 or any(m.out_features == 2 * ffn for m in ups)
    return ffn, gated


def _position_rows(model: torch.nn.Module) -> int:
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding) and any(k in name.lower() for k in ("pos", "wpe")):
            return mod.num_embeddings
    for name, p in model.named_parameters():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if len(shape) >= 2 and any(k in name.lower() for k in ("pos", "wpe")):
            return int(shape[0])
    return 0


def _int_attr(obj: Any, names: tuple[str, ...]) -> int:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


def model_facts(model: torch.nn.Module) -> ModelFacts:
    f = ModelFacts(params=sum(numel(p) for p in model.parameters() if p.requires_grad))
    blocks = _blocks(model)
    f.blocks = len(blocks)
    if blocks:
        f.block_class = type(blocks[0]).__name__
        f.block_params = sum(numel(p) for p in blocks[0].parameters())
    embeds = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if embeds:
        big = max(embeds, key=lambda m: m.num_embeddings)
        f.vocab, f.hidden = big.num_embeddings, big.embedding_dim
    f.largest_layer = max([f.block_params] + [numel(m.weight) for m in embeds])
    f.seq_len = _position_rows(model)
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            f.heads = f.heads or m.num_heads
        f.heads = f.heads or _int_attr(m, HEAD_ATTRS)
        f.kv_heads = f.kv_heads or _int_attr(m, KV_ATTRS)
        f.moe = f.moe or type(m).__name__ == "MoE" and type(m).__module__.startswith("deepspeed.moe")
    if blocks and f.hidden:
        f.ffn, f.gated = _ffn(blocks[0], f.hidden)
    cfg = getattr(model, "config", None)
    if cfg is not None:
        f.hf = {k: v for k, names in HF_FIELDS.items() if (v := _int_attr(cfg, names))}
    return f


def _gather(facts: ModelFacts) -> list[ModelFacts]:
    """Every rank's facts, so that pipeline stages agree on the whole model (collective: all ranks call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [facts]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, facts)
    return out


@dataclass
class Derived:
    """The workload Lagom could describe, or (``workload`` None) what it would need to.

    ``missing``: dotted workload fields to set under ``"lagom": {"workload": {...}}``; ``why``: the
    reason in words. The model's own counts are filled in either way.
    """

    workload: Workload | None
    model_params: int  # trainable parameters counted on the model (one tp rank, all stages)
    implied_params: int  # what the workload's shape implies (0 without a workload)
    largest_layer: int  # most parameters ZeRO-3 holds gathered for one module
    notes: list[str]
    missing: list[str] = field(default_factory=list)
    why: str = ""

    def fix(self) -> str:
        """What the user can add to the DeepSpeed config so that Lagom can plan for this job."""
        nested: dict[str, dict[str, str]] = {}
        for key in self.missing:
            section, _, name = key.partition(".")
            if key == "model.architecture":
                nested.setdefault(section, {}).update(architecture='"moe"', experts="N", top_k="N", moe_ffn="N")
            elif name:
                nested.setdefault(section, {})[name] = "N"
        body = ", ".join(f'"{section}": {{' + ", ".join(f'"{k}": {v}' for k, v in names.items()) + "}"
                         for section, names in nested.items())
        fields_part = f'set "lagom": {{"workload": {{{body}}}}} in the DeepSpeed config, or ' if body else "set "
        return fields_part + '"lagom": {"workload": "<file.yaml>"} (a workload file like those in lagom/configs/workloads/)'

    def warning(self) -> str:
        """The one warning a session logs when it runs with DeepSpeed's own settings instead of a plan."""
        return (f"Lagom cannot describe this job: {self.why}. DeepSpeed keeps its own bucket settings and "
                f"Lagom only records the collectives it sees. To let Lagom plan and tune: {self.fix()}")


@dataclass(frozen=True)
class EngineSettings:
    """What the engine will read from the DeepSpeed config, as DeepSpeed itself parses it."""

    micro_batch: int
    global_batch: int
    dtype: str
    grad_dtype: str  # the engine's communication_data_type
    knobs: dict[str, Any]  # as ``zero_knobs`` gives them


class RefusedByDeepSpeed(Exception):
    """DeepSpeed's own parser refused the config; the engine would refuse it the same way."""


class _DataParallelSize:
    """The one thing ``DeepSpeedConfig`` asks an mpu: the data-parallel size its batch rules divide by."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def _knobs(zero: Any) -> dict[str, Any]:
    """A parsed ``DeepSpeedZeroConfig`` as the knobs Lagom plans and writes (config spelling)."""
    return {"stage": int(zero.stage), "reduce_bucket_size": int(zero.reduce_bucket_size),
            "allgather_bucket_size": int(zero.allgather_bucket_size),
            "stage3_prefetch_bucket_size": int(zero.prefetch_bucket_size),
            "stage3_max_live_parameters": int(zero.max_live_parameters), "overlap_comm": bool(zero.overlap_comm)}


def zero_knobs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO knobs as the engine will read them, parsed by DeepSpeed (its defaults where absent)."""
    from deepspeed.runtime.zero.config import get_zero_config

    return _knobs(get_zero_config(copy.deepcopy(cfg)))


def engine_settings(cfg: dict[str, Any], dp: int) -> EngineSettings:
    """Parse ``cfg`` with DeepSpeed's ``DeepSpeedConfig`` for ``dp`` data-parallel ranks.

    Raises RefusedByDeepSpeed for a config DeepSpeed refuses. With ``dp`` > 1 DeepSpeed's comm must
    be initialised (DeepSpeedConfig reads the world only then).
    """
    import deepspeed.comm as ds_comm
    from deepspeed.runtime.config import DeepSpeedConfig

    if dp > 1 and not ds_comm.is_initialized():
        raise RuntimeError("engine_settings for more than one data-parallel rank needs deepspeed.comm initialised")
    try:
        ds = DeepSpeedConfig(copy.deepcopy(cfg), mpu=_DataParallelSize(dp))
    except Exception as err:  # any refusal (assert, ValueError, pydantic, DeepSpeedConfigError, ...)
        raise RefusedByDeepSpeed(str(err).splitlines()[0] if str(err) else type(err).__name__) from err
    half = "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else None
    autocast = DTYPE_NAMES.get(ds.torch_autocast_dtype) if ds.torch_autocast_enabled else None
    comm = ds.communication_data_type  # the engine's rule: the configured type, else the half type, else fp32
    return EngineSettings(micro_batch=ds.train_micro_batch_size_per_gpu, global_batch=ds.train_batch_size,
                          dtype=half or autocast or "fp32",
                          grad_dtype=DTYPE_NAMES[comm] if comm is not None else half or "fp32",
                          knobs=_knobs(ds.zero_config))


def _pick(name: str, hf: int, seen: int, source: str, notes: list[str]) -> int:
    if hf:
        notes.append(f"model.{name}={hf} from model.config")
        return hf
    if seen:
        notes.append(f"model.{name}={seen} from {source}")
    return seen


def _model_fields(every: list[ModelFacts], world_size: int, pp: int, given: dict[str, Any],
                  notes: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The model fields inferred from every rank's facts, skipping those the user gave (``given``:
    the overrides' "model" part); and the dotted names of required fields neither given nor inferred."""
    hf = every[dist.get_rank() if len(every) > 1 else 0].hf
    block = next((x.block_class for x in every if x.block_class), "")
    layers = sum(x.blocks for x in every) * pp // world_size
    seen = {
        "layers": (layers, f"{layers} x {block}"),
        "vocab": (max(x.vocab for x in every), "the largest nn.Embedding"),
        "hidden": (max(x.hidden for x in every), "the largest nn.Embedding"),
        "seq_len": (max(x.seq_len for x in every), "the position table"),
        "heads": (max(x.heads for x in every), "the attention modules"),
        "ffn": (max(x.ffn for x in every), f"the Linear back to hidden in {block}"),
    }
    out: dict[str, Any] = {name: _pick(name, hf.get(name, 0), value, source, notes)
                           for name, (value, source) in seen.items() if name not in given}
    missing = [f"model.{name}" for name in REQUIRED if name not in given and not out[name]]
    hidden = given.get("hidden") or out.get("hidden", 0)
    if "heads" not in given and not out["heads"] and hidden:
        per = max(1, hidden // 64)
        out["heads"] = per if hidden % per == 0 else 1
        notes.append(f"model.heads={out['heads']} assumed (one per 64 channels): no attention module names its heads")
    if "ffn" not in given and not out["ffn"] and hidden:
        out["ffn"] = 4 * hidden
        notes.append(f"model.ffn={out['ffn']} assumed (4 x hidden): no Linear maps back to hidden in a block")
    if "kv_heads" not in given:
        out["kv_heads"] = hf.get("kv_heads", 0) or max(x.kv_heads for x in every)
    if "gated_mlp" not in given:
        out["gated_mlp"] = any(x.gated for x in every)
    if any(x.moe for x in every) and "architecture" not in given:
        missing.append("model.architecture")
    return out, missing


def _why_missing(missing: list[str]) -> str:
    if "model.architecture" in missing:
        return "the model has DeepSpeed mixture-of-experts layers, whose experts are not read off the model"
    return (f"{', '.join(missing)} cannot be inferred from the model (it has no nn.Embedding, repeated "
            "blocks or model.config that give them)")


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in tree.items():
        keys |= _flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


def _merge(wl: Workload, overrides: dict[str, Any]) -> Workload:
    """``overrides`` merged into a workload strictly: unknown keys and wrong types name the key."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(wl), overrides)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"lagom.workload.{key}".rstrip("."), str(err).splitlines()[0],
                          "override fields of lagom/step/workload.py's Workload") from None


def grad_tensors(model: torch.nn.Module) -> list[int]:
    """Each trainable parameter's elements in the order backward completes its gradient, as DeepSpeed's gradient
    hooks see them: reverse registration order (a tied weight once, complete when its first user's backward is)."""
    return [numel(p) for p in reversed(list(model.parameters())) if p.requires_grad]


def describe(model: torch.nn.Module, ds_config: dict[str, Any], world_size: int, pp: int = 1, tp: int = 1,
             overrides: str | dict[str, Any] | None = None) -> Derived:
    """The job's workload, or why Lagom cannot describe it; every rank must call it (facts are gathered).

    ``overrides``: the section's ``"workload"``: a workload file used as is, or fields taken as
    given before anything is inferred. A mistake in what the user wrote there (unknown key, wrong
    type, a file that does not load, a given value the workload checks refuse) is a ConfigError;
    what Lagom cannot infer, and a config DeepSpeed itself refuses, come back in ``Derived``.
    """
    every = _gather(model_facts(model))
    counted = sum(x.params for x in every) * pp // world_size
    largest = max(x.largest_layer for x in every)
    notes: list[str] = []

    def checked(wl: Workload, users: set[str], from_file: bool = False) -> Derived:
        """``wl`` validated; a refused key the user wrote (``users``, or any from a file) is their error."""
        try:
            validate(wl, world_size)
        except ConfigError as err:
            if from_file or err.key in users:
                raise ConfigError(f"lagom.workload.{err.key}", err.problem, err.fix) from None
            if err.key.startswith("model."):  # inferred wrongly: the user can give the field
                return Derived(None, counted, 0, largest, notes, [err.key],
                               f"the model's shape as inferred fails Lagom's check of {err.key}: {err.problem}")
            return Derived(None, counted, 0, largest, notes, [],
                           f"Lagom's workload check refuses {err.key} ({err.problem}) for this job")
        return Derived(wl, counted, rank_params(wl), largest, notes)

    if isinstance(overrides, str):
        try:
            wl = load_workload(overrides)
        except ConfigError as err:
            raise ConfigError(f"lagom.workload: {err.key}", err.problem, err.fix) from None
        notes.append(f"workload from {overrides} (not derived from the model)")
        return checked(wl, set(), from_file=True)
    given = _flat_keys(overrides or {})
    if overrides:
        _merge(Workload(name=""), overrides)  # the user's keys and types, checked before anything is inferred
        notes.append(f"given in the lagom section: {', '.join(sorted(given))}")
    dp = max(1, world_size // (pp * tp))
    try:
        ds = engine_settings(ds_config, dp)
    except RefusedByDeepSpeed as err:
        return Derived(None, counted, 0, largest, notes, [], f"DeepSpeed refuses its config ({err}) and says so itself")
    inferred, missing = _model_fields(every, world_size, pp, (overrides or {}).get("model", {}), notes)
    if missing:
        return Derived(None, counted, 0, largest, notes, missing, _why_missing(missing))
    knobs = ds.knobs
    wl = Workload(
        name=f"deepspeed-{type(model).__name__}",
        description="derived by lagom_deepspeed from the model and the DeepSpeed config",
        model=Model(architecture="gpt", **inferred),
        training=Training(micro_batch=ds.micro_batch, global_batch=ds.global_batch, dtype=ds.dtype,
                          grad_dtype=ds.grad_dtype),
        parallel=Parallel(dp=dp, tp=tp, pp=pp, zero_stage=knobs["stage"], fsdp=knobs["stage"] == 3),
        framework=Framework(name="deepspeed", reduce_bucket_size=knobs["reduce_bucket_size"],
                            allgather_bucket_size=knobs["allgather_bucket_size"],
                            prefetch_bucket_size=knobs["stage3_prefetch_bucket_size"],
                            overlap_comm=knobs["overlap_comm"], grad_tensors=grad_tensors(model) if pp == 1 else None))
    return checked(_merge(wl, overrides) if overrides else wl, given)
