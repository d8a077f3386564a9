"""What Lagom's interception of megatron-core costs per collective call, on 2 gloo ranks (CPU).

Each case calls a megatron-core communication path (tensor-parallel mappings, the async
all-gather of the linear layers, a DDP bucket's gradient all-reduce, pipeline send/recv) many times,
alternating call by call with the interceptor installed and removed, and reports the median time
of one call each way and the difference. The first row isolates the interceptor's own work
(recording a call that does no communication), which is what it adds on any backend; the gloo rows
add what that work costs next to a real collective on a busy CPU.

    .venv/bin/python benchmarks/megatron_interception.py [--calls 2000] [--kib 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.distributed import run_ranks  # noqa: E402  (gloo ranks on a free port)


def cpu_megatron() -> None:
    """megatron-core allocates on torch.cuda.current_device() and reads the current stream; on CPU both are the host."""
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *args, **kwargs: None


def measure(cases: dict[str, Callable[[], object]], install: Callable[[], object], uninstall: Callable[[], None],
            recorder, calls: int) -> dict[str, tuple[float, float, float]]:
    """Per case: median µs of one call unwrapped and wrapped, and the wrapped median's excess.

    Calls alternate one by one between unwrapped and wrapped (both ranks in lock-step), so load that
    comes and goes on a shared machine hits both alike; the recorder's step end, which resolves the
    records, is timed too and its cost spread over the calls it resolved.
    """
    out = {}
    for name, fn in cases.items():
        fn()  # warm-up
        plain, wrapped, step_end, pending = [], [], 0.0, 0
        torch.distributed.barrier()
        recorder.begin_step(0)
        for i in range(2 * calls):
            if i % 2:
                install()
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
            if i % 2:
                uninstall()
                wrapped.append(t)
                pending += 1
                if pending == 100:
                    t0 = time.perf_counter()
                    recorder.end_step()
                    step_end += time.perf_counter() - t0
                    pending = 0
            else:
                plain.append(t)
        recorder.end_step()
        a = statistics.median(plain) * 1e6
        b = (statistics.median(wrapped) + step_end / len(wrapped)) * 1e6
        out[name] = (a, b, b - a)
    return out


def bench_rank(rank: int, world: int, calls: int, kib: int) -> dict[str, tuple[float, float, float]]:
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

    def switches() -> tuple[Callable[[], None], Callable[[], None]]:
        """(on, off) that swap the installed wrappers in and out, made once (installing makes new ones)."""
        interceptor.install()
        swaps = [(owner, attr, getattr(owner, attr), original) for owner, attr, original in interceptor._saved]
        interceptor.uninstall()
        return (lambda: [setattr(o, a, w) for o, a, w, _ in swaps],
                lambda: [setattr(o, a, orig) for o, a, _, orig in swaps])
    elems = kib * 1024 // 4
    results: dict[str, tuple[float, float, float]] = {}

    # the interceptor's own work: a recorded call whose "collective" does nothing
    def nothing(output: torch.Tensor, input_: torch.Tensor, group=None, async_op: bool = False) -> None:
        return None

    target = {"call": nothing}
    wrapped = interceptor._collective(nothing, "all_gather", out_arg=0)
    buf = torch.zeros(elems)
    results |= measure({"interception alone (no-op collective)": lambda: target["call"](buf, buf, group=None)},
                       lambda: target.update(call=wrapped), lambda: target.update(call=nothing), recorder, calls)

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
    results |= measure(cases, *switches(), recorder, calls)
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    model = torch.nn.Linear(elems // 8, 8, bias=False)  # one bucket of `kib` KiB
    model.config = config
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=False), model)
    group = ddp.bucket_groups[0]
    results |= measure({f"dp bucket all-reduce {kib} KiB (DDP start_grad_sync)": group.finish_grad_sync},
                       *switches(), recorder, calls)
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
                       *switches(), recorder, calls)
    parallel_state.destroy_model_parallel()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per case and variant")
    parser.add_argument("--kib", type=int, default=4, help="message size in KiB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    ranks = run_ranks(bench_rank, 2, args.calls, args.kib)
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
