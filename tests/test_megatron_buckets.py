"""The gradient buckets Lagom models (lagom.step.points) against the ones megatron-core 0.19 DDP really builds.

Four gloo ranks parse Megatron's own arguments (megatron.training), build megatron-core's GPTModel as
Megatron-LM's pretrain_gpt.py does (local layer spec) and wrap it in megatron-core's DDP with
overlapped gradient reduction, with and without the distributed optimizer. Every bucket's reduction
(grad_data bytes) and parameter gather (param_data bytes) must match a key of the step graph the plan
is made from, through the one size rule (lagom.step.calls.KeyIndex), as many times as the graph has it.
The model is exact for this layer spec, so the sizes are also compared byte for byte.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from lagom.step.calls import KeyIndex, TuningKey
from tests.distributed import run_ranks
from tests.test_megatron_ddp import cpu_megatron

WORLD = 4
COMMON = ["--num-layers", "2", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
          "--global-batch-size", "16", "--train-iters", "4", "--lr", "0.1", "--vocab-size", "128",
          "--tokenizer-type", "NullTokenizer", "--distributed-backend", "gloo", "--use-cpu-initialization",
          "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
# Megatron's GPT defaults (biases, LayerNorm, learned position embeddings, tied output layer), bf16 with
# fp32 gradient buckets; and a Llama-like model (SwiGLU, no biases, RMSNorm, RoPE, untied output layer)
# split over tp=2, in fp32.
GPT = ["--hidden-size", "64", "--num-attention-heads", "4", "--bf16"]
LLAMA = ["--hidden-size", "96", "--num-attention-heads", "6", "--tensor-model-parallel-size", "2", "--swiglu",
         "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--no-rope-fusion", "--untie-embeddings-and-output-weights"]
SCENARIOS = {
    "gpt": [*GPT, "--overlap-grad-reduce", "--ddp-bucket-size", "5000"],
    "llama_tp2": [*LLAMA, "--overlap-grad-reduce", "--ddp-bucket-size", "8000"],
    "llama_tp2_busbw_padding": [*LLAMA, "--overlap-grad-reduce", "--ddp-bucket-size", "8000",
                                "--ddp-pad-buckets-for-high-nccl-busbw"],
    "gpt_pp2": [*GPT, "--pipeline-model-parallel-size", "2", "--overlap-grad-reduce", "--ddp-bucket-size", "5000"],
    "gpt_no_overlap": GPT,  # one bucket
}


def cpu_megatron_training() -> None:
    """cpu_megatron, plus what megatron/training and tied pipeline embeddings ask of a GPU: validate_args
    reads the GPU architecture for tp > 1 (10: no CUDA_DEVICE_MAX_CONNECTIONS advice), and the tied output
    weight of the last stage is moved with ``.cuda()`` before its first all-reduce (host memory here)."""
    import torch
    from megatron.training import arguments

    cpu_megatron()
    arguments.get_device_arch_version = lambda: 10
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def build_ddp(argv: list[str], distributed_optimizer: bool):
    """Megatron's parsed arguments, and megatron-core's DDP around the GPTModel pretrain_gpt.py builds from them."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
    from megatron.training.training import get_megatron_ddp_config

    sys.argv = ["pretrain_gpt.py", *COMMON, *argv] + (["--use-distributed-optimizer"] if distributed_optimizer else [])
    args = parse_and_validate_args()
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    config = core_transformer_config_from_args(args)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type)
    if args.bf16:  # megatron.training's get_model: every parameter in bf16 (the torch norms are made in fp32)
        model = Float16Module(config, model)
    return args, DistributedDataParallel(config, get_megatron_ddp_config(args), model)


def buckets_rank(rank: int, world: int) -> dict:
    cpu_megatron_training()
    from megatron.core import parallel_state
    from megatron.training.global_vars import unset_global_variables

    from lagom.hardware import load_hardware
    from lagom.step.points import points_for
    from lagom_megatron.groups import GroupNames
    from lagom_megatron.workload import workload_from_args

    hw = load_hardware("a100-8x-100g")
    out: dict = {}
    for name, argv in SCENARIOS.items():
        for distributed_optimizer in (False, True):
            args, ddp = build_ddp(argv, distributed_optimizer)
            names = GroupNames()
            real = []
            for group in ddp.bucket_groups:  # what the interceptor records for each bucket (same group naming)
                reduced = names.name(group.intra_distributed_optimizer_instance_group if distributed_optimizer
                                     else group.data_parallel_group)
                for bucket in group.buckets:
                    real.append(str(TuningKey(reduced, "reduce_scatter" if distributed_optimizer else "all_reduce",
                                              bucket.grad_data.numel() * bucket.grad_data.element_size())))
                    if distributed_optimizer:
                        real.append(str(TuningKey(reduced, "all_gather",
                                                  bucket.param_data.numel() * bucket.param_data.element_size())))
            stage = parallel_state.get_pipeline_model_parallel_rank()
            graph = points_for(workload_from_args(args, script="pretrain_gpt.py"), hw)
            planned = [p.key for p in graph.points if p.device == stage and ("grad.bucket" in p.name or "param.ag" in p.name)]
            out[f"{name}/{distributed_optimizer}"] = {"real": real, "planned": planned, "stage": stage}
            parallel_state.destroy_model_parallel()
            unset_global_variables()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(buckets_rank, WORLD)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_real_bucket_is_a_planned_key(ranks: list[dict], scenario: str, distributed_optimizer: bool) -> None:
    for rank, out in enumerate(ranks):
        case = out[f"{scenario}/{distributed_optimizer}"]
        real, planned = case["real"], case["planned"]
        assert real, f"rank {rank}: megatron built no bucket"
        index = KeyIndex(planned)
        matched = [index.match(key) for key in real]
        assert None not in matched, f"rank {rank}: unplanned buckets {[k for k, m in zip(real, matched) if m is None]}"
        assert Counter(matched) == Counter(planned), f"rank {rank}: real {real}, planned {planned}"
        assert sorted(real) == sorted(planned)  # the model is exact for megatron's local layer spec
        groups = {key.split("/")[0] for key in real}
        assert groups == {"dp"}


def test_the_scenarios_cover_megatrons_bucket_rules(ranks: list[dict]) -> None:
    """Several buckets where megatron overlaps; one (plus the tied embedding's own) where it does not."""
    first = ranks[0]
    reductions = {name: [k for k in case["real"] if "/all_gather/" not in k] for name, case in first.items()}
    assert len(reductions["gpt/False"]) > 3 and len(reductions["llama_tp2/True"]) > 3
    assert len(reductions["gpt_no_overlap/False"]) == len(reductions["gpt_no_overlap/True"]) == 1
    last_stage = ranks[-1]
    assert last_stage["gpt_pp2/False"]["stage"] == 1
    # pipeline stages after the first keep one bucket; the distributed optimizer gives the tied output weight its own
    assert len(last_stage["gpt_pp2/False"]["real"]) == 1 and len(last_stage["gpt_pp2/True"]["real"]) == 2 * 2
    padded = [int(k.rsplit("/", 1)[1]) for k in first["llama_tp2_busbw_padding/True"]["real"]]
    assert all(size % (2**16 * 4) == 0 for size in padded)  # fp32 buckets padded to multiples of 2^16 elements
    grads = {k.rsplit("/", 1)[1] for k in first["gpt/True"]["real"] if "/reduce_scatter/" in k}
    gathers = {k.rsplit("/", 1)[1] for k in first["gpt/True"]["real"] if "/all_gather/" in k}
    assert {int(g) for g in grads} == {2 * int(g) for g in gathers}  # bf16 parameters, fp32 gradient buckets
