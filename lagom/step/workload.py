"""A training job described in YAML: model, batch, parallel layout and framework knobs.

Loaded through an omegaconf structured schema, so unknown keys and wrong types fail with the key's
name; layout checks (tp divides heads, dp*tp*pp*cp = world size, ...) follow in ``validate``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lagom.config_file import read_mapping
from lagom.errors import ConfigError
from lagom.resources import WORKLOAD_DIR

ARCHITECTURES = ("gpt", "bert", "t5", "moe")
FRAMEWORKS = ("megatron", "deepspeed")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# The step graph (lagom.step.points) holds every compute segment and collective of one step, about 300 bytes
# each; building 4M of them takes about a minute and 1.2 GB. A Llama-70B-like job on 1,024 GPUs (80
# layers, pp 8, 256 micro-batches) is estimated at 0.67M and builds 0.58M.
MAX_STEP_GRAPH_ITEMS = 4_000_000
MAX_DIMENSION = 2**24  # model widths, lengths, counts and batch sizes: larger is a typo, not a model
MAX_WORLD_SIZE = 2**20  # GPUs in one job
MAX_BUCKET_ELEMENTS = 2**40
# Segments and collectives one layer adds per micro-batch (forward and backward) at most: norms, the
# attention and MLP (or MoE) linears with their tensor-parallel collectives, sharded-parameter gathers.
# Each context-parallel rank adds four (a ring step's segment and send, both ways); a T5 decoder layer's
# cross-attention adds CROSS_ATTENTION_ITEMS; head, embedding and loss add MICRO_BATCH_ITEMS.
LAYER_ITEMS = 28
CP_ITEMS_PER_RANK = 4
CROSS_ATTENTION_ITEMS = 20
MICRO_BATCH_ITEMS = 8
# Parameter tensors (weights and biases) of one layer at most, besides its experts: three norms, the
# attention and cross-attention linears, the MLP or the router and shared experts; each expert has
# four; embeddings, the final norm and the output layer add EMBEDDING_TENSORS per stage, and each of a
# stage's two gradient buffers (dense and expert) may close BUFFER_BUCKETS more buckets than tensors.
TENSORS_PER_LAYER = 21
TENSORS_PER_EXPERT = 4
EMBEDDING_TENSORS = 5
BUFFER_BUCKETS = 4


@dataclass
class Model:
    architecture: str = "gpt"  # gpt (decoder) | bert (encoder) | t5 (encoder-decoder) | moe (decoder with experts)
    layers: int = 0  # decoder layers for gpt/moe, encoder layers for bert and t5
    decoder_layers: int = 0  # t5 only
    hidden: int = 0
    ffn: int = 0
    heads: int = 0
    kv_heads: int = 0  # 0 means the same as heads
    seq_len: int = 0
    decoder_seq_len: int = 0  # t5 only; 0 means seq_len
    vocab: int = 0
    gated_mlp: bool = False  # SwiGLU: fc1 produces 2 x ffn
    experts: int = 0  # moe only
    top_k: int = 0
    moe_ffn: int = 0  # per-expert ffn width
    shared_experts: int = 0  # always-on experts computed beside the all-to-all
    moe_every: int = 1  # every n-th layer is an MoE layer
    # Parameter tensors beyond the layers' weights: what megatron-core's DDP puts in its gradient buckets.
    linear_bias: bool = False  # linear layers carry biases (megatron's default; --disable-bias-linear drops them)
    rms_norm: bool = False  # RMSNorm (a weight per norm) instead of LayerNorm (weight and bias)
    position_embeddings: int = 0  # rows of a learned position-embedding table (megatron's learned_absolute); 0: none
    untied_embeddings: bool = False  # the output layer has its own weight instead of the word embedding's


@dataclass
class Training:
    micro_batch: int = 1
    global_batch: int = 1
    dtype: str = "bf16"
    grad_dtype: str = "fp32"  # what the gradient buckets are reduced in (megatron: fp32 unless grad_reduce_in_bf16)


@dataclass
class Parallel:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # megatron: reduce-scatter grads, all-gather params
    zero_stage: int = 0  # deepspeed ZeRO 0..3
    fsdp: bool = False  # parameters sharded and gathered per layer (ZeRO-3 / FSDP)


@dataclass
class Framework:
    name: str = "megatron"
    bucket_size: int | None = None  # megatron DDP elements per bucket; None: max(40M, 1M x dp)
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False  # megatron --ddp-pad-buckets-for-high-nccl-busbw
    reduce_bucket_size: int = 500_000_000  # deepspeed elements
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000  # deepspeed stage3_prefetch_bucket_size; 0: no prefetching
    overlap_comm: bool = True
    # deepspeed: elements of each trainable parameter tensor in the order backward completes their gradients, read
    # off the job's model (lagom_deepspeed); DeepSpeed's own bucket rule cuts them at any reduce_bucket_size. None:
    # the tensors the model fields imply. Used where pp == 1 (a pipeline stage's tensors are only its own).
    grad_tensors: list[int] | None = None


@dataclass
class Workload:
    name: str = "???"
    description: str = ""
    hardware: str | None = None  # default preset for this workload
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    parallel: Parallel = field(default_factory=Parallel)
    framework: Framework = field(default_factory=Framework)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.dp * p.tp * p.pp * p.cp

    @property
    def microbatches(self) -> int:
        """Micro-batches per step and per data-parallel rank (gradient accumulation steps)."""
        return self.training.global_batch // (self.training.micro_batch * self.parallel.dp)

    def with_microbatches(self, n: int) -> Workload:
        """The same job with ``n`` micro-batches per step and data-parallel rank (the global batch scaled to it)."""
        return replace(self, training=replace(self.training, global_batch=n * self.training.micro_batch * self.parallel.dp))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.training.dtype]

    @property
    def ddp_bucket_elems(self) -> int:
        """Megatron DDP's bucket size: the configured one, else max(40M, 1M x dp x cp) (megatron-core 0.19)."""
        return self.framework.bucket_size or max(40_000_000, 1_000_000 * self.parallel.dp * self.parallel.cp)

    def fingerprint(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def workload_names() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.yaml"))


def load_workload(source: str | Path) -> Workload:
    """Load a workload YAML (or the name of a shipped one, lagom/configs/workloads/) strictly, then check its layout."""
    path = Path(source)
    if not path.exists() and not path.suffix and (WORKLOAD_DIR / f"{source}.yaml").exists():
        path = WORKLOAD_DIR / f"{source}.yaml"
    if not path.exists():
        raise ConfigError("workload", f"file {source} does not exist", f"pass a YAML file or one of {', '.join(workload_names())}")
    if path.is_dir():
        raise ConfigError("workload", f"{source} is a folder", "pass a YAML file")
    data = read_mapping(path)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Workload), data)
        wl: Workload = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "workload"
        first = str(err).splitlines()[0]
        raise ConfigError(f"{path.name}: {key}", first, "see the schema in lagom/step/workload.py") from None
    validate(wl)
    return wl


