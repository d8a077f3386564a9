"""A few training steps of megatron-core's GPTModel, on CPU gloo ranks, with --lagom.

Megatron's own argument parsing (with the --lagom flags), megatron-core's process groups (their NCCL
options routed through the plan), the GPT model pretrain_gpt.py builds (local layer spec), DDP with
overlapped gradient buckets and the distributed optimizer's reduce-scatter / all-gather; Lagom
records every collective (the buckets have the sizes its plan models), tunes online and writes its
report. Run on 2 CPU ranks (no GPU needed):

    torchrun --standalone --nproc-per-node 2 -m lagom_megatron.run examples/megatron/train_tiny.py \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
        --max-position-embeddings 32 --micro-batch-size 4 --global-batch-size 8 --train-iters 8 \\
        --lr 0.05 --vocab-size 128 --tokenizer-type NullTokenizer --distributed-backend gloo \\
        --use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 5000 \\
        --lagom --lagom-mode online --lagom-tune-iters 3 \\
        --lagom-hardware examples/megatron/cpu-2ranks.yaml --lagom-report out/megatron-example

(``python -m lagom_megatron.run`` gives an unpatched megatron the flags; after ``lagom patch
megatron`` the script runs as is.) The optimizer is plain SGD written out below, because
megatron-core's optimizers allocate on CUDA; its update is the same on every data-parallel rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def cpu_only() -> None:
    """megatron-core asks torch.cuda for the device and stream it allocates on (on CPU both are the host), and
    draws attention dropout under its CUDA RNG tracker (on CPU torch's own generator does)."""
    if not torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.current_stream = lambda *args, **kwargs: None
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()


def gpt_model(args):
    """The GPTModel Megatron-LM's pretrain_gpt.py builds from these arguments, with megatron-core's own layers."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                               hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                               add_bias_linear=args.add_bias_linear, use_cpu_initialization=True,
                               params_dtype=torch.float32, sequence_parallel=args.sequence_parallel,
                               tensor_model_parallel_size=args.tensor_model_parallel_size)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type)
    return config, model


def sgd_step(ddp, model: torch.nn.Module, lr: float, distributed_optimizer: bool) -> None:
    """Plain SGD on the reduced gradients; with the distributed optimizer each rank updates its shard
    of every bucket and the shards are all-gathered back (megatron's start_param_sync)."""
    with torch.no_grad():
        if not distributed_optimizer:
            for p in model.parameters():
                p -= lr * p.main_grad
            return
        for buffer in ddp.buffers:
            for bucket in buffer.buckets:
                shard = bucket.param_data.numel() // dist.get_world_size()
                mine = slice(dist.get_rank() * shard, (dist.get_rank() + 1) * shard)
                bucket.param_data[mine] -= lr * bucket.grad_data[mine]
        ddp.start_param_sync(force_sync=True)


def main() -> None:
    cpu_only()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import get_megatron_ddp_config

    from lagom_megatron.hooks import current

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})  # Lagom starts here
    dist.init_process_group(args.distributed_backend)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed)
    config, model = gpt_model(args)
    ddp = DistributedDataParallel(config, get_megatron_ddp_config(args), model)  # bucket size from the plan
    session = current()
    data = torch.Generator().manual_seed(1000 + dist.get_rank())
    batch, seq = args.micro_batch_size, args.seq_length
    positions = torch.arange(seq).expand(batch, seq)
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)  # True: masked out
    period = torch.randint(0, args.vocab_size, (7,), generator=torch.Generator().manual_seed(7))
    for iteration in range(args.train_iters):
        if session:
            session.step_begin(iteration)
        ddp.zero_grad_buffer()
        # a periodic token stream: each token predicts the next, which the model can learn
        starts = torch.randint(0, len(period), (batch, 1), generator=data)
        stream = period[(starts + torch.arange(seq + 1)) % len(period)]
        loss = ddp(stream[:, :-1], positions, causal, labels=stream[:, 1:]).mean()
        loss.backward()
        ddp.finish_grad_sync()
        sgd_step(ddp, model, args.lr, args.use_distributed_optimizer)
        if session:
            session.step_end()
        if dist.get_rank() == 0:
            print(f"iteration {iteration}: loss {loss.item():.5f}", flush=True)
    dist.destroy_process_group()  # Lagom writes its final report when the process exits


if __name__ == "__main__":
    main()
