"""A Lagom Workload read off Megatron's parsed arguments, so a plan is fingerprinted against the real job.

Besides the layout, it carries what decides megatron-core's gradient buckets (biases, norms, position
embeddings, tied output layer, bucket padding), so the modelled buckets have the job's sizes.

Two runs with the same model, batch and layout get the same fingerprint (and so reuse a cached or
saved plan); changing any of them makes a saved plan refuse to load, naming the mismatch.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from lagom.errors import ConfigError
from lagom.step.workload import Framework, Model, Parallel, Training, Workload, validate


def _get(args: argparse.Namespace, name: str, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def architecture(args: argparse.Namespace, script: str | None = None) -> str:
    """gpt/moe from the arguments; bert and t5 from the training script's name (pretrain_bert.py, ...)."""
    name = Path(script if script is not None else (sys.argv[0] if sys.argv else "")).name.lower()
    if "t5" in name:
        return "t5"
    if "bert" in name:
        return "bert"
    return "moe" if _get(args, "num_experts") else "gpt"


def _ffn(args: argparse.Namespace) -> int:
    """Megatron's own default when --ffn-hidden-size is unset (validate_args fills it the same way)."""
    if args.ffn_hidden_size:
        return args.ffn_hidden_size
    if _get(args, "swiglu", False):
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64
    return 4 * args.hidden_size


def _padded_vocab(args: argparse.Namespace, tp: int) -> int:
    if _get(args, "padded_vocab_size"):
        return args.padded_vocab_size
    vocab = _get(args, "vocab_size")
    if not vocab:
        raise ConfigError("--vocab-size", "Lagom needs the vocabulary size to derive the workload",
                          "pass --vocab-size, or call Lagom after megatron has built the tokenizer")
    multiple = _get(args, "make_vocab_size_divisible_by", 128) * tp
    return int(math.ceil(vocab / multiple) * multiple)


def _position_rows(args: argparse.Namespace) -> int:
    """Rows of the learned position-embedding table (megatron's default learned_absolute); 0 for rope and others."""
    if _get(args, "position_embedding_type", "learned_absolute") != "learned_absolute":
        return 0
    return _get(args, "max_position_embeddings") or args.seq_length


def _moe_every(freq) -> int:
    """Megatron's --moe-layer-freq is an int period or a 0/1 pattern per layer."""
    if isinstance(freq, int):
        return max(1, freq)
    pattern = list(freq)
    return max(1, round(len(pattern) / max(1, sum(pattern))))


def workload_from_args(args: argparse.Namespace, script: str | None = None) -> Workload:
    """Build and validate the Workload of the job these Megatron arguments describe."""
    for flag, name in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"), ("--seq-length", "seq_length"),
                       ("--micro-batch-size", "micro_batch_size")):
        if not _get(args, name):
            raise ConfigError(flag, "is not set; Lagom derives the workload from it", f"pass {flag}")
    tp = _get(args, "tensor_model_parallel_size", 1)
    pp = _get(args, "pipeline_model_parallel_size", 1)
    cp = _get(args, "context_parallel_size", 1)
    ep = _get(args, "expert_model_parallel_size", 1)
    world = _get(args, "world_size", 1)
    if world % (tp * pp * cp):
        raise ConfigError("--tensor-model-parallel-size", f"tp*pp*cp={tp * pp * cp} does not divide the world size {world}",
                          "choose parallel sizes whose product divides the number of ranks")
    dp = world // (tp * pp * cp)
    arch = architecture(args, script)
    dtype = "bf16" if _get(args, "bf16", False) else "fp16" if _get(args, "fp16", False) else "fp32"
    grad_dtype = "fp32" if _get(args, "accumulate_allreduce_grads_in_fp32", False) or dtype == "fp32" else dtype
    micro = args.micro_batch_size
    experts = _get(args, "num_experts", 0) if arch == "moe" else 0
    moe_ffn = (_get(args, "moe_ffn_hidden_size") or _ffn(args)) if experts else 0
    shared = _get(args, "moe_shared_expert_intermediate_size", 0) if experts else 0
    model = Model(
        architecture=arch,
        layers=(_get(args, "encoder_num_layers") or args.num_layers) if arch == "t5" else args.num_layers,
        decoder_layers=(_get(args, "decoder_num_layers") or args.num_layers) if arch == "t5" else 0,
        hidden=args.hidden_size, ffn=_ffn(args), heads=args.num_attention_heads,
        kv_heads=_get(args, "num_query_groups", 0) if _get(args, "group_query_attention", False) else 0,
        seq_len=args.seq_length,
        decoder_seq_len=_get(args, "decoder_seq_length", 0) if arch == "t5" else 0,
        vocab=_padded_vocab(args, tp), gated_mlp=bool(_get(args, "swiglu", False)),
        experts=experts, top_k=_get(args, "moe_router_topk", 0) if experts else 0, moe_ffn=moe_ffn,
        shared_experts=shared // moe_ffn if experts and shared else 0,
        moe_every=_moe_every(_get(args, "moe_layer_freq", 1)) if experts else 1,
        linear_bias=bool(_get(args, "add_bias_linear", True)), rms_norm=_get(args, "normalization", "LayerNorm") == "RMSNorm",
        position_embeddings=_position_rows(args),
        untied_embeddings=bool(_get(args, "untie_embeddings_and_output_weights", False)),
    )
    training = Training(micro_batch=micro, global_batch=_get(args, "global_batch_size", micro * dp),
                        dtype=dtype, grad_dtype=grad_dtype)
    parallel = Parallel(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=bool(_get(args, "sequence_parallel", False)),
                        distributed_optimizer=bool(_get(args, "use_distributed_optimizer", False)))
    framework = Framework(name="megatron", bucket_size=_get(args, "ddp_bucket_size"),
                          overlap_grad_reduce=bool(_get(args, "overlap_grad_reduce", False)),
                          overlap_param_gather=bool(_get(args, "overlap_param_gather", False)),
                          pad_buckets_for_high_nccl_busbw=bool(_get(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
    layout = f"dp{dp}-tp{tp}-pp{pp}" + (f"-cp{cp}" if cp > 1 else "") + (f"-ep{ep}" if ep > 1 else "")
    wl = Workload(name=f"megatron-{arch}-{model.layers}x{model.hidden}-{layout}",
                  description=f"derived from Megatron arguments ({world} ranks)",
                  model=model, training=training, parallel=parallel, framework=framework)
    validate(wl, world)
    return wl