def validate(wl: Workload, world_size: int | None = None) -> None:
    """Check what the schema cannot: sizes, divisibility, and the layout against the cluster."""
    m, t, p, f = wl.model, wl.training, wl.parallel, wl.framework
    if m.architecture not in ARCHITECTURES:
        raise ConfigError("model.architecture", f"unknown '{m.architecture}'", f"use one of {', '.join(ARCHITECTURES)}")
    if f.name not in FRAMEWORKS:
        raise ConfigError("framework.name", f"unknown '{f.name}'", f"use one of {', '.join(FRAMEWORKS)}")
    if t.dtype not in DTYPE_BYTES or t.grad_dtype not in DTYPE_BYTES:
        raise ConfigError("training.dtype", f"unknown dtype '{t.dtype}'/'{t.grad_dtype}'", "use bf16, fp16 or fp32")
    positive = {
        "model.layers": m.layers, "model.hidden": m.hidden, "model.ffn": m.ffn, "model.heads": m.heads,
        "model.seq_len": m.seq_len, "model.vocab": m.vocab, "training.micro_batch": t.micro_batch,
        "training.global_batch": t.global_batch, "parallel.dp": p.dp, "parallel.tp": p.tp, "parallel.pp": p.pp,
        "parallel.cp": p.cp, "parallel.ep": p.ep, "framework.reduce_bucket_size": f.reduce_bucket_size,
        "framework.allgather_bucket_size": f.allgather_bucket_size,
    }
    if m.architecture == "t5":
        positive["model.decoder_layers"] = m.decoder_layers
    if m.architecture == "moe":
        positive |= {"model.experts": m.experts, "model.top_k": m.top_k, "model.moe_ffn": m.moe_ffn,
                     "model.moe_every": m.moe_every}
    if f.bucket_size is not None:
        positive["framework.bucket_size"] = f.bucket_size
    if m.kv_heads:
        positive["model.kv_heads"] = m.kv_heads
    if m.decoder_seq_len:
        positive["model.decoder_seq_len"] = m.decoder_seq_len
    _check_sizes(positive)
    if f.grad_tensors is not None:
        if f.name != "deepspeed":
            raise ConfigError("framework.grad_tensors", "describes DeepSpeed's gradient buckets",
                              "remove it, or set framework.name: deepspeed")
        if not f.grad_tensors or not all(0 <= n <= MAX_BUCKET_ELEMENTS for n in f.grad_tensors):
            raise ConfigError("framework.grad_tensors", f"needs one element count (0 to {MAX_BUCKET_ELEMENTS:,}) "
                              "per parameter tensor", "list the tensors' sizes, or leave it out")
    if not 0 <= f.prefetch_bucket_size <= MAX_BUCKET_ELEMENTS:  # 0: DeepSpeed's ZeRO-3 prefetching off
        raise ConfigError("framework.prefetch_bucket_size", f"must be 0 (no prefetch) to {MAX_BUCKET_ELEMENTS:,}, "
                          f"got {f.prefetch_bucket_size:,}")
    kv = m.kv_heads or m.heads
    if m.heads % p.tp or kv % p.tp:
        raise ConfigError("parallel.tp", f"tp={p.tp} does not divide heads={m.heads} / kv_heads={kv}",
                          "choose a tp that divides the head counts")
    if m.ffn % p.tp:
        raise ConfigError("parallel.tp", f"tp={p.tp} does not divide ffn={m.ffn}", "choose a tp that divides ffn")
    if m.heads % (kv or 1):
        raise ConfigError("model.kv_heads", f"kv_heads={kv} does not divide heads={m.heads}")
    if m.hidden % m.heads:
        raise ConfigError("model.heads", f"heads={m.heads} does not divide hidden={m.hidden}")
    layers_total = m.layers + (m.decoder_layers if m.architecture == "t5" else 0)
    if layers_total % p.pp:
        raise ConfigError("parallel.pp", f"pp={p.pp} does not divide the {layers_total} layers", "choose a pp that divides them")
    if m.seq_len % (p.tp * p.cp) and (p.sequence_parallel or p.cp > 1):
        raise ConfigError("model.seq_len", f"seq_len={m.seq_len} is not divisible by tp*cp={p.tp * p.cp}",
                          "sequence/context parallel split the sequence evenly")
    if p.ep > 1:
        if m.architecture != "moe":
            raise ConfigError("parallel.ep", f"ep={p.ep} needs model.architecture: moe")
        if m.experts % p.ep:
            raise ConfigError("parallel.ep", f"ep={p.ep} does not divide experts={m.experts}")
        if (p.dp * p.cp) % p.ep:
            raise ConfigError("parallel.ep", f"ep={p.ep} must divide dp*cp={p.dp * p.cp} (experts are spread over data-parallel ranks)")
    if p.sequence_parallel and p.tp == 1:
        raise ConfigError("parallel.sequence_parallel", "needs tp > 1", "set parallel.tp or turn sequence_parallel off")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero_stage", f"must be 0..3, got {p.zero_stage}")
    if p.zero_stage and f.name != "deepspeed":
        raise ConfigError("parallel.zero_stage", "ZeRO stages are DeepSpeed's", "set framework.name: deepspeed, or use distributed_optimizer / fsdp with megatron")
    if p.distributed_optimizer and f.name != "megatron":
        raise ConfigError("parallel.distributed_optimizer", "is megatron's", "use parallel.zero_stage with deepspeed")
    if t.global_batch % (t.micro_batch * p.dp):
        raise ConfigError("training.global_batch", f"{t.global_batch} is not a multiple of micro_batch*dp={t.micro_batch * p.dp}")
    if world_size is not None and wl.world_size != world_size:
        raise ConfigError("parallel", f"dp*tp*pp*cp={wl.world_size} but the cluster has {world_size} GPUs",
                          "change the parallel sizes or pick hardware with that many GPUs")
    _check_graph_size(wl)


