"""The lagom Workload of a DeepSpeed job, read off the torch model and the DeepSpeed config.

What is inferred, and from where (each choice is also written to ``Derived.notes`` and the report):
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
- training: micro/global batch by DeepSpeed's own rules; dtype from ``bf16``/``fp16``; gradient
  dtype from ``communication_data_type`` (else the training dtype).
- parallel: pp from a ``PipelineModule``, tp from the ``mpu``, dp = world / (pp x tp), ZeRO stage.
- framework: the ZeRO bucket knobs as DeepSpeed would read them (its defaults where absent).
The parameter count the workload implies is compared with the count on the model and both go to
the report, so a poor inference is visible. Mixture-of-experts models need a workload file.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.errors import ConfigError
from lagom.workload import Framework, Model, Parallel, Training, Workload, load_workload, validate

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
DS_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
               "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000}
DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "bf16": "bf16", "bfloat16": "bf16"}


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


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The largest set of same-class siblings that contain Linear layers: the repeated layers."""
    best: list[torch.nn.Module] = []
    for parent in model.modules():
        by_class: dict[type, list[torch.nn.Module]] = defaultdict(list)
        for child in parent.children():
            if any(True for _ in child.children()) and _linears(child):
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
    """Every rank's facts, so that pipeline stages agree on the whole model."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [facts]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, facts)
    return out


@dataclass
class Derived:
    workload: Workload
    model_params: int  # trainable parameters counted on the model (all stages)
    implied_params: int  # what the workload's shape implies
    largest_layer: int  # most parameters ZeRO-3 holds gathered for one module
    notes: list[str]


def _batch(cfg: dict[str, Any], dp: int) -> tuple[int, int]:
    """(micro_batch, global_batch) by DeepSpeed's rules for the three batch keys."""
    def get(key: str) -> int | None:
        v = cfg.get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    tb, mb, gas = get("train_batch_size"), get("train_micro_batch_size_per_gpu"), get("gradient_accumulation_steps")
    if mb is None and tb is not None:
        mb = tb // ((gas or 1) * dp)
    if mb is None:
        raise ConfigError("train_micro_batch_size_per_gpu", "missing (and train_batch_size too)",
                          "set the batch keys DeepSpeed needs")
    return mb, tb if tb is not None else mb * (gas or 1) * dp


def _dtypes(cfg: dict[str, Any]) -> tuple[str, str]:
    def on(key: str) -> bool:
        sec = cfg.get(key)
        return isinstance(sec, dict) and bool(sec.get("enabled"))

    dtype = "bf16" if on("bf16") or on("bfloat16") else "fp16" if on("fp16") else "fp32"
    comm = cfg.get("communication_data_type")
    if comm is not None and str(comm).lower() not in DTYPE_NAMES:
        raise ConfigError("communication_data_type", f"unknown '{comm}'", "use fp32, fp16 or bf16")
    return dtype, DTYPE_NAMES[str(comm).lower()] if comm is not None else dtype


