"""A few training steps of a small model built from megatron-core parts, on CPU gloo ranks, with --lagom.

Megatron's own argument parsing (with the --lagom flags), megatron-core's process groups (their NCCL
options routed through the plan), tensor-parallel linears, DDP with overlapped gradient buckets and
the distributed optimizer's reduce-scatter / all-gather; Lagom records every collective, tunes
online and writes its report. Run on 2 CPU ranks (no GPU needed):

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

import torch
import torch.distributed as dist


def cpu_only() -> None:
    """megatron-core asks torch.cuda for the device and stream it allocates on; on CPU both are the host."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.current_stream = lambda *args, **kwargs: None


class Block(torch.nn.Module):
    """h -> h + W2 gelu(W1 h): a transformer MLP as megatron-core's column- and row-parallel linears."""

    def __init__(self, config, hidden: int, ffn: int) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        init = torch.nn.init.xavier_normal_
        self.fc1 = ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=True, gather_output=False)
        self.fc2 = RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=True, input_is_parallel=True,
                                     skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        out, _ = self.fc2(torch.nn.functional.gelu(h))
        return x + out


class Tiny(torch.nn.Module):
    def __init__(self, config, layers: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.config = config
        self.blocks = torch.nn.ModuleList(Block(config, hidden, ffn) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


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
    from megatron.core.transformer import TransformerConfig
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.training import get_megatron_ddp_config

    from lagom_megatron.hooks import current

    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})  # Lagom starts here
    dist.init_process_group(args.distributed_backend)
    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    torch.manual_seed(args.seed)
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, use_cpu_initialization=True,
                               params_dtype=torch.float32, sequence_parallel=args.sequence_parallel,
                               tensor_model_parallel_size=args.tensor_model_parallel_size)
    model = Tiny(config, args.num_layers, args.hidden_size, args.ffn_hidden_size)
    ddp = DistributedDataParallel(config, get_megatron_ddp_config(args), model)  # bucket size from the plan
    session = current()
    data = torch.Generator().manual_seed(1000 + dist.get_rank())
    teacher = torch.Generator().manual_seed(7)
    target_map = torch.randn(args.hidden_size, args.hidden_size, generator=teacher) / args.hidden_size ** 0.5
    for iteration in range(args.train_iters):
        if session:
            session.step_begin(iteration)
        ddp.zero_grad_buffer()
        x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, generator=data)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ target_map)
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