def _check_sizes(positive: dict[str, int]) -> None:
    """Every size is positive and below the limit its kind has (a typo must not become a model)."""
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(key, f"must be positive, got {value}")
        limit = MAX_BUCKET_ELEMENTS if key.endswith("bucket_size") else MAX_DIMENSION
        if value > limit:
            raise ConfigError(key, f"{value:,} is beyond any real job (the limit is {limit:,})", "check the value")


def _parameter_tensors(wl: Workload) -> int:
    """More parameter tensors than all pipeline stages of one rank's model replica hold together.

    Megatron-core never splits a tensor across gradient buckets, so a stage has at most one bucket per
    tensor (and per bucket one parameter gather with the distributed optimizer), whatever the bucket size.
    """
    m, p = wl.model, wl.parallel
    per_layer = TENSORS_PER_LAYER + TENSORS_PER_EXPERT * (m.experts // p.ep if m.architecture == "moe" else 0)
    return (m.layers + m.decoder_layers) * per_layer + EMBEDDING_TENSORS * p.pp


def step_graph_size(wl: Workload) -> tuple[int, str]:
    """An upper estimate of the segments and collectives ``lagom.step.points.points_for`` builds for one step,
    and the workload key that drives most of it. Counted from the layout, without building anything."""
    m, p = wl.model, wl.parallel
    per_micro_batch = (m.layers + m.decoder_layers) * (LAYER_ITEMS + CP_ITEMS_PER_RANK * p.cp) + MICRO_BATCH_ITEMS
    if m.architecture == "t5":
        per_micro_batch += m.decoder_layers * CROSS_ATTENTION_ITEMS
    # Without a pipeline, identical micro-batches are one repeated phase: at most two are built.
    blocks = wl.microbatches if p.pp > 1 else min(wl.microbatches, 2)
    layer_items = blocks * per_micro_batch
    sends = 2 * (p.pp - 1) * wl.microbatches
    buckets_per_pass = _parameter_tensors(wl) + BUFFER_BUCKETS * p.pp  # every stage's gradient buckets
    passes = min(blocks, 2) + (1 if p.distributed_optimizer else 0)  # reductions, then parameter gathers
    bucket_items = passes * buckets_per_pass + p.pp  # and each stage's optimizer segment
    if bucket_items > layer_items:
        driver = "model.experts" if m.architecture == "moe" and m.experts // p.ep > TENSORS_PER_LAYER else "model.layers"
    else:
        driver = "training.global_batch" if p.pp > 1 else "model.layers"
    return layer_items + sends + bucket_items, driver


def _check_graph_size(wl: Workload) -> None:
    """Refuse a job whose step graph is too large to build, before anything is built."""
    if wl.world_size > MAX_WORLD_SIZE:
        raise ConfigError("parallel", f"dp*tp*pp*cp={wl.world_size:,} GPUs is beyond any real job "
                          f"(the limit is {MAX_WORLD_SIZE:,})", "check the parallel sizes")
    size, driver = step_graph_size(wl)
    if size > MAX_STEP_GRAPH_ITEMS:
        fixes = {
            "model.experts": "check the expert count and parallel.ep",
            "training.global_batch": "plan with a smaller global_batch, i.e. fewer micro-batches per step",
            "model.layers": "check the layer count",
        }
        raise ConfigError(driver, f"the step graph would hold about {size:,} compute segments and collectives, "
                          f"more than the {MAX_STEP_GRAPH_ITEMS:,} Lagom builds", fixes[driver])
