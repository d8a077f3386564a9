"""What Lagom's interception of megatron-core costs per collective call, on 2 gloo ranks (CPU).

Each case calls a megatron-core communication path (tensor-parallel mappings, the async
all-gather of the linear layers, a DDP bucket's gradient all-reduce, pipeline send/recv) many times,
alternating blocks with the interceptor installed and removed, and reports the median time per
call of each and their difference. The first row isolates the interceptor's own work (recording a
call that does no communication), which is what it adds on any backend; the gloo rows include
gloo's run-to-run noise, so their difference is that overhead plus noise.

    .venv/bin/python benchmarks/megatron_interception.py [--iters 100] [--reps 30] [--kib 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.distributed import run_ranks  # noqa: E402  (gloo ranks on a free port)


def cpu_megatron() -> None:
    """megatron-core allocates on torch.cuda.current_device() and reads the current stream; on CPU both are the host."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: None


def per_call_us(fn: Callable[[], object], iters: int, then: Callable[[], object] = lambda: None) -> float:
    """µs per call of ``fn``, ``then`` (run once after the calls) included."""
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    then()
    return (time.perf_counter() - t0) / iters * 1e6


def measure(cases: dict[str, Callable[[], object]], install: Callable[[], object], uninstall: Callable[[], None],
            recorder, iters: int, reps: int) -> dict[str, tuple[float, float, float]]:
    """Per case: median µs per call unwrapped, wrapped, and the median of paired differences.

    Short unwrapped and wrapped blocks alternate, so load that drifts over seconds hits each pair alike.
    """
    out = {}
    for name, fn in cases.items():
        plain, wrapped = [], []
        fn()  # warm-up
        for _ in range(reps):
            plain.append(per_call_us(fn, iters))
            install()
            recorder.begin_step(0)
            wrapped.append(per_call_us(fn, iters, recorder.end_step))  # the step end resolves the records
            uninstall()
        out[name] = (statistics.median(plain), statistics.median(wrapped),
                     statistics.median(w - p for p, w in zip(plain, wrapped)))
    return out


def bench_rank(rank: int, world: int, iters: int, reps: int, kib: int) -> dict[str, tuple[float, float, float]]:
    cpu_megatron()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer import TransformerConfig

    from lagom.runtime import Recorder
    from lagom_megatron.intercept import Interceptor

    recorder = Recorder(cuda=False)
    interceptor = Interceptor(recorder)
    elems = kib * 1024 // 4
    results: dict[str, tuple[float, float, float]] = {}

    # the interceptor's own work: a recorded call whose "collective" does nothing
    def nothing(output: torch.Tensor, input_: torch.Tensor, group=None, async_op: bool = False) -> None:
        return None

    target = {"call": nothing}
    wrapped = interceptor._collective(nothing, "all_gather", out_arg=0)
    buf = torch.zeros(elems)
    results |= measure({"interception alone (no-op collective)": lambda: target["call"](buf, buf, group=None)},
                       lambda: target.update(call=wrapped), lambda: target.update(call=nothing), recorder, iters, reps)

    parallel_state.initialize_model_parallel(2, 1)
    tp = parallel_state.get_tensor_model_parallel_group()
    shard = torch.randn(elems // 2)
    full = torch.randn(elems)
    gathered = torch.empty(elems)
    cases = {
        f"tp all-gather {kib} KiB (mappings, sync)": lambda: mappings._gather_along_first_dim(shard, tp),
        f"tp reduce-scatter {kib} KiB (mappings, sync)": lambda: mappings._reduce_scatter_along_first_dim(full, tp),
        f"tp all-reduce {kib} KiB (mappings._reduce)": lambda: mappings._reduce(full, tp),
        f"tp all-gather {kib} KiB (layers, async + wait)":
            lambda: layers.dist_all_gather_func(gathered, shard, group=tp, async_op=True).wait(),
    }
    results |= measure(cases, interceptor.install, interceptor.uninstall, recorder, iters, reps)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    model = torch.nn.Linear(elems // 8, 8, bias=False)  # one bucket of `kib` KiB
    model.config = config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False), model)
    group = ddp.bucket_groups[0]
    results |= measure({f"dp bucket all-reduce {kib} KiB (DDP start_grad_sync)": group.finish_grad_sync},
                       interceptor.install, interceptor.uninstall, recorder, iters, reps)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 2)
    pp = parallel_state.get_pipeline_model_parallel_group()
    peer = 1 - rank
    send, recv = torch.randn(elems), torch.empty(elems)

    def exchange() -> None:  # both directions at once, as send_forward_recv_backward does
        reqs = p2p_communication._batched_p2p_ops(
            tensor_send_prev=send if rank == 1 else None, tensor_recv_prev=recv if rank == 1 else None,
            tensor_send_next=send if rank == 0 else None, tensor_recv_next=recv if rank == 0 else None,
            group=pp, prev_pipeline_rank=peer, next_pipeline_rank=peer)
        for req in reqs:
            req.wait()

    results |= measure({f"pp send/recv {kib} KiB (batched P2P)": lambda: exchange()},
                       interceptor.install, interceptor.uninstall, recorder, iters, reps)
    parallel_state.destroy_model_parallel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=100, help="calls per timed block")
    parser.add_argument("--reps", type=int, default=30, help="block pairs per case (medians taken)")
    parser.add_argument("--kib", type=int, default=4, help="message size in KiB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ranks = run_ranks(bench_rank, 2, args.iters, args.reps, args.kib)
    # per case, the rank that saw the larger time (collectives finish together; the slower rank is the step)
    rows = {name: tuple(max(r[name][i] for r in ranks) for i in range(3)) for name in ranks[0]}
    if args.json:
        print(json.dumps({name: {"unwrapped_us": a, "wrapped_us": b, "overhead_us": d}
                          for name, (a, b, d) in rows.items()}))
        return 0
    print(f"{'collective path':52s} {'unwrapped µs':>13s} {'wrapped µs':>11s} {'overhead µs':>12s}")
    for name, (plain, wrapped, diff) in rows.items():
        print(f"{name:52s} {plain:13.1f} {wrapped:11.1f} {diff:12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