def zero_knobs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ZeRO knobs as the engine will read them: the user's values, DeepSpeed's defaults elsewhere."""
    zero = cfg.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    out: dict[str, Any] = {"stage": stage}
    for key, default in DS_DEFAULTS.items():
        alias = key.removeprefix("stage3_")
        v = zero.get(key, zero.get(alias, default))
        out[key] = int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default
    overlap = zero.get("overlap_comm")
    out["overlap_comm"] = bool(overlap) if isinstance(overlap, bool) else stage == 3  # DeepSpeed's default
    return out


def implied_params(wl: Workload) -> int:
    """Parameters a dense workload of this shape holds (embedding once, norms included)."""
    m = wl.model
    head_dim = m.hidden // m.heads
    attn = m.hidden * (m.hidden + 2 * (m.kv_heads or m.heads) * head_dim) + m.hidden * m.hidden
    mlp = m.hidden * m.ffn * (3 if m.gated_mlp else 2)
    return m.layers * (attn + mlp + 4 * m.hidden) + m.vocab * m.hidden


def _pick(name: str, hf: int, seen: int, source: str, notes: list[str]) -> int:
    if hf:
        notes.append(f"model.{name}={hf} from model.config")
        return hf
    if seen:
        notes.append(f"model.{name}={seen} from {source}")
    return seen


def derive(model: torch.nn.Module, cfg: dict[str, Any], world_size: int, pp: int = 1, tp: int = 1) -> Derived:
    """Infer the workload; raise ConfigError naming the workload field that cannot be inferred."""
    every = _gather(model_facts(model))
    f = every[dist.get_rank() if len(every) > 1 else 0]
    notes: list[str] = []
    if any(x.moe for x in every):
        raise ConfigError("lagom.workload", "mixture-of-experts models are not derived from the model",
                          "pass a workload YAML with model.architecture: moe as \"workload\": PATH")
    hf = f.hf
    layers_seen = sum(x.blocks for x in every) * pp // world_size
    block = next((x.block_class for x in every if x.block_class), "")
    layers = _pick("layers", hf.get("layers", 0), layers_seen, f"{layers_seen} x {block}", notes)
    vocab = _pick("vocab", hf.get("vocab", 0), max(x.vocab for x in every), "the largest nn.Embedding", notes)
    hidden = _pick("hidden", hf.get("hidden", 0), max(x.hidden for x in every), "the largest nn.Embedding", notes)
    seq = _pick("seq_len", hf.get("seq_len", 0), max(x.seq_len for x in every), "the position table", notes)
    for key, value in (("layers", layers), ("vocab", vocab), ("hidden", hidden), ("seq_len", seq)):
        if not value:
            raise ConfigError(f"lagom.workload.model.{key}", "cannot be inferred from the model",
                              f"add \"workload\": {{\"model\": {{\"{key}\": N}}}} to the lagom section")
    heads = _pick("heads", hf.get("heads", 0), max(x.heads for x in every), "the attention modules", notes)
    if not heads:
        heads = max(1, hidden // 64) if hidden % max(1, hidden // 64) == 0 else 1
        notes.append(f"model.heads={heads} assumed (one per 64 channels): no attention module names its heads")
    kv = hf.get("kv_heads", 0) or max(x.kv_heads for x in every)
    ffn = _pick("ffn", hf.get("ffn", 0), max(x.ffn for x in every), f"the Linear back to hidden in {block}", notes)
    if not ffn:
        ffn = 4 * hidden
        notes.append(f"model.ffn={ffn} assumed (4 x hidden): no Linear maps back to hidden in a block")
    dp = world_size // (pp * tp)
    micro, global_batch = _batch(cfg, dp)
    dtype, grad_dtype = _dtypes(cfg)
    knobs = zero_knobs(cfg)
    wl = Workload(
        name=f"deepspeed-{type(model).__name__}",
        description="derived by lagom_deepspeed from the model and the DeepSpeed config",
        model=Model(architecture="gpt", layers=layers, hidden=hidden, ffn=ffn, heads=heads, kv_heads=kv,
                    seq_len=seq, vocab=vocab, gated_mlp=any(x.gated for x in every)),
        training=Training(micro_batch=micro, global_batch=global_batch, dtype=dtype, grad_dtype=grad_dtype),
        parallel=Parallel(dp=dp, tp=tp, pp=pp, zero_stage=knobs["stage"], fsdp=knobs["stage"] == 3),
        framework=Framework(name="deepspeed", reduce_bucket_size=knobs["reduce_bucket_size"],
                            allgather_bucket_size=knobs["allgather_bucket_size"],
                            prefetch_bucket_size=knobs["stage3_prefetch_bucket_size"],
                            overlap_comm=knobs["overlap_comm"]))
    counted = sum(x.params for x in every) * pp // world_size
    return Derived(wl, counted, implied_params(wl), max(x.largest_layer for x in every), notes)


def apply_overrides(derived: Derived, source: str | dict[str, Any] | None, world_size: int) -> Derived:
    """Replace the derived workload by a YAML file, or merge a dict of overrides into it (strictly)."""
    if source is None:
        wl = derived.workload
    elif isinstance(source, str):
        wl = load_workload(source)
        derived.notes.append(f"workload from {source} (not derived from the model)")
    else:
        try:
            merged = OmegaConf.merge(OmegaConf.structured(derived.workload), source)
            wl = OmegaConf.to_object(merged)  # type: ignore[assignment]
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or ""
            raise ConfigError(f"lagom.workload.{key}".rstrip("."), str(err).splitlines()[0],
                              "override fields of lagom/workload.py's Workload") from None
        derived.notes.append(f"overrides from the lagom section: {source}")
    try:
        validate(wl, world_size)
    except ConfigError as err:
        raise ConfigError(f"lagom.workload: {err.key}", err.problem, err.fix) from None
    derived.workload = wl
    derived.implied_params = implied_params(wl)
    return derived
